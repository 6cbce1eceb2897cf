"""The prefix cache's disk tier: time to first token after a restart, against the same turn cold.

    .venv/bin/python bench/bench_prefix_disk.py [--turns 8] [--system-tokens 2000] [--json out.json]
    .venv/bin/python bench/bench_prefix_disk.py --quick          # smoke run: 2 turns, a 300-token system prompt

A 2-stage pipeline of the default model (one skippyd per stage on loopback,
``--threads`` compute threads, ``--lanes 2 --ctx 8192``, ``--prefix-cache-mb
512``, ``--prefix-cache-dir`` in a temporary directory). Every request is a
streamed greedy chat completion through the OpenAI endpoint (the ``openai``
client); TTFT is the time to the first non-empty content delta
(bench/bench_prefix_cache.py's ``stream_chat``).

1. A chat of ``--turns`` turns: a system prompt of ``--system-tokens``
   tokens, ~90-token user messages (bench_prefix_cache's generators), replies
   of at most 80 tokens.
2. Both daemons stopped (SIGTERM: the drain writes what memory holds to the
   disk tier) and started again; the next turn: **after restart**.
3. Every tier emptied (``cache clear --disk``); the same turn again: **cold**
   (same daemons, same prompt). Ratio: after restart / cold (target <= 0.15).
4. Stage 1 alone restarted with an empty disk tier (its directory removed: a
   stage that lost the prefix), stage 0 keeping its cache; the next turn. The
   tokens each stage computed for it (its scheduler's count) show which
   stages recomputed the prompt.

    .venv/bin/python bench/bench_prefix_disk.py --turns 8 --system-tokens 2000 --json bench/results/prefix_disk.json
"""

from __future__ import annotations

import argparse
import json
import shutil
import signal
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

import attrs  # noqa: E402

from bench.bench_prefix_cache import (  # noqa: E402
    FULL,
    Endpoint,
    chat_system,
    chat_user_messages,
    fmt_int,
    fmt_ms,
    free_port,
    stream_chat,
    wait_http,
)
from skippyd.runtime.models import fetch_default_model  # noqa: E402

TARGET = 0.15  # after a restart / cold: mesh-llm's disk tier measured 0.074


class Bench:
    """The 2-stage pipeline of the run: its processes, restarted as the scenarios need."""

    def __init__(self, model: Path, work: Path, threads: int, ctx: int):
        from tests.procs import Pipeline, split_for_test

        self.work = work
        self.port = free_port()
        split_for_test(model, 2, work)
        self.cache_dir = work / "prefix-cache"
        extra = ["--lanes", "2", "--ctx", str(ctx), "--threads", str(threads), "--openai",
                 f"127.0.0.1:{self.port}", "--prefix-cache-mb", "512", "--prefix-cache-dir", str(self.cache_dir)]
        self.pipe = Pipeline(work / "topology.toml", work, extra=extra)
        self.endpoint = Endpoint("2-stage", f"http://127.0.0.1:{self.port}/v1", self.stop)

    def start(self) -> None:
        self.pipe.start()
        head = self.pipe.head
        wait_http(f"http://127.0.0.1:{self.port}/v1/models", 60, lambda: head.proc.poll() is None, "the head")
        if not self.endpoint.model_id:
            models = self.endpoint.client().models.list()
            self.endpoint.model_id = models.data[0].id

    def stop(self) -> None:
        self.pipe.stop_cleanly()

    def restart_stage1_without_its_cache(self) -> None:
        stage = self.pipe.stages[1]
        stage.signal(signal.SIGTERM)
        stage.wait_exit()
        shutil.rmtree(self.cache_dir / "stage-1", ignore_errors=True)
        self.pipe.start_stage(1)
        # the head's lanes to stage 1 broke: wait until a request goes through again (a short one, no prefix)
        deadline = time.monotonic() + 60
        while True:
            try:
                self.ask([{"role": "user", "content": "Say hello."}], 2)
                return
            except Exception:
                if time.monotonic() > deadline:
                    raise
                time.sleep(0.5)

    def ask(self, messages: list[dict], max_tokens: int) -> dict:
        ep = self.endpoint
        return stream_chat(ep.client(), ep.model_id, messages, max_tokens)

    def control(self, make) -> object:
        import trio

        from skippyctl.client import open_control

        async def call():
            async with open_control(self.pipe.head.url, self.pipe.head.token_file) as client:
                return await client.call(make(client.new_id()))

        return trio.run(call)

    def computed_tokens(self) -> dict[int, int]:
        """Tokens each stage has computed since it started (its scheduler's count)."""
        out = {}
        for k, d in self.pipe.stages.items():
            st = d.status()
            snap = st["head"] if k == 0 else next(s for s in st["stages"] if s["stage_index"] == k)
            out[k] = int(snap["scheduler"].get("tokens", 0))
        return out


