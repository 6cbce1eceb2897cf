"""Verify windows (speculative decoding) on every stage: real libllama, real stage servers on loopback.

The test plays the head: it runs the real stage-0 slice (one KV sequence per session) and sends what a head
sends (ConfigureGeneration, PrefillChunk, DecodeStep, VerifyWindow) to stage 1, an in-process StageServer
(2 stages: the final one; 3 stages: a middle one, which forwards to the final stage's server), and once to
real skippyd processes of stages 1 and 2. The runtime (Context.sample_window) and the batch policy and
execution are tested directly too.

Greedy choices of the tiny random model are often close (logit margins of 1e-3), and computing a position
alone or inside a larger batch rounds differently (ULPs of the logits: ~1e-6 here). A window's tokens can
equal the single steps' only where no choice is within that rounding of a tie, so the prompt is picked
among a few whose reference run (the whole model, one position at a time) has no choice closer than
TIE: then windows and single steps must agree exactly, and do.
"""

from __future__ import annotations

import itertools
from pathlib import Path

import attrs
import numpy as np
import pytest
import trio

from skippyd.head.token_return import TokenReturnHub
from skippyd.runtime.llama import Context, ContextParams, GuidedSampler, InvalidArgumentError, Model, Sampler
from skippyd.sampling import Constraint
from skippyd.stage.batching import BatchPolicy, decode_steps
from skippyd.stage.downstream import DownstreamLink
from skippyd.stage.execution import Job
from skippyd.stage.scheduler import Scheduler
from skippyd.stage.server import StageConfig, StageServer
from skippyd.topology import Topology
from skippyd.wire.messages import (
    Ack,
    ConfigureGeneration,
    DecodeStep,
    ErrorCode,
    ErrorReply,
    Hello,
    PredictedToken,
    PredictedTokens,
    PrefillChunk,
    SamplingParams,
    Stop,
    Stopped,
    VerifyWindow,
)
from tests.procs import Pipeline, split_for_test

N_CTX = 64
TIE = 1e-4  # logits closer than this are a near tie: batch and single-row rounding could order them either way
PROMPTS = ["The capital of France is", "Once upon a time", "Hello world, this is", "In the beginning",
           "A quick brown fox", "Numbers: one two three"]
N_REF = 14  # tokens of the reference run (prefill's, then single steps')
GREEDY = SamplingParams.greedy()


@pytest.fixture(scope="module")
def split2(tiny_model_small_vocab_path, tmp_path_factory):
    return split_for_test(tiny_model_small_vocab_path, 2, tmp_path_factory.mktemp("vw-split2"))


@pytest.fixture(scope="module")
def split3_path(tiny_model_small_vocab_path, tmp_path_factory) -> Path:
    work = tmp_path_factory.mktemp("vw-split3")
    split_for_test(tiny_model_small_vocab_path, 3, work)
    return work / "topology.toml"


@pytest.fixture(scope="module")
def split3(split3_path):
    return Topology.load(split3_path)


@pytest.fixture(scope="module")
def reference(tiny_model_small_vocab_path):
    """(prompt tokens, greedy tokens) of the whole model one position at a time, for a prompt with no near tie."""
    with Model(tiny_model_small_vocab_path) as model, \
            Context(model, ContextParams(n_ctx_per_seq=N_CTX, n_seq_max=1, n_threads=1)) as ctx:
        for text in PROMPTS:
            prompt = model.tokenize(text, add_special=True, parse_special=False)
            ctx.kv_clear_seq(0)
            ctx.decode(np.arange(len(prompt)), np.zeros(len(prompt)), tokens=prompt)
            tokens, margins = [], []
            while len(tokens) < N_REF:
                logits = np.sort(ctx.logits(0))
                margins.append(float(logits[-1] - logits[-2]))
                tokens.append(int(ctx.logits(0).argmax()))
                ctx.decode_row(len(prompt) + len(tokens) - 1, 0, token=tokens[-1])
            if min(margins) > TIE:
                return prompt, tokens
    pytest.fail(f"every prompt's greedy run has a choice within {TIE} of a tie")


def config(**kw) -> StageConfig:
    return StageConfig(**{"n_ctx_per_seq": N_CTX, "lanes": 4, "n_batch": 64, "n_threads": 1,
                          "listen_host": "127.0.0.1", "listen_port": 0, **kw})


def stage_hello(topology, k: int) -> Hello:
    spec = topology.stage(k)
    return Hello(fingerprint=topology.source_sha256, stage_index=k, layer_start=spec.layer_start,
                 layer_end=spec.layer_end, n_layer=topology.n_layer, n_embd=topology.n_embd, node=f"test-{k}")


