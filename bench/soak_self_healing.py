"""Soak: a supervised deployment loses hosts and takes them back, under four streaming OpenAI clients.

    sudo .venv/bin/python bench/soak_self_healing.py [--runs 6] [--grace 10] [--json out.json]

Four hosts of their own (network namespaces, tests/netns.py: root, `ip` and
`tc`), a waiting skippyd on each (`--lanes 4 --ctx 512`), the default model
deployed by `skippyctl deploy --ranges 0:8,8:16,16:23,23:30` (host 0 the
head, with the OpenAI endpoint and `deploy.rejoin_grace_s` = `--grace`).
Four clients (the official `openai` package) stream greedy completions of
four fixed prompts in a loop, one of them with speculative decoding, one of
them long (~350 tokens; the prefix cache is off, so it is computed in full
each time and some losses land in its prefill); each reply is checked
against the same prompt's uninterrupted reply, measured first.

Each run takes the plan's final stage host away while the clients run: its
daemon killed with SIGKILL (odd runs) or its link taken down (even runs); the
head drops it after the grace, re-plans over the hosts left, ships the slices
they lack, and serves again. Then the host comes back (the daemon restarted;
the link up) and the head switches back to the four-stage plan at a request
boundary. The runs take turns at three kinds:

- loss: that alone;
- transfer: a second fault timed into the re-plan's slice transfer: the
  hosts left lose their slices beforehand and get them through a slow link
  (tc), and the first host seen receiving one is lost (the same way) while
  it does; the head abandons that re-plan and plans over the one host left;
- switch: a fault timed into the switch back: the returning host loses its
  slices and gets them through a slow link, and is lost again while the head
  switches; the head abandons the switch and serves on, and the host's second
  return is switched to.

Printed per run: loss to detection (from the fault to the head's first
unanswered probe); detection to serving (the grace, then the re-plan: cut,
ship, start) and the re-plan alone; join to first request on the new plan
(from the host back to the first reply asked once the final switch began).
Then the loss by phase over all runs: of the requests in flight when the host
was lost, those in prefill, in decode, in a speculative window (the
speculative client's, in decode); those overlapping the re-plan's slice
transfer; those overlapping the switch back; and how many faults were really
injected into a transfer or a switch (the head's lost_during_transfer and
lost_during_switch counts). Every count of failed or wrong replies must be 0
(exit status 1 otherwise). The machine is shared: the times are noisy,
compare them within one run of this script.
"""

from __future__ import annotations

import argparse
import json
import shutil
import statistics
import sys
import tempfile
import threading
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

import openai  # noqa: E402

from skippyd.runtime.models import fetch_default_model  # noqa: E402
from tests import netns  # noqa: E402
from tests.deploy_hosts import Hosts  # noqa: E402
from tests.procs import free_ports  # noqa: E402

# the last one long (~350 tokens, computed in full every time: the prefix cache is off), so that some losses
# land in a prefill
PROMPTS = ["The three primary colours are", "Water boils at", "The capital of France is",
           "Things to pack for a long trip: " + ", ".join(f"item {i}" for i in range(1, 70))
           + ". The one thing not to forget is"]
TOKENS = 48
FLAGS = ["--lanes", "4", "--ctx", "512"]
RANGES = "0:8,8:16,16:23,23:30"
HOSTS = 4
KINDS = ("loss", "transfer", "switch")
SLOW_MBIT = 40  # the slow link that makes a transfer last seconds (tens of MiB)


class Clients:
    """Four streaming clients, each looping over its prompt; every request recorded with what it went through."""

    def __init__(self, base_url: str, model: str, want: dict[int, str]):
        self.base_url, self.model, self.want = base_url, model, want
        self.records: list[dict] = []  # one per request: client, start, end, pieces, ok, text, error
        self.live: dict[int, dict] = {}  # client -> its request in flight
        self.stop = threading.Event()
        self._threads = [threading.Thread(target=self._loop, args=(k,), daemon=True) for k in range(len(PROMPTS))]

    def start(self) -> None:
        for t in self._threads:
            t.start()

    def join(self) -> None:
        self.stop.set()
        for t in self._threads:
            t.join(300)

    def _loop(self, k: int) -> None:
        client = openai.OpenAI(base_url=self.base_url, api_key="none", timeout=300, max_retries=0)
        while not self.stop.is_set():
            self.records.append(one(client, self.model, k, self.live))

    def snapshot(self) -> dict[int, dict]:
        """The requests in flight now: client -> (its record, pieces received so far)."""
        return {k: dict(r) for k, r in self.live.items()}


