"""The libllama runtime: real libllama, real model files, no mocks."""

from __future__ import annotations

import ctypes
import errno
import fcntl
import math
import os
import platform
import socket
import time
from pathlib import Path

import numpy as np
import pytest

import skippyd._native
from skippyd.runtime.llama import (
    ClosedError,
    Context,
    ContextParams,
    InvalidArgumentError,
    KvCacheFullError,
    Model,
    ModelLoadError,
    Sampler,
)
from skippyd.runtime.slicing import split_model
from skippyd.runtime.text import Detokenizer
from skippyd.sampling import InvalidSampling, SamplingParams
from tests.local_pipeline import LocalPipeline

PARAMS = ContextParams(n_ctx_per_seq=1024, n_seq_max=4, n_batch=512, n_ubatch=512, n_threads=2)
POEM = "Write a short poem about the sea, then explain what a lighthouse does."
# Greedy continuation of the chat-templated POEM prompt: the greedy tokens of the unsplit model.
POEM_REFERENCE = [504, 3426, 28, 253, 4749, 284, 11965, 7815, 28, 837, 260, 6177, 282, 260, 905, 359,
                  2042, 29, 16845, 30, 533, 260, 16862, 282, 260, 453, 33334, 28, 837, 260, 13226, 314]


@pytest.fixture(scope="session")
def smol_splits(default_model_path, tmp_path_factory):
    out = {}
    for n in (2, 3):
        topo = split_model(default_model_path, None, tmp_path_factory.mktemp(f"smol{n}"), stages=n)
        out[n] = [s.file for s in topo.stages]
    # balanced by compute: 0:19 + 19:30
    topo = split_model(default_model_path, None, tmp_path_factory.mktemp("smol2c"), stages=2, balance="compute")
    out["2-compute"] = [s.file for s in topo.stages]
    return out


@pytest.fixture(scope="session")
def tiny_splits(tiny_model_path, tmp_path_factory):
    out = {}
    for n in (2, 3):
        topo = split_model(tiny_model_path, None, tmp_path_factory.mktemp(f"tiny{n}"), stages=n)
        out[n] = [s.file for s in topo.stages]
    return out


@pytest.fixture(scope="module")
def smol(default_model_path):
    with Model(default_model_path) as m:
        yield m


def poem_tokens(model: Model) -> np.ndarray:
    text = model.apply_chat_template([{"role": "user", "content": POEM}])
    return model.tokenize(text, add_special=False, parse_special=True)


@pytest.mark.skipif(platform.machine().lower() not in ("x86_64", "amd64"), reason="AMX is an x86 extension")
def test_x86_build_is_native_without_amx():
    """native/build.py compiles ggml for this CPU (-march=native) but leaves the AMX kernels out: they died
    with SIGILL on the AMX-reporting VMs we test on."""
    ggml_cpu = ctypes.CDLL(str(Path(skippyd._native.__file__).parent / "libggml-cpu.so"))
    assert ggml_cpu.ggml_cpu_has_amx_int8() == 0
    cpu_flags = Path("/proc/cpuinfo").read_text().split()
    assert ggml_cpu.ggml_cpu_has_avx2() == ("avx2" in cpu_flags)


def test_model_metadata(smol):
    assert smol.architecture == "llama"
    assert (smol.n_layer, smol.n_embd, smol.n_vocab) == (30, 576, 49152)
    assert smol.stage.is_first and smol.stage.is_last and not smol.stage.is_slice
    assert "<|im_start|>" in smol.chat_template


def test_slice_metadata_read_by_runtime(smol_splits):
    with Model(smol_splits[3][1]) as mid:
        assert (mid.stage.layer_start, mid.stage.layer_end, mid.stage.n_layer_total) == (10, 20, 30)
        assert mid.stage.output == "hidden" and mid.n_layer == 10
        assert len(mid.stage.source_sha256) == 64


def test_unsplit_matches_reference(default_model_path):
    with LocalPipeline([default_model_path], PARAMS) as pipe:
        assert pipe.generate(poem_tokens(pipe.head), 32) == POEM_REFERENCE