class Head:
    """Stage 0 in the test process: the real stage-0 slice, one KV sequence per session (by its id)."""

    def __init__(self, topology):
        self.topology = topology
        self.model = Model(topology.stage(0).file)
        self.ctx = Context(self.model, ContextParams(n_ctx_per_seq=N_CTX, n_seq_max=4, n_threads=1))
        self.ids = itertools.count(100)

    def close(self) -> None:
        self.ctx.close()
        self.model.close()

    def hidden(self, seq: int, tokens, pos: int) -> np.ndarray:
        """Stage 0's hidden states of `tokens` at [pos, pos + n), after trimming the sequence to pos (as a head
        does after rejected drafts), computed as one batch."""
        tokens = np.asarray(tokens, dtype=np.int32)
        self.ctx.kv_trim(seq, pos)
        self.ctx.decode(np.arange(pos, pos + len(tokens), dtype=np.int32), np.full(len(tokens), seq, np.int32),
                        tokens=tokens)
        return self.ctx.hidden()

    async def connect(self, server: StageServer) -> DownstreamLink:
        return await DownstreamLink.connect("127.0.0.1", server.port, stage_hello(self.topology, 0))

    async def open(self, link, sid: int, prompt, sampling: SamplingParams = GREEDY, *,
                   direct_return: bool = False):
        """Configure and prefill session `sid` (sequence sid here); the final chunk's reply."""
        reply, *_ = await link.request(ConfigureGeneration(next(self.ids), sid, sampling, direct_return=direct_return))
        assert isinstance(reply, Ack), reply
        return await self.request(link, PrefillChunk(next(self.ids), sid, 0, prompt, self.hidden(sid, prompt, 0),
                                                     final=True))

    def step(self, sid: int, token: int, pos: int) -> DecodeStep:
        return DecodeStep(next(self.ids), sid, pos, [token], self.hidden(sid, [token], pos))

    def window(self, sid: int, tokens, pos: int, request_id: int | None = None) -> VerifyWindow:
        return VerifyWindow(request_id or next(self.ids), sid, pos, np.asarray(tokens, np.int32),
                            self.hidden(sid, tokens, pos))

    @staticmethod
    async def request(link, msg):
        reply, *_ = await link.request(msg)
        return reply

    async def plain(self, link, sid: int, prompt, n: int, sampling: SamplingParams = GREEDY):
        """A non-speculative generation of `n` tokens (prefill, then single steps), then Stop."""
        reply = await self.open(link, sid, prompt, sampling)
        assert isinstance(reply, PredictedToken), reply
        out = [reply.token]
        while len(out) < n:
            reply = await self.request(link, self.step(sid, out[-1], len(prompt) + len(out) - 1))
            assert isinstance(reply, PredictedToken), reply
            out.append(reply.token)
        assert isinstance(await self.request(link, Stop(next(self.ids), sid)), Stopped)
        return out


@pytest.fixture
def head2(split2):
    head = Head(split2)
    yield head
    head.close()


@pytest.fixture
def head3(split3):
    head = Head(split3)
    yield head
    head.close()


@pytest.fixture
async def final2(split2, nursery):
    """Stage 1 of 2 (the final stage), in-process."""
    return await nursery.start(StageServer(split2, 1, config()).run)


async def start3(split3, nursery, **final_config):
    """Stages 1 (middle) and 2 (final) of 3, in-process, on the topology's ports; (middle, final)."""
    final = await nursery.start(StageServer(split3, 2, config(listen_port=split3.stage(2).port, **final_config)).run)
    middle = await nursery.start(StageServer(split3, 1, config(listen_port=split3.stage(1).port)).run)
    return middle, final


def window_tokens(reply) -> list[int]:
    assert isinstance(reply, PredictedTokens), reply
    return reply.tokens.tolist()


def position(server: StageServer, sid: int) -> int:
    (session,) = [s for s in server.snapshot()["sessions"] if s["session_id"] == sid]
    return session["position"]


