"""Sampling on the stage that samples: llama.cpp sampler chains, and the guided sampler (constraints, logprobs)."""

from __future__ import annotations

import math
from collections.abc import Iterable

import attrs
import numpy as np

from skippyd.runtime.llama.ffi import InvalidArgumentError, LlamaError, NativeObject, ffi, lib
from skippyd.runtime.llama.model import Model
from skippyd.sampling import Constraint, InvalidConstraint, InvalidSampling, SamplingParams

LLAMA_DEFAULT_SEED = int(lib.LLAMA_DEFAULT_SEED)


def _validate(model: Model, params: SamplingParams) -> None:
    try:
        params.validate(model.n_vocab)
    except InvalidSampling as exc:
        raise InvalidArgumentError("sampling parameters", str(exc)) from None


class Sampler(NativeObject):
    """A llama.cpp sampler chain for one generation; it remembers accepted tokens (penalties)."""

    _kind = "sampler"

    def __init__(self, model: Model, params: SamplingParams, *, validated: bool = False):
        if not validated:
            _validate(model, params)
        self.params = params
        cparams = lib.llama_sampler_chain_default_params()
        cparams.no_perf = True
        chain = lib.llama_sampler_chain_init(cparams)
        if chain == ffi.NULL:
            raise LlamaError("create sampler", "llama_sampler_chain_init returned NULL")
        self._ptr = chain
        add = lambda s: lib.llama_sampler_chain_add(chain, s)  # noqa: E731 - the chain owns s from here
        if params.logit_bias:
            biases = ffi.new("llama_logit_bias[]", len(params.logit_bias))
            for i, (tok, bias) in enumerate(params.logit_bias):
                biases[i].token, biases[i].bias = int(tok), float(bias)
            add(lib.llama_sampler_init_logit_bias(model.n_vocab, len(params.logit_bias), biases))
        if params.repeat_penalty != 1.0 or params.presence_penalty or params.frequency_penalty:
            add(lib.llama_sampler_init_penalties(model.n_vocab, params.penalty_last_n, params.repeat_penalty,
                                                 params.frequency_penalty, params.presence_penalty))
        if params.temperature <= 0:
            add(lib.llama_sampler_init_greedy())
        else:
            if params.top_k > 0:
                add(lib.llama_sampler_init_top_k(params.top_k))
            if params.top_p < 1.0:
                add(lib.llama_sampler_init_top_p(params.top_p, 1))
            if params.min_p > 0.0:
                add(lib.llama_sampler_init_min_p(params.min_p, 1))
            add(lib.llama_sampler_init_temp(params.temperature))
            seed = LLAMA_DEFAULT_SEED if params.seed is None else params.seed
            add(lib.llama_sampler_init_dist(seed))

    def accept(self, tokens: Iterable[int]) -> None:
        """Feed tokens the penalties should know about (e.g. the prompt)."""
        ptr = self._live("sample")
        for t in tokens:
            lib.llama_sampler_accept(ptr, int(t))

    def reset(self) -> None:
        lib.llama_sampler_reset(self._live("sample"))

    def close(self) -> None:
        if self._ptr != ffi.NULL:
            lib.llama_sampler_free(self._ptr)
            self._ptr = ffi.NULL


def sampler_for(model: Model, params: SamplingParams) -> Sampler | GuidedSampler | None:
    """What the stage that samples uses for a generation: None (the argmax, in native code), a llama.cpp
    chain, or (a constraint, or logprobs) a :class:`GuidedSampler`."""
    if params.guided:
        return GuidedSampler(model, params)
    return None if params.is_plain_greedy else Sampler(model, params)


_TOKEN_DATA = np.dtype([("id", "<i4"), ("logit", "<f4"), ("p", "<f4")])  # llama_token_data


@attrs.frozen
class TokenLogprobs:
    """A sampled token's log-probability and its most likely alternatives ``(token, logprob)``, most likely
    first, under the distribution it was sampled from."""

    token: int
    logprob: float
    top: tuple[tuple[int, float], ...] = ()


