"""A stage's message handlers against a small fake core: no model, no sockets, no scheduler.

The handlers of a connection (skippyd/stage/handlers.py) see the stage only
through its core: a fake one here, whose "compute" doubles the hidden
states (a middle stage) or predicts token 42 (the final stage), and a fake
downstream link that answers what a next stage would. Replies are read
from the other end of a memory stream.
"""

from __future__ import annotations

from types import SimpleNamespace

import numpy as np
import pytest
import trio
import trio.testing

from skippyd.stage.connection import UpstreamConnection
from skippyd.stage.core import StageCounters
from skippyd.stage.downstream import DownstreamError
from skippyd.stage.prefix_cache import PrefixCache
from skippyd.stage.roles import FinalStage, MiddleStage, handlers_for
from skippyd.stage.sessions import SessionTable
from skippyd.wire.messages import (
    NO_TOKEN,
    Ack,
    ConfigureGeneration,
    DecodeStep,
    ErrorCode,
    ErrorReply,
    MediaRows,
    Ping,
    PredictedToken,
    PrefillChunk,
    SamplingParams,
    StageStats,
    Stop,
    Stopped,
    TrimSession,
)
from skippyd.wire.stream import ReceiveBuffer, read_reply, write_frame

N_EMBD = 8
TOKEN = 42


def rows(n: int, seed: int = 0) -> np.ndarray:
    return np.random.default_rng(seed).standard_normal((n, N_EMBD), dtype=np.float32)


class FakeContext:
    n_ctx_seq = 64
    n_batch = 64
    n_embd = N_EMBD
    token_input = False
    n_pos_per_embd = 4  # M-RoPE: media rows come with four positions each

    def __init__(self):
        self.trims: list[tuple[int, int]] = []
        self.cleared: list[int] = []

    def kv_trim(self, seq: int, pos: int) -> None:
        self.trims.append((seq, pos))

    def kv_clear_seq(self, seq: int) -> None:
        self.cleared.append(seq)


class FakeScheduler:
    """Computes at once: a final stage's job predicts TOKEN, a middle stage's doubles its hidden states."""

    def __init__(self):
        self.jobs = []
        self.notes = 0
        self.hot_path = SimpleNamespace(note=self._note)
        self.policy = SimpleNamespace(max_batch_tokens=16)

    def _note(self, *_) -> None:
        self.notes += 1

    async def submit(self, job):
        await trio.lowlevel.checkpoint()
        self.jobs.append(job)
        return TOKEN if job.want_token else job.embd * 2

    async def run_kv(self, op) -> None:
        await trio.lowlevel.checkpoint()
        op()

    def forget(self, seq: int) -> None:
        pass


class FakeCore:
    """What the handlers use of a StageCore, without a model."""

    def __init__(self, *, index: int, n_stages: int, lanes: int = 2):
        self.index = index
        self.n_stages = n_stages
        self.is_final = index == n_stages - 1
        self.next_is_final = index == n_stages - 2
        self.config = SimpleNamespace(write_timeout_s=5.0, idle_timeout_s=60.0, frame_timeout_s=5.0, peer_timeout_s=3.0)
        self.frame_min_rate = 1e6
        self.model = SimpleNamespace(n_embd_inp=N_EMBD)
        self.context = FakeContext()
        self.scheduler = FakeScheduler()
        self.sessions = SessionTable(lanes)
        self.token_return = None
        self.draining = False
        self.counters = StageCounters()
        self.prefix_cache = PrefixCache(0, stage_index=index)  # off: these tests are about the messages
        self.released: list[int] = []
        self.failing_release: set[int] = set()  # session ids whose release raises
        self.dialed = 0

    async def release(self, session) -> None:
        self.released.append(session.session_id)
        if session.session_id in self.failing_release:
            raise RuntimeError("a bug in the release")
        self.context.kv_clear_seq(session.seq)
        self.sessions.forget(session)

    async def open_downstream(self, nursery):
        self.dialed += 1
        raise DownstreamError("next:1", "nobody there")

    def no_direct_return(self) -> str:
        return "the pipeline has fewer than three stages"