async def speculate(head: Head, link, sid: int, prompt, ref: list[int], stages: list[StageServer] = ()) -> None:
    """The greedy speculative run checked against the reference `ref`: a window of drafts equal to the
    reference accepts every draft; a window whose 2nd draft is wrong accepts one and gives the reference's
    token; the next decode step, at the position after the accepted tokens (every stage holds the rejected
    ones, and trims them), and the steps after it go on as the reference."""
    reply = await head.open(link, sid, prompt)
    assert isinstance(reply, PredictedToken) and reply.token == ref[0], reply
    p = len(prompt)
    got = window_tokens(await head.request(link, head.window(sid, ref[0:4], p)))
    assert got == ref[1:5]  # the 3 drafts accepted, then the next token
    for server in stages:
        assert position(server, sid) == p + 4
    wrong = (ref[6] + 1) % 512
    got = window_tokens(await head.request(link, head.window(sid, [ref[4], ref[5], wrong, ref[7]], p + 4)))
    assert got == ref[5:7]  # 1 draft accepted, then the target's own token
    for server in stages:
        assert position(server, sid) == p + 8  # the window's every position, until the head trims
    out = ref[:7]
    while len(out) < len(ref):
        reply = await head.request(link, head.step(sid, out[-1], p + len(out) - 1))
        assert isinstance(reply, PredictedToken), reply
        out.append(reply.token)
    assert out == ref
    for server in stages:
        assert position(server, sid) == p + len(ref) - 1
    assert isinstance(await head.request(link, Stop(next(head.ids), sid)), Stopped)


# ---------------------------------------------------------------------------- the runtime


@pytest.fixture
def whole(tiny_model_small_vocab_path):
    """The whole tiny model: a first and final stage (token ids in, logits out), 2 sequences."""
    with Model(tiny_model_small_vocab_path) as model, \
            Context(model, ContextParams(n_ctx_per_seq=N_CTX, n_seq_max=2, n_threads=1)) as ctx:
        yield ctx


def prefill(ctx: Context, seq: int, prompt) -> None:
    ctx.kv_clear_seq(seq)
    ctx.decode(np.arange(len(prompt)), np.full(len(prompt), seq), tokens=prompt)


def test_sample_window_greedy_and_chain_follow_the_rows_while_drafts_match(whole, reference):
    prompt, ref = reference
    p = len(prompt)
    # two windows in one batch: sequence 0 with every draft right, 1 with its 2nd draft wrong
    prefill(whole, 0, prompt)
    prefill(whole, 1, prompt)
    right = np.array(ref[0:5], np.int32)
    wrong = np.array([ref[0], ref[1], (ref[2] + 1) % 512, ref[3]], np.int32)
    whole.decode(np.concatenate([np.arange(p, p + 5), np.arange(p, p + 4)]), np.array([0] * 5 + [1] * 4),
                 tokens=np.concatenate([right, wrong]), windows=[0, 1])
    assert whole.sample_window(0, None, right) == ref[1:6]
    assert whole.sample_window(1, None, wrong) == ref[1:3]
    # a llama.cpp chain accepts every token it samples: the same seed over the same rows gives the same tokens,
    # and a greedy chain (after penalties of 1.0) is the argmax
    greedy_chain = Sampler(whole.model, SamplingParams(temperature=0.0, repeat_penalty=1.0, top_k=1))
    assert whole.sample_window(0, greedy_chain, right) == ref[1:6]
    seeded = SamplingParams(temperature=1.0, seed=99)
    first = whole.sample_window(0, Sampler(whole.model, seeded), right)
    assert whole.sample_window(0, Sampler(whole.model, seeded), right) == first and 1 <= len(first) <= 5
    # a guided sampler without a constraint samples as greedy
    assert whole.sample_window(0, GuidedSampler(whole.model, SamplingParams.greedy()), right) == ref[1:6]


def test_sample_window_refuses_what_was_not_a_window(whole, reference):
    prompt, ref = reference
    p = len(prompt)
    prefill(whole, 0, prompt)
    with pytest.raises(InvalidArgumentError, match="verify window"):
        whole.sample_window(0, None, prompt[-1:])  # a prefill, not a window
    with pytest.raises(InvalidArgumentError, match="no row in the batch"):
        whole.decode(np.arange(p, p + 2), np.zeros(2), tokens=np.array(ref[0:2], np.int32), windows=[1])
    whole.kv_trim(0, p)
    whole.decode(np.arange(p, p + 2), np.zeros(2), tokens=np.array(ref[0:2], np.int32), windows=[0])
    with pytest.raises(InvalidArgumentError, match="3 tokens for a window of 2 rows"):
        whole.sample_window(0, None, ref[0:3])
    whole.decode_row(p + 2, 0, token=ref[2])  # a decode step after it: the window's rows are gone
    with pytest.raises(InvalidArgumentError, match="verify window"):
        whole.sample_window(0, None, ref[0:2])


