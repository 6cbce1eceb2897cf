"""Speculative decoding: decode speed with ``--speculate on`` against ``off``, the drafts' acceptance, and
whether the output stays the same.

    .venv/bin/python bench/bench_speculative.py [--stages 1,2,3] [--tokens 128] [--rounds 3] [--json out.json]
                                                [--delay-ms 10,30] [--skip-delay] [--skip-llama-cpp]
    .venv/bin/python bench/bench_speculative.py --tokens 16 --rounds 1          # smoke run

Workloads, chats through the control channel (``Generate`` with ``messages``: the head's chat template, as
``skippyctl generate`` sends them), each to ``--tokens`` tokens or its end:

* ``code edit``: a ~40-line Python function and "rewrite it with X renamed to Y, return the whole code":
  the reply copies most of its prompt, what prompt-lookup drafting is for;
* ``prose``: "write a short story about ...": new text, little to copy;
* ``4 mixed``: four sessions at once, streamed, two code edits (other functions, other names) and two
  stories. Decode rate: the aggregate while all four decode (the pieces that arrive from the last session's
  first piece to the first session's last, over that time, as bench/bench_pipeline.py counts it; none when
  they never decode at the same time), and end to end (every completion token over the wall time, the four
  prefills included: the ``(e2e)`` row).

Configurations: for each of ``--stages`` (1: ``skippyd --model``; 2, 3: one process per stage on loopback), a
pipeline with ``--speculate off`` and one with ``--speculate on``, all started at once and measured in the same
run: each round runs every workload on both, off and on in turn (the order swapped every round), greedy. Every
skippyd runs with ``--lanes 4 --ctx 2048 --threads T`` and the prefix cache off; the daemons of this run take
turns at the cores through one compute lock of their own.

Reported per stage count and workload: decode tokens/s (the daemon's ``decode_tokens_per_s``: tokens after
the first over the time from the first to the last), median (min-max) over the rounds, for off and on, and the
ratio on / off (of the medians, and the range of the per-round ratios); from the ``speculation`` counters of
the speculative runs' results (``windows``, ``drafted``, ``accepted``, summed over the rounds): the acceptance
(accepted / drafted) and the tokens per verify window ((windows + accepted) / windows: the window's own token
and the accepted drafts).

Beside them, in the same run (``--skip-llama-cpp`` skips it): llama-cpp-python's own prompt-lookup decoding
(``LlamaPromptLookupDecoding(num_pred_tokens=10)`` as ``draft_model``) against the same model without it, on
the same rendered prompts (code edit and prose), greedy, ``--threads`` threads, in a process of its own (built
by bench/reference.py from the pinned source, as bench/bench_pipeline.py's reference); its acceptance is
counted from the lookups it made (drafted) and the tokens they gave (tokens after the first, less one per
window: an estimate).

With a delay (``--skip-delay`` skips it; needs root, ``ip`` and ``tc``, else the reason is printed): the
comparison again for each of ``--delay-stages`` (2; or ``2,3``) and each of ``--delay-ms`` (10; a
comma-separated list, e.g. ``10,30``), 2 stages each in a network namespace of its own (tests/netns.py),
joined by a veth pair with ``tc qdisc ... netem delay`` on both ends: that one-way delay on the link, either
way (without netem in the kernel: skippy's own link conditioning, ``stage.link_delay_ms``, on loopback; 3
stages always so). Then the windows in flight: with speculation on, each workload's ms/token over the
delayed links against loopback (the same request on as many stages; ``--stages`` must include them), the
same with ``runtime.speculate_in_flight = 1``, the windows with a rejected draft and the steps with nothing
to draft per 100 tokens, and the ratio those allow (each costs a trip round the pipeline that no window in
flight can hide: loopback's ms/token plus one delay per stage for each), with the windows chained and
dropped.

Output identity: for each workload and configuration, greedy (the first round's runs) and seeded
(temperature 0.8, seed 7: one more run each, off and on), the speculative tokens against the others: identical,
or the first position where they differ and, asked of the ``off`` pipeline through its OpenAI endpoint
(``logprobs``, ``top_logprobs`` 2, the same messages and sampling, up to that token), the margin there between
the two best candidates as the endpoint reports them (for a seeded run the distribution it sampled from). A
greedy difference also gets this CPU's rounding band there (the whole model in this process: the five best
log-probabilities with the reply's last 40 positions computed as decode steps against in one prefill, as
bench/bench_prefix_cache.py measures it): a window computes its positions in one batch, so a flip at a margin
inside the band is rounding (for the mixed sessions a single sequence's band: batched with three other sessions
their rounding differs more). The greedy rows also say whether every round gave the same tokens (a pipeline
against itself: four sessions batched together need not).

Every figure is printed as it is, a figure or a ratio; nothing is asserted. ``--json`` writes every run.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
import uuid
from pathlib import Path

import trio

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

SEED = 7
SEEDED_TEMPERATURE = 0.8
LANES = 4
CTX = 2048
LOOKUP_PRED_TOKENS = 10  # llama-cpp-python's LlamaPromptLookupDecoding(num_pred_tokens=...)

# ---------------------------------------------------------------- workloads
_INVENTORY = '''def summarize_orders(orders, customers, tax_rate=0.2, currency="EUR"):
    """Totals per customer, the largest order and the orders that are late."""
    totals = {}
    largest = None
    late = []
    today = datetime.date.today()
    for order in orders:
        customer = customers.get(order["customer_id"])
        if customer is None:
            continue
        amount = 0.0
        for line in order["lines"]:
            price = line["unit_price"] * line["quantity"]
            if line.get("discount"):
                price = price * (1.0 - line["discount"])
            amount += price
        amount = round(amount * (1.0 + tax_rate), 2)
        name = customer["name"]
        totals[name] = totals.get(name, 0.0) + amount
        if largest is None or amount > largest[1]:
            largest = (order["id"], amount)
        due = order.get("due_date")
        if due is not None and due < today and not order.get("shipped"):
            late.append(order["id"])
    report = []
    for name in sorted(totals):
        report.append(f"{name}: {totals[name]:.2f} {currency}")
    if largest is not None:
        report.append(f"largest order: {largest[0]} ({largest[1]:.2f} {currency})")
    if late:
        report.append("late orders: " + ", ".join(str(i) for i in late))
    else:
        report.append("no late orders")
    return {
        "totals": totals,
        "largest": largest,
        "late": late,
        "report": "\\n".join(report),
    }
'''

_SENSORS = '''def clean_readings(readings, window=5, low=-40.0, high=85.0):
    """Drop impossible sensor readings, fill the gaps and smooth what is left."""
    cleaned = []
    dropped = 0
    last_good = None
    for reading in readings:
        value = reading.get("value")
        if value is None or value < low or value > high:
            dropped += 1
            if last_good is not None:
                cleaned.append({"time": reading["time"], "value": last_good, "filled": True})
            continue
        last_good = value
        cleaned.append({"time": reading["time"], "value": value, "filled": False})
    smoothed = []
    for i, reading in enumerate(cleaned):
        start = max(0, i - window + 1)
        values = [r["value"] for r in cleaned[start:i + 1]]
        average = sum(values) / len(values)
        smoothed.append({
            "time": reading["time"],
            "value": round(average, 3),
            "filled": reading["filled"],
        })
    filled = sum(1 for r in smoothed if r["filled"])
    if smoothed:
        lowest = min(r["value"] for r in smoothed)
        highest = max(r["value"] for r in smoothed)
    else:
        lowest = highest = None
    return {
        "readings": smoothed,
        "dropped": dropped,
        "filled": filled,
        "lowest": lowest,
        "highest": highest,
        "window": window,
    }
'''


def code_edit(function: str, old: str, new: str) -> str:
    return (f"Here is a Python function:\n\n```python\n{function}```\n\n"
            f"Rewrite it with `{old}` renamed to `{new}` everywhere. Return the whole code.")


def story(subject: str) -> str:
    return f"Write a short story about {subject}."


CODE_PROMPT = code_edit(_INVENTORY, "amount", "order_total")
PROSE_PROMPT = story("a lighthouse keeper who finds a message in a bottle")
MIXED_PROMPTS = [code_edit(_INVENTORY, "customer", "client"), story("a baker who opens a shop on the moon"),
                 code_edit(_SENSORS, "cleaned", "valid_readings"), story("two children who build a raft")]
WORKLOADS = ("code edit", "prose", "4 mixed")
SINGLE_PROMPTS = {"code edit": CODE_PROMPT, "prose": PROSE_PROMPT}


def messages(prompt: str) -> list[dict[str, str]]:
    return [{"role": "user", "content": prompt}]


def sampling(kind: str) -> dict:
    return {"temperature": 0.0} if kind == "greedy" else {"temperature": SEEDED_TEMPERATURE, "seed": SEED}


# ---------------------------------------------------------------- one generation
def speculation_of(result: dict) -> dict | None:
    """The result's speculation counters ({windows, drafted, accepted}), wherever the head reports them."""
    spec = result.get("speculation")
    if spec is None:
        spec = (result.get("usage") or {}).get("speculation")
    return spec


