"""runtime.activation_wire = "auto" (the default): every link chooses f32 or f16 once, when it opens.

The choice (skippyd/stage/link_choice.py): f16 only where an f32 row takes longer on the link than
RATIO times the sending stage's compute of a row; the rate is measured over the link itself right after its
handshake (LinkProbe frames, skippyd/wire/handshake.py). Shown here:

* the rule, and the timing of a real loopback connection with and without a bandwidth cap (the project's
  own link conditioning, skippyd/stage/conditioning.py);
* real processes of the default model on loopback: a 2-stage and a 3-stage pipeline keep f32 on every link
  and give exactly the unsplit model's greedy tokens, the lighthouse prompt included;
* a rate-limited link takes f16 and status says so, with the rate it measured; forcing f32 there, or f16
  on loopback, still works.

The daemons get the tests' usual settings (tests/procs.py: no prefix cache, no speculation), with
``runtime.activation_wire`` given explicitly, since tests/procs.py keeps other tests at f32.
"""

from __future__ import annotations

import functools
import math

import pytest
import trio
import trio.testing

from skippyd.config import Config
from skippyd.stage.conditioning import LinkShape
from skippyd.stage.downstream import DownstreamLink
from skippyd.stage.link_choice import RATIO, WirePolicy
from skippyd.stage.server import frame_min_rate
from skippyd.wire.errors import ProtocolError
from skippyd.wire.handshake import LinkTiming, handshake_server, serve_link_probes
from skippyd.wire.messages import LinkProbe, ProbeStep, Role, WireFormat, link_timed, wire_formats
from skippyd.wire.stream import DEFAULT_MIN_RATE, ReceiveBuffer, write_frame
from tests.procs import Pipeline, retarget, split_for_test
from tests.test_activation_wire import PROMPTS, hello
from tests.test_pipeline_processes import assert_parity

LIGHTHOUSE = "Here is a short story about a lighthouse keeper who"
SLOW_MBPS = 0.25  # a link this slow takes f16 for the default model on any machine that runs these tests


# ---------------------------------------------------------------------------------------------- the rule


def test_auto_is_the_default_and_asks_for_timing():
    assert Config().runtime.activation_wire == "auto"
    assert wire_formats("auto") == WireFormat.F32 | WireFormat.F16 | WireFormat.TIMED
    assert wire_formats("f16") == WireFormat.F32 | WireFormat.F16 and wire_formats("f32") == WireFormat.F32


def test_a_link_is_timed_when_its_dialer_asks_and_the_acceptor_takes_f16():
    auto, f16, f32 = (hello(wire_formats=wire_formats(w)) for w in ("auto", "f16", "f32"))
    assert link_timed(auto, auto) and link_timed(auto, f16)
    assert not link_timed(auto, f32) and not link_timed(f16, auto) and not link_timed(f32, auto)
    # the final stage's token-return connection carries no activations
    assert not link_timed(hello(wire_formats=wire_formats("auto"), role=Role.TOKEN_RETURN), auto)


def test_f16_only_where_an_f32_row_takes_longer_on_the_link_than_the_compute_allows():
    policy = WirePolicy("auto", n_embd=576, row_compute_s=0.3e-3)
    threshold = 4 * 576 / (RATIO * 0.3e-3)  # bytes/s: about 49 Mbit/s
    assert policy.threshold_Bps == pytest.approx(threshold)
    at = lambda rate: policy.choose(LinkTiming(rtt_s=1e-3, rate_Bps=rate, probes=2)).name  # noqa: E731
    assert at(threshold * 1.01) == "f32" and at(threshold) == "f16"
    assert at(1e6 / 8) == "f16"  # 1 Mbit/s
    assert at(1e9 / 8) == "f32" and at(20e9 / 8) == "f32"  # a gigabit LAN, loopback
    # a stage whose compute is not timed keeps f32; a forced mode keeps what the Hellos give
    assert WirePolicy("auto", 576).choose(LinkTiming(1e-3, 1e3, 2)).name == "f32"
    assert WirePolicy("f16", 576).untimed(WireFormat.F16).name == "f16"
    assert WirePolicy("f16", 576).untimed(WireFormat.F32).why == "the next stage takes f32 only"
    assert WirePolicy("auto", 576).untimed(WireFormat.F16).name == "f32"


