"""Security: who may open a stage link (allow-list, shared secret), the control token, sampling ranges.

Pure checks first (allow-list parsing and matching, the link secret file,
the control token comparison, SamplingParams' float32/int32 ranges), then
real skippyd processes: a stage refuses an upstream whose address its
allow-list does not name, or whose Hello lacks the link secret, says why,
logs it and keeps serving; a pipeline whose daemons share the secret
generates.
"""

from __future__ import annotations

import logging
import math

import numpy as np
import pytest
import trio
import trio.testing

from skippyd import config as cfgmod
from skippyd.cli import build_parser
from skippyd.sampling import InvalidSampling, SamplingParams
from skippyd.stage.access import LinkSecretError, UpstreamAllow, link_auth, load_link_secret
from skippyd.stage.downstream import DownstreamError, DownstreamLink
from skippyd.topology import TopologyError, parse_allow_entry
from skippyd.wire.errors import HandshakeRefused
from skippyd.wire.handshake import handshake_client, handshake_server, refuse_handshake
from skippyd.wire.messages import Ack, Hello, HelloReply, Ping
from skippyd.wire.stream import read_frame
from tests.fake_node import FakeNode
from tests.procs import Pipeline, split_for_test

FP = bytes(range(32))


# ---------------------------------------------------------------------------- allow-list
@pytest.mark.parametrize(("entry", "ok"), [("10.0.0.5", True), ("10.0.0.0/24", True), ("::1", True),
                                           ("stage-1.example.org", True), ("localhost", True), ("any", True),
                                           ("*", True), ("10.0.0", False), ("a b", False), ("300.1.1.1", False),
                                           ("", False), ("http://x", False)])
def test_allow_entries(entry, ok):
    if ok:
        parse_allow_entry(entry)
    else:
        with pytest.raises(TopologyError, match="bad allow-list entry"):
            parse_allow_entry(entry)


@pytest.mark.parametrize(("entries", "peer", "allowed"), [
    (["10.0.0.5"], "10.0.0.5", True),
    (["10.0.0.5"], "10.0.0.6", False),
    (["10.0.0.0/24"], "10.0.0.200", True),
    (["10.0.0.0/24"], "::ffff:10.0.0.7", True),  # an IPv4 peer on a dual-stack listener
    (["127.0.0.1"], "127.0.0.2", True),  # loopback is one address
    (["127.0.0.1"], "::1", True),
    (["0.0.0.0"], "127.0.0.1", True),  # dialed through loopback
    (["0.0.0.0"], "10.0.0.1", False),
    (["localhost"], "127.0.0.1", True),
    (["localhost"], "192.0.2.1", False),
    (["any"], "192.0.2.1", True),
    (["192.0.2.1"], "?", False),  # unknown peer address: never
    (["fe80::1"], "fe80::1%eth0", True),
    (["no-such-host.invalid"], "127.0.0.1", False),  # does not resolve: allows nothing
])
async def test_allow_list_matching(entries, peer, allowed):
    assert await UpstreamAllow(entries, source="test").allows(peer) is allowed


def test_default_allow_list_is_the_previous_stage_host(tiny_model_small_vocab_path, tmp_path):
    import attrs

    topo = split_for_test(tiny_model_small_vocab_path, 3, tmp_path)
    topo = attrs.evolve(topo, stages=[attrs.evolve(s, host=h) for s, h in
                                      zip(topo.stages, ["10.1.0.1", "10.1.0.2", "10.1.0.3"])])
    allow = UpstreamAllow.for_stage(topo, 2, None)
    assert allow.entries == ["10.1.0.2"] and "stage 1" in allow.source
    assert UpstreamAllow.for_stage(topo, 2, ["any"]).any
    # the head's only listener takes the final stage's token-return connection
    assert UpstreamAllow.for_stage(topo, 0, None).entries == ["10.1.0.3"]