async def generate(head, prompt: str, max_tokens: int, kind: str, *, stream: bool = False) -> dict:
    """One chat generation through the control channel: its tokens, decode rate and counters; streamed, also when
    each message of pieces arrived (time, pieces)."""
    from skippyctl.client import ControlError, open_control
    from skippyd.control import messages as m

    arrivals: list[tuple[float, int]] = []
    sent = time.perf_counter()
    try:
        async with open_control(head.url, head.token_file) as client:
            request = m.Generate(id=client.new_id(), messages=messages(prompt), max_tokens=max_tokens,
                                 stream=stream, **sampling(kind))
            if not stream:
                r = await client.call(request)
            else:
                r = None
                async for reply in client.replies(request):
                    if isinstance(reply, m.Piece):
                        arrivals.append((time.perf_counter(), reply.pieces))
                    elif isinstance(reply, m.Result):
                        r = reply.result
                    else:
                        return {"error": str(reply), "tokens": [], "tok_s": None}
    except ControlError as exc:
        return {"error": str(exc), "tokens": [], "tok_s": None}
    return {"tokens": r["tokens"], "tok_s": r["timings"]["decode_tokens_per_s"], "finish": r["finish_reason"],
            "ttft_ms": r["timings"]["ttft_ms"], "prompt_tokens": r["usage"]["prompt_tokens"],
            "speculation": speculation_of(r), "error": r.get("error"), "sent_at": sent, "done_at": time.perf_counter(),
            "arrivals": arrivals}


async def generate_mixed(head, max_tokens: int, kind: str) -> dict:
    """The four mixed sessions at once, streamed: each one's run and the summed counters; the aggregate decode
    rate while all of them decode (as bench/bench_pipeline.py's concurrent_decode: the pieces that arrive from
    the last session's first piece to the first session's last, over that time; None when they never decoded
    at the same time), and end to end (every completion token over the wall time, prefills included)."""
    runs: list[dict | None] = [None] * len(MIXED_PROMPTS)

    async def one(i: int) -> None:
        runs[i] = await generate(head, MIXED_PROMPTS[i], max_tokens, kind, stream=True)

    async with trio.open_nursery() as nursery:
        for i in range(len(MIXED_PROMPTS)):
            nursery.start_soon(one, i)
    errors = [r["error"] for r in runs if r.get("error")]
    out: dict = {"sessions": runs, "tokens": [r["tokens"] for r in runs], "error": errors[0] if errors else None,
                 "tok_s": None, "e2e_tok_s": None, "speculation": None}
    if not errors:
        wall = max(r["done_at"] for r in runs) - min(r["sent_at"] for r in runs)
        out["e2e_tok_s"] = sum(len(r["tokens"]) for r in runs) / wall
        if all(r["arrivals"] for r in runs):
            lo, hi = max(r["arrivals"][0][0] for r in runs), min(r["arrivals"][-1][0] for r in runs)
            if hi > lo:
                out["tok_s"] = sum(n for r in runs for t, n in r["arrivals"] if lo < t <= hi) / (hi - lo)
        specs = [r["speculation"] for r in runs]
        if all(s is not None for s in specs):
            out["speculation"] = {k: sum(s.get(k, 0) for s in specs) for k in ("windows", "drafted", "accepted")}
    for r in runs:
        r.pop("arrivals", None)  # (not kept in the JSON)
    return out


async def run_workload(head, workload: str, max_tokens: int, kind: str) -> dict:
    if workload == "4 mixed":
        return await generate_mixed(head, max_tokens, kind)
    return await generate(head, SINGLE_PROMPTS[workload], max_tokens, kind)


