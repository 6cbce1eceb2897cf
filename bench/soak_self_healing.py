"""Soak: a supervised deployment loses a host and takes it back, under four streaming OpenAI clients.

    sudo .venv/bin/python bench/soak_self_healing.py [--runs 3] [--grace 10] [--json out.json]

Three hosts of their own (network namespaces, tests/netns.py: root and `ip`),
a waiting skippyd on each (`--lanes 4 --ctx 512`), the default model deployed
by `skippyctl deploy --ranges 0:10,10:20,20:30` (host 0 the head, with the
OpenAI endpoint and `deploy.rejoin_grace_s` = `--grace`). Four clients (the
official `openai` package) stream greedy completions of four fixed prompts
in a loop, one of them with speculative decoding; each reply is checked
against the same prompt's uninterrupted reply, measured first.

Each run takes host 2 (the final stage) away while the clients run: its
daemon killed with SIGKILL (odd runs) or its link taken down (even runs); the
head drops it after the grace, re-plans over hosts 0 and 1 (the first run
ships the new slice; later runs find it held), and serves again. Then the
host comes back (the daemon restarted; the link up) and the head switches
back to the three-host plan at a request boundary. Printed per run:

- loss to detection: from the fault to the head's first unanswered probe;
- detection to serving: from there to the new plan serving (the grace, then
  the re-plan: cut, ship, start), and the re-plan alone;
- join to first request on the new plan: from the host back to the first
  reply asked once the switch began (so served on the new plan) to complete.

And the loss by phase: of the requests in flight when the host was lost,
those in prefill, in decode, in a speculative window (the speculative
client's, in decode); those waiting or resuming while slices were shipped;
those in flight during the switch back. Every count of failed or wrong
replies must be 0 (exit status 1 otherwise). The machine is shared: the times
are noisy, compare them within one run of this script.
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

ROOT = Path(__file__).resolve().parent.parent
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

import openai  # noqa: E402

from skippyd.runtime.models import fetch_default_model  # noqa: E402
from tests import netns  # noqa: E402
from tests.deploy_hosts import Hosts  # noqa: E402
from tests.procs import free_ports  # noqa: E402

PROMPTS = ["The three primary colours are", "Water boils at", "The capital of France is", "A haiku about the sea:"]
TOKENS = 48
FLAGS = ["--lanes", "4", "--ctx", "512"]
RANGES = "0:10,10:20,20:30"


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


def run_once(run: int, hosts: Hosts, net, clients: Clients, lost_name: str) -> dict:
    head = hosts.daemons[0]
    kind = "kill" if run % 2 == 1 else "link"
    generation = supervised(head)["generation"]
    in_flight = clients.snapshot()
    lost_at = time.time()
    if kind == "kill":
        hosts.daemons[2].kill()
    else:
        net.link_down(2)
    detected = wait_until(head, lambda s: host_state(s, lost_name)["state"] in ("unreachable", "dropped"))
    detected_at = host_state(detected, lost_name)["since"]
    served = wait_until(head, lambda s: s["generation"] > generation and s["state"] == "serving")
    replan = served["last_change"]
    shipping_from = replan["at"] - replan["took_s"]
    time.sleep(2.0)

    back_at = time.time()
    if kind == "kill":
        hosts.daemons[2].restart()
        hosts.daemons[2].wait_ready()
    else:
        net.link_up(2)
    joined_at = time.time()
    switched = wait_until(head, lambda s: s["generation"] > generation + 1 and s["state"] == "serving")
    switch = switched["last_change"]
    switch_from = switch["at"] - switch["took_s"]
    deadline = time.time() + 120
    first = None
    while first is None and time.time() < deadline:
        # served wholly on the new plan: asked once the switch began (it waited for it), answered after it
        first = min((r["end"] for r in clients.records if r["start"] >= switch_from and r.get("end")), default=None)
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
    return {
        "run": run, "fault": kind, "shipped_bytes": replan["bytes_shipped"],
        "loss_to_detection_s": round(detected_at - lost_at, 2),
        "detection_to_serving_s": round(replan["at"] - detected_at, 2),
        "replan_s": replan["took_s"],
        "join_to_switch_s": round(switch["at"] - joined_at, 2),
        "join_to_first_request_s": None if first is None else round(first - joined_at, 2),
        "back_s": round(joined_at - back_at, 2),
        "loss": {**{p: f"{failed(rs)}/{len(rs)}" for p, rs in by_phase.items()},
                 "slice_transfer": f"{failed(during_transfer)}/{len(during_transfer)}",
                 "switch": f"{failed(during_switch)}/{len(during_switch)}"},
        "failed": failed(at_loss) + failed(during_transfer) + failed(during_switch),
    }


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--runs", type=int, default=3)
    ap.add_argument("--grace", type=float, default=10.0, help="deploy.rejoin_grace_s on the head")
    ap.add_argument("--json", type=Path)
    ap.add_argument("--work", type=Path, help="keep the daemons' logs and slices here (default: a temporary folder)")
    args = ap.parse_args()
    why = netns.unavailable()
    if why:
        print(f"soak_self_healing: {why}", file=sys.stderr)
        return 2
    model = fetch_default_model()
    api_port = free_ports(1)[0]
    head_config = {"deploy.rejoin_grace_s": args.grace, "openai.listen": f"0.0.0.0:{api_port}"}
    results = []
    with netns.Network(3) as net, tempfile.TemporaryDirectory() as tmp:
        work = args.work or Path(tmp)
        work.mkdir(parents=True, exist_ok=True)
        hosts = Hosts(net, work, work / "cache", configs=[head_config, {}, {}], common=FLAGS)
        clients = None
        try:
            started = time.monotonic()
            deployed = hosts.deploy(model, "--ranges", RANGES)
            print(f"deployed in {time.monotonic() - started:.1f} s: "
                  + ", ".join(f"{s['host']} {s['layer_start']}:{s['layer_end']}" for s in deployed["plan"]["stages"]))
            lost_name = deployed["plan"]["stages"][2]["host"]
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
                result = run_once(run, hosts, net, clients, lost_name)
                results.append(result)
                print(json.dumps(result))
            clients.join()
            total = len(clients.records)
            bad = [r for r in clients.records if not r["ok"] or r["text"] != want[r["client"]]]
        finally:
            if clients is not None:
                clients.stop.set()
            for k in range(3):
                net.link_up(k)
            hosts.stop()
    print(f"\n{total} requests, {len(bad)} failed or different from the uninterrupted reply")
    for r in bad[:5]:
        print(f"  client {r['client']}: {r['error'] or 'different text: ' + repr(r['text'][:60])}")
    print(f"\n{'run':>3} {'fault':>5} {'shipped':>8} {'loss->det':>9} {'det->serve':>10} {'replan':>7} "
          f"{'join->switch':>12} {'join->1st req':>13}  loss: prefill decode spec transfer switch")
    for r in results:
        loss = r["loss"]
        print(f"{r['run']:>3} {r['fault']:>5} {r['shipped_bytes'] / (1 << 20):>6.1f}Mi "
              f"{r['loss_to_detection_s']:>9.2f} "
              f"{r['detection_to_serving_s']:>10.2f} {r['replan_s']:>7.2f} {r['join_to_switch_s']:>12.2f} "
              f"{r['join_to_first_request_s'] or float('nan'):>13.2f}        {loss['prefill']:>5} {loss['decode']:>6} "
              f"{loss['speculative']:>4} {loss['slice_transfer']:>8} {loss['switch']:>6}")
    if results:
        for key in ("loss_to_detection_s", "detection_to_serving_s", "replan_s", "join_to_first_request_s"):
            values = [r[key] for r in results if r[key] is not None]
            print(f"median {key}: {statistics.median(values):.2f} (spread {min(values):.2f}..{max(values):.2f})")
    if args.json:
        args.json.write_text(json.dumps({"runs": results, "requests": total, "failed": len(bad)}, indent=2) + "\n")
    return 1 if bad or any(r["failed"] for r in results) else 0


if __name__ == "__main__":
    sys.exit(main())