def measured(bench: Bench, label: str, messages: list[dict], max_tokens: int) -> dict:
    before = bench.computed_tokens()
    r = bench.ask(messages, max_tokens)
    after = bench.computed_tokens()
    r["computed"] = {k: after[k] - before.get(k, 0) for k in after}
    r["label"] = label
    print(f"  {label:28} TTFT {fmt_ms(r['ttft_ms']):>8} ms  prompt {fmt_int(r['prompt_tokens']):>5}  cached "
          f"{fmt_int(r['cached_tokens']):>5}  computed (prompt and reply): stage 0 {r['computed'][0]}, "
          f"stage 1 {r['computed'][1]}", flush=True)
    return r


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--turns", type=int, default=8)
    ap.add_argument("--system-tokens", type=int, default=2000)
    ap.add_argument("--quick", action="store_true", help="smoke run: 2 turns, a 300-token system prompt")
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--ctx", type=int, default=8192, help="context tokens per session (the chat grows past 4,000)")
    ap.add_argument("--seed", type=int, default=1)
    ap.add_argument("--model", type=Path, default=None)
    ap.add_argument("--json", type=Path, default=None)
    args = ap.parse_args()
    sizes = attrs.evolve(FULL, turns=2 if args.quick else args.turns,
                         chat_system_tokens=300 if args.quick else args.system_tokens)
    model = args.model or fetch_default_model()
    from skippyd.runtime.llama import Model

    vocab = Model(model, vocab_only=True)

    def count(text: str) -> int:
        return len(vocab.tokenize(text, add_special=False, parse_special=False))

    system = chat_system(sizes, count)
    users = chat_user_messages(args.seed, attrs.evolve(sizes, turns=sizes.turns + 2), count)
    vocab.close()
    from skippyd.control import messages as m

    out: dict = {"sizes": attrs.asdict(sizes), "threads": args.threads}
    with tempfile.TemporaryDirectory() as tmp:
        bench = Bench(model, Path(tmp), args.threads, args.ctx)
        bench.start()
        try:
            conv = [{"role": "system", "content": system}]
            print(f"chat: {sizes.turns} turns, a ~{sizes.chat_system_tokens}-token system prompt", flush=True)
            for turn, user in enumerate(users[:sizes.turns], 1):
                conv.append({"role": "user", "content": user})
                r = measured(bench, f"turn {turn}", conv, sizes.reply_tokens)
                conv.append({"role": "assistant", "content": r["text"]})
            nxt = [*conv, {"role": "user", "content": users[sizes.turns]}]
            print("both daemons stopped (the drain writes the caches to disk) and started again", flush=True)
            bench.stop()
            bench.start()
            restarted = measured(bench, "next turn, after restart", nxt, sizes.reply_tokens)
            bench.control(lambda i: m.CacheClear(id=i, disk=True))
            cold = measured(bench, "next turn, cold", nxt, sizes.reply_tokens)
            ratio = restarted["ttft_ms"] / cold["ttft_ms"]
            print(f"after restart / cold: {ratio:.3f} (target <= {TARGET})", flush=True)
            print("stage 1 alone restarted, its disk tier removed (stage 0 keeps its cache)", flush=True)
            conv2 = [*nxt, {"role": "assistant", "content": cold["text"]},
                     {"role": "user", "content": users[sizes.turns + 1]}]
            warm = measured(bench, "a turn, every stage warm", conv2, sizes.reply_tokens)
            conv3 = [*conv2, {"role": "assistant", "content": warm["text"]},
                     {"role": "user", "content": users[sizes.turns]}]
            bench.restart_stage1_without_its_cache()
            alone = measured(bench, "next, stage 1 restarted", conv3, sizes.reply_tokens)
            prompt = alone["prompt_tokens"] or 0
            print(f"stage 0 computed {alone['computed'][0]} tokens for a prompt of {prompt} (and its reply), "
                  f"stage 1 {alone['computed'][1]}", flush=True)
            out.update(restarted=restarted, cold=cold, ratio=ratio, warm=warm,
                       stage1_restarted=alone)
        finally:
            bench.stop()
    for key in ("restarted", "cold", "warm", "stage1_restarted"):
        out[key].pop("text", None)
    if args.json is not None:
        args.json.parent.mkdir(parents=True, exist_ok=True)
        args.json.write_text(json.dumps(out, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