# ---------------------------------------------------------------- pipelines
class Pair:
    """The same topology twice, ``--speculate off`` and ``on``: ``pipes[mode]``, ``openai[mode]`` (base URL)."""

    def __init__(self, name: str):
        self.name = name
        self.pipes: dict = {}
        self.openai: dict[str, str | None] = {}

    def stop(self) -> None:
        for pipe in self.pipes.values():
            pipe.stop()


def start_loopback(model: Path, n: int, work: Path, common: list[str], *, link_delay_ms: float = 0.0) -> Pair:
    """The pair on loopback; ``link_delay_ms``: skippy's own link conditioning (stage.link_delay_ms on every
    daemon: each frame between stages arrives that much later, either way)."""
    from tests.procs import Pipeline, SingleStage, free_ports, split_for_test

    pair = Pair(f"{n}-stage" + (f" link_delay_ms {link_delay_ms:g}" if link_delay_ms else ""))
    config = {"stage.link_delay_ms": link_delay_ms} if link_delay_ms else None
    try:
        for mode in ("off", "on"):
            port = free_ports(1)[0]
            extra = [*common, "--speculate", mode, "--openai", f"127.0.0.1:{port}"]
            where = work / f"{n}-{mode}" / (f"delay{link_delay_ms:g}" if link_delay_ms else "")
            where.mkdir(parents=True)
            if n == 1:
                pair.pipes[mode] = SingleStage(model, where, extra, config=config)
            else:
                split_for_test(model, n, where)
                pair.pipes[mode] = Pipeline(where / "topology.toml", where, extra=extra, config=config).start()
            pair.openai[mode] = f"http://127.0.0.1:{port}/v1"
    except BaseException:
        pair.stop()
        raise
    return pair


def delay_unavailable() -> str | None:
    """Why the delayed section cannot run here (None: it can)."""
    from tests import netns

    why = netns.unavailable()
    if why:
        return why
    if shutil.which("tc") is None:
        return "no `tc` command (Debian package iproute2)"
    probe = f"skspec{uuid.uuid4().hex[:6]}"
    try:
        subprocess.run(["ip", "netns", "add", probe], check=True, capture_output=True, timeout=30)
    except (subprocess.CalledProcessError, subprocess.TimeoutExpired) as exc:
        return f"`ip netns add` failed: {getattr(exc, 'stderr', b'') or exc}"
    try:
        tc = subprocess.run(["ip", "netns", "exec", probe, "tc", "qdisc", "add", "dev", "lo", "root", "netem",
                             "delay", "1ms"], capture_output=True, text=True, timeout=30)
        if tc.returncode != 0:
            return (f"tc cannot add a netem qdisc here ({tc.stderr.strip() or tc.stdout.strip()}): this kernel "
                    f"lacks sch_netem")
    finally:
        subprocess.run(["ip", "netns", "del", probe], capture_output=True, timeout=30)
    return None


def start_delayed(model: Path, work: Path, common: list[str], delay_ms: float):
    """Two namespaces joined by a veth pair with netem delay on both ends; the 2-stage pair on them. Returns
    (network, pair); raises NetnsError (tc's message) when netem cannot be set up."""
    import attrs

    from skippyd.topology import Topology
    from tests import netns
    from tests.procs import split_for_test
    from tests.test_network_faults import NetPipeline

    net = netns.Network(2)
    pair = Pair("2-stage delayed")
    try:
        for host in net.hosts:
            host.run("tc", "qdisc", "add", "dev", host.data_dev, "root", "netem", "delay", f"{delay_ms:g}ms")
        split = work / "delay-split"
        split.mkdir(parents=True)
        split_for_test(model, 2, split)
        topo = Topology.load(split / "topology.toml")
        for port, mode in ((7451, "off"), (7452, "on")):  # each namespace has ports of its own
            where = work / f"delay-{mode}"
            where.mkdir()
            stages = [attrs.evolve(s, host=h.address, port=port) for s, h in zip(topo.stages, net.hosts)]
            attrs.evolve(topo, stages=stages).dump(where / "topology.toml")
            pair.pipes[mode] = NetPipeline(where / "topology.toml", where, net, port=port, lanes=LANES,
                                           extra=[*common, "--speculate", mode]).start()
            pair.openai[mode] = None
    except BaseException:
        pair.stop()
        net.close()
        raise
    return net, pair


def ping_ms(net) -> float | None:
    """The round trip between the two hosts over the data link (ping's average), or None."""
    if shutil.which("ping") is None:
        return None
    a, b = net.hosts
    proc = a.run("ping", "-c", "3", "-i", "0.2", "-q", b.address, check=False)
    found = re.search(r"= [0-9.]+/([0-9.]+)/", proc.stdout)
    return float(found.group(1)) if found else None


# ---------------------------------------------------------------- rounds
def measure(pairs: list[Pair], workloads: tuple[str, ...], rounds: int, tokens: int,
            progress: str = "") -> dict[str, dict[str, dict[str, list[dict]]]]:
    """runs[pair][workload][mode]: one greedy run per round, off and on in turn (swapped every round)."""
    runs = {p.name: {w: {"off": [], "on": []} for w in workloads} for p in pairs}
    for pair in pairs:  # warm-up: every daemon's first generation pays one-off costs
        for pipe in pair.pipes.values():
            trio.run(generate, pipe.head, PROSE_PROMPT, 4, "greedy")
    for rnd in range(rounds):
        order = ("off", "on") if rnd % 2 == 0 else ("on", "off")
        for pair in pairs:
            for w in workloads:
                for mode in order:
                    r = trio.run(run_workload, pair.pipes[mode].head, w, tokens, "greedy")
                    runs[pair.name][w][mode].append(r)
                    if r.get("error"):
                        print(f"  {pair.name} {w} {mode}: ERROR {r['error']}", flush=True)
        print(f"{progress}round {rnd + 1}/{rounds} done", file=sys.stderr, flush=True)
    return runs


def seeded_runs(pairs: list[Pair], workloads: tuple[str, ...], tokens: int) -> dict:
    """seeded[pair][workload][mode]: one run each at temperature 0.8, seed 7."""
    out = {p.name: {w: {} for w in workloads} for p in pairs}
    for pair in pairs:
        for w in workloads:
            for mode in ("off", "on"):
                out[pair.name][w][mode] = trio.run(run_workload, pair.pipes[mode].head, w, tokens, "seeded")
    return out


# ---------------------------------------------------------------- figures
def spread(xs: list[float]) -> str:
    xs = [x for x in xs if x is not None]
    if not xs:
        return "-"
    return f"{statistics.median(xs):.1f} ({min(xs):.1f}-{max(xs):.1f})"


