"""A stage's llama context: its KV sequences, batches of rows in, hidden states or sampled tokens out."""

from __future__ import annotations

import os
from collections.abc import Iterable, Mapping, Sequence

import attrs
import numpy as np

from skippyd.runtime.llama.ffi import (
    ContextError,
    InvalidArgumentError,
    LlamaError,
    NativeObject,
    check_decode,
    ffi,
    lib,
)
from skippyd.runtime.llama.model import Model
from skippyd.runtime.llama.sampling import GuidedSampler, Sampler


@attrs.frozen
class ContextParams:
    n_ctx_per_seq: int = 4096
    n_seq_max: int = 4
    n_batch: int = 512
    n_ubatch: int = 512
    n_threads: int = 2
    n_threads_batch: int | None = None
    kv_unified: bool = False
    # A persistent ggml thread pool whose workers poll this long (0-100) before sleeping;
    # None keeps llama.cpp's default (worker threads created and joined for every graph).
    threadpool_poll: int | None = None
    # After each compute, a thread at the lowest scheduling class spins this long (0: none) on otherwise idle
    # cores, so that the next step does not start on cores gone cold (native/llama_helpers.c, keep warm).
    keep_warm_ms: float = 0.0
    # ... and this many such threads: one, as a SCHED_IDLE thread still takes a busy core for a moment now and
    # then, and a compute thread held up so holds up its peers at a barrier.
    keep_warm_threads: int = 1
    # llama.cpp's flash attention: "off", "on" or "auto" (llama.cpp decides; on for this CPU build). Off by
    # default: on a CPU build it makes decode much slower once the context holds a few hundred tokens.
    flash_attn: str = "off"


FLASH_ATTN_MODES = ("off", "on", "auto")
MAX_KEEP_WARM_MS = 10_000