def test_a_timed_links_frames_get_the_time_its_rate_needs_never_less_than_today():
    assert frame_min_rate(DEFAULT_MIN_RATE, 10_000_000) == DEFAULT_MIN_RATE  # 10 Gbit/s: today's deadline
    assert frame_min_rate(DEFAULT_MIN_RATE, 1000) == 1000 * 1e3 / 8 / 2  # 1 Mbit/s: half its rate
    assert frame_min_rate(DEFAULT_MIN_RATE, 0) == 1.0


def test_a_probe_result_names_one_encoding():
    assert LinkProbe(ProbeStep.RESULT, wire=WireFormat.F16, rate_kbps=5).wire == WireFormat.F16
    with pytest.raises(ValueError):
        LinkProbe(ProbeStep.RESULT, wire=WireFormat.F32 | WireFormat.F16)


# ---------------------------------------------------------------------------------------------- timing, in-process


async def _timed_link(mbps: float, dialer: str = "auto", acceptor: str = "auto") -> tuple[DownstreamLink, list]:
    """A link over real loopback TCP to an acceptor that only handshakes (and answers the timing): the
    dialer's link, and the RESULTs the acceptor got."""
    results: list[LinkProbe] = []
    ours = hello(wire_formats=wire_formats(dialer))
    theirs = hello(stage_index=1, layer_start=2, layer_end=4, wire_formats=wire_formats(acceptor))

    async def accept(stream: trio.SocketStream) -> None:
        async with trio.open_nursery() as nursery:
            out = LinkShape(mbps=mbps).wrap(stream, nursery)
            await handshake_server(stream, theirs, timeout=10, receive=ReceiveBuffer(stream), probe_out=out,
                                   timed=results.append)
            await trio.sleep_forever()

    async with trio.open_nursery() as nursery:
        (listener,) = await nursery.start(functools.partial(trio.serve_tcp, accept, 0, host="127.0.0.1"))
        port = listener.socket.getsockname()[1]
        link = await DownstreamLink.connect("127.0.0.1", port, ours, connect_timeout=10,
                                            wrap=LinkShape(mbps=mbps).wrap, nursery=nursery,
                                            policy=WirePolicy(dialer, 576, row_compute_s=0.3e-3))  # f16 < 49 Mbit/s
        await trio.sleep(0.05)  # the RESULT travels
        await link.aclose()
        nursery.cancel_scope.cancel()
    return link, results


async def test_loopback_is_timed_fast_and_keeps_f32():
    link, results = await _timed_link(0)
    assert link.wire == WireFormat.F32 and link.choice.name == "f32"
    assert link.choice.rate_Bps > 100e6 / 8  # well over 100 Mbit/s
    assert [(r.step, r.wire) for r in results] == [(ProbeStep.RESULT, WireFormat.F32)]


async def test_a_rate_limited_link_is_measured_at_its_rate_and_takes_f16():
    link, results = await _timed_link(2.0)
    rate_mbps = link.choice.rate_Bps * 8 / 1e6
    assert 1.0 < rate_mbps < 3.0, rate_mbps  # the conditioned rate, measured
    assert link.wire == WireFormat.F16 and link.choice.describe()["wire"] == "f16"
    (result,) = results
    assert result.wire == WireFormat.F16 and math.isclose(result.rate_kbps / 1e3, rate_mbps, rel_tol=0.01)


async def test_forced_modes_are_not_timed():
    for dialer, acceptor, want in (("f32", "auto", "f32"), ("f16", "auto", "f16"), ("auto", "f32", "f32")):
        link, results = await _timed_link(2.0, dialer, acceptor)
        assert (link.choice.name, link.choice.timing, results) == (want, None, []), (dialer, acceptor)


async def test_an_acceptor_refuses_endless_probes():
    a, b = trio.testing.memory_stream_pair()

    async def flood() -> None:
        for _ in range(20):
            await write_frame(a, LinkProbe(padding=16))

    async with trio.open_nursery() as nursery:
        nursery.start_soon(flood)
        nursery.start_soon(_drain, a)
        with pytest.raises(ProtocolError, match="more than"):
            await serve_link_probes(b, ReceiveBuffer(b), timeout=5)
        nursery.cancel_scope.cancel()