def summarize(runs: dict[str, list[dict]]) -> dict:
    """off/on rates, the ratio of medians and per round, and the speculation counters summed."""
    off = [r["tok_s"] for r in runs["off"] if r.get("tok_s")]
    on = [r["tok_s"] for r in runs["on"] if r.get("tok_s")]
    per_round = [b["tok_s"] / a["tok_s"] for a, b in zip(runs["off"], runs["on"]) if a.get("tok_s") and b.get("tok_s")]
    out: dict = {"off_tok_s": off, "on_tok_s": on, "ratio_per_round": per_round,
                 "ratio": statistics.median(on) / statistics.median(off) if off and on else None,
                 "errors": sum(bool(r.get("error")) for mode in ("off", "on") for r in runs[mode])}
    specs = [r["speculation"] for r in runs["on"] if r.get("speculation") is not None]
    out["speculation"] = total = ({k: sum(s.get(k, 0) for s in specs)
                                   for k in ("windows", "drafted", "accepted", "plain_steps", "rejected", "chained",
                                             "dropped")}
                                  if specs else None)
    out["tokens_on"] = sum(len(r["tokens"]) if isinstance(r.get("tokens"), list) and r["tokens"]
                           and isinstance(r["tokens"][0], int) else 0 for r in runs["on"])
    out["acceptance"] = total["accepted"] / total["drafted"] if total and total["drafted"] else None
    out["tokens_per_window"] = ((total["windows"] + total["accepted"]) / total["windows"]
                                if total and total["windows"] else None)
    if any("e2e_tok_s" in r for r in runs["off"] + runs["on"]):
        e2e = {mode: [r["e2e_tok_s"] for r in runs[mode] if r.get("e2e_tok_s")] for mode in ("off", "on")}
        out["e2e"] = {"off_tok_s": e2e["off"], "on_tok_s": e2e["on"],
                      "ratio_per_round": [b["e2e_tok_s"] / a["e2e_tok_s"] for a, b in zip(runs["off"], runs["on"])
                                          if a.get("e2e_tok_s") and b.get("e2e_tok_s")],
                      "ratio": (statistics.median(e2e["on"]) / statistics.median(e2e["off"])
                                if e2e["off"] and e2e["on"] else None)}
    off_spec = [r["speculation"] for r in runs["off"] if r.get("speculation")]
    out["off_windows"] = sum(s.get("windows", 0) for s in off_spec) if off_spec else None
    return out


def fmt(x: float | None, spec: str = ".3f") -> str:
    return "-" if x is None else format(x, spec)


def print_speed(title: str, table: dict[str, dict[str, dict]]) -> None:
    print(f"\n{title}")
    head = (f"  {'':34}{'off tok/s':>22}{'on tok/s':>22}{'on/off':>8}{'per round':>15}"
            f"{'accepted':>10}{'tok/window':>11}{'windows':>9}")
    print(head)
    for name, rows in table.items():
        for w, s in rows.items():
            windows = s["speculation"]["windows"] if s["speculation"] else None
            label = f"{name} {w}" + (" (aggr.)" if w == "4 mixed" else "")
            errors = f"  {s['errors']} ERRORS" if s["errors"] else ""
            print(f"  {label:34}{_rates(s)}{fmt(s['acceptance'], '.2f'):>10}{fmt(s['tokens_per_window'], '.2f'):>11}"
                  f"{fmt(windows, 'd'):>9}{errors}")
            if "e2e" in s:
                e2e_label = f"{name} {w} (e2e)"
                print(f"  {e2e_label:34}{_rates(s['e2e'])}")


def _rates(s: dict) -> str:
    pr = s["ratio_per_round"]
    rng = f"{min(pr):.2f}-{max(pr):.2f}" if pr else "-"
    ratio = "x" + fmt(s["ratio"], ".2f") if s["ratio"] else "-"
    return f"{spread(s['off_tok_s']):>22}{spread(s['on_tok_s']):>22}{ratio:>8}{rng:>15}"


# ---------------------------------------------------------------- output identity
def first_difference(a: list[int], b: list[int]) -> int | None:
    for i, (x, y) in enumerate(zip(a, b)):
        if x != y:
            return i
    return None if len(a) == len(b) else min(len(a), len(b))


def compare(off: list[int], on: list[int]) -> dict:
    pos = first_difference(off, on)
    if pos is None:
        return {"identical": True, "tokens": len(off)}
    return {"identical": False, "position": pos, "tokens": [len(off), len(on)],
            "off": off[pos] if pos < len(off) else None, "on": on[pos] if pos < len(on) else None}


def identity_rows(pairs: list[Pair], runs: dict, seeded: dict | None, workloads: tuple[str, ...]) -> list[dict]:
    """One row per configuration, workload, sampling and session (the mixed workload has four)."""
    rows = []
    for pair in pairs:
        for w in workloads:
            greedy = runs[pair.name][w]
            cases = [("greedy", greedy["off"][0] if greedy["off"] else None, greedy["on"][0] if greedy["on"] else None)]
            if seeded is not None:
                cases.append(("seeded", seeded[pair.name][w].get("off"), seeded[pair.name][w].get("on")))
            for kind, off, on in cases:
                if off is None or on is None or off.get("error") or on.get("error"):
                    rows.append({"config": pair.name, "workload": w, "sampling": kind, "session": None,
                                 "note": "not compared: a run failed"})
                    continue
                several = w == "4 mixed"
                offs = off["tokens"] if several else [off["tokens"]]
                ons = on["tokens"] if several else [on["tokens"]]
                for i, (a, b) in enumerate(zip(offs, ons)):
                    row = {"config": pair.name, "workload": w, "sampling": kind, "session": i if several else None,
                           "prompt": MIXED_PROMPTS[i] if several else SINGLE_PROMPTS[w], **compare(a, b)}
                    if kind == "greedy":  # each pipeline against itself over the rounds
                        for mode in ("off", "on"):
                            seqs = [(r["tokens"][i] if several else r["tokens"]) for r in greedy[mode]
                                    if not r.get("error")]
                            row[f"{mode}_rounds_agree"] = all(s == seqs[0] for s in seqs)
                    rows.append(row)
    return rows


