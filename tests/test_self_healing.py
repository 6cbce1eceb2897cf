"""A deployment that heals itself: three hosts of their own (network namespaces, tests/netns.py), the default
model in three stages, the head supervising (`skippyctl deploy` sets it up).

What these show: a host whose daemon is killed (SIGKILL) during decode is dropped after the grace, the head
re-plans over the two hosts left, ships the slice they lack, and every generation in flight completes with
the uninterrupted run's tokens; the host restarted is taken back (its share restored) with no request
failing; the hosts left too small for the model give 503 naming the shortfall (the request in flight fails
with it), and the pipeline serves again by itself when the host's link comes back; a faster host offered
with `deploy --add` takes the slow one's place, and status shows it. A host lost while the re-plan ships it
its slice (four hosts, a slow link into the one receiving) stops that re-plan: the head plans again over the
host left and the generation in flight completes with the uninterrupted run's tokens; the returning host lost
while the head switches to it leaves the plan it had serving, and a host of both plans lost then makes the head
plan over the hosts left, no request failing either time.
"""

from __future__ import annotations

import json
import time
from pathlib import Path

import httpx
import pytest
import trio

from skippyctl.client import ControlError, open_control
from skippyd.control import messages as m
from tests import netns
from tests.cpu_limit import SlowHost
from tests.deploy_hosts import FLAGS, Hosts, generate
from tests.procs import SingleStage, free_ports

pytestmark = pytest.mark.slow  # real daemon processes in network namespaces

PROMPT = "The three primary colours are"
GRACE = {"deploy.rejoin_grace_s": 3}
TOKENS = 96
RANGES = "0:10,10:20,20:30"  # in the hosts' order: host 0 the head, host 2 the final stage


@pytest.fixture(scope="module")
def net():
    with netns.network_for_test(3) as network:
        yield network


@pytest.fixture(scope="module")
def cache(tmp_path_factory) -> Path:
    return tmp_path_factory.mktemp("skippyctl-cache")


@pytest.fixture(scope="module")
def want(default_model_path, tmp_path_factory) -> dict:
    """The uninterrupted run's greedy reply, from one process."""
    pipe = SingleStage(default_model_path, tmp_path_factory.mktemp("single"), FLAGS)
    try:
        return generate(pipe.stages[0], prompt=PROMPT, raw=True, max_tokens=TOKENS)
    finally:
        pipe.stop_cleanly()


def _supervised(daemon) -> dict:
    return daemon.status()["deployment"]["supervised"]


def _wait_for(daemon, predicate, timeout: float = 120.0) -> dict:
    deadline = time.monotonic() + timeout
    while True:
        sup = _supervised(daemon)
        if predicate(sup):
            return sup
        assert time.monotonic() < deadline, sup
        time.sleep(0.25)


def _host(sup: dict, name: str) -> dict:
    return next(h for h in sup["hosts"] if h["name"] == name)


async def _stream(daemon, started: trio.Event | None = None, max_tokens: int = TOKENS, **kw) -> dict:
    """A streamed generation through the control channel (as `skippyctl generate` runs it): its result, or the
    error it ended with."""
    async with open_control(daemon.url, daemon.token_file) as client:
        request = m.Generate(id=client.new_id(), prompt=PROMPT, raw=True, max_tokens=max_tokens, **kw)
        async for reply in client.replies(request):
            if isinstance(reply, m.Piece) and started is not None:
                started.set()
            if isinstance(reply, m.Error):
                return {"failed": reply.message, "code": reply.code}
            if isinstance(reply, m.Result):
                return reply.result
    raise AssertionError("no result")


def _stream_while(daemon, act) -> dict:
    """One streamed generation (see _stream); ``act`` (async) runs once its first piece has come. Its result."""
    async def run() -> dict:
        started = trio.Event()
        result = {}

        async def one() -> None:
            result.update(await _stream(daemon, started))

        async with trio.open_nursery() as nursery:
            nursery.start_soon(one)
            await started.wait()
            await act()
        return result

    return trio.run(run)