async def _drain(stream) -> None:
    while await stream.receive_some():
        pass


# ---------------------------------------------------------------------------------------------- real processes


async def _start(split_dir, tmp_path_factory, tag: str, config: dict) -> Pipeline:
    work = tmp_path_factory.mktemp(tag)
    pipe = Pipeline(retarget(split_dir / "topology.toml", work), work, config=config)
    return await trio.to_thread.run_sync(pipe.start)


@pytest.fixture(scope="module")
def split_dirs(default_model_path, tmp_path_factory):
    dirs = {}
    for n in (2, 3):
        dirs[n] = tmp_path_factory.mktemp(f"auto-split{n}")
        split_for_test(default_model_path, n, dirs[n])
    return dirs


async def _links(pipe: Pipeline) -> dict[int, dict]:
    """Each stage's link to the next, as its status shows it."""
    out = {}
    for k, daemon in pipe.stages.items():
        snap = await daemon.astatus()
        own = snap["head"] if k == 0 else snap["stages"][0]
        if own.get("link") is not None:
            out[k] = own["link"]
    return out


@pytest.mark.slow
@pytest.mark.parametrize("n_stages", [2, 3])
async def test_auto_on_loopback_keeps_the_split_exact(split_dirs, tmp_path_factory, default_model_path, n_stages):
    pipe = await _start(split_dirs[n_stages], tmp_path_factory, f"auto{n_stages}", {"runtime.activation_wire": "auto"})
    try:
        await assert_parity(pipe, default_model_path, [*PROMPTS, LIGHTHOUSE], 32)
        links = (await _links(pipe))
        assert sorted(links) == list(range(n_stages - 1))
        for k, link in links.items():
            assert (link["to"], link["wire"], link["mode"]) == (k + 1, "f32", "auto"), link
            assert link["rate_mbps"] > link["threshold_mbps"] and set(link["lanes"]) == {"f32"}, link
    finally:
        await trio.to_thread.run_sync(pipe.stop_cleanly)


@pytest.mark.slow
async def test_a_slow_link_takes_f16_and_status_says_so(split_dirs, tmp_path_factory):
    cfg = {"runtime.activation_wire": "auto", "stage.link_mbps": SLOW_MBPS, "runtime.lanes": 1}
    pipe = await _start(split_dirs[2], tmp_path_factory, "auto-slow", cfg)
    try:
        got = await pipe.generate(prompt=PROMPTS[0], raw=True, max_tokens=4)
        assert len(got["tokens"]) == 4
        (link,) = (await _links(pipe)).values()
        assert (link["wire"], link["mode"], link["lanes"]) == ("f16", "auto", {"f16": 1}), link
        assert SLOW_MBPS / 2 < link["rate_mbps"] < SLOW_MBPS * 1.5 and link["rate_mbps"] <= link["threshold_mbps"]
        (stage1,) = (await pipe.stages[1].astatus())["stages"]
        assert stage1["upstream_link"]["wire"] == "f16"  # as the dialer said in its RESULT
    finally:
        await trio.to_thread.run_sync(pipe.stop_cleanly)


@pytest.mark.slow
async def test_forcing_still_works(split_dirs, tmp_path_factory, default_model_path):
    cfg = {"runtime.activation_wire": "f32", "stage.link_mbps": SLOW_MBPS, "runtime.lanes": 1}
    pipe = await _start(split_dirs[2], tmp_path_factory, "forced-f32", cfg)
    try:
        await assert_parity(pipe, default_model_path, PROMPTS[:1], 4)
        (link,) = (await _links(pipe)).values()
        assert (link["wire"], link["mode"], link["rate_mbps"]) == ("f32", "f32", None), link
    finally:
        await trio.to_thread.run_sync(pipe.stop_cleanly)
    pipe = await _start(split_dirs[2], tmp_path_factory, "forced-f16", {"runtime.activation_wire": "f16"})
    try:
        got = await pipe.generate(prompt=PROMPTS[0], raw=True, max_tokens=4)
        assert len(got["tokens"]) == 4
        (link,) = (await _links(pipe)).values()
        assert (link["wire"], link["mode"], link["rate_mbps"]) == ("f16", "f16", None), link
    finally:
        await trio.to_thread.run_sync(pipe.stop_cleanly)