@pytest.mark.parametrize("n_stages", [2, 3, "2-compute"])
def test_split_greedy_tokens_identical(default_model_path, smol_splits, n_stages):
    with LocalPipeline([default_model_path], PARAMS) as full, LocalPipeline(smol_splits[n_stages], PARAMS) as split:
        prompt = full.head.tokenize("The capital of France is")
        want = full.generate(prompt, 40, stop_at_eog=False)
        got = split.generate(prompt, 40, stop_at_eog=False)
        assert got == want
        assert split.generate(poem_tokens(split.head), 32) == POEM_REFERENCE


@pytest.mark.parametrize("chunk", [512, 37])
def test_split_logits_bit_identical_under_same_chunking(default_model_path, smol_splits, chunk):
    with LocalPipeline([default_model_path], PARAMS) as full, LocalPipeline(smol_splits[2], PARAMS) as split:
        prompt = poem_tokens(full.head)
        for pipe in (full, split):
            pipe.prefill(prompt, chunk=chunk)
        np.testing.assert_array_equal(full.last.logits(0), split.last.logits(0))
        pos = len(prompt)
        for _ in range(8):
            token = full.last.sample({0: None})[0]
            assert split.last.sample({0: None})[0] == token
            for pipe in (full, split):
                pipe.decode(np.array([token]), np.array([pos]), np.array([0]))
            np.testing.assert_array_equal(full.last.logits(0), split.last.logits(0))
            pos += 1


@pytest.mark.parametrize("n_stages", [2, 3])
def test_tiny_model_split_identical(tiny_model_path, tiny_splits, n_stages):
    with LocalPipeline([tiny_model_path], PARAMS) as full, LocalPipeline(tiny_splits[n_stages], PARAMS) as split:
        prompt = full.head.tokenize("hello world, this is a tiny model")
        want = full.generate(prompt, 32, stop_at_eog=False)
        assert split.generate(prompt, 32, stop_at_eog=False) == want
        np.testing.assert_array_equal(full.last.logits(0), split.last.logits(0))


def test_batched_sequences_match_single(default_model_path, smol_splits):
    """Several sequences in one llama_decode give the same greedy tokens as each alone.

    Each sequence attends in its own KV stream and the weights' products treat rows alike, so batching adds
    rows without changing any sequence's computation: its logits match alone bit for bit."""
    with LocalPipeline(smol_splits[2], PARAMS) as pipe:
        prompts = [pipe.head.tokenize(p) for p in ("The capital of France is", "Once upon a time",
                                                      "def fibonacci(n):")]
        alone = [pipe.generate(p, 12, seq=0, stop_at_eog=False) for p in prompts]
        for seq in range(len(prompts)):
            pipe.contexts[0].kv_clear_seq(seq), pipe.contexts[1].kv_clear_seq(seq)
        for seq, p in enumerate(prompts):
            pipe.prefill(p, seq=seq)
            # read each sequence's first token right after its own prefill
            alone_first = pipe.last.sample({seq: None})[seq]
            assert alone_first == alone[seq][0]
        outs = [[alone[s][0]] for s in range(len(prompts))]
        pos = [len(p) for p in prompts]
        for _ in range(11):
            seqs = np.arange(len(prompts), dtype=np.int32)
            toks = np.array([o[-1] for o in outs], dtype=np.int32)
            pipe.decode(toks, np.array(pos, dtype=np.int32), seqs)
            nxt = pipe.last.sample({int(s): None for s in seqs})
            for s in range(len(prompts)):
                outs[s].append(nxt[s])
                pos[s] += 1
        assert outs == alone


def test_seeded_sampling_reproducible(smol_splits):
    sampling = SamplingParams(temperature=0.9, top_k=40, top_p=0.95, min_p=0.05, repeat_penalty=1.1, seed=1234)
    with LocalPipeline(smol_splits[2], PARAMS) as pipe:
        prompt = pipe.head.tokenize("Tell me a story about a dragon.")
        first = pipe.generate(prompt, 24, sampling=sampling, stop_at_eog=False)
        again = pipe.generate(prompt, 24, sampling=sampling, stop_at_eog=False)
        other = pipe.generate(prompt, 24, sampling=attrs_evolve(sampling, seed=99), stop_at_eog=False)
    assert first == again
    assert other != first


def attrs_evolve(obj, **kw):
    import attrs

    return attrs.evolve(obj, **kw)