def test_upstream_allow_in_config_and_flags(tmp_path):
    good = tmp_path / "good.toml"
    good.write_text('[stage]\nupstream_allow = ["10.0.0.0/24", "stage1.lan"]\nlink_secret_file = "secret"\n'
                    'frame_timeout = 3.5\n')
    conf = cfgmod.load(good)
    assert conf.stage.upstream_allow == ["10.0.0.0/24", "stage1.lan"]
    assert conf.stage.link_secret_file == tmp_path / "secret" and conf.stage.frame_timeout == 3.5
    assert cfgmod.toml_value(conf.stage.upstream_allow) == '["10.0.0.0/24", "stage1.lan"]'
    bad = tmp_path / "bad.toml"
    bad.write_text('[stage]\nupstream_allow = ["10.0.0.0/24", "not an address"]\n')
    with pytest.raises(cfgmod.ConfigError, match="stage.upstream_allow: bad allow-list entry 'not an address'"):
        cfgmod.load(bad)
    empty = tmp_path / "empty.toml"
    empty.write_text("[stage]\nupstream_allow = []\n")
    with pytest.raises(cfgmod.ConfigError, match="stage.upstream_allow"):
        cfgmod.load(empty)
    parser = build_parser()
    args = parser.parse_args(["--upstream-allow", "10.0.0.1, 10.0.1.0/24", "--link-secret-file", "/s"])
    assert args.upstream_allow == ["10.0.0.1", "10.0.1.0/24"]
    with pytest.raises(SystemExit):
        parser.parse_args(["--upstream-allow", "10.0.0.1,nope nope"])


# ---------------------------------------------------------------------------- link secret
def test_link_secret_file(tmp_path, caplog):
    secret = tmp_path / "link.secret"
    secret.write_text("  0123456789abcdef0123456789abcdef\n")
    secret.chmod(0o600)
    auth = load_link_secret(secret)
    assert auth == link_auth(b"0123456789abcdef0123456789abcdef") and len(auth) == 32
    assert b"0123456789abcdef" not in auth  # the secret itself never goes on the wire
    assert link_auth(b"") == b""
    secret.chmod(0o644)
    with caplog.at_level(logging.WARNING, logger="skippyd.stage"):
        load_link_secret(secret)
    assert "readable by others" in caplog.text
    short = tmp_path / "short"
    short.write_text("abc\n")
    with pytest.raises(LinkSecretError, match="at least 16 bytes"):
        load_link_secret(short)
    with pytest.raises(LinkSecretError, match="missing"):
        load_link_secret(tmp_path / "missing")


def hello(stage: int, start: int, end: int, auth: bytes = b"") -> Hello:
    return Hello(fingerprint=FP, stage_index=stage, layer_start=start, layer_end=end, n_layer=30, n_embd=8,
                 node=f"s{stage}", auth=auth)


async def _handshake(client: Hello, server: Hello):
    a, b = trio.testing.memory_stream_pair()
    results: dict = {}

    async def side(name, coro):
        try:
            results[name] = await coro
        except HandshakeRefused as exc:
            results[name] = exc

    async with trio.open_nursery() as nursery:
        nursery.start_soon(side, "client", handshake_client(a, client, timeout=2))
        nursery.start_soon(side, "server", handshake_server(b, server, timeout=2))
    return results["client"], results["server"]


@pytest.mark.parametrize(("client_auth", "server_auth", "refused"), [
    (link_auth(b"s" * 32), link_auth(b"s" * 32), None),
    (b"", link_auth(b"s" * 32), "server"),  # no secret: refused by the stage
    (link_auth(b"t" * 32), link_auth(b"s" * 32), "server"),  # wrong secret
    (link_auth(b"s" * 32), b"", "client"),  # the dialer will not talk to a stage without the secret either
])
async def test_link_secret_handshake(client_auth, server_auth, refused):
    client, server = await _handshake(hello(0, 0, 10, client_auth), hello(1, 10, 30, server_auth))
    if refused is None:
        assert isinstance(client, Hello) and isinstance(server, Hello)
        return
    if refused == "server":
        assert isinstance(server, HandshakeRefused) and not server.by_peer
        assert isinstance(client, HandshakeRefused) and client.by_peer
        assert server.reason == client.reason == "authentication failed"
    else:
        assert isinstance(client, HandshakeRefused) and client.reason == "authentication failed"


async def test_refuse_handshake_reads_the_hello_then_says_why():
    a, b = trio.testing.memory_stream_pair()
    async with trio.open_nursery() as nursery:
        async def dialer():
            with pytest.raises(HandshakeRefused) as info:
                await handshake_client(a, hello(0, 0, 10), timeout=2)
            assert info.value.by_peer and info.value.reason.startswith("upstream address not allowed")

        nursery.start_soon(dialer)
        with pytest.raises(HandshakeRefused) as info:
            await refuse_handshake(b, "upstream address not allowed: 192.0.2.1", timeout=2)
        assert not info.value.by_peer
    # garbage instead of a Hello is refused all the same; silence is just dropped
    a, b = trio.testing.memory_stream_pair()
    await a.send_all(b"GET / HTTP/1.1\r\n\r\n")
    with pytest.raises(HandshakeRefused):
        await refuse_handshake(b, "nope", timeout=1)
    assert await read_frame(a, timeout=1) == HelloReply(False, "nope")


