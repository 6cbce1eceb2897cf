"""`skippyctl deploy` onto three hosts of their own: each a network namespace (tests/netns.py) running
`skippyd` with neither a topology nor a model, waiting; `skippyctl` runs on host 0, as an operator would on
one of the machines, and reaches the others over the data network (10.77.0.0/24), where their stages then
listen. The test itself reads each daemon's status over its management link.

What these show: a deploy from a clean state answers with the single process's greedy tokens; a second
deploy of the same model sends nothing; an interrupted transfer resumes; a damaged slice is found and sent
again; a host without the memory, and a wrong token, are refused before anything is sent; the planner gives
a slower host fewer layers.
"""

from __future__ import annotations

import json
import signal
import time
from pathlib import Path

import pytest

from skippyd.deploy.planner import model_shape
from skippyd.runtime.slicing import balanced_ranges, plan_ranges
from tests import netns
from tests.cpu_limit import SlowHost
from tests.deploy_hosts import FLAGS, Hosts, generate
from tests.gemma3 import LONG_PROMPT
from tests.procs import SingleStage

pytestmark = pytest.mark.slow  # real daemon processes in network namespaces

PROMPT = "The three primary colours are"


@pytest.fixture(scope="module")
def net():
    with netns.network_for_test(3) as network:
        yield network


@pytest.fixture(scope="module")
def cache(tmp_path_factory) -> Path:
    return tmp_path_factory.mktemp("skippyctl-cache")


@pytest.fixture(scope="module")
def single(default_model_path, tmp_path_factory):
    pipe = SingleStage(default_model_path, tmp_path_factory.mktemp("single"), FLAGS)
    yield pipe
    pipe.stop_cleanly()


def test_deploy_from_clean_answers_like_one_process_and_a_second_deploy_sends_nothing(
        net, cache, default_model_path, single, tmp_path):
    hosts = Hosts(net, tmp_path, cache)
    try:
        first = hosts.deploy(default_model_path, "--stages", "3")
        stages = first["plan"]["stages"]
        assert sorted(s["host"] for s in stages) == sorted(hosts.data_hosts().split(","))
        assert stages[0]["layers"][0] == 0 and stages[-1]["layers"][1] == 30
        stage_of = {s["host"]: s["index"] for s in stages}
        sizes = {name: t["size"] for name, t in first["transfers"].items()}
        assert first["bytes_sent"] == sum(sizes.values()) and not any(t["held"] for t in first["transfers"].values())
        for k, d in enumerate(hosts.daemons):  # every host runs its stage, its slice kept by its sha256
            status = d.status()
            stage = stage_of[hosts.data_hosts([k])]
            assert status["deployment"]["assigned"]["stage"] == stage, status
            assert status["deployment"]["assigned"]["layers"] == stages[stage]["layers"]
            assert sorted(p.name for p in hosts.slices(k).glob("*.gguf"))
        assert first["head"].endswith(stages[0]["host"])
        head = hosts.daemons[hosts.data_hosts().split(",").index(stages[0]["host"])]
        want = generate(single.stages[0], prompt=PROMPT, raw=True, max_tokens=24)
        got = generate(head, prompt=PROMPT, raw=True, max_tokens=24)
        assert got["tokens"] == want["tokens"] and got["text"] == want["text"]

        again = hosts.deploy(default_model_path, "--stages", "3")
        assert again["plan"]["stages"] == stages  # the hosts remember their timing: the same plan
        assert again["bytes_sent"] == 0 and all(t["held"] for t in again["transfers"].values()), again["transfers"]
        assert generate(head, prompt=PROMPT, raw=True, max_tokens=24)["tokens"] == want["tokens"]

        proc = hosts.skippyctl("undeploy", "--json")
        assert proc.returncode == 0, proc.stderr
        released = json.loads(proc.stdout)["released"]
        assert {h: was["stage"] for h, was in released.items()} == stage_of
        for d in hosts.daemons:
            status = d.status()
            assert status["role"] == "waiting for a deployment" and status["deployment"]["assigned"] is None
            assert status["stages"] == [] and status["head"] is None
    finally:
        hosts.stop()


