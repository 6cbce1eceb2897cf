"""How the final stage picks each token: one type from the API surfaces down to the wire and the sampler.

Values are rounded to float32 / checked against int32 when a ``SamplingParams``
is made, because that is what the wire and llama.cpp's C structs carry: a
value equals what every stage sees. ``validate(n_vocab)`` adds the ranges the
sampler needs (``top_p`` in (0, 1], a bias for a token the model has, ...).
The defaults sample nothing away: greedy, no filters, no penalties.
"""

from __future__ import annotations

import math
import struct

import attrs

MAX_LOGIT_BIAS = 1024  # logit-bias entries a request may carry (the wire's limit too)
RANDOM_SEED = 0xFFFFFFFF  # llama.cpp's LLAMA_DEFAULT_SEED, "pick a random seed": the wire's form of None

_F32 = struct.Struct("<f")
_F32_MAX = 3.4028234663852886e38
_I32_MIN, _I32_MAX = -(2**31), 2**31 - 1


class InvalidSampling(ValueError):
    """A sampling parameter no stage could use; ``field`` names it, and so does the message."""

    def __init__(self, field: str, message: str):
        super().__init__(f"{field} {message}")
        self.field = field


def _f32(value: object, field: str) -> float:
    """Round to the nearest float32, so a value equals what the wire carries."""
    if isinstance(value, bool) or not hasattr(value, "__float__"):
        raise InvalidSampling(field, f"must be a number, got {value!r}")
    try:
        return _F32.unpack(_F32.pack(float(value)))[0]
    except (OverflowError, TypeError, ValueError):
        raise InvalidSampling(field, f"must fit a float32, got {value!r}") from None


def _float32_field(default: float, name: str):
    def as_finite_float32(value: object) -> float:
        value = _f32(value, name)
        if not math.isfinite(value):
            raise InvalidSampling(name, f"must be a finite float32, got {value!r}")
        return value

    return attrs.field(default=default, converter=as_finite_float32)


def _int32_field(default: int, name: str):
    def as_int32(value: object) -> int:
        if isinstance(value, bool) or not hasattr(value, "__index__") or not _I32_MIN <= value <= _I32_MAX:
            raise InvalidSampling(name, f"must be an int32, got {value!r}")
        return int(value)

    return attrs.field(default=default, converter=as_int32)


def _as_seed(value: object) -> int | None:
    if value is None:
        return None
    if isinstance(value, bool) or not hasattr(value, "__index__") or not 0 <= value <= RANDOM_SEED:
        raise InvalidSampling("seed", f"must fit in 32 bits, got {value!r}")
    value = int(value)
    return None if value == RANDOM_SEED else value


def _as_bias(value: object) -> tuple[tuple[int, float], ...]:
    out = []
    for token, bias in value:  # type: ignore[attr-defined]
        if isinstance(token, bool) or not hasattr(token, "__index__") or not _I32_MIN <= token <= _I32_MAX:
            raise InvalidSampling("logit_bias", f"token {token!r} does not fit an int32")
        bias = _f32(bias, "logit_bias")
        if math.isnan(bias):
            raise InvalidSampling("logit_bias", f"for token {token} is NaN")
        out.append((int(token), bias))
    if len(out) > MAX_LOGIT_BIAS:
        raise InvalidSampling("logit_bias", f"has {len(out)} entries, at most {MAX_LOGIT_BIAS}")
    return tuple(out)


@attrs.frozen
class SamplingParams:
    """Sampler settings the final stage applies. ``temperature <= 0`` means greedy (argmax); ``seed`` None
    means random; ``logit_bias`` holds ``(token, bias)`` pairs, ``-inf`` banning a token."""

    temperature: float = _float32_field(0.0, "temperature")
    top_k: int = _int32_field(0, "top_k")  # 0: off
    top_p: float = _float32_field(1.0, "top_p")
    min_p: float = _float32_field(0.0, "min_p")
    repeat_penalty: float = _float32_field(1.0, "repeat_penalty")
    presence_penalty: float = _float32_field(0.0, "presence_penalty")
    frequency_penalty: float = _float32_field(0.0, "frequency_penalty")
    penalty_last_n: int = _int32_field(64, "penalty_last_n")
    seed: int | None = attrs.field(default=None, converter=_as_seed)
    logit_bias: tuple[tuple[int, float], ...] = attrs.field(default=(), converter=_as_bias)

    @classmethod
    def greedy(cls) -> SamplingParams:
        return cls()

    @property
    def is_plain_greedy(self) -> bool:
        """Argmax of the raw logits: no sampler chain needed."""
        return (self.temperature <= 0 and not self.logit_bias and self.repeat_penalty == 1.0
                and self.presence_penalty == 0.0 and self.frequency_penalty == 0.0)

    def validate(self, n_vocab: int) -> None:
        """The ranges llama.cpp's samplers need, for a model of ``n_vocab`` tokens."""
        checks = [
            (self.top_k >= 0, "top_k", "must be an int32 >= 0"),
            (0.0 < self.top_p <= 1.0, "top_p", "must be in (0, 1]"),
            (0.0 <= self.min_p <= 1.0, "min_p", "must be in [0, 1]"),
            (self.repeat_penalty > 0, "repeat_penalty", "must be a finite float32 > 0"),
            (self.penalty_last_n >= -1, "penalty_last_n", "must be an int32 >= -1"),
            (len(self.logit_bias) <= n_vocab, "logit_bias", "has more entries than the vocabulary has tokens"),
        ]
        for ok, field, message in checks:
            if not ok:
                raise InvalidSampling(field, message)
        for token, bias in self.logit_bias:
            if not 0 <= token < n_vocab:
                raise InvalidSampling("logit_bias", f"token {token} is outside the vocabulary")
            if bias == math.inf:  # -inf bans a token; +inf has no meaning to the sampler
                raise InvalidSampling("logit_bias", f"for token {token} must be a finite float32 or -inf")