# ---------------------------------------------------------------------------- control token
class FakeRequest:
    def __init__(self, headers):
        self.headers = headers


@pytest.mark.parametrize(("header", "ok"), [
    (None, False), (b"", False), (b"Bearer ", False), (b"Bearer wrong", False), (b"Bearer tok", False),
    (b"Bearer the-token-x", False), (b"Basic the-token", False), (b"Bearer \xff\xfe", False),
    (b"Bearer the-token", True), (b"bearer the-token", True),
])
def test_control_token_check(tmp_path, header, ok):
    from skippyd.control.server import ControlServer

    token = tmp_path / "t"
    token.write_text("the-token\n")
    server = ControlServer(FakeNode(), "127.0.0.1", 0, token_file=token)
    headers = [] if header is None else [(b"authorization", header)]
    assert server._authorized(FakeRequest(headers)) is ok


# ---------------------------------------------------------------------------- sampling ranges
F32_MAX = float(np.finfo(np.float32).max)


@pytest.mark.parametrize("bad", [
    dict(temperature=1e300), dict(temperature=F32_MAX * 2), dict(temperature=math.inf), dict(temperature=math.nan),
    dict(top_k=2**31), dict(top_k=-1), dict(top_k=True), dict(top_p=1e300), dict(min_p=math.nan),
    dict(repeat_penalty=1e39), dict(repeat_penalty=0.0), dict(presence_penalty=-1e39),
    dict(frequency_penalty=math.inf), dict(penalty_last_n=2**31), dict(penalty_last_n=-2),
    dict(seed=2**32), dict(seed=-1), dict(seed=1.5), dict(logit_bias=((1, 1e39),)), dict(logit_bias=((1, math.inf),)),
    dict(logit_bias=((1, math.nan),)), dict(logit_bias=((100, 1.0),)),
])
def test_sampling_params_out_of_c_range_are_refused(bad):
    with pytest.raises(InvalidSampling):
        SamplingParams(**bad).validate(n_vocab=100)


@pytest.mark.parametrize("good", [
    dict(), dict(temperature=F32_MAX), dict(temperature=-5.0), dict(top_k=2**31 - 1), dict(seed=2**32 - 1),
    dict(seed=0), dict(penalty_last_n=-1), dict(penalty_last_n=2**31 - 1), dict(logit_bias=((1, -math.inf),)),
    dict(logit_bias=((99, -F32_MAX),)), dict(presence_penalty=-2.0), dict(top_k=np.int64(5)),
])
def test_sampling_params_at_the_edges_are_accepted(good):
    SamplingParams(**good).validate(n_vocab=100)


# ---------------------------------------------------------------------------- real processes
def refusals(daemon) -> list[str]:
    return [line for line in daemon.log().splitlines() if "refused upstream" in line]


def stage0_hello(pipe: Pipeline, auth: bytes = b"") -> Hello:
    topo = pipe.topology
    s0 = topo.stage(0)
    return Hello(fingerprint=topo.source_sha256, stage_index=0, layer_start=s0.layer_start, layer_end=s0.layer_end,
                 n_layer=topo.n_layer, n_embd=topo.n_embd, node="test", auth=auth)


async def dial(pipe: Pipeline, hello: Hello) -> DownstreamLink:
    s1 = pipe.topology.stage(1)
    return await DownstreamLink.connect(s1.host, s1.port, hello, connect_timeout=5)


async def expect_refusal(pipe: Pipeline, hello: Hello, reason: str) -> None:
    before = len(refusals(pipe.stages[1]))
    with pytest.raises(DownstreamError) as info:
        await dial(pipe, hello)
    assert f"refused by peer: {reason}" in str(info.value)
    with trio.fail_after(2):
        while not (logged := refusals(pipe.stages[1])[before:]):
            await trio.sleep(0.02)
    assert len(logged) == 1 and reason in logged[0]


async def ping(pipe: Pipeline, hello: Hello) -> None:
    link = await dial(pipe, hello)
    try:
        reply, *_ = await link.request(Ping(5))
        assert isinstance(reply, Ack)
    finally:
        await link.aclose()