async def test_window_jobs_batch_with_decode_steps_and_are_sampled_as_windows(whole, reference):
    """The batch policy takes verify windows as decode steps (several sessions' in one batch, before any
    prefill chunk), the execution computes them in one llama_decode and samples each as a window, and the
    sessions count as decoding."""
    prompt, ref = reference
    p = len(prompt)
    prefill(whole, 0, prompt)
    prefill(whole, 1, prompt)
    scheduler = Scheduler(whole, adapt_threads=False)

    def window(seq: int, tokens) -> Job:
        tokens = np.array(tokens, np.int32)
        return Job(seq, p, tokens=tokens, embd=None, want_token=True, window=True, window_tokens=tokens)

    a, b = window(0, ref[0:4]), window(1, [ref[0], (ref[1] + 1) % 512])
    chunk = Job(1, 0, tokens=np.ones(8, np.int32), embd=None)  # another sequence's prefill chunk (not computed)

    @attrs.frozen
    class Step:  # a decode step of a third session, as the policy sees it
        seq: int
        n: int = 1

    policy = BatchPolicy(max_batch_tokens=64)
    assert decode_steps([a, b, chunk]) == {0, 1}
    taken = policy.take([chunk, b, a, Step(5)])
    assert [(j.seq, j.n) for j in taken] == [(0, 4), (1, 2), (5, 1)]  # the chunk's sequence has a window
    assert [(j.seq, j.n) for j in policy.take([chunk, a])] == [(0, 4), (1, 8)]  # chunks go after windows
    assert [j.seq for j in BatchPolicy(max_batch_tokens=5).take([a, b])] == [1]  # while they fit, smallest first
    decoded = []
    scheduler.execution._on_decoded = decoded.append
    await scheduler.execution.compute([a, b])
    assert a.error is None and b.error is None, (a.error, b.error)
    assert a.result == ref[1:5] and b.result == [ref[1]]
    assert scheduler.stats.multi_seq_batches == 1 and scheduler.stats.max_batch_seqs == 2
    assert scheduler.stats.tokens == 6 and scheduler.stats.decode_batches == 0
    assert decoded == [{0, 1}]
    assert not scheduler.execution.inline_turn([window(0, ref[0:1])])  # a window is never the one-row path


# ---------------------------------------------------------------------------- greedy


async def test_two_stages_greedy_window_accepts_drafts_and_the_next_step_trims(head2, final2, reference):
    prompt, ref = reference
    link = await head2.connect(final2)
    assert await head2.plain(link, 1, prompt, len(ref)) == ref  # the pipeline's plain run is the reference
    await speculate(head2, link, 2, prompt, ref, [final2])
    # a window of the current token alone (no draft) is a decode step: its one prediction
    reply = await head2.open(link, 3, prompt)
    assert window_tokens(await head2.request(link, head2.window(3, [ref[0]], len(prompt)))) == [ref[1]]
    # every draft up to the last accepted: at most len(tokens) predictions
    got = window_tokens(await head2.request(link, head2.window(3, ref[1:9], len(prompt) + 1)))
    assert got == ref[2:10] and len(got) == 8
    assert reply.token == ref[0]
    await link.aclose()


async def test_three_stages_middle_stage_relays_windows(head3, split3, nursery, reference):
    prompt, ref = reference
    middle, final = await start3(split3, nursery)
    link = await head3.connect(middle)
    assert await head3.plain(link, 1, prompt, len(ref)) == ref
    await speculate(head3, link, 2, prompt, ref, [middle, final])
    await link.aclose()


async def test_three_stages_direct_return_windows(head3, split3, nursery, reference):
    """A direct-return session's window: the final stage answers on the token-return connection to the
    head (here a TokenReturnHub on stage 0's port), the lane gets Acks (the middle stage's, at once)."""
    prompt, ref = reference
    hub = TokenReturnHub(stage_hello(split3, 0), read_deadline=10.0)
    await nursery.start(hub.serve, "127.0.0.1", split3.stage(0).port)
    middle, final = await start3(split3, nursery, direct_return=True)
    link = await head3.connect(middle)
    sid = 3
    returns = hub.open_session(sid, 1)
    reply, *_ = await link.request(ConfigureGeneration(1, sid, SamplingParams.greedy(), direct_return=True))
    assert isinstance(reply, Ack), reply
    msg = PrefillChunk(1, sid, 0, prompt, head3.hidden(sid, prompt, 0), final=True)
    assert isinstance(await head3.request(link, msg), Ack)
    with trio.fail_after(5):
        first = await returns.receive()
    assert isinstance(first, PredictedToken) and first.token == ref[0], first
    p = len(prompt)
    assert isinstance(await head3.request(link, head3.window(sid, ref[0:4], p, request_id=1)), Ack)
    with trio.fail_after(5):
        assert window_tokens(await returns.receive()) == ref[1:5]
    wrong = (ref[6] + 1) % 512
    assert isinstance(await head3.request(link, head3.window(sid, [ref[4], ref[5], wrong], p + 4, request_id=1)),
                      Ack)
    with trio.fail_after(5):
        assert window_tokens(await returns.receive()) == ref[5:7]
    assert position(final, sid) == p + 7
    # the next step (relayed through the lane's acks, its prediction on the return connection) trims there
    step = DecodeStep(1, sid, p + 6, [ref[6]], head3.hidden(sid, [ref[6]], p + 6))
    assert isinstance(await head3.request(link, step), Ack)
    with trio.fail_after(5):
        step = await returns.receive()
    assert isinstance(step, PredictedToken) and step.token == ref[7], step
    assert hub.stats.tokens == 4
    # only the decode step went the path that owes no lane reply; the windows were acked on the lane
    assert final.snapshot()["returns_only"]["answered"] == 1
    assert isinstance(await head3.request(link, Stop(2, sid)), Stopped)
    await link.aclose()


