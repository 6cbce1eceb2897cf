"""Soak the prefix cache: random chat turns on a 2-stage pipeline with the cache on, each against the same turn
on an identical pipeline with it off.

    .venv/bin/python bench/soak_prefix_cache.py --turns 1000 --json bench/results/soak_prefix_cache.json
    .venv/bin/python bench/soak_prefix_cache.py --turns 1000 --disk-mb 16     # with a disk tier too

Conversations are drawn at random (a new one, or the next turn of one of the
last few), with random user messages and a random max_tokens; every few
hundred turns the cached pipeline restarts with another budget, drawn from
small (entries evicted all the time) to roomy. Both pipelines get the same
messages: a conversation continues with the uncached run's reply.

Checked for every turn: the greedy tokens with the cache equal those without
it, or first differ at a near-tie (a restored prefix followed by a suffix
prefill rounds differently from one whole prefill): the margin between the
two best candidates there, computed in this process on the whole model, is
printed. After each segment: every stage's cache holds at most its budget.
With ``--disk-mb``, the cached pipeline has a disk tier of that budget, kept
across its restarts (each segment starts warm from it): its bytes are checked
against that budget too.
Every 50 turns: the resident memory of each cached-pipeline process.
"""

from __future__ import annotations

import argparse
import json
import random
import sys
import tempfile
import time
from pathlib import Path

import trio

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from bench.bench_prefix_cache import NEAR_TIE, Offline, first_difference, top2_margin  # noqa: E402
from skippyctl.client import open_control  # noqa: E402
from skippyd.control import messages as m  # noqa: E402
from skippyd.runtime.models import default_model_path  # noqa: E402
from tests.procs import Pipeline, retarget, split_for_test  # noqa: E402

BUDGETS_MB = (1, 2, 4, 16, 512)
WORDS = ("ship harbour tide lighthouse wind storm pier cargo captain crew night beacon rock channel sail rope "
         "anchor gull fog dawn coast chart compass engine radio signal boat wave current island mast").split()
MAX_CONVERSATION_TOKENS = 420  # a conversation longer than this ends; the next one starts afresh
CTX = 512


def user_message(rng: random.Random) -> str:
    n = rng.randint(4, 30)
    return " ".join(rng.choice(WORDS) for _ in range(n)).capitalize() + rng.choice(["?", ".", "!"])


def rss_kib(pid: int) -> int:
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1])
    return 0


async def generate(pipe: Pipeline, messages: list[dict], max_tokens: int) -> dict:
    async with open_control(pipe.head.url, pipe.head.token_file) as client:
        return await client.call(m.Generate(id=client.new_id(), stream=False, messages=messages,
                                            max_tokens=max_tokens))


async def cache_rows(pipe: Pipeline) -> list[dict]:
    async with open_control(pipe.head.url, pipe.head.token_file) as client:
        return await client.call(m.CacheShow(id=client.new_id()))


