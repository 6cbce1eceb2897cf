"""How the final stage picks each token: one type from the API surfaces down to the wire and the sampler.

Values are rounded to float32 / checked against int32 when a ``SamplingParams``
is made, because that is what the wire and llama.cpp's C structs carry: a
value equals what every stage sees. ``validate(n_vocab)`` adds the ranges the
sampler needs (``top_p`` in (0, 1], a bias for a token the model has, ...).
The defaults sample nothing away: greedy, no filters, no penalties.
"""

from __future__ import annotations

import json
import math
import struct
from collections.abc import Mapping

import attrs

MAX_LOGIT_BIAS = 1024  # logit-bias entries a request may carry (the wire's limit too)
MAX_TOP_LOGPROBS = 20  # alternatives a token's logprobs may list (OpenAI's limit)
MAX_CONSTRAINT_BYTES = 65531  # UTF-8 bytes of a constraint's text (the wire's u16 extension less its 4-byte head)
RANDOM_SEED = 0xFFFFFFFF  # llama.cpp's LLAMA_DEFAULT_SEED, "pick a random seed": the wire's form of None

_F32 = struct.Struct("<f")
_F32_MAX = 3.4028234663852886e38
_I32_MIN, _I32_MAX = -(2**31), 2**31 - 1


class InvalidSampling(ValueError):
    """A sampling parameter no stage could use; ``field`` names it, and so does the message."""

    def __init__(self, field: str, message: str):
        super().__init__(f"{field} {message}")
        self.field = field


CONSTRAINT_KINDS = ("json_schema", "json_object", "grammar")


class InvalidConstraint(InvalidSampling):
    """A schema or grammar no stage could constrain a generation by: invalid, unsupported, or not compiling."""


@attrs.frozen
class Constraint:
    """What a generation's output must match, applied to the logits on the stage that samples, every step.

    ``kind``: ``json_schema`` (``text`` is the schema as JSON), ``json_object`` (any JSON object; no text) or
    ``grammar`` (``text`` is a Lark grammar as llguidance reads it, or llama.cpp's GBNF). Make one with
    :meth:`json_schema`, :meth:`json_object` or :meth:`grammar`, which check it (``InvalidConstraint`` naming
    the problem); ``compiled()`` is the grammar the matcher runs (llguidance's form). The generation ends
    when the output is complete: the end of text is allowed only then, and forced once nothing can follow.
    """

    kind: str = attrs.field(validator=attrs.validators.in_(CONSTRAINT_KINDS))
    text: str = attrs.field(default="", validator=attrs.validators.instance_of(str))

    @classmethod
    def json_schema(cls, schema: Mapping | str | bool) -> Constraint:
        """Output that is JSON valid against ``schema`` (a dict, or its JSON text); checked here."""
        if isinstance(schema, str):
            try:
                schema = json.loads(schema)
            except ValueError as exc:
                raise InvalidConstraint("json_schema", f"is not JSON: {exc}") from None
        if not isinstance(schema, (Mapping, bool)):
            raise InvalidConstraint("json_schema", f"must be a JSON object, got {type(schema).__name__}")
        made = cls("json_schema", json.dumps(schema, separators=(",", ":"), ensure_ascii=False))
        made.check()
        return made

    @classmethod
    def json_object(cls) -> Constraint:
        """Output that is one JSON object, any object."""
        return cls("json_object")

    @classmethod
    def grammar(cls, text: str) -> Constraint:
        """Output that matches the grammar ``text`` (Lark, as llguidance reads it, or GBNF); checked here."""
        made = cls("grammar", text)
        made.check()
        return made

    def check(self) -> None:
        """Raise InvalidConstraint (naming the problem) unless the schema or grammar compiles."""
        if len(self.text.encode("utf-8")) > MAX_CONSTRAINT_BYTES:
            raise InvalidConstraint(self.kind, f"is longer than {MAX_CONSTRAINT_BYTES} bytes")
        if self.kind == "json_schema":
            _check_schema(self.text)
        self.compiled()

    def compiled(self) -> str:
        """The grammar llguidance's matcher runs; InvalidConstraint if it does not compile."""
        import llguidance

        try:
            if self.kind == "json_object":
                grammar = llguidance.LLMatcher.grammar_from_json_schema({"type": "object"}, defaults=_JSON_OPTIONS)
            elif self.kind == "json_schema":
                grammar = llguidance.LLMatcher.grammar_from_json_schema(self.text, defaults=_JSON_OPTIONS)
            else:
                if not self.text.strip():
                    raise InvalidConstraint("grammar", "is empty")
                grammar = llguidance.grammar_from("grammar", self.text)
            error = llguidance.LLMatcher.validate_grammar(grammar)
        except InvalidConstraint:
            raise
        except ValueError as exc:
            raise InvalidConstraint(self.kind, _one_line(str(exc))) from None
        except (KeyboardInterrupt, SystemExit):
            raise
        except BaseException as exc:  # a panic in llguidance's Rust is a BaseException: the input's fault
            raise InvalidConstraint(self.kind, f"does not compile ({type(exc).__name__}: {_one_line(str(exc))})") \
                from None
        if error:
            what = "schema" if self.kind == "json_schema" else "grammar"
            raise InvalidConstraint(self.kind, f"{what} not supported: {_one_line(error)}")
        return grammar