@pytest.mark.slow  # real daemon processes
async def test_stage_refuses_addresses_its_allow_list_does_not_name(tiny_model_small_vocab_path, tmp_path):
    split_for_test(tiny_model_small_vocab_path, 2, tmp_path)
    pipe = Pipeline(tmp_path / "topology.toml", tmp_path, extra=["--upstream-allow", "192.0.2.1,198.51.100.0/24"])
    try:
        await pipe.astart_stage(1)
        for _ in range(3):  # refused each time, the stage keeps serving
            await expect_refusal(pipe, stage0_hello(pipe), "upstream address not allowed: 127.0.0.1 may not connect")
        st = await pipe.stages[1].astatus()
        assert st["stages"][0]["refused_upstreams"] == 3
        assert st["stages"][0]["upstream_allow"] == "192.0.2.1, 198.51.100.0/24"
        assert "upstream connections allowed from 192.0.2.1, 198.51.100.0/24" in pipe.stages[1].log()
        assert pipe.stages[1].proc.poll() is None
    finally:
        codes = pipe.stop()
    assert codes == {1: 0}


@pytest.mark.slow  # real daemon processes
async def test_default_allow_list_admits_the_loopback_topology_and_status_names_listeners(
        tiny_model_small_vocab_path, tmp_path):
    split_for_test(tiny_model_small_vocab_path, 2, tmp_path)
    pipe = Pipeline(tmp_path / "topology.toml", tmp_path)
    try:
        await trio.to_thread.run_sync(pipe.start)
        got = await pipe.generate(prompt="hi", raw=True, max_tokens=3)
        assert len(got["tokens"]) == 3
        st = await pipe.stages[1].astatus()
        assert st["stages"][0]["upstream_allow"] == "127.0.0.1"
        listeners = {x["what"]: x for x in st["listeners"]}
        assert listeners["control"]["loopback"] and listeners["stage 1"]["loopback"]
        assert listeners["stage 1"]["address"] == f"127.0.0.1:{pipe.topology.stage(1).port}"
        head = await pipe.head.astatus()
        assert [x["what"] for x in head["listeners"]] == ["control"]
    finally:
        codes = pipe.stop()
    assert all(c == 0 for c in codes.values()), codes


@pytest.mark.slow  # real daemon processes
async def test_head_refuses_a_token_return_connection_from_elsewhere(tiny_model_small_vocab_path, tmp_path):
    """The head's token-return listener takes only the final stage's host: from anywhere else a peer that
    passed the handshake could inject tokens into running generations. Refused, the final stage falls back to
    the relayed path and generations still work."""
    split_for_test(tiny_model_small_vocab_path, 3, tmp_path)
    pipe = Pipeline(tmp_path / "topology.toml", tmp_path)
    try:
        await pipe.astart_stage(2)
        await pipe.astart_stage(1)
        pipe.extra = ["--upstream-allow", "192.0.2.1"]  # the head only: not where the final stage dials from
        await pipe.astart_stage(0)
        got = await pipe.generate(prompt="hi", raw=True, max_tokens=3)
        assert len(got["tokens"]) == 3
        tr = (await pipe.head.astatus())["head"]["token_return"]
        assert tr["refused"] >= 1 and tr["accepted"] == 0 and tr["direct"] == 0, tr
        assert "upstream address not allowed: 127.0.0.1 may not open the token-return connection" \
            in pipe.head.log()
    finally:
        codes = pipe.stop()
    assert all(c == 0 for c in codes.values()), codes


@pytest.mark.slow  # real daemon processes
async def test_pipeline_with_a_link_secret(tiny_model_small_vocab_path, tmp_path):
    """Every daemon holds the secret: lanes (and status probes) work; a dialer without it, or with
    another, is refused with "authentication failed"."""
    split_for_test(tiny_model_small_vocab_path, 3, tmp_path)
    secret = tmp_path / "link.secret"
    secret.write_text("correct horse battery staple 0123456789\n")
    secret.chmod(0o600)
    pipe = Pipeline(tmp_path / "topology.toml", tmp_path, extra=["--link-secret-file", str(secret)])
    try:
        await trio.to_thread.run_sync(pipe.start)
        got = await pipe.generate(prompt="hi", raw=True, max_tokens=4)
        assert len(got["tokens"]) == 4
        auth = load_link_secret(secret)
        before = (await pipe.stages[1].astatus())["stages"][0]["refused_upstreams"]  # startup races count too
        await ping(pipe, stage0_hello(pipe, auth))
        await expect_refusal(pipe, stage0_hello(pipe), "authentication failed")
        await expect_refusal(pipe, stage0_hello(pipe, link_auth(b"x" * 40)), "authentication failed")
        head = await pipe.head.astatus()
        tr = head["head"]["token_return"]  # the final stage's token-return link presented the secret too
        assert tr["accepted"] >= 1 and tr["refused"] == 0 and tr["direct"] >= 1, tr
        reach = {s["index"]: (s["reachable"], s.get("error")) for s in head["topology"]["stages"]}
        assert reach[2] == (True, None), reach  # the probe presents the secret too
        snap = (await pipe.stages[1].astatus())["stages"][0]
        assert snap["link_secret"] is True and snap["refused_upstreams"] == before + 2
    finally:
        codes = pipe.stop()
    assert all(c == 0 for c in codes.values()), codes