class FakeDownstream:
    """A next stage that acks what is acked and answers the rest as a final stage would (token 7)."""

    address = "next:1"
    stream = None  # no socket: no keepalive to set

    def __init__(self):
        self.sent: list = []  # (how, message)
        self.broken = False
        self.closed = False
        self.pending_acks = 0

    async def request(self, msg):
        self.sent.append(("request", msg))
        if isinstance(msg, (DecodeStep, PrefillChunk)):
            reply = PredictedToken(msg.request_id, msg.session_id, 7, StageStats.single(2, compute_us=5))
        elif isinstance(msg, Stop):  # the final stage held 2 positions of the prompt
            reply = Stopped(msg.request_id, msg.session_id, (2,), StageStats.single(2))
        else:
            reply = Ack(msg.request_id, getattr(msg, "session_id", 0), StageStats.single(2))
        return reply, 100, 1, 2

    async def send_deferred(self, msg, prepared=None):
        self.sent.append(("deferred", msg))
        return 100, 1

    async def send(self, msg, prepared=None):
        self.sent.append(("send", msg))
        return 100, 1

    async def send_expecting_ack(self, msg, prepared=None):
        self.sent.append(("expecting_ack", msg))
        self.pending_acks += 1
        return 100, 1

    async def drain(self) -> None:
        self.pending_acks = 0

    def take_folded(self):
        return StageStats.single(2, compute_us=3), None

    def prepare_step(self, *step):  # no frame prepared: the step goes through send()
        return None

    def looks_alive(self) -> bool:
        return True

    async def aclose(self) -> None:
        self.closed = True


class Upstream:
    """The upstream end of a connection's memory stream: what the handlers answer arrives here."""

    def __init__(self, stream):
        self.stream = stream
        self.receive = ReceiveBuffer(stream)

    async def reply(self):
        with trio.fail_after(2):
            return await read_reply(self.receive, timeout=2)

    async def nothing(self) -> bool:
        """True if nothing comes within a moment."""
        with trio.move_on_after(0.2):
            await read_reply(self.receive, timeout=1)
            return False
        return True


def final_stage(**kw) -> tuple[FakeCore, FinalStage, Upstream]:
    core = FakeCore(index=1, n_stages=2, **kw)
    ours, theirs = trio.testing.memory_stream_pair()
    handlers = handlers_for(core, 1, ours)
    assert isinstance(handlers, FinalStage)
    return core, handlers, Upstream(theirs)


def middle_stage(n_stages: int = 3) -> tuple[FakeCore, MiddleStage, Upstream, FakeDownstream]:
    core = FakeCore(index=1, n_stages=n_stages)
    ours, theirs = trio.testing.memory_stream_pair()
    down = FakeDownstream()
    handlers = handlers_for(core, 1, ours, down=down)
    assert isinstance(handlers, MiddleStage)
    return core, handlers, Upstream(theirs), down


def greedy(request_id: int, session_id: int, **kw) -> ConfigureGeneration:
    return ConfigureGeneration(request_id, session_id, SamplingParams.greedy(), **kw)


# ---------------------------------------------------------------------------- the final stage


async def test_final_stage_configures_prefills_decodes_and_stops_a_session():
    core, h, up = final_stage()
    await h.dispatch(greedy(1, 5))
    reply = await up.reply()
    assert isinstance(reply, Ack) and reply.request_id == 1 and reply.stats.stage_count == 1
    session = core.sessions.get(1, 5)
    assert session.answer is h.on_lane and not session.direct_return

    await h.dispatch(PrefillChunk(2, 5, 0, np.arange(3), rows(3), final=True))
    reply = await up.reply()
    assert isinstance(reply, PredictedToken) and (reply.request_id, reply.token) == (2, TOKEN)
    assert session.position == 3 and session.state == "decode" and session.generated == 1
    assert core.scheduler.jobs[-1].want_token

    await h.dispatch(DecodeStep(3, 5, 3, [TOKEN], rows(1)))
    reply = await up.reply()
    assert isinstance(reply, PredictedToken) and reply.request_id == 3 and session.position == 4
    assert core.scheduler.notes == 1  # the decode step's hot-path timing

    await h.dispatch(Stop(4, 5))
    reply = await up.reply()
    assert isinstance(reply, Stopped) and reply.cached == (0,)  # it computed the whole prompt
    assert core.released == [5] and core.sessions.live == [] and core.context.cleared == [session.seq]


async def test_unknown_session_is_answered_and_the_connection_goes_on():
    core, h, up = final_stage()
    await h.dispatch(DecodeStep(1, 9, 0, [1], rows(1)))
    reply = await up.reply()
    assert isinstance(reply, ErrorReply) and reply.code == ErrorCode.UNKNOWN_SESSION and reply.request_id == 1
    await h.dispatch(Ping(2))
    assert isinstance(await up.reply(), Ack)
    await h.dispatch(Stop(3, 9))  # stopping an unknown session is no error
    reply = await up.reply()
    assert isinstance(reply, Stopped) and reply.cached == (0,) and core.released == []