def probe_margins(pairs: list[Pair], rows: list[dict], vocab) -> None:
    """For each row that differs: the off pipeline asked (OpenAI chat, logprobs, top_logprobs 2) for the tokens up
    to the difference; the two best candidates there and their margin, in place."""
    import openai

    by_name = {p.name: p for p in pairs}
    for row in rows:
        if row.get("identical") is not False:
            continue
        base = by_name[row["config"]].openai.get("off")
        if base is None:
            row["margin_note"] = "no OpenAI endpoint on this pipeline"
            continue
        pos = row["position"]
        client = openai.OpenAI(base_url=base, api_key="unused", max_retries=0, timeout=600)
        try:
            served = client.models.list().data
            got = client.chat.completions.create(model=served[0].id if served else "default",
                                                 messages=messages(row["prompt"]), max_tokens=pos + 1,
                                                 logprobs=True, top_logprobs=2, **sampling(row["sampling"]))
        except openai.OpenAIError as exc:
            row["margin_note"] = f"the logprobs request failed: {exc}"
            continue
        content = (got.choices[0].logprobs.content or []) if got.choices[0].logprobs else []
        # the probe's tokens before the difference against the off run's (the same pieces?)
        off_prefix = [vocab.token_piece(t, special=True) for t in row["off_tokens"][:pos]]
        probe_prefix = [bytes(c.bytes or c.token.encode()) for c in content[:pos]]
        row["probe_agrees"] = off_prefix == probe_prefix
        if len(content) <= pos:
            row["margin_note"] = f"the probe ended after {len(content)} tokens"
            continue
        top = content[pos].top_logprobs
        row["top"] = [(t.token, t.logprob) for t in top]
        if len(top) >= 2:
            row["margin"] = top[0].logprob - top[1].logprob


BAND_STEPS = 40  # the rounding band: this many positions before a difference, as decode steps against one prefill


def rounding_bands(model: Path, rows: list[dict], threads: int) -> None:
    """For each greedy row that differs, in place: this CPU's rounding band there (bench/bench_prefix_cache.py's
    Offline.rounding_band, the whole model in this process): how far apart the five best log-probabilities after
    the prompt and the reply up to the difference land when the last positions (up to BAND_STEPS) are computed
    as decode steps or in one prefill. A window computes its positions in one batch where plain decoding steps,
    so a flip at a margin inside this band is rounding."""
    todo = [r for r in rows if r.get("identical") is False and r["sampling"] == "greedy" and r["position"] > 0]
    if not todo:
        return
    from bench.bench_prefix_cache import Offline
    from skippyd.runtime.chat_template import render_chat

    offline = Offline(model, threads, CTX)
    try:
        for row in todo:
            text = render_chat(offline.model, messages(row["prompt"]))
            prompt = offline.model.tokenize(text, add_special=False, parse_special=True).tolist()
            reply = row["off_tokens"][:row["position"]]
            row["rounding_band"] = offline.rounding_band(prompt + reply, stepped=min(len(reply), BAND_STEPS))
    finally:
        offline.close()


def print_identity(rows: list[dict], vocab) -> None:
    def piece(t: int | None) -> str:
        return "<end>" if t is None else repr(vocab.token_piece(t, special=True).decode("utf-8", "replace"))

    print("\noutput identity: speculative tokens against the same configuration's non-speculative ones")
    for row in rows:
        where = f"{row['config']} {row['workload']}" + (f" #{row['session']}" if row.get("session") is not None else "")
        label = f"  {where:34} {row['sampling']:7}"
        if "note" in row:
            print(f"{label} {row['note']}")
            continue
        agree = ""
        if row["sampling"] == "greedy":
            agree = (f"  (rounds agree: off {'yes' if row['off_rounds_agree'] else 'NO'}, "
                     f"on {'yes' if row['on_rounds_agree'] else 'NO'})")
        if row["identical"]:
            print(f"{label} identical ({row['tokens']} tokens){agree}")
            continue
        margin = ""
        if "margin" in row:
            tops = ", ".join(f"{t!r} {lp:.4f}" for t, lp in row["top"])
            margin = f"; there top-2 {tops}: margin {row['margin']:.4f}"
            if not row.get("probe_agrees", True):
                margin += " (the probe's tokens before it differ from the off run's)"
            if "rounding_band" in row:
                inside = "inside" if row["margin"] <= row["rounding_band"] else "OUTSIDE"
                margin += f"; rounding band {row['rounding_band']:.4f}: {inside}"
        elif "margin_note" in row:
            margin = f"; margin: {row['margin_note']}"
        print(f"{label} differ at token {row['position']} (of {row['tokens'][0]}/{row['tokens'][1]}): "
              f"off {piece(row['off'])} on {piece(row['on'])}{margin}{agree}")


# ---------------------------------------------------------------- llama-cpp-python
def llama_cpp_worker(args: argparse.Namespace) -> int:
    """In a process of its own: plain and prompt-lookup greedy decode of the given prompts; JSON on stdout."""
    import llama_cpp
    from llama_cpp.llama_speculative import LlamaPromptLookupDecoding

    class Counting(LlamaPromptLookupDecoding):
        def __init__(self):
            super().__init__(num_pred_tokens=LOOKUP_PRED_TOKENS)
            self.calls = self.drafted = 0

        def __call__(self, input_ids, /, **kwargs):
            out = super().__call__(input_ids, **kwargs)
            self.calls += 1
            self.drafted += len(out)
            return out

    spec = json.loads(Path(args.llama_cpp_worker).read_text())
    eog = set(spec["eog"])
    params = dict(n_threads=args.threads, n_threads_batch=args.threads, n_ctx=CTX, n_batch=512, n_ubatch=512,
                  verbose=False)
    lookup = Counting()
    models = {"plain": llama_cpp.Llama(spec["model"], **params),
              # logits_all as a draft model makes it anyway: said here too, or its score buffer is sized for
              # one batch (n_batch rows) and a window past that many positions does not fit
              "prompt lookup": llama_cpp.Llama(spec["model"], draft_model=lookup, logits_all=True, **params)}

    def run(llm, prompt: list[int], n: int) -> dict:
        llm.reset()
        lookup.calls = lookup.drafted = 0
        out: list[int] = []
        first_at = None
        for tok in llm.generate(prompt, top_k=1, top_p=1.0, min_p=0.0, temp=0.0, repeat_penalty=1.0, reset=True):
            if first_at is None:
                first_at = time.perf_counter()
            out.append(int(tok))
            if len(out) >= n or tok in eog:
                break
        rest = time.perf_counter() - first_at
        r = {"tokens": out, "tok_s": (len(out) - 1) / rest if len(out) > 1 and rest > 0 else None}
        if llm.draft_model is not None:
            r["lookups"], r["drafted"] = lookup.calls, lookup.drafted
            r["accepted_est"] = max(0, len(out) - 1 - lookup.calls)
        return r

    for llm in models.values():
        run(llm, spec["prompts"]["prose"], 4)  # warm-up
    results = {w: {name: [] for name in models} for w in spec["prompts"]}
    for rnd in range(args.rounds):
        names = list(models) if rnd % 2 == 0 else list(models)[::-1]
        for w, prompt in spec["prompts"].items():
            for name in names:
                results[w][name].append(run(models[name], prompt, args.tokens))
    json.dump({"version": llama_cpp.__version__, "results": results}, sys.stdout)
    return 0