@pytest.mark.slow
async def test_three_stage_daemons_verify_windows(head3, split3, split3_path, tmp_path, reference):
    """The same through real skippyd processes (stages 1 and 2 of 3; the test is stage 0)."""
    prompt, ref = reference
    pipe = Pipeline(split3_path, tmp_path)
    try:
        for k in (2, 1):
            await pipe.astart_stage(k)
        link = await DownstreamLink.connect(split3.stage(1).host, split3.stage(1).port, stage_hello(split3, 0))
        assert await head3.plain(link, 1, prompt, len(ref)) == ref
        await speculate(head3, link, 2, prompt, ref)
        await link.aclose()
        await pipe.wait_all_released(5.0)
    finally:
        pipe.stop_cleanly()


# ---------------------------------------------------------------------------- seeded sampling


async def test_seeded_sampling_window_consumes_the_rng_as_single_steps(head2, final2, reference):
    """A window of the tokens a plain seeded run produced accepts them all, and the next token (and the one
    after, by a decode step) is the plain run's: each row's sampling took the chain's RNG (and penalties)
    exactly as the single steps did."""
    prompt, _ = reference
    sampling = SamplingParams(temperature=1.5, top_k=40, repeat_penalty=1.1, seed=1234)
    link = await head2.connect(final2)
    plain = await head2.plain(link, 1, prompt, 10, sampling)
    again = await head2.plain(link, 1, prompt, 10, sampling)
    assert plain == again  # seeded: a run is reproducible
    reply = await head2.open(link, 2, prompt, sampling)
    assert reply.token == plain[0]
    p = len(prompt)
    assert window_tokens(await head2.request(link, head2.window(2, plain[0:6], p))) == plain[1:7]
    reply = await head2.request(link, head2.step(2, plain[6], p + 6))
    assert isinstance(reply, PredictedToken) and reply.token == plain[7]
    # a rejected draft: the sampled token is the plain run's too, and the RNG goes on as the plain run's
    wrong = (plain[8] + 1) % 512
    assert window_tokens(await head2.request(link, head2.window(2, [plain[7], wrong], p + 7))) == [plain[8]]
    reply = await head2.request(link, head2.step(2, plain[8], p + 8))
    assert isinstance(reply, PredictedToken) and reply.token == plain[9]
    await link.aclose()


async def test_constrained_window_matches_its_plain_run(head2, final2, reference):
    """A session with a constraint (a guided sampler on the final stage): the matcher takes the window's
    current token before the compute and each accepted draft before the next row, so a window of a plain
    run's tokens is accepted whole; a draft the grammar forbids is rejected and the matcher never took it
    (the next decode step samples as the plain run did)."""
    prompt, _ = reference
    sampling = SamplingParams(temperature=1.0, seed=7, constraint=Constraint.grammar("root ::= [a-z]+"))
    link = await head2.connect(final2)
    plain = await head2.plain(link, 1, prompt, 8, sampling)
    assert all(head2.model.detokenize([t]).isalpha() for t in plain[:4]), plain
    assert (await head2.open(link, 2, prompt, sampling)).token == plain[0]
    p = len(prompt)
    assert window_tokens(await head2.request(link, head2.window(2, plain[0:4], p))) == plain[1:5]
    (digit,) = head2.model.tokenize("7", add_special=False, parse_special=False)
    assert window_tokens(await head2.request(link, head2.window(2, [plain[4], int(digit)], p + 4))) == [plain[5]]
    reply = await head2.request(link, head2.step(2, plain[5], p + 5))
    assert isinstance(reply, PredictedToken) and reply.token == plain[6], reply
    await link.aclose()