def test_logit_bias_forces_token(smol_splits):
    with LocalPipeline(smol_splits[2], PARAMS) as pipe:
        prompt = pipe.head.tokenize("The capital of France is")
        forced = pipe.generate(prompt, 5, sampling=SamplingParams(logit_bias=((42, 100.0),)), stop_at_eog=False)
    assert forced == [42] * 5


def test_trim_then_regenerate_reproduces(smol_splits):
    with LocalPipeline(smol_splits[2], PARAMS) as pipe:
        prompt = pipe.head.tokenize("The quick brown fox")
        ref = pipe.generate(prompt, 16, stop_at_eog=False)
        n = len(prompt)
        assert all(ctx.kv_len(0) == n + 15 for ctx in pipe.contexts)
        # trim back to prompt + 5 generated tokens, then recompute the last prompt position
        keep = n + 5
        for ctx in pipe.contexts:
            ctx.kv_trim(0, keep - 1)
            assert ctx.kv_len(0) == keep - 1
        full = list(prompt) + ref
        pipe.decode(np.array([full[keep - 1]]), np.array([keep - 1]), np.array([0]))
        tail = pipe.continue_decode(keep, 16 - 5, stop_at_eog=False)
        assert tail == ref[5:]


def test_kv_copy_and_state_roundtrip(smol_splits):
    """A copied, trimmed or exported-and-imported sequence continues exactly as the original does.

    The copies below decode the prompt's last token alone, so the reference does too: one token alone and
    the same token inside a batch take different kernels, which round differently on some CPUs."""
    with LocalPipeline(smol_splits[2], PARAMS) as pipe:
        prompt = pipe.head.tokenize("Lighthouses guide ships")
        n = len(prompt)
        pipe.prefill(prompt[:-1], seq=0)
        pipe.decode(np.array([prompt[-1]]), np.array([n - 1]), np.array([0]))
        ref = pipe.continue_decode(n, 10, seq=0, stop_at_eog=False)
        for ctx in pipe.contexts:
            ctx.kv_copy(0, 1, n_keep=n - 1)
            assert ctx.kv_pos_range(1) == (0, n - 2)
        pipe.decode(np.array([prompt[-1]]), np.array([n - 1]), np.array([1]))
        assert pipe.continue_decode(n, 10, seq=1, stop_at_eog=False) == ref
        states = [ctx.state_export(1) for ctx in pipe.contexts]
        for ctx, state in zip(pipe.contexts, states):
            ctx.kv_clear_seq(0), ctx.kv_clear_seq(1)
            assert ctx.kv_pos_range(1) is None
            ctx.state_import(2, state)
            ctx.kv_trim(2, n - 1)
        pipe.decode(np.array([prompt[-1]]), np.array([n - 1]), np.array([2]))
        assert pipe.continue_decode(n, 10, seq=2, stop_at_eog=False) == ref


def test_kv_copy_refuses_same_sequence(smol):
    with Context(smol, PARAMS) as ctx:
        with pytest.raises(InvalidArgumentError, match="same"):
            ctx.kv_copy(1, 1)
        with pytest.raises(InvalidArgumentError, match="outside"):
            ctx.kv_copy(0, 99)


def test_missing_file(tmp_path):
    with pytest.raises(ModelLoadError, match="no such file"):
        Model(tmp_path / "nope.gguf")


def test_not_a_gguf(tmp_path):
    bad = tmp_path / "bad.gguf"
    bad.write_bytes(b"hello, this is not a model" * 10)
    with pytest.raises(ModelLoadError, match="not a GGUF"):
        Model(bad)


def test_truncated_gguf(default_model_path, tmp_path):
    cut = tmp_path / "cut.gguf"
    with open(default_model_path, "rb") as src:
        cut.write_bytes(src.read(5_000_000))
    with pytest.raises(ModelLoadError, match="could not load"):
        Model(cut)


def test_unsupported_architecture_refused(tmp_path, tokenizer_fields):
    from tests.tiny_model import write_tiny_llama

    path = write_tiny_llama(tmp_path / "weird.gguf", tokenizer=tokenizer_fields, arch="notanarch")
    with pytest.raises(ModelLoadError) as err:
        Model(path)
    assert "notanarch" in str(err.value) or "architecture" in str(err.value)