def one(client, model: str, k: int, live: dict | None = None) -> dict:
    record = {"client": k, "start": time.time(), "pieces": 0, "text": "", "ok": False, "error": None}
    if live is not None:
        live[k] = record
    extra = {"speculate": True} if k == 0 else {"speculate": "off"}
    try:
        stream = client.completions.create(model=model, prompt=PROMPTS[k], max_tokens=TOKENS, temperature=0,
                                           stream=True, extra_body=extra)
        for chunk in stream:
            record["text"] += chunk.choices[0].text
            record["pieces"] += 1
        record["ok"] = True
    except Exception as exc:  # every failure is a finding, reported
        record["error"] = f"{type(exc).__name__}: {exc}"
    record["end"] = time.time()
    if live is not None:
        live.pop(k, None)
    return record


def supervised(head) -> dict:
    return head.status()["deployment"]["supervised"]


def wait_until(head, predicate, timeout: float = 180.0) -> dict:
    deadline = time.monotonic() + timeout
    while True:
        sup = supervised(head)
        if predicate(sup):
            return sup
        if time.monotonic() > deadline:
            raise TimeoutError(f"the deployment did not get there in {timeout:g} s: {sup}")
        time.sleep(0.1)


def host_state(sup: dict, name: str) -> dict:
    return next(h for h in sup["hosts"] if h["name"] == name)


class Faults:
    """Takes host k away and brings it back, by SIGKILL and a restart or by its link down and up."""

    def __init__(self, hosts: Hosts, net, names: list[str]):
        self.hosts, self.net, self.names = hosts, net, names

    def lose(self, k: int, how: str) -> None:
        if how == "kill":
            self.hosts.daemons[k].kill()
        else:
            self.net.link_down(k)

    def back(self, k: int, how: str) -> None:
        if how == "kill":
            self.hosts.daemons[k].restart()
            self.hosts.daemons[k].wait_ready()
        else:
            self.net.link_up(k)

    def forget_slices(self, k: int) -> None:
        """Host k loses the slices it holds, so that a plan giving it a stage ships it one."""
        for path in self.hosts.slices(k).glob("*.gguf"):
            path.unlink(missing_ok=True)

    def index(self, name: str) -> int:
        return self.names.index(name)