async def test_a_stage_ahead_trims_and_a_gap_is_refused():
    core, h, up = final_stage()
    await h.dispatch(greedy(1, 1))
    await up.reply()
    await h.dispatch(PrefillChunk(2, 1, 0, np.arange(4), rows(4), final=True))
    await up.reply()
    session = core.sessions.get(1, 1)
    await h.dispatch(DecodeStep(3, 1, 6, [1], rows(1)))  # we hold 4 positions
    reply = await up.reply()
    assert isinstance(reply, ErrorReply) and reply.code == ErrorCode.POSITION_GAP
    assert session.position == 4 and core.context.trims == []
    await h.dispatch(DecodeStep(4, 1, 2, [1], rows(1)))  # behind us: trim to 2, then compute
    assert isinstance(await up.reply(), PredictedToken)
    assert core.context.trims == [(session.seq, 2)] and session.position == 3
    await h.dispatch(TrimSession(5, 1, 1))
    assert isinstance(await up.reply(), Ack)
    assert core.context.trims[-1] == (session.seq, 1) and session.position == 1


async def test_a_non_final_chunk_is_acked_first_and_its_error_reported_with_the_next_reply():
    core, h, up = final_stage()
    await h.dispatch(PrefillChunk(1, 3, 2, np.arange(2), rows(2)))  # a gap: the session holds nothing
    assert isinstance(await up.reply(), Ack)
    await h.dispatch(PrefillChunk(2, 3, 4, np.arange(2), rows(2)))  # skipped: its session already failed
    assert isinstance(await up.reply(), Ack)
    await h.dispatch(PrefillChunk(3, 3, 6, np.arange(1), rows(1), final=True))
    reply = await up.reply()
    assert isinstance(reply, ErrorReply) and reply.code == ErrorCode.POSITION_GAP and reply.request_id == 3
    assert len(core.scheduler.jobs) == 0


async def test_draining_refuses_new_sessions_and_lets_running_ones_go_on():
    core, h, up = final_stage()
    await h.dispatch(greedy(1, 1))
    await up.reply()
    core.draining = True
    await h.dispatch(greedy(2, 2))
    reply = await up.reply()
    assert isinstance(reply, ErrorReply) and reply.code == ErrorCode.SHUTTING_DOWN
    assert core.sessions.get(1, 2) is None
    await h.dispatch(PrefillChunk(3, 1, 0, np.arange(2), rows(2), final=True))
    assert isinstance(await up.reply(), PredictedToken)


async def test_direct_return_without_a_return_link_is_refused_and_the_session_released():
    core, h, up = final_stage()
    await h.dispatch(greedy(1, 1, direct_return=True))
    reply = await up.reply()
    assert isinstance(reply, ErrorReply) and reply.code == ErrorCode.DIRECT_RETURN_UNAVAILABLE
    assert "fewer than three stages" in reply.message and core.released == [1] and core.sessions.live == []


async def test_the_final_stage_says_nothing_on_the_lane_for_a_direct_return_step():
    core, h, up = final_stage()
    await h.dispatch(DecodeStep(1, 4, 0, [1], rows(1), direct_return=True))  # unknown session: it fails
    assert await up.nothing()
    await h.dispatch(Ping(2))
    reply = await up.reply()
    assert isinstance(reply, Ack) and reply.request_id == 2


# ---------------------------------------------------------------------------- a middle stage