# ---------------------------------------------------------------------------- batching


async def test_windows_of_several_sessions_compute_in_one_batch(head2, final2, reference):
    """Two sessions' windows queued together go into one llama_decode (the scheduler counts multi-sequence
    batches), and each session's answer is its own."""
    prompt, ref = reference
    links = [await head2.connect(final2), await head2.connect(final2)]
    for sid, link in enumerate(links, 1):
        assert (await head2.open(link, sid, prompt)).token == ref[0]
    stats = final2.scheduler.stats
    before = stats.multi_seq_batches
    p = len(prompt)
    answers: dict[int, list[int]] = {}
    windows = {sid: head2.window(sid, ref[0:4], p) for sid in (1, 2)}

    async def one(sid: int) -> None:
        answers[sid] = window_tokens(await head2.request(links[sid - 1], windows[sid]))

    # both frames go out before either reply is read: the stage reads both, then its scheduler batches them
    async with trio.open_nursery() as nursery:
        for sid in (1, 2):
            nursery.start_soon(one, sid)
    assert answers == {1: ref[1:5], 2: ref[1:5]}
    # and once more, with different windows (one rejects a draft)
    windows = {1: head2.window(1, ref[4:8], p + 4), 2: head2.window(2, [ref[4], ref[5], (ref[6] + 1) % 512], p + 4)}
    async with trio.open_nursery() as nursery:
        for sid in (1, 2):
            nursery.start_soon(one, sid)
    assert answers == {1: ref[5:9], 2: ref[5:7]}
    # the two frames reach the stage at once, but its scheduler may start on the first before it reads the
    # second (a busy host): the same windows again (at the same positions: the stage trims) until they share
    # a batch
    for _ in range(20):
        if stats.multi_seq_batches > before:
            break
        async with trio.open_nursery() as nursery:
            for sid in (1, 2):
                nursery.start_soon(one, sid)
        assert answers == {1: ref[5:9], 2: ref[5:7]}
    assert stats.multi_seq_batches > before, stats
    for link in links:
        await link.aclose()


# ---------------------------------------------------------------------------- errors


async def test_bad_windows_get_clear_errors_and_the_lane_goes_on(head2, final2, reference):
    prompt, ref = reference
    link = await head2.connect(final2)
    n_embd = final2.topology.n_embd
    p = len(prompt)
    act = np.zeros((2, n_embd), dtype=np.float32)
    reply = await head2.request(link, VerifyWindow(1, 77, 0, [1, 2], act))
    assert isinstance(reply, ErrorReply) and reply.code == ErrorCode.UNKNOWN_SESSION, reply
    assert (await head2.open(link, 1, prompt)).token == ref[0]
    reply = await head2.request(link, VerifyWindow(2, 1, p, [ref[0], 5]))
    assert isinstance(reply, ErrorReply) and reply.code == ErrorCode.MISSING_ACTIVATION, reply
    reply = await head2.request(link, VerifyWindow(3, 1, p + 1, [ref[0], 5], act))
    assert isinstance(reply, ErrorReply) and reply.code == ErrorCode.POSITION_GAP, reply
    # the session is where it was: a window there works
    assert window_tokens(await head2.request(link, head2.window(1, ref[0:3], p))) == ref[1:4]
    # a session configured with logprobs is never sent windows: refused, clearly
    reply, *_ = await link.request(ConfigureGeneration(5, 2, SamplingParams(logprobs=2)))
    assert isinstance(reply, Ack)
    reply = await head2.request(link, VerifyWindow(6, 2, 0, [1, 2], act))
    assert isinstance(reply, ErrorReply) and reply.code == ErrorCode.UNSUPPORTED_REQUEST and "logprobs" in reply.message
    # a refused request, not a broken lane: the connection goes on
    assert window_tokens(await head2.request(link, head2.window(1, ref[3:5], p + 3))) == ref[4:6]
    await link.aclose()