def test_decode_row_matches_decode(smol_splits):
    """decode_row (a decode step's one row, no arrays built) computes what decode does with one-row arrays:
    the same hidden states on every stage and the same logits, bit for bit."""
    with LocalPipeline(smol_splits[3], PARAMS) as pipe:
        prompt = poem_tokens(pipe.head)
        for seq in (0, 1):
            pipe.prefill(prompt, seq=seq)
        token, pos = pipe.last.sample({1: None})[1], len(prompt)  # the last prefill was seq 1's
        for _ in range(6):
            by_array = by_row = None
            for ctx in pipe.contexts:
                one = np.array([pos], dtype=np.int32)
                if ctx.token_input:
                    ctx.decode(one, np.array([0], dtype=np.int32), tokens=np.array([token], dtype=np.int32))
                    out_array = ctx.hidden()
                    ctx.decode_row(pos, 1, token=token)
                else:
                    ctx.decode(one, np.array([0], dtype=np.int32), embd=by_array)
                    out_array = ctx.hidden() if ctx.hidden_output else ctx.logits(0)
                    ctx.decode_row(pos, 1, embd=by_row)
                out_row = ctx.hidden() if ctx.hidden_output else ctx.logits(1)
                np.testing.assert_array_equal(out_row, out_array)
                by_array, by_row = out_array, out_row
            token = pipe.last.sample({1: None})[1]
            pos += 1


def test_execution_releases_the_host_lock_after_a_fused_call_it_refused_or_ran(smol_splits, tmp_path):
    """The fused call releases the host lock as its compute ends; one that refuses its arguments before any
    compute leaves it held, and the execution (which alone takes and releases the lock) releases it then."""
    from skippyd.stage.execution import Execution, HotPath, Job, SchedulerStats
    from skippyd.stage.host_lock import HostComputeLock
    from skippyd.stage.threads import ThreadChooser
    from skippyd.wire.stream import PreparedFrame

    lock, other = HostComputeLock(tmp_path / "lock"), HostComputeLock(tmp_path / "lock")
    with LocalPipeline(smol_splits[2], PARAMS) as pipe:
        ctx = pipe.contexts[0]
        prompt = poem_tokens(pipe.head)
        execution = Execution(ctx, threads=ThreadChooser(PARAMS.n_threads, enabled=False), stats=SchedulerStats(),
                              hot_path=HotPath(), host_lock=lock)
        ctx.decode(np.arange(len(prompt), dtype=np.int32), np.zeros(len(prompt), dtype=np.int32), tokens=prompt)
        for tail, refused in ((7, True), (ctx.n_embd * 4, False)):  # a frame with no room for the row, then one
            job = Job(0, len(prompt), tokens=np.array([prompt[-1]], dtype=np.int32), embd=None,
                      out=PreparedFrame(b"head", tail, -1))
            assert lock.try_acquire()  # as inline_turn takes it
            execution.compute_row(job)
            assert isinstance(job.error, InvalidArgumentError) if refused else job.error is None
            assert other.try_acquire(), "the host lock is still held"
            other.release()
    lock.close()
    other.close()