def test_a_host_killed_during_decode_is_replaced_and_taken_back_with_no_request_failing(
        net, cache, default_model_path, want, tmp_path):
    hosts = Hosts(net, tmp_path, cache, configs=[GRACE] * 3)
    names = hosts.data_hosts().split(",")
    try:
        deployed = hosts.deploy(default_model_path, "--ranges", RANGES)
        assert [s["host"] for s in deployed["plan"]["stages"]] == names, deployed["plan"]
        assert deployed["supervised"]["generation"] == 1 and names[0] in deployed["supervised"]["model_copy"]
        head = hosts.daemons[0]
        sup = _supervised(head)
        assert sup["state"] == "serving" and {h["state"] for h in sup["hosts"]} == {"in plan"}

        async def during_decode() -> list[dict]:
            results: list[dict] = [{}] * 2  # one per lane
            started = [trio.Event() for _ in results]

            async def one(k: int) -> None:
                results[k] = await _stream(head, started[k])

            async with trio.open_nursery() as nursery:
                for k in range(len(results)):
                    nursery.start_soon(one, k)
                for event in started:
                    await event.wait()
                await trio.to_thread.run_sync(hosts.daemons[2].kill)  # the final stage, mid-decode
            return results

        for result in trio.run(during_decode):
            assert "failed" not in result, result
            assert result["tokens"] == want["tokens"], result

        sup = _supervised(head)
        assert sup["generation"] == 2 and sup["replans"]["dropped"] == 1, sup
        assert [s["host"] for s in sup["plan"]["stages"]] == names[:2], sup["plan"]
        dropped = _host(sup, names[2])
        assert dropped["state"] == "dropped" and dropped["reason"], dropped
        assert "dropped" in sup["last_change"]["cause"] and sup["last_change"]["bytes_shipped"] > 0, sup
        assert "deploy: generation 2:" in head.log()
        assert generate(head, prompt=PROMPT, raw=True, max_tokens=TOKENS)["tokens"] == want["tokens"]

        # back with another control token: refused, it stays dropped
        lost = hosts.daemons[2]
        token = lost.token_file.read_text()
        lost.token_file.write_text("another-token\n")
        lost.restart()
        lost.wait_ready()
        sup = _wait_for(head, lambda s: "control token" in (_host(s, names[2])["reason"] or ""))
        assert _host(sup, names[2])["state"] == "dropped" and sup["generation"] == 2, sup
        assert lost.stop() == 0
        lost.token_file.write_text(token)

        # the host comes back (a fresh daemon, the same token): its share is given back at a request boundary
        lost.restart()
        lost.wait_ready()

        async def through_the_switch() -> list[dict]:
            results = []

            async def keep_asking() -> None:
                while (await head.astatus())["deployment"]["supervised"]["generation"] < 3:
                    results.append(await _stream(head))

            async with trio.open_nursery() as nursery:
                nursery.start_soon(keep_asking)
                nursery.start_soon(keep_asking)
            return results

        for result in trio.run(through_the_switch):
            assert "failed" not in result and result["tokens"] == want["tokens"], result
        sup = _wait_for(head, lambda s: s["generation"] >= 3)
        assert len(sup["plan"]["stages"]) == 3 and _host(sup, names[2])["state"] == "in plan", sup
        assert sup["replans"]["returned"] == 1 and "back" in sup["last_change"]["cause"], sup
        assert generate(head, prompt=PROMPT, raw=True, max_tokens=TOKENS)["tokens"] == want["tokens"]
        metrics = head.status()  # the counters behind /metrics
        assert metrics["deployment"]["supervised"]["replans"] == {
            "dropped": 1, "returned": 1, "added": 0, "restarted": 0, "lost_during_transfer": 0,
            "lost_during_switch": 0}
    finally:
        hosts.stop()


def test_too_little_memory_left_is_a_503_naming_the_shortfall_until_the_host_returns(
        net, cache, default_model_path, want, tmp_path):
    # hosts 1 and 2 may use 140 MiB: a third of the model each, not the two thirds after the head's layers
    api_port = free_ports(1)[0]
    small = {**GRACE, "runtime.memory_limit_mb": 140}
    head_config = {**GRACE, "openai.listen": f"0.0.0.0:{api_port}"}
    hosts = Hosts(net, tmp_path, cache, configs=[head_config, small, small])
    names = hosts.data_hosts().split(",")
    try:
        deployed = hosts.deploy(default_model_path, "--ranges", RANGES)
        assert [s["host"] for s in deployed["plan"]["stages"]] == names
        head = hosts.daemons[0]
        api = f"http://{net.hosts[0].control_host}:{api_port}/v1/completions"
        body = {"model": "SmolLM2-135M-Instruct.Q4_1", "prompt": PROMPT, "max_tokens": TOKENS, "temperature": 0}

        async def cut() -> None:
            net.link_down(2)  # for good, as far as the grace goes

        failed = _stream_while(head, cut)
        assert "more than" in failed.get("failed", ""), failed
        sup = _wait_for(head, lambda s: s["state"] == "short")
        assert f"more than {names[1]} holds" in sup["why"], sup
        assert _host(sup, names[2])["state"] == "dropped"
        refused = httpx.post(api, json=body, timeout=30)
        assert refused.status_code == 503, refused.text
        assert "the model needs" in refused.text and f"more than {names[1]} holds" in refused.text, refused.text

        net.link_up(2)  # its daemon still runs its old stage: it is given a place again
        sup = _wait_for(head, lambda s: s["state"] == "serving" and len(s["plan"]["stages"]) == 3)
        assert _host(sup, names[2])["state"] == "in plan", sup
        ok = httpx.post(api, json=body, timeout=60)
        assert ok.status_code == 200, ok.text
        metrics = httpx.get(api.replace("/v1/completions", "/metrics"), timeout=30).text
        assert 'skippy_deploy_replans_total{cause="returned"} 1.0' in metrics, metrics
        assert "skippy_deploy_generation 2.0" in metrics and "skippy_requests_resumed_total" in metrics
        assert generate(head, prompt=PROMPT, raw=True, max_tokens=TOKENS)["tokens"] == want["tokens"]
    finally:
        net.link_up(2)
        hosts.stop()