async def test_middle_stage_relays_each_message_with_its_hidden_states():
    core, h, up, down = middle_stage()
    await h.dispatch(greedy(1, 5))
    reply = await up.reply()
    assert isinstance(reply, Ack) and reply.stats.stage_count == 2
    session = core.sessions.get(1, 5)
    assert session.answer is h.relayed and not session.direct_return

    prompt = rows(3, seed=1)
    await h.dispatch(PrefillChunk(2, 5, 0, np.arange(3), prompt))  # acked at once, then forwarded
    reply = await up.reply()
    assert isinstance(reply, Ack) and reply.request_id == 2
    how, forwarded = down.sent[-1]
    assert how == "deferred" and np.array_equal(forwarded.activation, prompt * 2)

    await h.dispatch(PrefillChunk(3, 5, 3, np.arange(1), rows(1, seed=2), final=True))
    reply = await up.reply()
    assert isinstance(reply, PredictedToken) and reply.token == 7 and reply.request_id == 3
    assert reply.stats.stage_count == 2
    assert not core.scheduler.jobs[-1].want_token and session.position == 4

    step = rows(1, seed=3)
    await h.dispatch(DecodeStep(4, 5, 4, [7], step))
    reply = await up.reply()
    assert isinstance(reply, PredictedToken) and reply.request_id == 4
    how, forwarded = down.sent[-1]
    assert how == "request" and isinstance(forwarded, DecodeStep) and not forwarded.direct_return
    assert np.array_equal(forwarded.activation, step * 2) and forwarded.pos_start == 4

    await h.dispatch(Stop(5, 5))
    reply = await up.reply()
    assert isinstance(reply, Stopped) and reply.cached == (0, 2)  # this stage's count, then the next one's
    assert reply.stats.stage_count == 2
    assert down.sent[-1] == ("request", Stop(5, 5)) and core.released == [5]


async def test_middle_stage_forwards_direct_return_steps_and_acks_at_once():
    core, h, up, down = middle_stage(n_stages=3)  # stage 1 of 3: the next stage is the final one
    await h.dispatch(greedy(1, 5, direct_return=True))
    assert isinstance(await up.reply(), Ack)
    session = core.sessions.get(1, 5)
    assert session.direct_return and session.answer is h.direct
    await h.dispatch(PrefillChunk(2, 5, 0, np.arange(2), rows(2), final=True))
    reply = await up.reply()
    assert isinstance(reply, Ack) and reply.request_id == 2  # the prediction goes to the head directly
    assert down.sent[-1][0] == "deferred"
    await h.dispatch(DecodeStep(3, 5, 2, [1], rows(1)))
    reply = await up.reply()
    assert isinstance(reply, Ack) and reply.request_id == 3
    how, forwarded = down.sent[-1]
    assert how == "send" and forwarded.direct_return  # the final stage owes no ack for it
    assert core.counters.returns_only["forwarded"] == 1
    await h.dispatch(DecodeStep(4, 5, 3, [1], rows(1), direct_return=True))  # from the head: owes nothing
    assert await up.nothing()
    assert core.counters.returns_only == {"forwarded": 2, "answered": 0, "unacked": 1}
    assert session.unreported.total().stage_count == 2  # its report and the folded ack's wait for the next reply


async def test_a_direct_return_step_for_a_session_configured_without_it_is_refused():
    core, h, up, down = middle_stage()
    await h.dispatch(greedy(1, 5))
    await up.reply()
    await h.dispatch(DecodeStep(2, 5, 0, [1], rows(1), direct_return=True))
    reply = await up.reply()  # a middle stage reports a failure on the lane
    assert isinstance(reply, ErrorReply) and reply.code == ErrorCode.DIRECT_RETURN_UNAVAILABLE


async def test_a_dead_next_stage_is_reported_then_raised():
    core, h, up, down = middle_stage()
    down.looks_alive = lambda: False  # the next stage went away while the lane was idle: reconnect first
    with pytest.raises(DownstreamError):
        await h.dispatch(greedy(1, 5))
    reply = await up.reply()
    assert isinstance(reply, ErrorReply) and reply.code == ErrorCode.DOWNSTREAM_FAILED
    assert down.closed and core.dialed == 1 and h.down is None


# ---------------------------------------------------------------------------- the connection


async def test_closing_a_connection_releases_every_session_it_owned_even_if_one_release_raises(nursery):
    core = FakeCore(index=1, n_stages=3, lanes=4)
    ours, theirs = trio.testing.memory_stream_pair()
    down = FakeDownstream()
    conn = UpstreamConnection(core, ours, "test", down=down)
    done = trio.Event()

    async def serve():
        await conn.serve()
        done.set()

    nursery.start_soon(serve)
    up = Upstream(theirs)
    for sid in (1, 2, 3):
        await write_frame(theirs, greedy(sid, sid))
        assert isinstance(await up.reply(), Ack)
    other = core.sessions.open(99, 1, 1)  # another connection's session
    core.failing_release = {1}
    await theirs.aclose()
    with trio.fail_after(2):
        await done.wait()
    assert sorted(core.released) == [1, 2, 3]
    assert core.sessions.live == [core.sessions.get(conn.conn_id, 1), other]  # only the one that failed
    assert down.closed  # the next stage then releases the lane's sessions too