def test_decode_row_send_writes_the_frame_at_the_compute_end(smol_splits, tmp_path):
    """decode_row_send computes what decode_row does, puts the hidden state after the frame's head and writes
    the whole frame to the socket from native code, releasing the compute lock first (a call refused before the
    compute leaves the lock to its caller); without a socket it only fills the frame. Its time of the compute's
    end is CLOCK_MONOTONIC's."""
    lock_path = tmp_path / "lock"
    lock_path.touch()
    with LocalPipeline(smol_splits[3], PARAMS) as pipe:
        prompt = poem_tokens(pipe.head)
        for seq in (0, 1):
            pipe.prefill(prompt, seq=seq)
        token, pos = pipe.last.sample({1: None})[1], len(prompt)
        hidden = None
        for ctx in pipe.contexts[:2]:  # the head (token in) and a middle stage (hidden state in)
            inputs = {"token": token} if ctx.token_input else {"embd": hidden}
            ctx.decode_row(pos, 0, **inputs)
            expected = ctx.hidden()
            head = bytes(range(40))
            frame = bytearray(len(head) + expected.nbytes)
            frame[:len(head)] = head
            ours, theirs = socket.socketpair()
            holder, other = open(lock_path, "rb"), open(lock_path, "rb")
            try:
                fcntl.flock(holder.fileno(), fcntl.LOCK_EX)
                before = time.clock_gettime_ns(time.CLOCK_MONOTONIC)
                sent, done_ns = ctx.decode_row_send(pos, 1, frame, len(head), lock_fd=holder.fileno(),
                                                    fd=ours.fileno(), **inputs)
                assert before < done_ns < time.clock_gettime_ns(time.CLOCK_MONOTONIC)
                assert sent == len(frame)
                assert theirs.recv(len(frame) + 1, socket.MSG_DONTWAIT) == bytes(frame)
                assert frame[len(head):] == expected.tobytes()
                np.testing.assert_array_equal(ctx.hidden(), expected)  # the row's results stand as decode_row's
                fcntl.flock(other.fileno(), fcntl.LOCK_EX | fcntl.LOCK_NB)  # released: raises if still held
                fcntl.flock(other.fileno(), fcntl.LOCK_UN)

                ctx.kv_trim(1, pos)  # the same row again
                unsent = bytearray(len(frame))
                assert ctx.decode_row_send(pos, 1, unsent, len(head), fd=-1, **inputs)[0] == 0
                assert unsent[len(head):] == expected.tobytes()
                with pytest.raises(BlockingIOError):
                    theirs.recv(1, socket.MSG_DONTWAIT)

                fcntl.flock(holder.fileno(), fcntl.LOCK_EX)
                with pytest.raises(InvalidArgumentError, match="bytes after its head"):
                    ctx.decode_row_send(pos, 1, bytearray(10), 4, lock_fd=holder.fileno(), fd=ours.fileno(),
                                        **inputs)
                with pytest.raises(BlockingIOError):  # refused before any compute: the lock is still the caller's
                    fcntl.flock(other.fileno(), fcntl.LOCK_EX | fcntl.LOCK_NB)
                fcntl.flock(holder.fileno(), fcntl.LOCK_UN)

                ctx.kv_trim(1, pos)  # the same row again
                theirs.close()
                sent, _ = ctx.decode_row_send(pos, 1, frame, len(head), fd=ours.fileno(), **inputs)
                assert -sent in (errno.EPIPE, errno.ECONNRESET)
                np.testing.assert_array_equal(ctx.hidden(), expected)
            finally:
                ours.close()
                theirs.close()
                holder.close()
                other.close()
            hidden = expected
        with pytest.raises(InvalidArgumentError, match="logits"):
            pipe.last.decode_row_send(pos, 1, bytearray(4), 0, embd=hidden)

        # the final stage: the token sampled as sample_row does, at the frame's end; the compute's time twice
        final = pipe.last
        final.decode_row(pos, 0, embd=hidden)
        want = final.sample_row(0, None)
        ours, theirs = socket.socketpair()
        try:
            frame = bytearray(b"\xff" * 64)
            token, sent, _ = final.decode_row_sample_send(pos, 1, None, frame, 8, embd=hidden, fd=ours.fileno())
            assert token == want and sent == len(frame)
            assert theirs.recv(len(frame) + 1, socket.MSG_DONTWAIT) == bytes(frame)
            assert int.from_bytes(frame[-4:], "little") == want
            us, us_max = int.from_bytes(frame[8:16], "little"), int.from_bytes(frame[16:24], "little")
            assert 0 < us == us_max < 10_000_000
            assert frame[:8] == b"\xff" * 8 and frame[24:60] == b"\xff" * 36  # nothing else written
            with pytest.raises(InvalidArgumentError, match="room for the token"):
                final.decode_row_sample_send(pos, 1, None, bytearray(20), 8, embd=hidden)
        finally:
            ours.close()
            theirs.close()


def test_decode_row_sample_send_draws_what_sample_row_draws(smol):
    """The final stage's native call samples as sample_row does, with a seeded sampler too: two twin
    sequences, one stepped by decode_row + sample_row, the other by decode_row_sample_send, draw the same."""
    prompt = smol.tokenize("The sea was calm and", add_special=True)
    params = SamplingParams(temperature=0.9, top_k=40, seed=7)
    by_row, by_send = Sampler(smol, params), Sampler(smol, params)
    with Context(smol, ContextParams(n_ctx_per_seq=128, n_seq_max=2)) as ctx:
        tokens = np.array(prompt, dtype=np.int32)
        ctx.decode(np.arange(len(prompt)), np.zeros(len(prompt)), tokens=tokens)
        row = ctx.sample_row(0, by_row)
        ctx.decode(np.arange(len(prompt)), np.ones(len(prompt)), tokens=tokens)
        sent = ctx.sample_row(1, by_send)
        drawn = []
        for pos in range(len(prompt), len(prompt) + 8):
            assert sent == row
            drawn.append(row)
            ctx.decode_row(pos, 0, token=row)
            row = ctx.sample_row(0, by_row)
            frame = bytearray(32)
            sent, written, _ = ctx.decode_row_sample_send(pos, 1, by_send, frame, 8, token=sent)
            assert written == 0 and int.from_bytes(frame[-4:], "little") == sent  # no socket: filled only
        assert sent == row
        assert drawn != [drawn[0]] * len(drawn)
    by_row.close()
    by_send.close()