def test_a_control_channel_without_a_deployment_refuses_supervision(net, cache, tmp_path):
    hosts = Hosts(net, tmp_path, cache)
    try:
        async def ask(make):
            async with open_control(hosts.daemons[0].url, hosts.daemons[0].token_file) as client:
                return await client.call(make(client.new_id()))

        with pytest.raises(ControlError, match="supervises no deployment"):
            trio.run(ask, lambda i: m.AddHost(id=i, name="10.77.0.9:7390", url="ws://10.77.0.9:7390"))
        with pytest.raises(ControlError, match="only the head"):
            trio.run(ask, lambda i: m.Supervise(id=i, model_sha256="0" * 64, model_name="x.gguf", hosts=[],
                                                plan={"stages": []}, token="t", stage_port=7400))
    finally:
        hosts.stop()


def test_a_faster_host_added_takes_over_at_a_request_boundary(net, cache, default_model_path, want, tmp_path):
    slow = SlowHost(0.3)
    try:
        hosts = Hosts(net, tmp_path, cache, configs=[GRACE] * 3, prefixes=[[], slow.prefix, []])
        names = hosts.data_hosts().split(",")
        try:
            proc = hosts.skippyctl("deploy", str(default_model_path), "--hosts", hosts.data_hosts([0, 1]),
                                   "--ranges", "0:10,10:30", "--json")
            assert proc.returncode == 0, proc.stderr
            head = hosts.daemons[0]
            added = hosts.skippyctl("deploy", "--add", names[2], "--json")
            assert added.returncode == 0, added.stderr
            assert json.loads(added.stdout)["name"] == names[2]
            sup = _wait_for(head, lambda s: s["generation"] >= 2)
            assert [s["host"] for s in sup["plan"]["stages"]] == [names[0], names[2]], (slow.how, sup)
            assert "joined" in sup["last_change"]["cause"] and sup["replans"]["added"] == 1, sup
            assert _host(sup, names[1])["state"] == "waiting" and _host(sup, names[2])["ms_per_layer"]
            assert hosts.daemons[1].status()["deployment"]["assigned"] is None  # released: it waits
            assert generate(head, prompt=PROMPT, raw=True, max_tokens=TOKENS)["tokens"] == want["tokens"]

            shown = hosts.skippyctl("--url", f"ws://{names[0]}", "status")
            assert shown.returncode == 0, shown.stderr
            assert "deployment: generation 2, serving" in shown.stdout and f"{names[1]}: waiting" in shown.stdout

            again = hosts.skippyctl("deploy", "--add", "10.77.0.250", "--json")  # nobody there
            assert again.returncode != 0 and "Traceback" not in again.stderr and "10.77.0.250" in again.stderr
        finally:
            hosts.stop()
    finally:
        slow.close()


@pytest.fixture(scope="module")
def net4():
    with netns.network_for_test(4) as network:
        yield network


def _change(daemon, predicate, timeout: float = 120.0) -> dict:
    """The change under way once `predicate` holds for it (a change ended meanwhile fails the test)."""
    return _wait_for(daemon, lambda s: s["change"] is not None and predicate(s["change"]), timeout)["change"]