class Context(NativeObject):
    """A llama context for one stage, holding ``n_seq_max`` KV sequences.

    Input is token ids on a first stage and hidden states (float32
    ``[n, n_embd_inp]``) on any later stage. Output is the hidden state of every
    token on a non-final stage, and logits of each sequence's last token on the
    final stage (of every token of a verify window's sequence, see
    :meth:`sample_window`). One thread at a time may use a context.
    """

    _kind = "context"

    def __init__(self, model: Model, params: ContextParams = ContextParams()):
        self._ptr = ffi.NULL
        self._batch = None
        self._input_batch = None
        self._threadpool = ffi.NULL
        self._warm = ffi.NULL
        op = "create context"
        if params.n_seq_max < 1 or params.n_seq_max > 256:
            raise InvalidArgumentError(op, "n_seq_max must be in [1, 256]")
        if params.n_ubatch < 1 or params.n_batch < params.n_ubatch:
            raise InvalidArgumentError(op, "need 1 <= n_ubatch <= n_batch")
        if params.n_ctx_per_seq < 16:
            raise InvalidArgumentError(op, "n_ctx_per_seq must be >= 16")
        if params.n_threads < 1:
            raise InvalidArgumentError(op, "n_threads must be >= 1")
        if params.flash_attn not in FLASH_ATTN_MODES:
            raise InvalidArgumentError(op, f"flash_attn must be one of {', '.join(FLASH_ATTN_MODES)}")
        if not 0 <= params.keep_warm_ms <= MAX_KEEP_WARM_MS:
            raise InvalidArgumentError(op, f"keep_warm_ms must be in [0, {MAX_KEEP_WARM_MS}]")
        self.model = model
        self.params = params
        self.hidden_output = model.stage.output == "hidden"
        self.token_input = model.stage.is_first
        cp = lib.llama_context_default_params()
        cp.n_ctx = params.n_ctx_per_seq * params.n_seq_max if not params.kv_unified else params.n_ctx_per_seq
        cp.n_batch = params.n_batch
        cp.n_ubatch = params.n_ubatch
        cp.n_seq_max = params.n_seq_max
        cp.n_threads = params.n_threads
        cp.n_threads_batch = params.n_threads_batch or params.n_threads
        cp.kv_unified = params.kv_unified
        cp.flash_attn_type = {"off": lib.LLAMA_FLASH_ATTN_TYPE_DISABLED, "on": lib.LLAMA_FLASH_ATTN_TYPE_ENABLED,
                              "auto": lib.LLAMA_FLASH_ATTN_TYPE_AUTO}[params.flash_attn]
        cp.no_perf = True
        cp.embeddings = self.hidden_output
        if self.hidden_output:
            cp.pooling_type = lib.LLAMA_POOLING_TYPE_NONE
        ptr = lib.llama_init_from_model(model._live(op), cp)
        if ptr == ffi.NULL:
            raise ContextError(op, f"llama.cpp could not create a context for {model.path}")
        self._ptr = ptr
        if params.threadpool_poll is not None:
            if not 0 <= params.threadpool_poll <= 100:
                raise InvalidArgumentError(op, "threadpool_poll must be in [0, 100]")
            n_pool = max(params.n_threads, params.n_threads_batch or params.n_threads)
            self._threadpool = lib.skippy_threadpool_new(n_pool, params.threadpool_poll)
            if self._threadpool == ffi.NULL:
                self.close()
                raise ContextError(op, "could not create the ggml thread pool")
            lib.llama_attach_threadpool(ptr, self._threadpool, self._threadpool)
        self._warm_ns = int(params.keep_warm_ms * 1e6)
        if self._warm_ns > 0:
            self._warm = lib.skippy_warm_new(params.keep_warm_threads)
            if self._warm == ffi.NULL:
                err = ffi.errno
                self.close()
                raise ContextError(op, f"could not start the keep-warm threads: {os.strerror(err)}")
        self._mem = lib.llama_get_memory(ptr)
        self.n_batch = int(lib.llama_n_batch(ptr))
        self.n_seq_max = int(lib.llama_n_seq_max(ptr))
        self.n_ctx_seq = int(lib.llama_n_ctx_seq(ptr))
        self.n_embd = model.n_embd
        self.n_embd_inp = model.n_embd_inp
        self._batch = lib.llama_batch_init(self.n_batch, 0 if self.token_input else self.n_embd_inp, 1)
        self._pbatch = ffi.new("llama_batch *", self._batch)
        self.n_pos_per_embd = model.n_pos_per_embd
        self._pos_all = None  # M-RoPE: the positions of rows given as embeddings, n_pos_per_embd per row
        if self.n_pos_per_embd > 1 and not self.token_input:
            self._pos_all = self._pbatch.pos = ffi.new("llama_pos[]", self.n_batch * self.n_pos_per_embd)
        self._pinput = ffi.NULL  # a first stage's batch of input embeddings (an image's rows), made when first used
        self._send_out = ffi.new("int64_t[2]")  # decode_row_send's bytes written and time of the compute's end
        # sample_row's arguments, allocated once (it runs for every token)
        self._row1, self._smpl1, self._token1 = (ffi.new("int32_t[1]"), ffi.new("struct llama_sampler *[1]"),
                                                 ffi.new("llama_token[1]"))
        self._out_rows: dict[int, int] = {}
        self._window_rows: dict[int, list[int]] = {}  # the last decode's verify windows: each one's rows
        self._n_last = 0
        model._contexts.add(self)

    # -- lifetime
    def close(self) -> None:
        """Free the batch, the context, then its thread pool (reverse order of creation). Idempotent."""
        if self._batch is not None:
            lib.llama_batch_free(self._batch)
            self._batch = None
        if self._input_batch is not None:
            lib.llama_batch_free(self._input_batch)  # the struct as allocated (its pos, not our M-RoPE buffer)
            self._input_batch = None
            self._pinput = ffi.NULL
        if self._ptr != ffi.NULL:
            if self._threadpool != ffi.NULL:
                lib.llama_detach_threadpool(self._ptr)
            lib.llama_free(self._ptr)
            self._ptr = ffi.NULL
        if self._threadpool != ffi.NULL:
            lib.skippy_threadpool_free(self._threadpool)
            self._threadpool = ffi.NULL
        if self._warm != ffi.NULL:
            lib.skippy_warm_free(self._warm)
            self._warm = ffi.NULL

    @property
    def keep_warm_spun_s(self) -> float:
        """Seconds the keep-warm threads have spent spinning (wall time, all threads together; 0 without)."""
        return lib.skippy_warm_spun_ns(self._warm) / 1e9 if self._warm != ffi.NULL else 0.0

    def _computing(self) -> None:
        """Before a compute: the keep-warm threads leave the cores to it."""
        if self._warm != ffi.NULL:
            lib.skippy_warm_hold(self._warm)

    def _computed(self) -> None:
        """After a compute (or a failed one): the keep-warm threads spin for their while from now."""
        if self._warm != ffi.NULL:
            lib.skippy_warm_touch(self._warm, self._warm_ns)


    def set_threads(self, n_threads: int, n_threads_batch: int | None = None) -> None:
        if n_threads < 1:
            raise InvalidArgumentError("set threads", "n_threads must be >= 1")
        lib.llama_set_n_threads(self._live("set threads"), n_threads, n_threads_batch or n_threads)

    def _check_seq(self, seq: int, op: str) -> None:
        if not 0 <= int(seq) < self.n_seq_max:
            raise InvalidArgumentError(op, f"sequence {seq} outside [0, {self.n_seq_max})")

    # -- compute
    def decode(self, pos: np.ndarray, seq: np.ndarray, *, tokens: np.ndarray | None = None,
               embd: np.ndarray | None = None, input_embd: np.ndarray | None = None, windows: Iterable[int] = (),
               causal: bool = True) -> None:
        """Run one batch. Rows may belong to several sequences, each with explicit positions.

        Read the result with :meth:`hidden` (non-final stage) or :meth:`logits`
        / :meth:`sample` (final stage) before the next decode. On a final stage every row of the sequences
        in ``windows`` (verify windows) outputs logits, read with :meth:`sample_window`; other sequences'
        last row only.

        A first stage takes ``input_embd`` in place of ``tokens``: input embeddings (an image's rows from a
        projector, ``[n, n_embd_inp]``). On an M-RoPE model (``n_pos_per_embd`` 4) rows given as embeddings
        (``input_embd``, ``embd``) take ``pos`` of shape ``[4, n]``, section-major (llama.cpp's layout, an
        image's rows); 1-D positions of such rows are text tokens', spread over the sections as llama.cpp
        spreads a token's: (p, p, p, 0).
        ``causal=False`` computes the batch with causal attention off (an image whose rows attend both ways).
        """
        op = "decode"
        ptr = self._live(op)
        pos = np.ascontiguousarray(pos, dtype=np.int32)
        seq = np.ascontiguousarray(seq, dtype=np.int32)
        n = int(pos.shape[-1]) if pos.ndim in (1, 2) else -1
        if n < 1:
            raise InvalidArgumentError(op, "empty batch")
        if n > self.n_batch:
            raise InvalidArgumentError(op, f"batch of {n} tokens exceeds n_batch {self.n_batch}")
        if seq.shape != (n,):
            raise InvalidArgumentError(op, f"seq has shape {seq.shape}, expected ({n},)")
        given = embd if input_embd is None else input_embd  # the rows given as embeddings, if any
        if pos.ndim == 2 and (given is None or self.n_pos_per_embd == 1 or pos.shape[0] != self.n_pos_per_embd):
            raise InvalidArgumentError(op, f"positions of shape {pos.shape}: only rows given as embeddings to an "
                                           f"M-RoPE model take {self.n_pos_per_embd} per row")
        if input_embd is not None and not (self.token_input and tokens is None and embd is None):
            raise InvalidArgumentError(op, "input embeddings (an image's rows) go to a first stage, in place of "
                                           "its token ids")
        # input embeddings stand where a first stage's token ids would
        self._check_rows(op, _bounds(seq), _bounds(pos[0] if pos.ndim == 2 else pos),
                         tokens if input_embd is None else input_embd, embd)
        # which rows produce output: all on a hidden stage, the last row of each sequence otherwise (every row
        # of a verify window's)
        last_rows: dict[int, int] = {}
        seq_list = seq.tolist()
        for row, s in enumerate(seq_list):
            last_rows[s] = row
        window_rows: dict[int, list[int]] = {}
        if windows:
            for s in windows:
                s = int(s)
                if s not in last_rows:
                    raise InvalidArgumentError(op, f"verify window sequence {s} has no row in the batch")
                window_rows[s] = []
            for row, s in enumerate(seq_list):
                if s in window_rows:
                    window_rows[s].append(row)
        if self.hidden_output:
            out = np.ones(n, dtype=np.int8)
        else:
            out = np.zeros(n, dtype=np.int8)
            out[list(last_rows.values())] = 1
            for rows in window_rows.values():
                out[rows] = 1
        pos_c = ffi.from_buffer("llama_pos[]", pos)
        seq_c = ffi.from_buffer("llama_seq_id[]", seq)
        out_c = ffi.from_buffer("int8_t[]", out)
        batch = self._pbatch
        if tokens is not None and input_embd is None:
            tokens = np.ascontiguousarray(tokens, dtype=np.int32)
            if tokens.shape != (n,):
                raise InvalidArgumentError(op, f"tokens has shape {tokens.shape}, expected ({n},)")
            self._check_token_ids(op, *_bounds(tokens))
            rc = lib.skippy_fill_token_batch(batch, ffi.from_buffer("llama_token[]", tokens), n, pos_c, seq_c, out_c)
        else:
            given = self._hidden_input(op, given, n)
            if self.token_input:
                batch = self._input_embd_batch()
            rc = lib.skippy_fill_embd_batch(batch, ffi.from_buffer("float[]", given), n, self.n_embd_inp,
                                            pos_c, seq_c, out_c)
            if rc == 0 and self.n_pos_per_embd > 1:  # the fill copied n positions; the batch takes 4 per row
                if pos.ndim == 1:
                    pos = np.stack([pos, pos, pos, np.zeros_like(pos)])
                ffi.memmove(batch.pos, ffi.from_buffer("llama_pos[]", pos), pos.nbytes)
        if rc != 0:
            raise LlamaError(op, "batch has no room for this input kind")
        self._out_rows = {}
        self._window_rows = {}
        self._n_last = 0
        self._computing()
        if not causal:
            lib.llama_set_causal_attn(ptr, False)
        try:
            rc = lib.llama_decode(ptr, batch[0])
        finally:
            if not causal:
                lib.llama_set_causal_attn(ptr, True)
            self._computed()
        check_decode(op, rc)
        self._out_rows = last_rows
        self._window_rows = window_rows
        self._n_last = n

    def decode_row(self, pos: int, seq: int, *, token: int | None = None, embd: np.ndarray | None = None) -> None:
        """:meth:`decode` of one row: a decode step, the per-token call. The same checks and results, with
        no arrays built for it (its Python time counts against every token)."""
        op = "decode"
        ptr = self._live(op)
        self._check_rows(op, (seq, seq), (pos, pos), token, embd)
        if self.token_input:
            self._check_token_ids(op, token, token)
            embd_c = ffi.NULL
        else:
            embd_c, token = ffi.from_buffer("float[]", self._hidden_input(op, embd, 1)), 0
            self._row_sections(pos)
        self._out_rows = {}
        self._window_rows = {}
        self._n_last = 0
        self._computing()
        rc = lib.skippy_decode_row(ptr, self._pbatch, token, embd_c, self.n_embd_inp, pos, seq)
        self._computed()
        if rc == -100:
            raise LlamaError(op, "batch has no room for this input kind")
        check_decode(op, rc)
        self._out_rows = {seq: 0}
        self._n_last = 1

    def decode_row_send(self, pos: int, seq: int, frame: bytearray, head_len: int, *, token: int | None = None,
                        embd: np.ndarray | None = None, lock_fd: int = -1, fd: int = -1) -> tuple[int, int]:
        """:meth:`decode_row` whose hidden state goes into ``frame[head_len:]`` (exactly one row's bytes: float32,
        or half floats if that is 2 bytes a value), then out on the socket ``fd`` (-1: not sent) from native
        code the moment the compute ends: a stage's forward without the Python after a compute in its way.
        ``lock_fd`` (a flock held for this compute, -1: none) is released then too, whatever the compute's
        result; a call whose arguments are refused (InvalidArgumentError, ClosedError: before any compute)
        leaves it held. Returns (bytes written: 0 if the socket took none, -errno if the write failed, the
        decode's results standing; CLOCK_MONOTONIC ns at the compute's end, or 0 if the row did not fit half
        floats: nothing written, the frame is the caller's to send otherwise). A decode that failed raises as
        decode_row (nothing written)."""
        op = "decode"
        row = len(frame) - head_len
        ptr, token, embd_c = self._send_row_input(op, pos, seq, token, embd, hidden=True,
                                                  fits=row in (self.n_embd * 4, self.n_embd * 2) and head_len >= 0,
                                                  need=f"{self.n_embd * 4} or {self.n_embd * 2} bytes after its head")
        out = self._send_out
        self._computing()
        rc = lib.skippy_decode_row_send(ptr, self._pbatch, token, embd_c, self.n_embd_inp, pos, seq,
                                        ffi.from_buffer("uint8_t[]", frame), head_len, len(frame),
                                        int(row == self.n_embd * 2), lock_fd, fd, out, out + 1)
        self._computed()
        self._sent_row(op, rc, seq)
        return out[0], out[1]

    def decode_row_sample_send(self, pos: int, seq: int, sampler: Sampler | None, frame: bytearray, us_at: int, *,
                               token: int | None = None, embd: np.ndarray | None = None, lock_fd: int = -1,
                               fd: int = -1) -> tuple[int, int, int]:
        """The final stage's :meth:`decode_row_send`: the row's token, sampled as :meth:`sample_row` does, goes
        into the last 4 bytes of ``frame`` (a one-token reply), the compute's microseconds (decode and
        sampling) into the two u64 at ``us_at`` (the reply's compute_us and compute_us_max), and the frame out
        as decode_row_send's. Returns (token, bytes written or -errno, CLOCK_MONOTONIC ns at the end)."""
        op = "decode"
        ptr, token, embd_c = self._send_row_input(op, pos, seq, token, embd, hidden=False,
                                                  fits=0 <= us_at and us_at + 16 <= len(frame) - 4,
                                                  need=f"room for the token and the times at {us_at}")
        smpl = ffi.NULL if sampler is None else sampler._live(op)
        out = self._send_out
        self._computing()
        rc = lib.skippy_decode_row_sample_send(ptr, self._pbatch, token, embd_c, self.n_embd_inp, pos, seq, smpl,
                                               ffi.from_buffer("uint8_t[]", frame), len(frame), us_at, lock_fd, fd,
                                               out, out + 1, self._token1)
        self._computed()
        self._sent_row(op, rc, seq)
        return self._token1[0], out[0], out[1]

    def _send_row_input(self, op: str, pos: int, seq: int, token, embd, *, hidden: bool, fits: bool, need: str):
        """decode_row's checks for the two calls above, and its input: (context, token, hidden-state pointer)."""
        try:
            ptr = self._live(op)
            if hidden != self.hidden_output:
                raise InvalidArgumentError(op, "this stage outputs " + ("logits, not hidden states" if hidden else
                                                                        "hidden states, not logits"))
            if not fits:
                raise InvalidArgumentError(op, f"the frame has no {need}")
            self._check_rows(op, (seq, seq), (pos, pos), token, embd)
            if self.token_input:
                self._check_token_ids(op, token, token)
                return ptr, token, ffi.NULL
            embd_c = ffi.from_buffer("float[]", self._hidden_input(op, embd, 1))
            self._row_sections(pos)
            return ptr, 0, embd_c
        finally:
            self._out_rows = {}
            self._window_rows = {}
            self._n_last = 0

    def _sent_row(self, op: str, rc: int, seq: int) -> None:
        if rc == -100:
            raise LlamaError(op, "batch has no room for this input kind")
        if rc == -101:
            raise LlamaError(op, "llama_get_embeddings returned NULL")
        if rc == -102:
            raise LlamaError(op, "logits missing for a sampled row")
        check_decode(op, rc)
        self._out_rows = {seq: 0}
        self._n_last = 1

    def _check_rows(self, op: str, seq: tuple[int, int], pos: tuple[int, int], tokens, embd) -> None:
        """What decode and decode_row both check: the rows' sequence ids and positions (lowest, highest) are
        in range, and the input is the kind this stage takes (token ids first, hidden states after)."""
        if seq[0] < 0 or seq[1] >= self.n_seq_max:
            raise InvalidArgumentError(op, f"sequence id outside [0, {self.n_seq_max})")
        if pos[0] < 0 or pos[1] >= self.n_ctx_seq:
            raise InvalidArgumentError(op, f"position outside the context [0, {self.n_ctx_seq})")
        if self.token_input:
            if tokens is None or embd is not None:
                raise InvalidArgumentError(op, "a first stage takes token ids, not hidden states")
        elif embd is None or tokens is not None:
            raise InvalidArgumentError(op, "a later stage takes hidden states, not token ids")

    def _input_embd_batch(self):
        """A first stage's batch for input embeddings (its own batch holds token ids), made when first used."""
        if self._pinput == ffi.NULL:
            self._input_batch = lib.llama_batch_init(self.n_batch, self.n_embd_inp, 1)
            self._pinput = ffi.new("llama_batch *", self._input_batch)
            if self.n_pos_per_embd > 1:
                self._input_pos = self._pinput.pos = ffi.new("llama_pos[]", self.n_batch * self.n_pos_per_embd)
        return self._pinput

    def _row_sections(self, pos: int) -> None:
        """A hidden-state row of a decode step on an M-RoPE model is a text token's: the native call sets its
        first section, the others are (pos, pos, 0) as llama.cpp gives a token."""
        if self._pos_all is not None:
            self._pos_all[1] = self._pos_all[2] = pos
            self._pos_all[3] = 0

    def _check_token_ids(self, op: str, lowest: int, highest: int) -> None:
        if lowest < 0 or highest >= self.model.n_vocab:
            raise InvalidArgumentError(op, f"token id outside the vocabulary [0, {self.model.n_vocab})")

    def _hidden_input(self, op: str, embd, n: int) -> np.ndarray:
        """`embd` as the float32 [n, n_embd] array llama.cpp reads (InvalidArgumentError if it is not one)."""
        embd = np.ascontiguousarray(embd, dtype=np.float32)
        if embd.shape != (n, self.n_embd_inp):
            raise InvalidArgumentError(op, f"hidden states have shape {embd.shape}, expected ({n}, {self.n_embd_inp})")
        return embd

    def hidden(self) -> np.ndarray:
        """Hidden state of every row of the last decode, float32 ``[n, n_embd]`` (a copy)."""
        op = "read hidden states"
        if not self.hidden_output:
            raise InvalidArgumentError(op, "this stage outputs logits, not hidden states")
        if not self._n_last:
            raise InvalidArgumentError(op, "no decode to read from")
        p = lib.llama_get_embeddings(self._live(op))
        if p == ffi.NULL:
            raise LlamaError(op, "llama_get_embeddings returned NULL")
        count = self._n_last * self.n_embd
        return np.frombuffer(ffi.buffer(p, count * 4), dtype=np.float32).reshape(self._n_last, self.n_embd).copy()

    def logits(self, seq: int) -> np.ndarray:
        """Logits of `seq`'s last row in the last decode (a copy)."""
        op = "read logits"
        row = self._output_row(seq, op)
        p = lib.llama_get_logits_ith(self._live(op), row)
        if p == ffi.NULL:
            raise LlamaError(op, f"no logits for row {row}")
        return np.frombuffer(ffi.buffer(p, self.model.n_vocab * 4), dtype=np.float32).copy()

    def _logits_row(self, row: int, op: str) -> np.ndarray:
        """A row's logits in place (float32 [n_vocab], valid until the next decode): a guided sampler's input."""
        p = lib.llama_get_logits_ith(self._live(op), row)
        if p == ffi.NULL:
            raise LlamaError(op, f"no logits for row {row}")
        return np.frombuffer(ffi.buffer(p, self.model.n_vocab * 4), dtype=np.float32)

    def sample(self, samplers: Mapping[int, Sampler | GuidedSampler | None]) -> dict[int, int]:
        """One token per sequence from the last decode; `None` means plain greedy (argmax in C); a
        GuidedSampler samples its sequence's row in Python."""
        op = "sample"
        guided = {s: g for s, g in samplers.items() if isinstance(g, GuidedSampler)}
        if guided:
            picked = {s: g.sample(self._logits_row(self._output_row(s, op), op)) for s, g in guided.items()}
            rest = {s: g for s, g in samplers.items() if s not in guided}
            return {**picked, **(self.sample(rest) if rest else {})}
        seqs = list(samplers)
        n = len(seqs)
        rows = np.array([self._output_row(s, op) for s in seqs], dtype=np.int32)
        smpl = ffi.new("struct llama_sampler *[]", n)
        for i, s in enumerate(seqs):
            sampler = samplers[s]
            smpl[i] = ffi.NULL if sampler is None else sampler._live(op)
        out = np.empty(n, dtype=np.int32)
        rc = lib.skippy_sample_rows(self._live(op), smpl, ffi.from_buffer("int32_t[]", rows), n,
                                    ffi.from_buffer("llama_token[]", out))
        if rc != 0:
            raise LlamaError(op, "logits missing for a sampled row")
        return dict(zip(seqs, out.tolist()))

    def sample_row(self, seq: int, sampler: Sampler | GuidedSampler | None) -> int:
        """:meth:`sample` of one sequence: the same token, with no arrays built for it (the per-token call
        of a session decoding alone)."""
        op = "sample"
        if isinstance(sampler, GuidedSampler):
            return sampler.sample(self._logits_row(self._output_row(seq, op), op))
        self._row1[0] = self._output_row(seq, op)
        self._smpl1[0] = ffi.NULL if sampler is None else sampler._live(op)
        if lib.skippy_sample_rows(self._live(op), self._smpl1, self._row1, 1, self._token1) != 0:
            raise LlamaError(op, "logits missing for a sampled row")
        return self._token1[0]

    def sample_window(self, seq: int, sampler: Sampler | GuidedSampler | None, tokens: Sequence[int]) -> list[int]:
        """The verify window ``tokens`` (the current token, then the drafts) of ``seq``, decoded in the last
        decode (``windows``): row i's token is sampled as :meth:`sample_row` samples a decode step's; while it
        equals the draft after it (``tokens[i + 1]``) the next row is sampled, else sampling stops. Returns
        the tokens sampled (the drafts accepted, then the next token: at most ``len(tokens)``).

        The sampler takes exactly what the same tokens decoded one step at a time would have given it: a
        llama.cpp chain accepts each token it samples (its RNG and penalties go on as step by step); a guided
        sampler samples each row's logits, and its constraint takes each accepted draft before the next
        row (the window's first token it takes before the compute, as a decode step's)."""
        op = "sample window"
        self._live(op)
        if self.hidden_output:
            raise InvalidArgumentError(op, "this stage outputs hidden states, not logits")
        rows = self._window_rows.get(int(seq))
        if rows is None:
            raise InvalidArgumentError(op, f"sequence {seq} was not a verify window in the last decode")
        if len(tokens) != len(rows):
            raise InvalidArgumentError(op, f"{len(tokens)} tokens for a window of {len(rows)} rows")
        guided = isinstance(sampler, GuidedSampler)
        if not guided:
            self._smpl1[0] = ffi.NULL if sampler is None else sampler._live(op)
        out: list[int] = []
        last = len(rows) - 1
        for i, row in enumerate(rows):
            if guided:
                token = sampler.sample(self._logits_row(row, op))
            else:
                self._row1[0] = row
                if lib.skippy_sample_rows(self._ptr, self._smpl1, self._row1, 1, self._token1) != 0:
                    raise LlamaError(op, f"logits missing for row {row}")
                token = int(self._token1[0])
            out.append(token)
            if i == last or token != int(tokens[i + 1]):
                break
            if guided:
                sampler.advance(token)  # an accepted draft: the sequence goes on with it
        return out

    def _output_row(self, seq: int, op: str) -> int:
        if self.hidden_output:
            raise InvalidArgumentError(op, "this stage outputs hidden states, not logits")
        row = self._out_rows.get(int(seq))
        if row is None:
            raise InvalidArgumentError(op, f"sequence {seq} was not in the last decode")
        return row

    # -- KV cache, per sequence
    def kv_trim(self, seq: int, n_keep: int) -> None:
        """Drop positions >= n_keep of `seq` (a trim to 0 clears it)."""
        op = "trim KV"
        self._check_seq(seq, op)
        if n_keep < 0:
            raise InvalidArgumentError(op, "n_keep must be >= 0")
        if not lib.llama_memory_seq_rm(self._mem_live(op), int(seq), int(n_keep), -1):
            raise LlamaError(op, f"llama_memory_seq_rm refused to trim sequence {seq} to {n_keep}")

    def kv_clear_seq(self, seq: int) -> None:
        self.kv_trim(seq, 0)

    def kv_copy(self, src: int, dst: int, n_keep: int | None = None) -> None:
        """Make `dst` a copy of `src` (optionally only its first n_keep positions).

        llama.cpp aborts the process on a partial-range copy with the default
        per-sequence KV streams, so this always copies whole and trims after.
        """
        op = "copy KV"
        self._check_seq(src, op)
        self._check_seq(dst, op)
        if src == dst:
            raise InvalidArgumentError(op, "source and destination sequence are the same")
        mem = self._mem_live(op)
        lib.llama_memory_seq_rm(mem, int(dst), -1, -1)
        lib.llama_memory_seq_cp(mem, int(src), int(dst), -1, -1)
        if n_keep is not None:
            self.kv_trim(dst, n_keep)

    def kv_pos_range(self, seq: int) -> tuple[int, int] | None:
        """(min, max) position held for `seq`, or None when it is empty."""
        op = "KV range"
        self._check_seq(seq, op)
        mem = self._mem_live(op)
        hi = int(lib.llama_memory_seq_pos_max(mem, int(seq)))
        if hi < 0:
            return None
        return int(lib.llama_memory_seq_pos_min(mem, int(seq))), hi

    def kv_len(self, seq: int) -> int:
        r = self.kv_pos_range(seq)
        return 0 if r is None else r[1] + 1

    def state_export(self, seq: int) -> bytearray:
        """The sequence's state (its KV), as llama.cpp writes it; a bytearray, not copied again into bytes (a long
        sequence's state is tens of MB)."""
        op = "export sequence state"
        self._check_seq(seq, op)
        ptr = self._live(op)
        size = int(lib.llama_state_seq_get_size(ptr, int(seq)))
        buf = bytearray(size)
        written = int(lib.llama_state_seq_get_data(ptr, ffi.from_buffer("uint8_t[]", buf), size, int(seq)))
        if written != size:
            raise LlamaError(op, f"wrote {written} of {size} bytes")
        return buf

    def state_import(self, seq: int, data: bytes) -> None:
        op = "import sequence state"
        self._check_seq(seq, op)
        if not data:
            raise InvalidArgumentError(op, "empty state")
        read = int(lib.llama_state_seq_set_data(self._live(op), ffi.from_buffer("uint8_t[]", data), len(data),
                                                int(seq)))
        if read != len(data):
            raise LlamaError(op, f"llama.cpp accepted {read} of {len(data)} bytes (state from another model?)")

    def _mem_live(self, op: str):
        self._live(op)
        return self._mem



def _bounds(a: np.ndarray) -> tuple[int, int]:
    """(min, max) of a non-empty int array; a decode step's one row without numpy's reductions (~µs each)."""
    if a.shape[0] == 1:
        v = int(a[0])
        return v, v
    return int(a.min()), int(a.max())
