"""A loaded GGUF (a whole model or one stage slice of it): metadata, the vocabulary, chat templates."""

from __future__ import annotations

import os
import threading
import weakref
from collections.abc import Iterable, Mapping, Sequence
from pathlib import Path

import attrs
import numpy as np

from skippyd.runtime.llama.devices import check_room, placement
from skippyd.runtime.llama.ffi import (
    InvalidArgumentError,
    LlamaError,
    ModelLoadError,
    NativeObject,
    backend_init,
    ffi,
    lib,
    read_string,
)

GGUF_MAGIC = b"GGUF"


@attrs.frozen
class StageInfo:
    """Which layers of the source model a GGUF holds, from the slicer's `skippy.*` keys."""

    layer_start: int
    layer_end: int
    n_layer_total: int
    output: str  # "hidden" (residual stream after the last layer) or "logits"
    source_sha256: str | None = None
    is_slice: bool = False

    @property
    def is_first(self) -> bool:
        return self.layer_start == 0

    @property
    def is_last(self) -> bool:
        return self.output == "logits"



class Model(NativeObject):
    """A loaded GGUF: a whole model or one stage slice of it."""

    _kind = "model"

    def __init__(self, path: str | os.PathLike, *, n_gpu_layers: int = 0, vocab_only: bool = False):
        self._ptr = ffi.NULL
        self._contexts = weakref.WeakSet()  # its contexts (context.py adds each): closed before the model
        self._piece_cache: dict[int, bytes] = {}
        self._eog_tokens: np.ndarray | None = None
        self._lltokenizer = None  # llguidance's LLTokenizer, made on first use or by prepare()
        self._lltokenizer_lock = threading.Lock()
        self.path = Path(path)
        _check_gguf_file(self.path)
        backend_init()
        params = lib.llama_model_default_params()
        params.n_gpu_layers = int(n_gpu_layers)
        params.vocab_only = bool(vocab_only)
        params.progress_callback = lib.skippy_progress_quiet
        ptr = lib.llama_model_load_from_file(os.fsencode(self.path), params)
        if ptr == ffi.NULL:
            raise ModelLoadError("load model", f"llama.cpp could not load {self.path}")
        self._ptr = ptr
        self._vocab = lib.llama_model_get_vocab(ptr)
        self.n_embd = int(lib.llama_model_n_embd(ptr))
        self.n_embd_inp = int(lib.llama_model_n_embd_inp(ptr))
        self.n_layer = int(lib.llama_model_n_layer(ptr))
        self.n_vocab = int(lib.llama_vocab_n_tokens(self._vocab))
        self.n_ctx_train = int(lib.llama_model_n_ctx_train(ptr))
        # positions per row given as embeddings: 4 (time, row, column, unused) for M-RoPE, else 1
        rope = lib.llama_model_rope_type(ptr)
        self.n_pos_per_embd = 4 if rope in (lib.LLAMA_ROPE_TYPE_MROPE, lib.LLAMA_ROPE_TYPE_IMROPE) else 1
        self.architecture = self.meta("general.architecture") or "unknown"
        self.name = self.meta("general.name") or self.path.stem
        self.stage = self._read_stage_info()
        self.n_gpu_layers = int(n_gpu_layers)  # as llama.cpp took it: -1 all, else the last N layers
        self.bos = int(lib.llama_vocab_bos(self._vocab))
        self.eos = int(lib.llama_vocab_eos(self._vocab))

    # -- lifetime
    def close(self) -> None:
        for ctx in list(self._contexts):
            ctx.close()
        if self._ptr != ffi.NULL:
            lib.llama_model_free(self._ptr)
            self._ptr = ffi.NULL
            self._vocab = ffi.NULL

    def check_gpu_room(self, n_ctx_per_seq: int, n_seq: int, n_ubatch: int) -> None:
        """Raise GpuMemoryError if this model's layers on the GPU and their KV cache for ``n_seq`` lanes of
        ``n_ctx_per_seq`` tokens would not fit the device (see devices.check_room)."""
        ptr = self._live("check GPU memory")
        arch = self.architecture
        n_head = max(1, int(lib.llama_model_n_head(ptr)))
        head_dim = self.n_embd // n_head
        k_len = int(self.meta(f"{arch}.attention.key_length") or head_dim)
        v_len = int(self.meta(f"{arch}.attention.value_length") or head_dim)
        kv_per_token_layer = int(lib.llama_model_n_head_kv(ptr)) * (k_len + v_len) * 2  # f16 K and V
        check_room(self.n_gpu_layers, self.n_layer, int(lib.llama_model_size(ptr)), kv_per_token_layer,
                   n_ctx_per_seq, n_seq, int(lib.llama_model_n_swa(ptr)), n_ubatch)

    def placement(self) -> dict:
        """Where this model computes: backend, device, its memory and the layers on the GPU (for status)."""
        return placement(self.n_gpu_layers, self.n_layer)

    # -- metadata
    def meta(self, key: str) -> str | None:
        return read_string(lib.llama_model_meta_val_str, self._live("read metadata"), key.encode())

    def _read_stage_info(self) -> StageInfo:
        output = self.meta("skippy.output")
        if output is None:
            return StageInfo(0, self.n_layer, self.n_layer, "logits")
        if output not in ("hidden", "logits"):
            raise ModelLoadError("load model", f"{self.path}: skippy.output is {output!r}, not hidden or logits")
        try:
            start = int(self.meta("skippy.layer_start") or 0)
            end = int(self.meta("skippy.layer_end") or self.n_layer)
            total = int(self.meta("skippy.n_layer_total") or self.n_layer)
        except ValueError as exc:
            raise ModelLoadError("load model", f"{self.path}: malformed skippy.* layer keys: {exc}") from exc
        if end - start != self.n_layer:
            raise ModelLoadError(
                "load model", f"{self.path}: skippy range [{start},{end}) disagrees with block_count {self.n_layer}"
            )
        return StageInfo(start, end, total, output, self.meta("skippy.source_sha256"), is_slice=True)

    # -- text
    def tokenize(self, text: str, *, add_special: bool = True, parse_special: bool = True) -> np.ndarray:
        """Token ids of `text` (int32). `add_special` adds BOS where the model wants it."""
        vocab = self._live("tokenize") and self._vocab
        data = text.encode("utf-8")
        cap = len(data) + 8
        while True:
            out = np.empty(cap, dtype=np.int32)
            n = lib.llama_tokenize(vocab, data, len(data), ffi.from_buffer("llama_token[]", out), cap,
                                   add_special, parse_special)
            if n >= 0:
                return out[:n].copy()
            if -n <= cap:
                raise LlamaError("tokenize", f"llama_tokenize failed ({n})")
            cap = -n

    def token_piece(self, token: int, *, special: bool = False) -> bytes:
        """The bytes of one token (may be part of a UTF-8 character). Cached per token."""
        key = token if not special else -1 - token
        piece = self._piece_cache.get(key)
        if piece is None:
            self._check_token(token, "token to piece")
            size = 32
            while True:
                buf = ffi.new("char[]", size)
                n = lib.llama_token_to_piece(self._vocab, int(token), buf, size, 0, special)
                if n >= 0:
                    piece = ffi.buffer(buf, n)[:]
                    break
                size = -n
            self._piece_cache[key] = piece
        return piece

    def detokenize(self, tokens: Iterable[int], *, special: bool = False) -> str:
        return b"".join(self.token_piece(int(t), special=special) for t in tokens).decode("utf-8", "replace")

    def is_eog(self, token: int) -> bool:
        return bool(lib.llama_vocab_is_eog(self._live("is_eog") and self._vocab, int(token)))

    def eog_tokens(self) -> np.ndarray:
        """The vocabulary's end-of-generation tokens (the EOS at least), found once per model (in one C call)."""
        eog = self._eog_tokens
        if eog is None:
            vocab = self._live("eog tokens") and self._vocab
            out = np.empty(self.n_vocab, dtype=np.int32)
            n = lib.skippy_vocab_eog(vocab, self.n_vocab, ffi.from_buffer("llama_token[]", out))
            eog = self._eog_tokens = out[:n].copy() if n else np.array([self.eos], dtype=np.int32)
        return eog

    def vocabulary(self) -> tuple[list[bytes], list[int]]:
        """Every token's bytes (special tokens shown) and the ids of the control tokens (those whose text shows
        only as special), read in one C call, which runs without the GIL."""
        vocab = self._live("read the vocabulary") and self._vocab
        n_vocab = self.n_vocab
        offsets = np.empty(n_vocab + 1, dtype=np.int64)
        control = np.empty(n_vocab, dtype=np.uint8)
        cap = 16 * n_vocab
        while True:
            buf = bytearray(cap)
            need = lib.skippy_vocab_pieces(vocab, n_vocab, ffi.from_buffer(buf), cap,
                                           ffi.from_buffer("int64_t[]", offsets), ffi.from_buffer("uint8_t[]", control))
            if need <= cap:
                break
            cap = need
        data, bounds = bytes(memoryview(buf)[:need]), offsets.tolist()
        return [data[a:b] for a, b in zip(bounds, bounds[1:])], np.flatnonzero(control).tolist()

    def lltokenizer(self):
        """llguidance's view of this model's vocabulary (each token's bytes, the special tokens, the
        end-of-generation tokens), made once per model and shared by its matchers. Making it holds the GIL
        in llguidance's Rust for a while (~0.2 s for a 49k vocabulary, over 1 s for 262k), which would stall
        the event loop of whoever waits: a stage that samples makes it while it loads (:meth:`prepare`)."""
        with self._lltokenizer_lock:
            if self._lltokenizer is None:
                self._lltokenizer = self._make_lltokenizer()
            return self._lltokenizer

    def prepare(self) -> None:
        """Make now, in the calling thread, what a constrained generation needs of the vocabulary (the stage
        that samples calls it while it loads, before it serves)."""
        self.eog_tokens()
        self.lltokenizer()

    def _make_lltokenizer(self):
        import llguidance

        tokens, special = self.vocabulary()
        eog = self.eog_tokens().tolist()
        model = self

        class _Vocab:  # what llguidance's TokenizerWrapper reads
            eos_token_id = eog[0]
            bos_token_id = self.bos if self.bos >= 0 else None
            special_token_ids = special

            def __init__(self):
                self.tokens = tokens

            def __call__(self, text):
                if isinstance(text, bytes):
                    text = text.decode("utf-8", "replace")
                return model.tokenize(text, add_special=False, parse_special=False).tolist()

        return llguidance.LLTokenizer(llguidance.TokenizerWrapper(_Vocab()), n_vocab=self.n_vocab, eos_token=eog)

    def _check_token(self, token: int, op: str) -> None:
        self._live(op)
        if not 0 <= int(token) < self.n_vocab:
            raise InvalidArgumentError(op, f"token {token} outside the vocabulary [0, {self.n_vocab})")

    @property
    def chat_template(self) -> str | None:
        p = lib.llama_model_chat_template(self._live("chat template"), ffi.NULL)
        return None if p == ffi.NULL else ffi.string(p).decode("utf-8", "replace")

    def apply_chat_template(self, messages: Sequence[Mapping[str, str]], *, add_assistant: bool = True,
                            template: str | None = None) -> str:
        """Render `messages` ({role, content}) with the model's template (llama.cpp's built-in engine)."""
        tmpl = template or self.chat_template
        if tmpl is None:
            raise InvalidArgumentError("apply chat template", f"{self.name} has no chat template; use a raw prompt")
        keep = []  # the char[] objects must outlive the C call
        chat = ffi.new("llama_chat_message[]", len(messages))
        for i, msg in enumerate(messages):
            role = ffi.new("char[]", str(msg["role"]).encode())
            content = ffi.new("char[]", str(msg["content"]).encode())
            keep += [role, content]
            chat[i].role, chat[i].content = role, content
        tmpl_c = ffi.new("char[]", tmpl.encode())
        size = 1024 + sum(len(str(m["content"])) * 2 for m in messages)
        while True:
            buf = ffi.new("char[]", size)
            n = lib.llama_chat_apply_template(tmpl_c, chat, len(messages), add_assistant, buf, size)
            if n < 0:
                raise InvalidArgumentError("apply chat template", "llama.cpp does not support this chat template")
            if n < size:
                return ffi.string(buf, n).decode("utf-8", "replace")
            size = n + 1


def _check_gguf_file(path: Path) -> None:
    op = "load model"
    if not path.exists():
        raise ModelLoadError(op, f"{path}: no such file")
    if not path.is_file():
        raise ModelLoadError(op, f"{path}: not a regular file")
    with open(path, "rb") as f:
        head = f.read(4)
    if head != GGUF_MAGIC:
        raise ModelLoadError(op, f"{path}: not a GGUF file (magic {head!r})")