def measure_llama_cpp(model: Path, vocab, tokens: int, rounds: int, threads: int, work: Path) -> dict:
    from skippyd.runtime.chat_template import render_chat

    prompts = {}
    for w, prompt in SINGLE_PROMPTS.items():
        text = render_chat(vocab, messages(prompt))
        prompts[w] = vocab.tokenize(text, add_special=False, parse_special=True).tolist()
    spec = work / "llama-cpp.json"
    spec.write_text(json.dumps({"model": str(model), "prompts": prompts, "eog": vocab.eog_tokens().tolist()}))
    proc = subprocess.run([sys.executable, __file__, "--llama-cpp-worker", str(spec), "--tokens", str(tokens),
                           "--rounds", str(rounds), "--threads", str(threads)],
                          capture_output=True, text=True, timeout=1200)
    if proc.returncode != 0:
        raise RuntimeError(f"llama-cpp-python run failed:\n{proc.stderr[-2000:]}")
    out = json.loads(proc.stdout)
    out["prompt_tokens"] = {w: len(p) for w, p in prompts.items()}
    return out


def summarize_llama_cpp(lc: dict) -> dict:
    out = {}
    for w, by in lc["results"].items():
        plain = [r["tok_s"] for r in by["plain"] if r["tok_s"]]
        look = [r["tok_s"] for r in by["prompt lookup"] if r["tok_s"]]
        per_round = [b["tok_s"] / a["tok_s"] for a, b in zip(by["plain"], by["prompt lookup"])
                     if a["tok_s"] and b["tok_s"]]
        drafted = sum(r["drafted"] for r in by["prompt lookup"])
        accepted = sum(r["accepted_est"] for r in by["prompt lookup"])
        lookups = sum(r["lookups"] for r in by["prompt lookup"])
        out[w] = {"plain_tok_s": plain, "lookup_tok_s": look, "ratio_per_round": per_round,
                  "ratio": statistics.median(look) / statistics.median(plain) if plain and look else None,
                  "lookups": lookups, "drafted": drafted, "accepted_est": accepted,
                  "acceptance_est": accepted / drafted if drafted else None,
                  "same_tokens": all(a["tokens"] == b["tokens"] for a, b in zip(by["plain"], by["prompt lookup"]))}
    return out


def print_llama_cpp(summary: dict, lc: dict, skippy_greedy: dict) -> None:
    print(f"\nllama-cpp-python {lc.get('version')} prompt lookup (LlamaPromptLookupDecoding(num_pred_tokens="
          f"{LOOKUP_PRED_TOKENS})) against the same model without it, greedy; acceptance estimated")
    print(f"  {'':34}{'plain tok/s':>22}{'lookup tok/s':>22}{'ratio':>8}{'per round':>15}{'accepted':>10}"
          f"{'lookups':>9}  tokens")
    for w, s in summary.items():
        pr = s["ratio_per_round"]
        rng = f"{min(pr):.2f}-{max(pr):.2f}" if pr else "-"
        same = "lookup = plain" if s["same_tokens"] else "lookup != plain"
        ref = skippy_greedy.get(w)
        if ref is not None:
            plain_tokens = lc["results"][w]["plain"][0]["tokens"]
            same += ", = skippy 1-stage off" if plain_tokens == ref else ", != skippy 1-stage off"
        print(f"  {w:34}{spread(s['plain_tok_s']):>22}{spread(s['lookup_tok_s']):>22}"
              f"{'x' + fmt(s['ratio'], '.2f') if s['ratio'] else '-':>8}{rng:>15}"
              f"{fmt(s['acceptance_est'], '.2f'):>10}{s['lookups']:>9}  {same}")


# ---------------------------------------------------------------- main
def parse_stages(text: str) -> list[int]:
    try:
        stages = sorted({int(x) for x in text.split(",") if x.strip()})
    except ValueError:
        raise argparse.ArgumentTypeError(f"a comma-separated list of 1, 2 and 3, not {text!r}") from None
    if not stages or not set(stages) <= {1, 2, 3}:
        raise argparse.ArgumentTypeError(f"a comma-separated list of 1, 2 and 3, not {text!r}")
    return stages


def delay_stages(text: str) -> list[int]:
    stages = parse_stages(text)
    if 1 in stages:
        raise argparse.ArgumentTypeError("a delay needs a link: 2 or 3 stages")
    return stages


def parse_delays(text: str) -> list[float]:
    try:
        delays = [float(x) for x in text.split(",") if x.strip()]
    except ValueError:
        raise argparse.ArgumentTypeError(f"not a list of milliseconds: {text!r}") from None
    if not delays or any(d <= 0 for d in delays):
        raise argparse.ArgumentTypeError("delays must be positive (--skip-delay skips the section)")
    return delays