class GuidedSampler:
    """A generation sampled in Python on the final stage: the row's logits are read in place, the
    constraint's token mask (llguidance) applied, the token picked by the session's llama.cpp chain (or the
    argmax) and its logprobs kept (``last``). The matcher follows the tokens the sequence is given
    (:meth:`advance`, with each decode step's token: a replay after a resume feeds it the same way). Once the
    constraint is complete only the end of generation is allowed; once nothing can follow, it is forced.

    Logprobs come from the distribution sampled from: the chain's, after its biases, penalties, filters and
    temperature (tokens it filtered out have none); for greedy decoding, the softmax of the (masked) logits.
    """

    def __init__(self, model: Model, params: SamplingParams):
        _validate(model, params)
        self.params = params
        self.n_vocab = model.n_vocab
        self.top_n = params.logprobs
        self.last: TokenLogprobs | None = None
        self.chain = Sampler(model, params, validated=True) if params.needs_chain else None
        self.matcher = None
        self._eog = model.eog_tokens()
        if params.constraint is not None:
            self.matcher = _matcher(model, params.constraint)
            self._mask = np.zeros((model.n_vocab + 31) // 32, dtype=np.int32)
            self._mask_address = int(ffi.cast("uintptr_t", ffi.from_buffer(self._mask)))
        self._candidates = ffi.new("llama_token_data_array *")  # the chain's input, reused for every token

    def accept(self, tokens: Iterable[int]) -> None:
        """Feed the prompt to the chain's penalties (the constraint starts after it)."""
        if self.chain is not None:
            self.chain.accept(tokens)

    def allowed(self) -> np.ndarray | None:
        """The token ids the constraint allows next (None: any)."""
        m = self.matcher
        if m is None:
            return None
        if m.is_error() or m.is_stopped():
            return self._eog
        m.unsafe_compute_mask_ptr(self._mask_address, self._mask.nbytes)
        bits = np.unpackbits(self._mask.view(np.uint8), bitorder="little")[: self.n_vocab]
        ids = np.flatnonzero(bits).astype(np.int32)
        return ids if len(ids) else self._eog

    def sample(self, logits: np.ndarray) -> int:
        """The next token from one row's logits (float32 [n_vocab], read only)."""
        ids = self.allowed()
        cand_logits = logits if ids is None else logits[ids]
        if self.chain is None:
            i = int(np.argmax(cand_logits))
            token = i if ids is None else int(ids[i])
            if self.top_n is not None:
                self.last = self._logprobs(token, i, ids, cand_logits, normalized=False)
        else:
            cand = np.empty(len(cand_logits), dtype=_TOKEN_DATA)
            cand["id"] = np.arange(self.n_vocab, dtype=np.int32) if ids is None else ids
            cand["logit"] = cand_logits
            cand["p"] = 0.0
            arr, data = self._candidates, ffi.from_buffer("llama_token_data[]", cand)
            arr.data, arr.size, arr.selected, arr.sorted = data, len(cand), -1, False
            chain = self.chain._live("sample")
            lib.llama_sampler_apply(chain, arr)
            if not 0 <= arr.selected < arr.size:
                raise LlamaError("sample", "the sampler chain selected no token")
            if arr.data == data:
                kept = cand[: arr.size]
            else:  # the chain pointed data at a buffer of its own: read there (before its next use)
                kept = np.frombuffer(ffi.buffer(arr.data, arr.size * _TOKEN_DATA.itemsize), dtype=_TOKEN_DATA)
            token = int(kept["id"][arr.selected])
            lib.llama_sampler_accept(chain, token)
            if self.top_n is not None:
                if self.params.temperature > 0:  # the dist sampler's probabilities
                    with np.errstate(divide="ignore"):
                        self.last = self._logprobs(token, arr.selected, kept["id"], np.log(kept["p"]), normalized=True)
                else:  # greedy after biases / penalties: the softmax of the logits it chose from
                    self.last = self._logprobs(token, arr.selected, kept["id"], kept["logit"], normalized=False)
        return token

    def advance(self, token: int) -> None:
        """The sequence goes on with ``token`` (the one sampled last): the constraint's matcher takes it. A token
        the constraint does not allow puts the matcher in error, after which only the end is allowed."""
        if self.matcher is not None and not self.matcher.is_stopped():
            self.matcher.consume_token(int(token))

    def _logprobs(self, token: int, index: int, ids: np.ndarray | None, scores: np.ndarray, *,
                  normalized: bool) -> TokenLogprobs:
        """``token`` (at ``index`` of the candidates ``ids``, None: the whole vocabulary) and the ``top_n`` best
        candidates, from ``scores``: log-probabilities already, or logits to normalize (log-softmax). A few
        passes over the vocabulary, no more: this runs for every token."""
        offset = 0.0
        if not normalized:
            top = float(scores.max())
            if math.isfinite(top):
                offset = top + math.log(float(np.exp(scores - top).sum(dtype=np.float64)))
        n = min(self.top_n, len(scores))
        best = np.argpartition(scores, len(scores) - n)[len(scores) - n:] if n else np.empty(0, dtype=np.int64)
        best = best[np.argsort(-scores[best], kind="stable")]
        token_of = (lambda i: int(i)) if ids is None else (lambda i: int(ids[i]))
        alternatives = tuple((token_of(i), float(scores[i]) - offset) for i in best if np.isfinite(scores[i]))
        return TokenLogprobs(token, float(scores[index]) - offset, alternatives)

    def reset(self) -> None:
        if self.chain is not None:
            self.chain.reset()
        if self.matcher is not None:
            self.matcher.reset()

    def close(self) -> None:
        if self.chain is not None:
            self.chain.close()


def _matcher(model: Model, constraint: Constraint):
    """llguidance's matcher of ``constraint`` over the model's vocabulary; InvalidArgumentError naming the
    problem if it does not compile."""
    import llguidance

    try:
        grammar = constraint.compiled()
        matcher = llguidance.LLMatcher(model.lltokenizer(), grammar, log_level=0)
    except InvalidConstraint as exc:
        raise InvalidArgumentError("constraint", str(exc)) from None
    except (KeyboardInterrupt, SystemExit):
        raise
    except BaseException as exc:  # a panic in llguidance's Rust is a BaseException: a bad input, not a dead stage
        raise InvalidArgumentError("constraint", f"{constraint.kind}: {type(exc).__name__}: {exc}") from None
    if matcher.is_error():
        raise InvalidArgumentError("constraint", f"{constraint.kind}: {matcher.get_error()}")
    return matcher