async def test_a_window_beyond_the_context_is_refused(final2):
    """A window whose last position is past the session's context: CONTEXT_FULL; one that ends at the
    context's end is computed."""
    link = await DownstreamLink.connect("127.0.0.1", final2.port, stage_hello(final2.topology, 0))
    n_embd, n_ctx = final2.topology.n_embd, final2.context.n_ctx_seq
    reply, *_ = await link.request(ConfigureGeneration(1, 1, SamplingParams.greedy()))
    assert isinstance(reply, Ack)
    held = n_ctx - 2
    for lo in range(0, held, 64):
        n = min(64, held - lo)
        chunk = PrefillChunk(2, 1, lo, [1] * n, np.zeros((n, n_embd), np.float32), final=lo + n == held)
        if lo + n < held:
            await link.send_deferred(chunk)
        else:
            assert isinstance(await Head.request(link, chunk), PredictedToken)
    reply = await Head.request(link, VerifyWindow(3, 1, held, [1, 2, 3], np.zeros((3, n_embd), np.float32)))
    assert isinstance(reply, ErrorReply) and reply.code == ErrorCode.CONTEXT_FULL, reply
    reply = await Head.request(link, VerifyWindow(4, 1, held, [1, 2], np.zeros((2, n_embd), np.float32)))
    assert isinstance(reply, PredictedTokens) and 1 <= len(reply.tokens) <= 2, reply
    assert position(final2, 1) == n_ctx
    await link.aclose()


async def test_a_window_larger_than_the_stage_batch_is_refused(head2, split2, nursery, reference):
    """More tokens than the stage's batch: the frame is refused by the stage's wire limits (a protocol
    error), never queued for a batch it cannot fit in; a new connection is served."""
    prompt, ref = reference
    server = await nursery.start(StageServer(split2, 1, config(n_batch=16)).run)
    link = await head2.connect(server)
    assert (await head2.open(link, 1, prompt)).token == ref[0]
    n_embd = split2.n_embd
    reply = await head2.request(link, VerifyWindow(2, 1, len(prompt), [1] * 17, np.zeros((17, n_embd), np.float32)))
    assert isinstance(reply, ErrorReply) and reply.code == ErrorCode.FRAME_TOO_LARGE, reply
    await link.aclose()
    link = await head2.connect(server)
    assert (await head2.open(link, 1, prompt)).token == ref[0]
    assert window_tokens(await head2.request(link, head2.window(1, ref[0:3], len(prompt)))) == ref[1:4]
    await link.aclose()


async def test_a_window_whose_activation_has_the_wrong_width_is_a_protocol_error(head2, final2, reference):
    """Hidden states of another width than the handshake's: the frame's length disagrees with its header, a
    protocol error (the stage answers it and closes that connection only)."""
    prompt, ref = reference
    link = await head2.connect(final2)
    n_embd = final2.topology.n_embd
    reply = await head2.request(link, VerifyWindow(1, 1, 0, [1, 2], np.zeros((2, n_embd - 1), np.float32)))
    assert isinstance(reply, ErrorReply) and reply.code < 32, reply
    await link.aclose()
    other = await head2.connect(final2)
    assert (await head2.open(other, 1, prompt)).token == ref[0]
    assert window_tokens(await head2.request(other, head2.window(1, ref[0:2], len(prompt)))) == ref[1:3]
    await other.aclose()


# ---------------------------------------------------------------------------- steps and windows round alike
@pytest.mark.parametrize("plan", [[1, 1, 1, 1, 1, 1], [1, 1, 4], [2, 1, 1, 2], [1, 5]])
def test_a_decode_step_computes_the_bits_of_the_same_row_in_a_window(default_model_path, plan):
    """One row and several go through the same attention kernels (native/patches/0006): positions computed
    as decode steps, as a window's rows or in any mix hold the same KV, bit for bit, and give the same logits,
    so a window's verdicts are the token-by-token loop's, not just up to a near-tie."""
    model = Model(default_model_path)
    prompt = model.tokenize("Write a short story about a lighthouse keeper who finds a message in a bottle. " * 3)
    following = [int(t) for t in model.tokenize(" The keeper read it twice.", add_special=False)[:6]]
    n = len(prompt)

    def compute(sizes: list[int]) -> tuple[bytes, np.ndarray]:
        """The KV the sequence holds after ``following`` in computes of ``sizes`` rows, and the last row's
        logits."""
        ctx = Context(model, ContextParams(n_ctx_per_seq=512, n_seq_max=1, n_threads=2))
        try:
            ctx.decode(np.arange(n), np.zeros(n), tokens=prompt)
            p = n
            for size in sizes:
                rows = following[p - n:p - n + size]
                if size == 1:
                    ctx.decode_row(p, 0, token=rows[0])
                else:
                    ctx.decode(np.arange(p, p + size), np.zeros(size), tokens=np.array(rows), windows=[0])
                p += size
            return bytes(ctx.state_export(0)), ctx.logits(0)
        finally:
            ctx.close()

    want_state, want_logits = compute([6])
    state, logits = compute(plan)
    assert state == want_state
    assert np.array_equal(logits, want_logits)


# ---------------------------------------------------------------------------- windows in flight