def positive(text: str) -> int:
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"a positive integer, not {text!r}") from None
    if value < 1:
        raise argparse.ArgumentTypeError(f"a positive integer, not {text!r}")
    return value


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--stages", type=parse_stages, default=[1, 2, 3], help="stage counts on loopback (default 1,2,3)")
    ap.add_argument("--tokens", type=positive, default=128, help="max tokens of every generation (default 128)")
    ap.add_argument("--rounds", type=positive, default=3, help="interleaved rounds (default 3)")
    ap.add_argument("--threads", type=positive, default=2,
                    help="compute threads of every stage and of llama-cpp-python (default 2)")
    ap.add_argument("--delay-ms", type=parse_delays, default=[10.0],
                    help="one-way delays of the delayed section, comma-separated (default 10)")
    ap.add_argument("--delay-stages", type=delay_stages, default=[2],
                    help="stage counts of the delayed section, comma-separated, from 2 (default 2; 3 and more with "
                         "skippy's link conditioning)")
    ap.add_argument("--skip-delay", action="store_true", help="skip the comparison over delayed links")
    ap.add_argument("--skip-llama-cpp", action="store_true", help="skip llama-cpp-python's prompt lookup")
    ap.add_argument("--model", type=Path, default=None, help="GGUF (default: the embedded default model)")
    ap.add_argument("--json", type=Path, default=None, help="write every run and figure here")
    ap.add_argument("--llama-cpp-worker", default=None, help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.llama_cpp_worker:
        return llama_cpp_worker(args)


    from skippyd.runtime.llama import Model
    from skippyd.runtime.models import fetch_default_model

    model = args.model or fetch_default_model()
    started = time.monotonic()
    if not args.skip_llama_cpp:
        from bench.reference import ensure_reference

        ensure_reference()  # before anything is timed: a first build takes minutes
    vocab = Model(model, vocab_only=True)
    common = ["--lanes", str(LANES), "--ctx", str(CTX), "--threads", str(args.threads)]
    report: dict = {"model": model.name, "cores": os.cpu_count(), "threads": args.threads, "tokens": args.tokens,
                    "rounds": args.rounds, "stages": args.stages}
    with tempfile.TemporaryDirectory(prefix="bench-speculative-") as tmp:
        tmp = Path(tmp)
        # this run's daemons take turns at the cores with each other, not with another run's stages on this host
        os.environ["SKIPPY_COMPUTE_LOCK"] = str(tmp / "compute.lock")
        pairs: list[Pair] = []
        section = time.monotonic()
        try:
            for n in args.stages:
                print(f"starting {n}-stage, speculate off and on", file=sys.stderr, flush=True)
                pairs.append(start_loopback(model, n, tmp, common))
            for pair in pairs:
                for pipe in pair.pipes.values():  # the OpenAI listener follows READY by milliseconds
                    _wait_http(pair, pipe)
            runs = measure(pairs, WORKLOADS, args.rounds, args.tokens)
            seeded = seeded_runs(pairs, WORKLOADS, args.tokens)
            rows = identity_rows(pairs, runs, seeded, WORKLOADS)
            for row in rows:  # the off run's tokens, for the probe's check
                if row.get("identical") is False:
                    row["off_tokens"] = _off_tokens(runs, seeded, row)
            probe_margins(pairs, rows, vocab)
        finally:
            for pair in pairs:
                pair.stop()
        report["loopback"] = {"runs": runs, "seeded": seeded,
                              "summary": {name: {w: summarize(runs[name][w]) for w in WORKLOADS} for name in runs}}
        rounding_bands(model, rows, args.threads)
        report["identity"] = rows

        walls = report["section_wall_s"] = {"loopback": time.monotonic() - section}
        section = time.monotonic()
        why_not = "--skip-delay" if args.skip_delay else delay_unavailable()
        delays: list[dict] = []
        for n in ([] if args.skip_delay else args.delay_stages):
            for delay_ms in args.delay_ms:
                delays.append(measure_delayed(model, tmp, common, n, delay_ms, why_not, args.rounds, args.tokens))
        report["delayed"] = delays if delays else {"skipped": why_not}

        walls["delayed"] = time.monotonic() - section
        section = time.monotonic()
        lc = None
        if args.skip_llama_cpp:
            report["llama_cpp"] = {"skipped": "--skip-llama-cpp"}
        else:
            print("llama-cpp-python: plain and prompt lookup", file=sys.stderr, flush=True)
            try:
                lc = measure_llama_cpp(model, vocab, args.tokens, args.rounds, args.threads, tmp)
                report["llama_cpp"] = {**lc, "summary": summarize_llama_cpp(lc)}
            except (RuntimeError, subprocess.TimeoutExpired, ValueError) as exc:
                report["llama_cpp"] = {"skipped": str(exc)}
        walls["llama-cpp-python"] = time.monotonic() - section
    report["wall_s"] = time.monotonic() - started

    print(f"\nmodel {model.name}, {os.cpu_count()} cores, {args.threads} threads per stage, --tokens {args.tokens}, "
          f"{args.rounds} interleaved rounds, greedy; decode tok/s median (min-max); on/off: ratio of the medians "
          f"and the range of the per-round ratios; accepted: accepted / drafted drafts; tok/window: tokens per "
          f"verify window; windows: verify windows in all rounds")
    print_speed("loopback", report["loopback"]["summary"])
    for delayed in delays:
        rtt = f", ping round trip {delayed['ping_rtt_ms']:.1f} ms" if delayed["ping_rtt_ms"] else ""
        how = ("skippy's link conditioning (stage.link_delay_ms) on loopback" if delayed.get("how")
               else "network namespaces, netem")
        print_speed(f"{delayed['stages']} stages, {how}, {delayed['delay_ms']:g} ms one-way on every link{rtt}",
                    delayed["summary"])
    if not delays:
        print(f"\ndelayed links: skipped ({why_not})")
    else:
        print_in_flight(report["loopback"]["summary"], delays)
    print_identity(rows, vocab)
    for delayed in delays:
        print_identity(delayed["identity"], vocab)
    if lc is not None:
        ones = {w: runs["1-stage"][w]["off"][0]["tokens"] for w in SINGLE_PROMPTS
                if "1-stage" in runs and runs["1-stage"][w]["off"]}
        print_llama_cpp(report["llama_cpp"]["summary"], lc, ones)
    elif not args.skip_llama_cpp:
        print(f"\nllama-cpp-python: skipped ({report['llama_cpp']['skipped']})")
    print(f"\nwall time {report['wall_s']:.0f} s (" + ", ".join(f"{k} {v:.0f} s" for k, v in walls.items()) + ")")
    vocab.close()
    if args.json:
        args.json.parent.mkdir(parents=True, exist_ok=True)
        args.json.write_text(json.dumps(report, indent=1, default=str))
    return 0


def measure_delayed(model: Path, tmp: Path, common: list[str], n: int, delay_ms: float, why_not: str | None,
                    rounds: int, tokens: int) -> dict:
    """The ``n``-stage pair over links delayed ``delay_ms`` each way: 2 stages in network namespaces with netem
    where the kernel has it (``why_not`` None), else with skippy's own link conditioning on loopback."""
    if why_not is None and n == 2:
        net = dpair = None
        try:
            print(f"starting 2-stage in two network namespaces, netem {delay_ms:g} ms each way", file=sys.stderr,
                  flush=True)
            net, dpair = start_delayed(model, tmp, common, delay_ms)
            rtt = ping_ms(net)
            druns = measure([dpair], WORKLOADS, rounds, tokens, progress=f"delayed {delay_ms:g} ms: ")
            return {"stages": n, "delay_ms": delay_ms, "ping_rtt_ms": rtt, "runs": druns,
                    "identity": identity_rows([dpair], druns, None, WORKLOADS),
                    "summary": {dpair.name: {w: summarize(druns[dpair.name][w]) for w in WORKLOADS}}}
        except Exception as exc:  # netem missing in this kernel, a namespace that cannot be made: said, not fatal
            why_not = f"{type(exc).__name__}: {exc}"
        finally:
            if dpair is not None:
                dpair.stop()
            if net is not None:
                net.close()
    # no netem here: the same delay from skippy's own link conditioning, on loopback
    print(f"delayed links, {n} stages: no netem ({why_not or 'netem runs 2 stages only'}); stage.link_delay_ms "
          f"{delay_ms:g} on loopback instead", file=sys.stderr, flush=True)
    dpair = start_loopback(model, n, tmp / f"conditioned-{n}-{delay_ms:g}", common, link_delay_ms=delay_ms)
    try:
        druns = measure([dpair], WORKLOADS, rounds, tokens, progress=f"delayed {delay_ms:g} ms: ")
        delayed = {"stages": n, "delay_ms": delay_ms, "ping_rtt_ms": None, "how": "stage.link_delay_ms",
                   "netem_missing": why_not, "runs": druns, "identity": identity_rows([dpair], druns, None, WORKLOADS),
                   "summary": {dpair.name: {w: summarize(druns[dpair.name][w]) for w in WORKLOADS}}}
    finally:
        dpair.stop()
    delayed["one_in_flight"] = measure_one_in_flight(model, tmp, common, n, delay_ms, rounds, tokens)
    return delayed


def measure_one_in_flight(model: Path, tmp: Path, common: list[str], n: int, delay_ms: float, rounds: int,
                          tokens: int) -> dict:
    """The same ``n`` stages with speculation on and ``runtime.speculate_in_flight = 1`` (each window answered
    before the next goes out): decode tok/s of the single-session workloads, ``rounds`` each, and their tokens."""
    from tests.procs import Pipeline, split_for_test

    where = tmp / f"one-in-flight-{n}-{delay_ms:g}"
    where.mkdir(parents=True)
    split_for_test(model, n, where)
    pipe = Pipeline(where / "topology.toml", where, extra=[*common, "--speculate", "on"],
                    config={"stage.link_delay_ms": delay_ms, "runtime.speculate_in_flight": 1}).start()
    try:
        trio.run(generate, pipe.head, PROSE_PROMPT, 4, "greedy")  # warm-up
        out: dict = {}
        for w in SINGLE_PROMPTS:
            runs = [trio.run(run_workload, pipe.head, w, tokens, "greedy") for _ in range(rounds)]
            out[w] = {"tok_s": [r["tok_s"] for r in runs if r.get("tok_s")], "tokens": runs[0].get("tokens")}
        return out
    finally:
        pipe.stop()


def print_in_flight(loopback: dict, delays: list[dict]) -> None:
    """Speculation on: ms/token over each delayed link against loopback, the same request on as many stages.
    Every rejected draft, and every step with nothing to draft, costs one trip round the pipeline (a one-way
    delay per stage, with direct return) that no window in flight can hide: the bound is loopback's ms/token
    plus those, per token."""
    print("\nwindows in flight, speculation on: ms/token (median), delayed / loopback; one in flight: "
          "the same with runtime.speculate_in_flight = 1; rej/100: windows with a rejected draft per 100 tokens; "
          "plain/100: steps with nothing to draft; bound: the ratio those round trips allow (none can be hidden)")
    print(f"  {'':22}{'delay':>7}{'loopback':>10}{'delayed':>9}{'ratio':>7}{'1 in flight':>12}{'ratio':>7}"
          f"{'rej/100':>9}{'plain/100':>10}{'bound':>7}{'chained':>9}{'dropped':>9}")
    for w in ("code edit", "prose"):
        for delayed in delays:
            n = delayed["stages"]
            base = loopback.get(f"{n}-stage", {}).get(w)
            if not base or not base["on_tok_s"]:
                continue
            loop_ms = 1e3 / statistics.median(base["on_tok_s"])
            s = next(iter(delayed["summary"].values())).get(w)
            if not s or not s["on_tok_s"] or not s["speculation"] or not s["tokens_on"]:
                continue
            ms = 1e3 / statistics.median(s["on_tok_s"])
            spec = s["speculation"]
            rej, plain = spec["rejected"] / s["tokens_on"], spec["plain_steps"] / s["tokens_on"]
            bound = (loop_ms + (rej + plain) * n * delayed["delay_ms"]) / loop_ms
            one = (delayed.get("one_in_flight") or {}).get(w) or {}
            one_ms = 1e3 / statistics.median(one["tok_s"]) if one.get("tok_s") else None
            one_txt = f"{one_ms:>12.2f}{one_ms / loop_ms:>7.2f}" if one_ms else f"{'-':>12}{'-':>7}"
            label = f"{w}, {n} stages"
            print(f"  {label:22}{delayed['delay_ms']:>5g}ms{loop_ms:>10.2f}{ms:>9.2f}{ms / loop_ms:>7.2f}{one_txt}"
                  f"{100 * rej:>9.1f}{100 * plain:>10.1f}{bound:>7.2f}{spec['chained']:>9}{spec['dropped']:>9}")


def _off_tokens(runs: dict, seeded: dict, row: dict) -> list[int]:
    src = runs[row["config"]][row["workload"]]["off"][0] if row["sampling"] == "greedy" \
        else seeded[row["config"]][row["workload"]]["off"]
    return src["tokens"][row["session"]] if row["session"] is not None else src["tokens"]


def _wait_http(pair: Pair, pipe) -> None:
    import urllib.request

    mode = next(k for k, v in pair.pipes.items() if v is pipe)
    base = pair.openai.get(mode)
    if base is None:
        return
    deadline = time.monotonic() + 30
    while time.monotonic() < deadline:
        try:
            with urllib.request.urlopen(f"{base}/models", timeout=5) as resp:
                if resp.status == 200:
                    return
        except OSError:
            pass
        time.sleep(0.1)
    raise TimeoutError(f"{pair.name} {mode}: the OpenAI endpoint is not answering {base}")


if __name__ == "__main__":
    sys.exit(main())