def test_sample_row_is_sample_of_one_sequence(smol):
    """sample_row (a lone session's per-token call) draws what sample does: greedy, and a seeded sampler
    whose twin goes through sample, step for step; and it checks what sample checks."""
    prompt = smol.tokenize("The sea was calm and", add_special=True)
    params = SamplingParams(temperature=0.9, top_k=40, seed=7)
    by_row, by_dict = Sampler(smol, params), Sampler(smol, params)
    with Context(smol, ContextParams(n_ctx_per_seq=128, n_seq_max=2)) as ctx:
        ctx.decode(np.arange(len(prompt)), np.zeros(len(prompt)), tokens=np.array(prompt, dtype=np.int32))
        with pytest.raises(InvalidArgumentError, match="not in the last decode"):
            ctx.sample_row(1, None)
        drawn = []
        for pos in range(len(prompt), len(prompt) + 8):
            greedy = ctx.sample_row(0, None)
            assert greedy == ctx.sample({0: None})[0] == int(np.argmax(ctx.logits(0)))
            token = ctx.sample_row(0, by_row)
            assert token == ctx.sample({0: by_dict})[0]
            drawn.append(token)
            ctx.decode_row(pos, 0, token=token)
        assert drawn != [drawn[0]] * len(drawn)  # a sampler at 0.9 that always repeats would test nothing
    by_row.close()
    by_dict.close()


def test_decode_row_checks_its_arguments(smol, smol_splits):
    with Context(smol, ContextParams(n_ctx_per_seq=64, n_seq_max=2)) as ctx:
        with pytest.raises(InvalidArgumentError, match="vocabulary"):
            ctx.decode_row(0, 0, token=10**7)
        with pytest.raises(InvalidArgumentError, match="sequence"):
            ctx.decode_row(0, 2, token=1)
        with pytest.raises(InvalidArgumentError, match="position"):
            ctx.decode_row(ctx.n_ctx_seq, 0, token=1)
        with pytest.raises(InvalidArgumentError, match="token ids"):
            ctx.decode_row(0, 0, embd=np.zeros((1, smol.n_embd), dtype=np.float32))
    with Model(smol_splits[2][1]) as tail, Context(tail, ContextParams(n_ctx_per_seq=64, n_seq_max=1)) as ctx:
        with pytest.raises(InvalidArgumentError, match="hidden states"):
            ctx.decode_row(0, 0, token=1)
        with pytest.raises(InvalidArgumentError, match="shape"):
            ctx.decode_row(0, 0, embd=np.zeros((2, tail.n_embd), dtype=np.float32))
        ctx.decode_row(0, 0, embd=np.zeros((1, tail.n_embd), dtype=np.float32))
        assert ctx.logits(0).shape == (tail.n_vocab,)


def test_oversized_batch_and_bad_arguments(smol):
    with Context(smol, ContextParams(n_ctx_per_seq=1024, n_seq_max=2, n_batch=64, n_ubatch=64)) as ctx:
        n = 65
        with pytest.raises(InvalidArgumentError, match="exceeds n_batch"):
            ctx.decode(np.arange(n), np.zeros(n), tokens=np.ones(n, dtype=np.int32))
        with pytest.raises(InvalidArgumentError, match="vocabulary"):
            ctx.decode(np.arange(2), np.zeros(2), tokens=np.array([1, 10**7]))
        with pytest.raises(InvalidArgumentError, match="sequence"):
            ctx.decode(np.arange(2), np.array([0, 5]), tokens=np.array([1, 2]))
        with pytest.raises(InvalidArgumentError, match="hidden states"):
            ctx.decode(np.arange(2), np.zeros(2), embd=np.zeros((2, smol.n_embd), dtype=np.float32))
        with pytest.raises(InvalidArgumentError, match="not in the last decode"):
            ctx.logits(0)