def _part_bytes(folder: Path) -> int:
    return sum(p.stat().st_size for p in folder.glob("*.part")) if folder.is_dir() else 0


def test_an_interrupted_transfer_resumes_and_a_damaged_slice_is_sent_again(net, cache, default_model_path, tmp_path):
    hosts = Hosts(net, tmp_path, cache)
    try:
        # slowly (5 MB/s), so that it is still under way when the deploy is killed
        proc = hosts.skippyctl("deploy", str(default_model_path), "--hosts", hosts.data_hosts(), "--stages", "3",
                               "--max-rate", "5", background=True)
        deadline = time.monotonic() + 120
        # every host has timed the calibration slice (sent at full speed, host by host) before the stage slices
        while (not all(any(hosts.slices(k).glob("*.gguf")) for k in range(3))
               or _part_bytes(hosts.slices(1)) < 4 << 20):
            assert proc.poll() is None and time.monotonic() < deadline, proc.communicate()
            time.sleep(0.05)
        proc.send_signal(signal.SIGKILL)
        proc.wait()
        kept = _part_bytes(hosts.slices(1))
        assert kept >= 4 << 20 and not list(hosts.slices(1).glob("*.gguf"))[1:]  # at most the calibration slice

        resumed = hosts.deploy(default_model_path, "--stages", "3")
        t1 = resumed["transfers"][hosts.data_hosts([1])]
        assert t1["resumed_from"] == kept and t1["sent"] == t1["size"] - kept, t1
        assert _part_bytes(hosts.slices(1)) == 0
        want = hosts.head_generate(resumed, prompt=PROMPT, raw=True, max_tokens=12)["tokens"]

        # a held slice damaged on host 2's disk: found at the next deploy, deleted, sent again whole
        stage = next(s["index"] for s in resumed["plan"]["stages"] if s["host"] == hosts.data_hosts([2]))
        topology = (Path(resumed["topology"])).read_text()
        sha = [line.split('"')[1] for line in topology.splitlines() if line.startswith("sha256")][stage]
        slice_path = hosts.slices(2) / f"{sha}.gguf"
        with open(slice_path, "r+b") as f:
            f.seek(slice_path.stat().st_size // 2)
            byte = f.read(1)
            f.seek(-1, 1)
            f.write(bytes([byte[0] ^ 0xFF]))
        repaired = hosts.deploy(default_model_path, "--stages", "3")
        t2 = repaired["transfers"][hosts.data_hosts([2])]
        assert not t2["held"] and t2["sent"] == t2["size"], t2
        assert all(t["held"] for name, t in repaired["transfers"].items() if name != hosts.data_hosts([2]))
        assert "no longer matches its sha256" in hosts.daemons[2].log()
        assert hosts.head_generate(repaired, prompt=PROMPT, raw=True, max_tokens=12)["tokens"] == want
    finally:
        hosts.stop()


def test_too_little_memory_and_a_wrong_token_are_refused_before_anything_is_sent(
        net, cache, default_model_path, tmp_path):
    # host 2 may use 60 MiB: not even one layer with the embedding every slice carries
    hosts = Hosts(net, tmp_path, cache, configs=[{}, {}, {"runtime.memory_limit_mb": 60}])
    try:
        proc = hosts.skippyctl("deploy", str(default_model_path), "--hosts", hosts.data_hosts(), "--stages", "3")
        assert proc.returncode != 0
        assert hosts.data_hosts([2]) in proc.stderr and "short" in proc.stderr, proc.stderr
        assert "Traceback" not in proc.stderr
        for k in range(3):  # nothing sent: not even the calibration slice
            assert not hosts.slices(k).exists() or not any(hosts.slices(k).iterdir())
        # without --stages: one host, the model fitting on either of the others (the faster one), not host 2
        planned = hosts.skippyctl("plan", str(default_model_path), "--hosts", hosts.data_hosts(), "--json")
        assert planned.returncode == 0, planned.stderr
        chosen = [s["host"] for s in json.loads(planned.stdout)["stages"]]
        assert len(chosen) == 1 and chosen[0] in hosts.data_hosts([0, 1]).split(","), chosen

        wrong = tmp_path / "wrong.token"
        wrong.write_text("not-the-token\n")
        held = [sorted(hosts.slices(k).iterdir()) for k in range(3)]  # the plan's calibration slices
        proc = hosts.skippyctl("deploy", str(default_model_path), "--hosts", hosts.data_hosts([0, 1]),
                               token_file=wrong)
        assert proc.returncode != 0 and "refused the control token" in proc.stderr, proc.stderr
        assert [sorted(hosts.slices(k).iterdir()) for k in range(3)] == held
        for d in hosts.daemons:
            assert d.status()["deployment"]["assigned"] is None
    finally:
        hosts.stop()


def test_a_slower_host_is_given_fewer_layers(net, cache, default_model_path, tmp_path):
    slow = SlowHost(0.3)
    try:
        hosts = Hosts(net, tmp_path, cache, prefixes=[[], [], slow.prefix])
        try:
            proc = hosts.skippyctl("plan", str(default_model_path), "--hosts", hosts.data_hosts(), "--stages", "3",
                                   "--json")
            assert proc.returncode == 0, proc.stderr
            plan = json.loads(proc.stdout)
            names = hosts.data_hosts().split(",")
            speed = {name: plan["hosts"][name]["ms_per_layer"] for name in names}
            assert speed[names[2]] > 1.3 * max(speed[names[0]], speed[names[1]]), (slow.how, speed)
            layers = {s["host"]: s["layer_end"] - s["layer_start"] for s in plan["stages"]}
            assert layers[names[2]] < min(layers[names[0]], layers[names[1]]), (slow.how, plan)
            # at these speeds, its slowest stage is faster than the even split's and the compute balance's
            shape = model_shape(default_model_path)
            order = [speed[s["host"]] for s in plan["stages"]]
            mean = sum(shape.layer_costs) / shape.n_layer

            def slowest(ranges) -> float:
                return max(ms * (sum(shape.layer_costs[a:b]) + (shape.head_cost if b == shape.n_layer else 0))
                           / mean for (a, b), ms in zip(ranges, order))

            planned = slowest([(s["layer_start"], s["layer_end"]) for s in plan["stages"]])
            assert planned < slowest(plan_ranges(shape.n_layer, stages=3)), plan
            assert planned <= slowest(balanced_ranges(shape.layer_costs, shape.head_cost, 3)), plan
        finally:
            hosts.stop()
    finally:
        slow.close()


# Gemma 3 270M's prompt is longer than its sliding window: a stage that took the wrong layers' pattern would
# answer otherwise. Every daemon prefills in chunks of 512, the single process as the pipeline.
GEMMA3_FLAGS = ["--lanes", "1", "--ctx", "2048"]
GEMMA3_CONFIG = {"runtime.prefill_chunk": 512}


@pytest.fixture(scope="module")
def gemma3_single(gemma3_path, tmp_path_factory):
    pipe = SingleStage(gemma3_path, tmp_path_factory.mktemp("gemma3-single"), GEMMA3_FLAGS, config=GEMMA3_CONFIG)
    yield pipe
    pipe.stop_cleanly()


def test_a_deployment_of_gemma3_answers_like_one_process(net, cache, gemma3_path, gemma3_single, tmp_path):
    hosts = Hosts(net, tmp_path, cache, configs=[GEMMA3_CONFIG] * 3, common=GEMMA3_FLAGS)
    try:
        deployed = hosts.deploy(gemma3_path, "--stages", "3")
        stages = deployed["plan"]["stages"]
        assert len(stages) == 3 and stages[-1]["layers"][1] == 18
        want = generate(gemma3_single.stages[0], prompt=LONG_PROMPT, raw=True, max_tokens=32)
        got = hosts.head_generate(deployed, prompt=LONG_PROMPT, raw=True, max_tokens=32)
        assert got["finish_reason"] == "length" and got["tokens"] == want["tokens"], (stages, got, want)
    finally:
        hosts.stop()