async def send_behind(head: Head, link, sid: int, windows: list[tuple[list[int], int, bool]]) -> list[list[int]]:
    """Send every window (tokens, position, chained) before reading any answer, as a head keeps windows in
    flight; their answers, in order."""
    for tokens, pos, chained in windows:
        msg = head.window(sid, tokens, pos)
        await link.begin(attrs.evolve(msg, chained=chained))
    answers = []
    for _ in windows:
        reply, _wait = await link.finish()
        answers.append(window_tokens(reply))
    return answers


def wrong(token: int) -> int:
    return (token + 1) % 512


# where the window ahead's rejection is: its first draft, a middle one, or after its last (every draft accepted,
# the next token other than the chained window's first)
REJECTED_AT = {
    "first row": (lambda ref: [ref[0], wrong(ref[1]), ref[2], ref[3]], 1),
    "middle row": (lambda ref: [ref[0], ref[1], wrong(ref[2]), ref[3]], 2),
    "last row": (lambda ref: [ref[0], ref[1], ref[2], ref[3]], 4),
}


@pytest.mark.parametrize("where", list(REJECTED_AT))
async def test_windows_behind_a_rejection_are_dropped_unsampled_and_the_next_step_goes_on(head2, final2, reference,
                                                                                         where):
    """Two chained windows behind one with a rejection: the final stage answers each with no tokens, without
    computing it (its position stays the first window's end); the next window, at the position the first
    answer confirmed, trims there and gives the reference's tokens."""
    prompt, ref = reference
    link = await head2.connect(final2)
    sid, p = 1, len(prompt)
    assert (await head2.open(link, sid, prompt)).token == ref[0]
    first, accepted = REJECTED_AT[where]
    chained_first = wrong(ref[4]) if where == "last row" else ref[4]  # "last row": the guess of ref[4] is wrong
    answers = await send_behind(head2, link, sid, [(first(ref), p, False),
                                                   ([chained_first, ref[5], ref[6]], p + 4, True),
                                                   ([ref[7], ref[8]], p + 7, True)])
    assert answers == [ref[1:1 + accepted], [], []]
    assert position(final2, sid) == p + 4  # the first window's rows only: the dropped ones were never computed
    assert final2.snapshot()["windows_dropped"] == 2
    confirmed = p + accepted
    got = window_tokens(await head2.request(link, head2.window(sid, ref[accepted:accepted + 4], confirmed)))
    assert got == ref[accepted + 1:accepted + 5]
    assert position(final2, sid) == confirmed + 4
    assert isinstance(await head2.request(link, Stop(next(head2.ids), sid)), Stopped)
    await link.aclose()


async def test_chained_windows_that_follow_are_computed_as_if_sent_after_the_answer(head2, final2, reference):
    """Windows sent behind one another, each drafted as if the one ahead were accepted in full, give the
    reference's tokens when it is: the same as one window after another."""
    prompt, ref = reference
    link = await head2.connect(final2)
    sid, p = 2, len(prompt)
    assert (await head2.open(link, sid, prompt)).token == ref[0]
    answers = await send_behind(head2, link, sid, [(ref[0:4], p, False), (ref[4:7], p + 4, True),
                                                   (ref[7:10], p + 7, True)])
    assert answers == [ref[1:5], ref[5:8], ref[8:11]]
    assert final2.snapshot()["windows_dropped"] == 0
    # a chained window at another position than the answer's end is dropped too, even with the right token
    assert await send_behind(head2, link, sid, [([ref[10], ref[11]], p + 9, True)]) == [[]]
    assert position(final2, sid) == p + 10
    assert isinstance(await head2.request(link, Stop(next(head2.ids), sid)), Stopped)
    await link.aclose()


async def test_three_stages_the_middle_stage_computes_chained_windows_and_the_final_stage_drops_them(
        head3, split3, nursery, reference):
    prompt, ref = reference
    middle, final = await start3(split3, nursery)
    link = await head3.connect(middle)
    sid, p = 3, len(prompt)
    assert (await head3.open(link, sid, prompt)).token == ref[0]
    answers = await send_behind(head3, link, sid, [([ref[0], ref[1], wrong(ref[2])], p, False),
                                                   ([ref[3], ref[4]], p + 3, True)])
    assert answers == [ref[1:3], []]
    assert position(middle, sid) == p + 5 and position(final, sid) == p + 3
    got = window_tokens(await head3.request(link, head3.window(sid, ref[2:5], p + 2)))
    assert got == ref[3:6]
    assert position(middle, sid) == position(final, sid) == p + 5
    assert isinstance(await head3.request(link, Stop(next(head3.ids), sid)), Stopped)
    await link.aclose()
