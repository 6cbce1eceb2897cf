"""Deployment: how fast a planned pipeline decodes against the even split and the compute balance, on three
hosts of which one is slower, all measured in the same run.

    sudo .venv/bin/python bench/bench_deploy.py [--slow 0.3] [--rounds 3] [--tokens 64] [--json out.json]

Three network-namespace hosts (tests/netns.py: needs root and `ip`), each a
waiting skippyd; host 2 runs under a CPU quota of `--slow` of a core (a cgroup;
where none can be written, confined to one core instead: tests/cpu_limit.py).
Each arrangement is deployed with `skippyctl deploy` (after the first round the
hosts hold every slice: a deploy then only reassigns) and measured in turn,
round after round so that drift on the machine falls on all of them alike:

- plan: `deploy --stages 3`, the planner's hosts, order and layers;
- even: `--ranges` with equal layer counts, the hosts in the order given;
- compute: `--ranges` from `skippyctl model split --balance compute` (equal
  multiply-adds per stage), the hosts in the order given.

For each: one client's decode rate (tokens/s of a greedy generation of
`--tokens` tokens, the median over rounds) and four clients' aggregate rate
at once (where the slowest stage sets the pace). Prints a table with each
arrangement's rates against the plan's.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import tempfile
import threading
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from skippyd.deploy.planner import model_shape
from skippyd.runtime.models import default_model_path
from skippyd.runtime.slicing import balanced_ranges, plan_ranges
from tests import netns
from tests.cpu_limit import SlowHost
from tests.deploy_hosts import Hosts, generate

PROMPT = "Once upon a time, in a small village by the sea, there lived a lighthouse keeper who"
FLAGS = ["--lanes", "4", "--ctx", "512"]


def _ranges_text(ranges) -> str:
    return ",".join(f"{a}:{b}" for a, b in ranges)


def one_client(hosts: Hosts, deployed: dict, tokens: int) -> float:
    result = hosts.head_generate(deployed, prompt=PROMPT, raw=True, max_tokens=tokens)
    if result["usage"]["completion_tokens"] < tokens:
        raise RuntimeError(f"the generation stopped after {result['usage']['completion_tokens']} tokens")
    return result["timings"]["decode_tokens_per_s"]


def four_clients(hosts: Hosts, deployed: dict, tokens: int) -> float:
    head = deployed["plan"]["stages"][0]["host"]
    daemon = hosts.daemons[hosts.data_hosts().split(",").index(head)]
    counts: list[int] = []

    def run(k: int) -> None:
        result = generate(daemon, prompt=f"Story {k + 1}. {PROMPT}", raw=True, max_tokens=tokens)
        counts.append(result["usage"]["completion_tokens"])

    started = time.monotonic()
    threads = [threading.Thread(target=run, args=(k,)) for k in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    return sum(counts) / (time.monotonic() - started)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--slow", type=float, default=0.3, help="host 2's CPU quota, in cores (default 0.3)")
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--tokens", type=int, default=64)
    ap.add_argument("--json", type=Path, default=None)
    args = ap.parse_args()
    if why := netns.unavailable():
        print(f"bench_deploy: {why}", file=sys.stderr)
        return 2
    model = default_model_path()
    shape = model_shape(model)
    arrangements = {
        "plan": ["--stages", "3"],
        "even": ["--ranges", _ranges_text(plan_ranges(shape.n_layer, stages=3))],
        "compute": ["--ranges", _ranges_text(balanced_ranges(shape.layer_costs, shape.head_cost, 3))],
    }
    single: dict[str, list[float]] = {name: [] for name in arrangements}
    four: dict[str, list[float]] = {name: [] for name in arrangements}
    layout: dict[str, str] = {}
    slow = SlowHost(args.slow)
    work = Path(tempfile.mkdtemp(prefix="bench-deploy-"))
    try:
        with netns.Network(3) as net:
            hosts = Hosts(net, work, work / "cache", prefixes=[[], [], slow.prefix], common=FLAGS)
            try:
                names = hosts.data_hosts().split(",")
                print(f"host 2 ({names[2]}) slowed by {slow.how}", file=sys.stderr)
                for r in range(args.rounds):
                    for name, flags in arrangements.items():
                        deployed = hosts.deploy(model, *flags)
                        layout[name] = "  ".join(
                            f"h{names.index(s['host'])}:{s['layer_start']}-{s['layer_end']}"
                            for s in deployed["plan"]["stages"])
                        one_client(hosts, deployed, 8)  # warm
                        single[name].append(one_client(hosts, deployed, args.tokens))
                        four[name].append(four_clients(hosts, deployed, args.tokens))
                        print(f"round {r + 1} {name}: {single[name][-1]:.1f} tok/s one client, "
                              f"{four[name][-1]:.1f} tok/s four", file=sys.stderr)
                timing = {n: round(t["ms_per_layer"], 3) for n, t in deployed["plan"]["hosts"].items()}
            finally:
                hosts.stop()
    finally:
        slow.close()
    med1 = {n: statistics.median(v) for n, v in single.items()}
    med4 = {n: statistics.median(v) for n, v in four.items()}
    print(f"\nms per layer measured: {timing}")
    print(f"{'arrangement':<12}{'stages (host:layers)':<34}{'1 client tok/s':>16}{'/ plan':>8}"
          f"{'4 clients tok/s':>17}{'/ plan':>8}")
    for name in arrangements:
        print(f"{name:<12}{layout[name]:<34}{med1[name]:>16.1f}{med1[name] / med1['plan']:>8.2f}"
              f"{med4[name]:>17.1f}{med4[name] / med4['plan']:>8.2f}")
    if args.json:
        args.json.write_text(json.dumps({"slow": slow.how, "ms_per_layer": timing, "layout": layout,
                                         "one_client": single, "four_clients": four}, indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