def start(topology: Path, work: Path, cache_mb: int, disk: list[str] = ()) -> Pipeline:
    """A pipeline of the split on ports of its own (the two pipelines run side by side)."""
    work.mkdir(parents=True, exist_ok=True)
    return Pipeline(retarget(topology, work), work,
                    extra=["--ctx", str(CTX), "--lanes", "2", "--prefix-cache-mb", str(cache_mb), *disk]).start()


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--turns", type=int, default=1000)
    ap.add_argument("--segments", type=int, default=4, help="the cached pipeline restarts with a new budget")
    ap.add_argument("--seed", type=int, default=1)
    ap.add_argument("--json", type=Path, default=None)
    ap.add_argument("--disk-mb", type=int, default=0, help="the cached pipeline's disk tier (MiB; 0: none)")
    args = ap.parse_args()
    rng = random.Random(args.seed)
    model = default_model_path()
    root = Path(tempfile.mkdtemp(prefix="skippy-soak-"))
    split_for_test(model, 2, root)
    topology = root / "topology.toml"
    offline = Offline(model, threads=2, n_ctx=CTX)
    off = start(topology, root / "off", 0)
    conversations: list[list[dict]] = []
    turns: list[dict] = []
    segments: list[dict] = []
    rss: list[dict] = []
    per_segment = max(1, args.turns // args.segments)
    started = time.time()
    try:
        for seg in range(args.segments):
            budget = rng.choice(BUDGETS_MB)
            disk = ["--prefix-cache-dir", str(root / "disk"), "--prefix-cache-disk-mb", str(args.disk_mb)]
            on = start(topology, root / f"on{seg}", budget, disk if args.disk_mb else [])
            try:
                first_rss = None
                for k in range(per_segment):
                    if not conversations or rng.random() < 0.25:
                        conversations.append([{"role": "system", "content": "You answer questions about the sea."}])
                        conversations[:] = conversations[-6:]
                    conv = rng.choice(conversations)
                    messages = [*conv, {"role": "user", "content": user_message(rng)}]
                    max_tokens = rng.randint(1, 16)
                    ref = trio.run(generate, off, messages, max_tokens)
                    got = trio.run(generate, on, messages, max_tokens)
                    row = {"segment": seg, "budget_mb": budget, "prompt_tokens": got["usage"]["prompt_tokens"],
                           "cached_tokens": got["usage"]["cached_tokens"], "equal": got["tokens"] == ref["tokens"]}
                    if not row["equal"]:
                        pos = first_difference(ref["tokens"], got["tokens"])
                        prefix = offline.prompt_tokens(messages) + ref["tokens"][:pos]
                        _, _, margin, _ = top2_margin(offline.after(prefix))
                        row.update(position=pos, margin=margin, near_tie=margin <= NEAR_TIE)
                    turns.append(row)
                    conv[:] = [*messages, {"role": "assistant", "content": ref["text"]}]
                    if ref["usage"]["prompt_tokens"] + ref["usage"]["completion_tokens"] > MAX_CONVERSATION_TOKENS:
                        conversations.remove(conv)
                    if k % 50 == 0 or k == per_segment - 1:
                        sample = {"turn": len(turns), "segment": seg,
                                  "rss_kib": {s: rss_kib(d.proc.pid) for s, d in on.stages.items()}}
                        first_rss = first_rss or sample
                        rss.append(sample)
                        n = len(turns)
                        diffs = [t for t in turns if not t["equal"]]
                        cached = sum(t["cached_tokens"] for t in turns) / max(1, sum(t["prompt_tokens"] for t in turns))
                        print(f"turn {n}/{args.turns} ({time.time() - started:.0f} s): budget {budget} MiB, "
                              f"cached {cached:.0%} of prompt tokens, {len(diffs)} differing, "
                              f"rss {sample['rss_kib']} KiB", flush=True)
                rows = trio.run(cache_rows, on)
                segments.append({"segment": seg, "budget_mb": budget, "turns": per_segment,
                                 "stages": rows, "within_budget": all(
                                     r["bytes"] <= r["budget_bytes"] and r["disk"]["bytes"] <= args.disk_mb << 20
                                     for r in rows),
                                 "rss_first_kib": first_rss["rss_kib"], "rss_last_kib": rss[-1]["rss_kib"]})
            finally:
                on.stop()
    finally:
        off.stop()
        offline.close()
    diffs = [t for t in turns if not t["equal"]]
    summary = {
        "turns": len(turns), "hits": sum(1 for t in turns if t["cached_tokens"] > 0),
        "cached_fraction": sum(t["cached_tokens"] for t in turns) / max(1, sum(t["prompt_tokens"] for t in turns)),
        "equal": len(turns) - len(diffs), "differing": len(diffs),
        "differing_not_near_tie": sum(1 for t in diffs if not t["near_tie"]),
        "largest_margin_at_a_difference": max((t["margin"] for t in diffs), default=None),
        "every_segment_within_budget": all(s["within_budget"] for s in segments),
        "seconds": round(time.time() - started, 1),
    }
    print("\nsegments:")
    for s in segments:
        print(f"  {s['segment']}: budget {s['budget_mb']} MiB, within budget {s['within_budget']}, "
              f"bytes {[r['bytes'] for r in s['stages']]}, evictions {[r['evictions'] for r in s['stages']]}, "
              f"disk bytes {[r['disk']['bytes'] for r in s['stages']]}, "
              f"disk hits {[r['disk']['hits'] for r in s['stages']]}, "
              f"rss first {s['rss_first_kib']} last {s['rss_last_kib']} KiB")
    print("differences:")
    for t in diffs:
        print(f"  turn with {t['cached_tokens']}/{t['prompt_tokens']} cached: first differs at token {t['position']}, "
              f"margin {t['margin']:.2e} ({'near-tie' if t['near_tie'] else 'NOT a near-tie'})")
    print("summary:", json.dumps(summary))
    if args.json:
        args.json.parent.mkdir(parents=True, exist_ok=True)
        args.json.write_text(json.dumps({"summary": summary, "segments": segments, "rss": rss, "turns": turns},
                                        indent=1))
    return 0 if summary["differing_not_near_tie"] == 0 and summary["every_segment_within_budget"] else 1


if __name__ == "__main__":
    sys.exit(main())