async def test_a_protocol_violation_ends_the_connection_with_an_error_and_releases(nursery):
    core = FakeCore(index=1, n_stages=2)
    ours, theirs = trio.testing.memory_stream_pair()
    conn = UpstreamConnection(core, ours, "test")
    nursery.start_soon(conn.serve)
    up = Upstream(theirs)
    await write_frame(theirs, greedy(1, 1))
    assert isinstance(await up.reply(), Ack)
    await theirs.send_all(b"\xff" * 64)  # not a frame
    reply = await up.reply()
    assert isinstance(reply, ErrorReply)
    with trio.fail_after(2):
        while core.sessions.live:
            await trio.sleep(0.01)
    assert core.released == [1]


# ---------------------------------------------------------------------------- media rows


def image_rows(pos_start: int, lo: int, hi: int, *, last: bool, causal: bool = True) -> PrefillChunk:
    """Rows [lo, hi) of an M-RoPE image of 3x2 rows at `pos_start` (it takes 3 positions, with its last rows)."""
    pos = np.array([[pos_start] * 6, [pos_start + i // 3 for i in range(6)],
                    [pos_start + i % 3 for i in range(6)], [0] * 6])[:, lo:hi]
    end = pos_start + 3 if last else pos_start
    media = MediaRows(pos, end, [-7, -8, -9][:end - pos_start], causal=causal)
    return PrefillChunk(lo + 10, 5, pos_start, [NO_TOKEN] * (hi - lo), rows(hi - lo), final=last, media=media)


async def test_media_rows_are_computed_at_their_positions_and_take_theirs():
    core, h, up = final_stage()
    await h.dispatch(greedy(1, 5))
    await up.reply()
    await h.dispatch(PrefillChunk(2, 5, 0, [3, 4], rows(2)))
    await up.reply()
    session = core.sessions.get(1, 5)
    await h.dispatch(image_rows(2, 0, 4, last=False))  # the image's first rows: no position taken yet
    assert isinstance(await up.reply(), Ack) and session.position == 2
    job = core.scheduler.jobs[-1]
    assert job.solo and job.positions.shape == (4, 4) and job.causal and job.tokens is None
    await h.dispatch(image_rows(2, 4, 6, last=True))  # its last rows: the image's 3 positions
    assert isinstance(await up.reply(), PredictedToken) and session.position == 5
    assert session.held_keys().tolist() == [3, 4, -7, -8, -9]  # what a prefix cache would key them by
    assert core.context.trims == []
    await h.dispatch(DecodeStep(3, 5, 5, [TOKEN], rows(1)))  # decoding goes on at the prompt's positions
    assert isinstance(await up.reply(), PredictedToken) and session.position == 6


async def test_media_rows_this_model_cannot_take_are_refused():
    core, h, up = final_stage()
    await h.dispatch(greedy(1, 5))
    await up.reply()
    one_each = MediaRows(np.arange(3).reshape(1, 3), 3, [-1, -2, -3])
    await h.dispatch(PrefillChunk(2, 5, 0, [NO_TOKEN] * 3, rows(3), final=True, media=one_each))
    reply = await up.reply()
    assert isinstance(reply, ErrorReply) and reply.code == ErrorCode.UNSUPPORTED_REQUEST
    assert "takes 4 per row" in reply.message
    # rows that attend both ways are computed in one batch: more than this stage's (16) are refused
    n = 18
    both_ways = MediaRows(np.zeros((4, n), np.int32), 1, [-1], causal=False)
    await h.dispatch(PrefillChunk(3, 5, 0, [NO_TOKEN] * n, rows(n), final=True, media=both_ways))
    reply = await up.reply()
    assert isinstance(reply, ErrorReply) and reply.code == ErrorCode.UNSUPPORTED_REQUEST
    assert "batch of 16" in reply.message
    assert core.scheduler.jobs == []


async def test_a_middle_stage_forwards_media_rows_with_their_positions():
    core, h, up, down = middle_stage()
    await h.dispatch(greedy(1, 5))
    await up.reply()
    await h.dispatch(image_rows(0, 0, 6, last=True, causal=False))
    await up.reply()
    (how, forwarded), = [(how, msg) for how, msg in down.sent if isinstance(msg, PrefillChunk)]
    assert forwarded.media == image_rows(0, 0, 6, last=True, causal=False).media
    assert np.array_equal(forwarded.activation, image_rows(0, 0, 6, last=True).activation * 2)
    assert not core.scheduler.jobs[-1].causal
