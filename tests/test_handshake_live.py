"""The handshake against a real skippyd stage process: each refusal says which check failed.

Stage 1 (a middle stage) of a 3-stage split of the tiny model runs as its own
process. The dialer is the daemon's own DownstreamLink with a Hello that is
wrong in one way; the stage refuses with a reason, logs it, and keeps
serving. Stage 2 is started last, to show that the same stage then accepts a
correct upstream.
"""

from __future__ import annotations

import pytest
import trio

from skippyd.stage.downstream import DownstreamError, DownstreamLink
from skippyd.wire.messages import PROTOCOL_VERSION, Ack, Hello, Ping
from tests.procs import Pipeline, split_for_test

pytestmark = pytest.mark.slow  # real daemon processes


@pytest.fixture(scope="module")
def stage1(tiny_model_small_vocab_path, tmp_path_factory):
    work = tmp_path_factory.mktemp("handshake")
    split_for_test(tiny_model_small_vocab_path, 3, work)
    pipe = Pipeline(work / "topology.toml", work)
    try:
        pipe.start_stage(1)
        yield pipe
    finally:
        codes = pipe.stop()
    assert all(c == 0 for c in codes.values()), codes


def upstream_hello(pipe: Pipeline, **kw) -> Hello:
    topo = pipe.topology
    s0 = topo.stage(0)
    return Hello(**{"fingerprint": topo.source_sha256, "stage_index": 0, "layer_start": s0.layer_start,
                    "layer_end": s0.layer_end, "n_layer": topo.n_layer, "n_embd": topo.n_embd, "node": "test",
                    **kw})


async def dial(pipe: Pipeline, hello: Hello) -> DownstreamLink:
    s1 = pipe.topology.stage(1)
    return await DownstreamLink.connect(s1.host, s1.port, hello, connect_timeout=5)


def refusals(pipe: Pipeline) -> list[str]:
    return [line for line in pipe.stages[1].log().splitlines() if "refused upstream" in line]


CASES = {
    "fingerprint": (dict(fingerprint=bytes(range(32))),
                    "model fingerprint mismatch: peer 0001020304050607…, ours "),
    # a stage of the protocol before media rows (version 6) is refused, not sent rows it would misread
    "version": (dict(version=6), f"protocol version mismatch: peer 6, ours {PROTOCOL_VERSION}"),
    "layer-range": (dict(layer_end=1),
                    "non-adjacent stage: peer is stage 0 with layers [0, 1) of 4, expected stage 0 ending at layer 2"),
    "stage-index": (dict(stage_index=2, layer_start=1, layer_end=2),
                    "non-adjacent stage: peer is stage 2 with layers [1, 2) of 4, expected stage 0 ending at layer 2"),
}


@pytest.mark.parametrize("case", list(CASES))
async def test_refused_with_the_reason(stage1, case):
    wrong, reason = CASES[case]
    before = len(refusals(stage1))
    with pytest.raises(DownstreamError) as info:
        await dial(stage1, upstream_hello(stage1, **wrong))
    assert f"handshake failed: refused by peer: {reason}" in str(info.value)
    with trio.fail_after(2):  # the operator sees it too (the line is written right after the refusal)
        while not (logged := refusals(stage1)[before:]):
            await trio.sleep(0.02)
    assert len(logged) == 1 and reason in logged[0]


async def test_downstream_away_then_back(stage1):
    """With stage 2 down a correct upstream is refused (the lane would lead nowhere); once it is up, accepted."""
    assert stage1.topology.stage(1).layer_start == 2  # the split CASES assume
    with pytest.raises(DownstreamError, match="refused by peer: downstream unavailable: stage 2 at 127.0.0.1:"):
        await dial(stage1, upstream_hello(stage1))
    await stage1.astart_stage(2)
    link = await dial(stage1, upstream_hello(stage1))
    try:
        assert link.peer.stage_index == 1 and link.peer.layer_start == 2
        reply, *_ = await link.request(Ping(7))
        assert isinstance(reply, Ack) and reply.request_id == 7
    finally:
        await link.aclose()
    await stage1.wait_all_released(2.0)