def test_kv_full_is_typed_error(smol):
    # a unified KV buffer shared by two sequences: the second cannot find room
    params = ContextParams(n_ctx_per_seq=256, n_seq_max=2, n_batch=256, n_ubatch=256, kv_unified=True)
    with Context(smol, params) as ctx:
        ctx.decode(np.arange(200), np.zeros(200), tokens=np.full(200, 7, dtype=np.int32))
        with pytest.raises(KvCacheFullError, match="no free KV slot"):
            ctx.decode(np.arange(100), np.ones(100), tokens=np.full(100, 7, dtype=np.int32))
        ctx.kv_clear_seq(0)  # the context stays usable
        ctx.decode(np.arange(100), np.ones(100), tokens=np.full(100, 7, dtype=np.int32))


def test_close_is_idempotent_and_guards_use(default_model_path):
    model = Model(default_model_path)
    ctx = Context(model, PARAMS)
    sampler = Sampler(model, SamplingParams(temperature=0.5, seed=1))
    sampler.close(), sampler.close()
    model.close()  # closes its contexts first
    model.close()
    ctx.close()
    with pytest.raises(ClosedError):
        ctx.kv_len(0)
    with pytest.raises(ClosedError):
        model.tokenize("x")


def test_sampling_params_validated(smol):
    for bad in (dict(top_p=0.0), dict(logit_bias=((10**7, 1.0),)), dict(logit_bias=((1, math.inf),))):
        with pytest.raises(InvalidArgumentError):
            Sampler(smol, SamplingParams(**bad))
    with pytest.raises(InvalidSampling):  # what no C struct could hold is refused as it is made
        SamplingParams(seed=2**40)


def test_detokenizer_never_splits_utf8(smol):
    text = "Café — 東京 🚀 ok"
    tokens = smol.tokenize(text, add_special=False)
    det = Detokenizer(smol.token_piece)
    pieces = [det.push(int(t)) for t in tokens] + [det.flush()]
    assert "".join(pieces) == text
    assert all("\ufffd" not in p for p in pieces)
    # at least one emoji / CJK character spans several tokens, so some pushes emit nothing
    assert "" in pieces[:-1]


def test_persistent_threadpool_gives_identical_tokens(default_model_path):
    pooled = ContextParams(n_ctx_per_seq=1024, n_seq_max=1, n_threads=2, threadpool_poll=0)
    with LocalPipeline([default_model_path], PARAMS) as ref, LocalPipeline([default_model_path], pooled) as pipe:
        prompt = ref.head.tokenize("The capital of France is")
        assert pipe.generate(prompt, 16, stop_at_eog=False) == ref.generate(prompt, 16, stop_at_eog=False)
    with pytest.raises(InvalidArgumentError, match="threadpool_poll"):
        with Model(default_model_path) as model:
            Context(model, ContextParams(threadpool_poll=101))


def test_flash_attention_setting(default_model_path):
    """Off by default (this CPU build decodes long contexts much slower with it); on/auto still run and give the
    same greedy answer here; anything else is refused."""
    assert ContextParams().flash_attn == "off"
    prompt = None
    answers = []
    for mode in ("off", "on", "auto"):
        params = ContextParams(n_ctx_per_seq=1024, n_seq_max=1, n_threads=2, flash_attn=mode)
        with LocalPipeline([default_model_path], params) as pipe:
            prompt = pipe.head.tokenize("The capital of France is") if prompt is None else prompt
            answers.append(pipe.generate(prompt, 8, stop_at_eog=False))
    # "on" is another kernel, so its logits differ a little: the tokens agree because this prompt's top-1
    # margins are wider than that difference, which would not hold for every prompt
    assert answers[0] == answers[1] == answers[2]
    with pytest.raises(InvalidArgumentError, match="flash_attn"):
        with Model(default_model_path) as model:
            Context(model, ContextParams(flash_attn="fast"))