def test_a_host_lost_during_the_slice_transfer_is_dropped_and_the_plan_made_again(
        net4, cache, default_model_path, want, tmp_path):
    # hosts 0-2 run the three stages, host 3 waits; traffic to host 3 crawls, so that a slice it is sent is on
    # its way for seconds
    hosts = Hosts(net4, tmp_path, cache, configs=[GRACE] * 4)
    names = hosts.data_hosts().split(",")
    try:
        deployed = hosts.deploy(default_model_path, "--ranges", RANGES)
        assert [s["host"] for s in deployed["plan"]["stages"]] == names[:3], deployed["plan"]
        head = hosts.daemons[0]
        net4.limit_rate(3, 8)

        async def lose_two() -> None:
            await trio.to_thread.run_sync(hosts.daemons[2].kill)  # the final stage, mid-decode
            # the re-plan over hosts 1 and 3 ships host 3 its slice: it dies on the way
            change = await trio.to_thread.run_sync(lambda: _change(head, lambda c: names[3] in c["shipping"]))
            assert change["step"] == "shipping" and "dropped" in change["cause"], change
            await trio.to_thread.run_sync(hosts.daemons[3].kill)

        result = _stream_while(head, lose_two)
        assert "failed" not in result and result["tokens"] == want["tokens"], result
        sup = _wait_for(head, lambda s: s["state"] == "serving" and s["generation"] >= 2)
        assert sup["generation"] == 2 and [s["host"] for s in sup["plan"]["stages"]] == names[:2], sup
        assert sup["replans"]["lost_during_transfer"] == 1 and sup["replans"]["dropped"] == 0, sup
        assert f"{names[3]} lost while shipping" in sup["last_change"]["cause"], sup["last_change"]
        assert _host(sup, names[3])["state"] == "dropped" and sup["change"] is None, sup
        log = head.log()
        assert f"{names[3]} lost while shipping" in log and "abandoned after" in log and "Traceback" not in log
        assert generate(head, prompt=PROMPT, raw=True, max_tokens=TOKENS)["tokens"] == want["tokens"]
    finally:
        net4.heal()
        hosts.stop()


def test_a_host_lost_during_a_switch_leaves_the_plan_serving(net, cache, default_model_path, want, tmp_path):
    hosts = Hosts(net, tmp_path, cache, configs=[GRACE] * 3)
    names = hosts.data_hosts().split(",")
    try:
        hosts.deploy(default_model_path, "--ranges", RANGES)
        head = hosts.daemons[0]
        hosts.daemons[2].kill()
        _wait_for(head, lambda s: s["generation"] == 2 and s["state"] == "serving")

        async def switch_cut_short(victim: int) -> list[dict]:
            # host 2 comes back; a long generation holds the switch to it at its request boundary, one more
            # asked meanwhile waits there; host `victim` dies then
            results: list[dict] = [{}, {}]
            started = trio.Event()

            async def one(k: int, **kw) -> None:
                results[k] = await _stream(head, **kw)

            async with trio.open_nursery() as nursery:
                nursery.start_soon(lambda: one(0, started=started, max_tokens=400))
                await started.wait()
                back = hosts.daemons[2]
                await trio.to_thread.run_sync(back.restart)
                await trio.to_thread.run_sync(back.wait_ready)  # back: the head switches to give it its share
                change = await trio.to_thread.run_sync(lambda: _change(head, lambda c: c["step"] == "draining"))
                assert names[2] in change["hosts"] and "back" in change["cause"], change
                nursery.start_soon(one, 1)
                await trio.to_thread.run_sync(hosts.daemons[victim].kill)
            return results

        long, waiting = trio.run(switch_cut_short, 2)  # the host joining, mid-switch
        assert "failed" not in long and long["tokens"][:len(want["tokens"])] == want["tokens"], long
        assert "failed" not in waiting and waiting["tokens"] == want["tokens"], waiting
        sup = _wait_for(head, lambda s: s["state"] == "serving" and s["change"] is None)
        assert sup["generation"] == 2 and [s["host"] for s in sup["plan"]["stages"]] == names[:2], sup
        assert sup["replans"]["lost_during_switch"] == 1, sup
        assert f"{names[2]} lost while draining" in sup["last_change"]["cause"], sup["last_change"]
        assert _host(sup, names[2])["state"] == "dropped", sup
        assert "generation 2 serves on" in head.log() and "Traceback" not in head.log()
        assert generate(head, prompt=PROMPT, raw=True, max_tokens=TOKENS)["tokens"] == want["tokens"]

        # back again; this time host 1, in the plan serving and in the new one, dies mid-switch: the head plans
        # over host 2, and the generation that was running (on host 1) is replayed there
        long, waiting = trio.run(switch_cut_short, 1)
        assert "failed" not in long and long["tokens"][:len(want["tokens"])] == want["tokens"], long
        assert "failed" not in waiting and waiting["tokens"] == want["tokens"], waiting
        sup = _wait_for(head, lambda s: s["state"] == "serving" and s["change"] is None)
        assert sup["generation"] == 3 and [s["host"] for s in sup["plan"]["stages"]] == [names[0], names[2]], sup
        assert sup["replans"]["lost_during_switch"] == 2, sup
        assert f"{names[1]} lost while draining" in sup["last_change"]["cause"], sup["last_change"]
        assert generate(head, prompt=PROMPT, raw=True, max_tokens=TOKENS)["tokens"] == want["tokens"]
    finally:
        hosts.stop()