def run_once(run: int, head, faults: Faults, clients: Clients) -> dict:
    kind, how = KINDS[(run - 1) % len(KINDS)], "kill" if run % 2 == 1 else "link"
    before = supervised(head)
    generation, replans = before["generation"], before["replans"]
    victim = faults.index(before["plan"]["stages"][-1]["host"])
    others = [faults.index(s["host"]) for s in before["plan"]["stages"][1:-1]]
    if kind == "transfer":  # the re-plan will ship both hosts left their slices, slowly
        for k in others:
            faults.forget_slices(k)
            faults.net.limit_rate(k, SLOW_MBIT)
    in_flight = clients.snapshot()
    lost_at = time.time()
    faults.lose(victim, how)
    detected = wait_until(head, lambda s: host_state(s, faults.names[victim])["state"] in ("unreachable", "dropped"))
    detected_at = host_state(detected, faults.names[victim])["since"]
    gone = [victim]
    if kind == "transfer":
        change = wait_until(head, lambda s: bool(s["change"] and s["change"]["shipping"]))["change"]
        second = faults.index(change["shipping"][0])
        faults.lose(second, how)
        gone.append(second)
        for k in others:
            faults.net.unlimit_rate(k)
    served = wait_until(head, lambda s: s["generation"] > generation and s["state"] == "serving"
                        and s["change"] is None)
    replan = served["last_change"]
    shipping_from = replan["at"] - replan["took_s"]
    time.sleep(2.0)

    switch_from = None
    if kind == "switch":  # the host comes back with nothing, through a slow link, and is lost while switched to
        faults.forget_slices(victim)
        faults.net.limit_rate(victim, SLOW_MBIT)
        faults.back(victim, how)
        change = wait_until(head, lambda s: bool(s["change"] and faults.names[victim] in s["change"]["shipping"]))
        switch_from = change["change"]["since"]
        faults.lose(victim, how)
        faults.net.unlimit_rate(victim)
        wait_until(head, lambda s: s["change"] is None and s["state"] == "serving")
        time.sleep(1.0)
    back_at = time.time()
    for k in gone:
        faults.back(k, how)
    joined_at = time.time()
    switched = wait_until(head, lambda s: len(s["plan"]["stages"]) == HOSTS and s["state"] == "serving"
                          and s["change"] is None)
    switch = switched["last_change"]
    last_switch_from = switch["at"] - switch["took_s"]
    switch_from = switch_from or last_switch_from
    deadline = time.time() + 120
    first = None
    while first is None and time.time() < deadline:
        # served wholly on the new plan: asked once the switch began (it waited for it), answered after it
        first = min((r["end"] for r in clients.records if r["start"] >= last_switch_from and r.get("end")),
                    default=None)
        time.sleep(0.1)
    time.sleep(1.0)

    def failed(records) -> int:
        return sum(1 for r in records if not r["ok"] or r["text"] != clients.want[r["client"]])

    finished = [r for r in clients.records if r.get("end")]
    ids = {(k, r["start"]) for k, r in in_flight.items()}
    at_loss = [r for r in finished if (r["client"], r["start"]) in ids]
    phase_of = {(k, r["start"]): ("prefill" if r["pieces"] == 0 else "speculative" if k == 0 else "decode")
                for k, r in in_flight.items()}
    by_phase = {p: [r for r in at_loss if phase_of[(r["client"], r["start"])] == p]
                for p in ("prefill", "decode", "speculative")}
    during_transfer = [r for r in finished if r["start"] < replan["at"] and r["end"] > shipping_from]
    during_switch = [r for r in finished if r["start"] < switch["at"] and r["end"] > switch_from]
    now = switched["replans"]
    return {
        "run": run, "kind": kind, "fault": how, "shipped_bytes": replan["bytes_shipped"],
        "loss_to_detection_s": round(detected_at - lost_at, 2),
        "detection_to_serving_s": round(replan["at"] - detected_at, 2),
        "replan_s": replan["took_s"],
        "join_to_switch_s": round(switch["at"] - joined_at, 2),
        "join_to_first_request_s": None if first is None else round(first - joined_at, 2),
        "back_s": round(joined_at - back_at, 2),
        "injected": {"slice_transfer": now["lost_during_transfer"] - replans["lost_during_transfer"],
                     "switch": now["lost_during_switch"] - replans["lost_during_switch"]},
        "loss": {**{p: [failed(rs), len(rs)] for p, rs in by_phase.items()},
                 "slice_transfer": [failed(during_transfer), len(during_transfer)],
                 "switch": [failed(during_switch), len(during_switch)]},
        "failed": failed(at_loss) + failed(during_transfer) + failed(during_switch),
    }


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--runs", type=int, default=6, help="runs, taking turns at the kinds loss, transfer, switch")
    ap.add_argument("--grace", type=float, default=10.0, help="deploy.rejoin_grace_s on the head")
    ap.add_argument("--json", type=Path)
    ap.add_argument("--work", type=Path, help="keep the daemons' logs and slices here (default: a temporary folder)")
    args = ap.parse_args()
    why = netns.unavailable() or (None if shutil.which("tc") else "no `tc` command (Debian package iproute2)")
    if why:
        print(f"soak_self_healing: {why}", file=sys.stderr)
        return 2
    model = fetch_default_model()
    api_port = free_ports(1)[0]
    head_config = {"deploy.rejoin_grace_s": args.grace, "openai.listen": f"0.0.0.0:{api_port}"}
    results: list[dict] = []
    total, bad = 0, []
    with netns.Network(HOSTS) as net, tempfile.TemporaryDirectory() as tmp:
        work = args.work or Path(tmp)
        work.mkdir(parents=True, exist_ok=True)
        no_cache = {"runtime.prefix_cache_mb": 0}
        hosts = Hosts(net, work, work / "cache", configs=[{**head_config, **no_cache}] + [no_cache] * (HOSTS - 1),
                      common=FLAGS)
        clients = None
        try:
            started = time.monotonic()
            deployed = hosts.deploy(model, "--ranges", RANGES)
            print(f"deployed in {time.monotonic() - started:.1f} s: "
                  + ", ".join(f"{s['host']} {s['layer_start']}:{s['layer_end']}" for s in deployed["plan"]["stages"]))
            faults = Faults(hosts, net, hosts.data_hosts().split(","))
            base = f"http://{net.hosts[0].control_host}:{api_port}/v1"
            name = model.name.removesuffix(".gguf")
            reference = openai.OpenAI(base_url=base, api_key="none", timeout=300, max_retries=0)
            want = {}
            for k in range(len(PROMPTS)):
                record = one(reference, name, k)
                assert record["ok"], record
                want[k] = record["text"]
            clients = Clients(base, name, want)
            clients.start()
            time.sleep(3.0)
            for run in range(1, args.runs + 1):
                result = run_once(run, hosts.daemons[0], faults, clients)
                results.append(result)
                print(json.dumps(result), flush=True)
            clients.join()
            total = len(clients.records)
            bad = [r for r in clients.records if not r["ok"] or r["text"] != want[r["client"]]]
        finally:
            if clients is not None:
                clients.stop.set()
            net.heal()
            hosts.stop()
    print(f"\n{total} requests, {len(bad)} failed or different from the uninterrupted reply")
    for r in bad[:5]:
        print(f"  client {r['client']}: {r['error'] or 'different text: ' + repr(r['text'][:60])}")
    print(f"\n{'run':>3} {'kind':>8} {'fault':>5} {'shipped':>8} {'loss->det':>9} {'det->serve':>10} {'replan':>7} "
          f"{'join->switch':>12} {'join->1st req':>13}")
    for r in results:
        print(f"{r['run']:>3} {r['kind']:>8} {r['fault']:>5} {r['shipped_bytes'] / (1 << 20):>6.1f}Mi "
              f"{r['loss_to_detection_s']:>9.2f} {r['detection_to_serving_s']:>10.2f} {r['replan_s']:>7.2f} "
              f"{r['join_to_switch_s']:>12.2f} {r['join_to_first_request_s'] or float('nan'):>13.2f}")
    if results:
        for key in ("loss_to_detection_s", "detection_to_serving_s", "replan_s", "join_to_first_request_s"):
            values = [r[key] for r in results if r[key] is not None]
            if values:
                print(f"median {key}: {statistics.median(values):.2f} (spread {min(values):.2f}..{max(values):.2f})")
        print("\nby phase (requests failed or wrong / requests):")
        labels = {"prefill": "in prefill at the loss", "decode": "in decode at the loss",
                  "speculative": "in a speculative window at the loss", "slice_transfer": "during slice transfer",
                  "switch": "during switch"}
        for phase, label in labels.items():
            failed_n = sum(r["loss"][phase][0] for r in results)
            seen = sum(r["loss"][phase][1] for r in results)
            injected = (f"{sum(r['injected'][phase] for r in results)} injected, "
                        if phase in ("slice_transfer", "switch") else "")
            print(f"  {label:<38} {injected}{seen} requests, {failed_n} failed")
    if args.json:
        args.json.write_text(json.dumps({"runs": results, "requests": total, "failed": len(bad)}, indent=2) + "\n")
    return 1 if bad or any(r["failed"] for r in results) or not results else 0


if __name__ == "__main__":
    sys.exit(main())