def _idle_class_threads() -> dict[int, int]:
    """This process's SCHED_IDLE threads: tid -> nanoseconds on a CPU so far (schedstat)."""
    out = {}
    for tid in Path("/proc/self/task").iterdir():
        try:
            if os.sched_getscheduler(int(tid.name)) == os.SCHED_IDLE:
                out[int(tid.name)] = int((tid / "schedstat").read_text().split()[0])
        except (FileNotFoundError, ProcessLookupError):  # a thread that ended meanwhile
            pass
    return out


def _spun_ms(before: dict[int, int], after: dict[int, int]) -> list[float]:
    """Milliseconds on a CPU between two _idle_class_threads() of the threads in ``before``."""
    return [(after[tid] - before[tid]) / 1e6 for tid in before if tid in after]


def test_keep_warm_spins_at_idle_class_after_each_compute(default_model_path):
    """keep_warm_ms: one SCHED_IDLE thread, asleep until a compute ends, then spinning for that long (on a
    CPU: the idle class gets what nothing else wants), asleep again after; the same tokens as without; closing
    the context ends the thread. None without it; out-of-range values refused."""
    assert ContextParams().keep_warm_ms == 0
    before_any = set(_idle_class_threads())
    with Model(default_model_path) as model:
        with Context(model, ContextParams(n_ctx_per_seq=256, n_seq_max=1, n_threads=2)) as plain:
            assert set(_idle_class_threads()) == before_any and plain.keep_warm_spun_s == 0
        warm = Context(model, ContextParams(n_ctx_per_seq=256, n_seq_max=1, n_threads=2, keep_warm_ms=80))
        threads = {tid: ns for tid, ns in _idle_class_threads().items() if tid not in before_any}
        assert len(threads) == 1
        time.sleep(0.15)
        asleep = {tid: ns for tid, ns in _idle_class_threads().items() if tid in threads}
        assert _spun_ms(threads, asleep) == [pytest.approx(0, abs=5)]  # no compute yet: asleep
        warm.decode_row(0, 0, token=1)
        time.sleep(0.3)
        spun = {tid: ns for tid, ns in _idle_class_threads().items() if tid in threads}
        # until 80 ms after the compute's end (less the time the idle class waited for a core), then asleep
        assert 0.04 < warm.keep_warm_spun_s < 0.2
        assert 5 < _spun_ms(asleep, spun)[0] < 120  # ... and on a CPU meanwhile
        time.sleep(0.15)
        assert _spun_ms(spun, _idle_class_threads()) == [pytest.approx(0, abs=5)]
        warm.close()
        assert set(_idle_class_threads()) == before_any
        for bad in (-1, 10_001):
            with pytest.raises(InvalidArgumentError, match="keep_warm_ms"):
                Context(model, ContextParams(keep_warm_ms=bad))
    pooled = ContextParams(n_ctx_per_seq=1024, n_seq_max=1, n_threads=2, keep_warm_ms=50)
    with LocalPipeline([default_model_path], PARAMS) as ref, LocalPipeline([default_model_path], pooled) as pipe:
        prompt = ref.head.tokenize("The capital of France is")
        assert pipe.generate(prompt, 16, stop_at_eog=False) == ref.generate(prompt, 16, stop_at_eog=False)


@pytest.mark.parametrize("which", ["default", "gemma3"])
def test_vocabulary_in_one_call_is_every_token_piece(which, request):
    """The vocabulary llguidance reads, made natively in one call, is token for token what token_piece gives
    (special tokens shown), its control tokens are those that show only as special, and the end-of-generation
    tokens are those libllama calls so: for SmolLM2's 49k tokens and Gemma 3's 262k."""
    path = request.getfixturevalue("default_model_path" if which == "default" else "gemma3_path")
    model = Model(path, vocab_only=True)
    try:
        tokens, control = model.vocabulary()
        assert len(tokens) == model.n_vocab
        assert tokens == [model.token_piece(t, special=True) for t in range(model.n_vocab)]
        assert control == [t for t in range(model.n_vocab) if tokens[t] and not model.token_piece(t)]
        assert control and model.bos in control
        eog = model.eog_tokens().tolist()
        assert eog == [t for t in range(model.n_vocab) if model.is_eog(t)] and model.eos in eog
        model.prepare()
        tokenizer = model.lltokenizer()
        assert tokenizer is model.lltokenizer() and tokenizer.vocab_size == model.n_vocab
        assert sorted(tokenizer.eos_tokens) == eog
        assert all(tokenizer.is_special_token(t) for t in control[:50])
    finally:
        model.close()