# ---------------------------------------------------------------------------- the systemd units
@pytest.mark.parametrize("name", ["skippyd.service", "skippyd@.service"])
def test_units_run_unprivileged_and_confined(name):
    from pathlib import Path

    keys: dict[str, str] = {}
    for line in (Path(__file__).resolve().parent.parent / "systemd" / name).read_text().splitlines():
        if "=" in line and not line.startswith(("#", "[")):
            key, value = line.split("=", 1)
            keys[key.strip()] = value.strip()
    assert keys["DynamicUser"] == "yes" and keys.get("User") != "root"
    assert keys["CapabilityBoundingSet"] == "" and keys["NoNewPrivileges"] == "yes"
    assert keys["ProtectSystem"] == "strict" and keys["ProtectHome"] == "yes"
    assert keys["SystemCallFilter"] == "@system-service" and keys["SystemCallErrorNumber"] == "EPERM"
    assert keys["Environment"] == "MALLOC_ARENA_MAX=2"
    assert keys["RestrictAddressFamilies"] == "AF_UNIX AF_INET AF_INET6"


# ---------------------------------------------------------------------------- a handshake flood
@pytest.mark.slow  # real daemon processes
async def test_connections_beyond_max_handshakes_are_closed_at_once(tiny_model_small_vocab_path, tmp_path, nursery):
    """Silent connections fill the handshake slots; the next ones are closed unheard; once the silent ones
    time out, a real upstream is accepted again."""
    from skippyd.stage.server import StageConfig, StageServer

    topo = split_for_test(tiny_model_small_vocab_path, 2, tmp_path)
    cfg = StageConfig(n_ctx_per_seq=256, lanes=2, n_batch=64, n_threads=1, listen_host="127.0.0.1", listen_port=0,
                      handshake_timeout_s=2.0, max_handshakes=4)
    server = await nursery.start(StageServer(topo, 1, cfg).run)
    silent = [await trio.open_tcp_stream("127.0.0.1", server.port) for _ in range(4)]
    with trio.fail_after(2):
        while server.counters.handshaking < 4:
            await trio.sleep(0.01)
    extra = await trio.open_tcp_stream("127.0.0.1", server.port)
    with trio.fail_after(1):  # closed at once, not at the handshake deadline
        assert await extra.receive_some(100) == b""
    assert server.counters.dropped_handshakes == 1
    with trio.fail_after(4):  # the silent ones time out; the slots are free again
        while server.counters.handshaking:
            await trio.sleep(0.05)
    s0 = topo.stage(0)
    hello = Hello(fingerprint=topo.source_sha256, stage_index=0, layer_start=s0.layer_start, layer_end=s0.layer_end,
                  n_layer=topo.n_layer, n_embd=topo.n_embd, node="test")
    link = await DownstreamLink.connect("127.0.0.1", server.port, hello, connect_timeout=5)
    try:
        reply, *_ = await link.request(Ping(1))
        assert isinstance(reply, Ack)
    finally:
        await link.aclose()
    for s in [*silent, extra]:
        await s.aclose()
    assert server.snapshot()["dropped_handshakes"] == 1


def test_a_bad_link_secret_file_is_a_usage_error(tmp_path):
    """Exit 2 with one line (systemd's RestartPreventExitStatus=2), before any model is loaded."""
    import subprocess
    import sys

    short = tmp_path / "short.secret"
    short.write_text("abc\n")
    for path, why in ((tmp_path / "missing", "No such file"), (short, "at least 16 bytes")):
        proc = subprocess.run([sys.executable, "-m", "skippyd.daemon", "--model", str(tmp_path / "none.gguf"),
                               "--no-control", "--link-secret-file", str(path)], capture_output=True, text=True,
                              timeout=60)
        assert proc.returncode == 2 and why in proc.stderr and "Traceback" not in proc.stderr, proc.stderr