# JSON as a model writes it compactly: no free whitespace, so a sampled run of spaces cannot stall the output
_JSON_OPTIONS = {"whitespace_flexible": False, "item_separator": ", ", "key_separator": ": "}


def _one_line(text: str) -> str:
    return " ".join(text.split())


def preload() -> None:
    """Import what checking and compiling a constraint takes (jsonschema, llguidance: a fifth of a second),
    so that the first constrained request does not wait for the imports on the event loop. Blocking: a head
    calls it in a worker thread while it loads."""
    import llguidance  # noqa: F401

    try:
        import jsonschema  # noqa: F401
    except ImportError:  # pragma: no cover - a dependency
        pass


def _check_schema(text: str) -> None:
    """A schema that is not one by JSON Schema's meta-schema (what the draft it names, or 2020-12, allows)."""
    try:
        import jsonschema
    except ImportError:  # pragma: no cover - a dependency; llguidance still checks what it compiles
        return
    schema = json.loads(text)
    try:
        jsonschema.validators.validator_for(schema, default=jsonschema.Draft202012Validator).check_schema(schema)
    except jsonschema.SchemaError as exc:
        where = "/".join(str(p) for p in exc.path)
        raise InvalidConstraint("json_schema", f"is not a valid JSON schema: {_one_line(exc.message)}"
                                + (f" (at {where})" if where else "")) from None


def _as_constraint(value: object) -> Constraint | None:
    if value is None or isinstance(value, Constraint):
        return value
    raise InvalidSampling("constraint", f"must be a Constraint, got {type(value).__name__}")


def _as_logprobs(value: object) -> int | None:
    if value is None:
        return None
    if isinstance(value, bool) or not hasattr(value, "__index__") or not 0 <= value <= MAX_TOP_LOGPROBS:
        raise InvalidSampling("logprobs", f"must be an integer in [0, {MAX_TOP_LOGPROBS}], got {value!r}")
    return int(value)


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
    # what the output must match (None: anything), and the logprobs each token carries back (None: none; n: the
    # sampled token's and its n most likely alternatives')
    constraint: Constraint | None = attrs.field(default=None, converter=_as_constraint)
    logprobs: int | None = attrs.field(default=None, converter=_as_logprobs)

    @classmethod
    def greedy(cls) -> SamplingParams:
        return cls()

    @property
    def is_plain_greedy(self) -> bool:
        """Argmax of the raw logits: no sampler chain needed (and no constraint or logprobs)."""
        return (self.temperature <= 0 and not self.logit_bias and self.repeat_penalty == 1.0
                and self.presence_penalty == 0.0 and self.frequency_penalty == 0.0 and not self.guided)

    @property
    def needs_chain(self) -> bool:
        """Whether llama.cpp's sampler chain has work: anything but the argmax of the logits."""
        return (self.temperature > 0 or bool(self.logit_bias) or self.repeat_penalty != 1.0
                or self.presence_penalty != 0.0 or self.frequency_penalty != 0.0)

    @property
    def guided(self) -> bool:
        """Sampled by the Python path on the final stage: a constraint masks the logits, or logprobs go back."""
        return self.constraint is not None or self.logprobs is not None

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
