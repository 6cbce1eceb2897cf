"""Control-channel messages: attrs classes in tagged unions, one cattrs converter.

Every JSON object carries ``"type"`` (the class name in snake_case) and ``"id"``
(chosen by the client, echoed in every reply to that request). Unknown keys
are errors; a validation error names the path of the bad field.
"""

from __future__ import annotations

import json
import math
import re
import struct
from typing import Any

import attrs
from cattrs.strategies import configure_tagged_union

from skippyd.convert import Invalid, converter, structure_errors
from skippyd.convert import show as _show
from skippyd.sampling import Constraint, InvalidSampling, SamplingParams

_SAMPLING = SamplingParams()  # the defaults a request leaves out


def _snake(cls: type) -> str:
    return re.sub(r"(?<!^)(?=[A-Z])", "_", cls.__name__).lower()


# ---------------------------------------------------------------- requests
FLOAT32_MAX = 3.4028234663852886e38
INT32_MAX = 2**31 - 1


def _float32(_inst, attribute, value: float) -> None:
    """Sampling parameters travel between stages as float32: a value must survive the trip."""
    if not math.isfinite(value) or abs(value) > FLOAT32_MAX:
        raise Invalid(f"must be a finite number of at most {FLOAT32_MAX:.7g} in magnitude (a float32), "
                      f"got {_show(value)}", attribute.name)


def _positive_float32(inst, attribute, value: float) -> None:
    _float32(inst, attribute, value)
    if not struct.unpack("<f", struct.pack("<f", value))[0] > 0:
        raise Invalid(f"must be > 0 (as a float32), got {_show(value)}", attribute.name)


def _int32(_inst, attribute, value: int) -> None:
    if value > INT32_MAX:
        raise Invalid(f"must be at most {INT32_MAX}, got {_show(value)}", attribute.name)


@attrs.frozen
class Generate:
    id: str
    prompt: str = ""
    system: str | None = None
    messages: list[dict[str, str]] = attrs.field(factory=list)
    raw: bool = False
    max_tokens: int = 256
    temperature: float = attrs.field(default=_SAMPLING.temperature, validator=_float32)
    top_k: int = attrs.field(default=_SAMPLING.top_k, validator=_int32)
    top_p: float = attrs.field(default=_SAMPLING.top_p, validator=_float32)
    min_p: float = attrs.field(default=_SAMPLING.min_p, validator=_float32)
    repeat_penalty: float = attrs.field(default=_SAMPLING.repeat_penalty, validator=_positive_float32)
    presence_penalty: float = attrs.field(default=_SAMPLING.presence_penalty, validator=_float32)
    frequency_penalty: float = attrs.field(default=_SAMPLING.frequency_penalty, validator=_float32)
    seed: int | None = _SAMPLING.seed
    stop: list[str] = attrs.field(factory=list)
    stream: bool = True
    # what the output must match: a JSON schema (its JSON text), any JSON object, or a grammar (Lark as
    # llguidance reads it, or GBNF); at most one of them
    json_schema: str | None = None
    json_object: bool = False
    grammar: str | None = None
    logprobs: int | None = None  # each token's logprob and this many alternatives' (0..20); None: none
    speculate: bool | None = None  # speculative decoding for this generation; None: the daemon's setting
    ignore_eos: bool = False  # the end-of-generation token ends nothing: the reply runs to max_tokens (or a stop)
    # images (PNG, JPEG, ...: the file's bytes, base64), one per media marker of the prompt, in order; a prompt
    # without markers gets them before its text
    images: list[str] = attrs.field(factory=list)

    def sampling(self) -> SamplingParams:
        """Raises InvalidSampling (what the checks above cannot see: a seed beyond 32 bits, a schema or a grammar
        that does not compile, say)."""
        asked = [name for name, value in (("json_schema", self.json_schema), ("json_object", self.json_object or None),
                                          ("grammar", self.grammar)) if value is not None]
        if len(asked) > 1:
            raise InvalidSampling(asked[1], f"cannot go with {asked[0]}: one constraint per generation")
        constraint = (Constraint.json_schema(self.json_schema) if self.json_schema is not None
                      else Constraint.json_object() if self.json_object
                      else Constraint.grammar(self.grammar) if self.grammar is not None else None)
        return SamplingParams(temperature=self.temperature, top_k=self.top_k, top_p=self.top_p, min_p=self.min_p,
                              repeat_penalty=self.repeat_penalty, presence_penalty=self.presence_penalty,
                              frequency_penalty=self.frequency_penalty, seed=self.seed, constraint=constraint,
                              logprobs=self.logprobs)


@attrs.frozen
class SessionsList:
    id: str


@attrs.frozen
class SessionShow:
    id: str
    session_id: int


@attrs.frozen
class SessionKill:
    id: str
    session_id: int
    wait: bool = False  # answer only once the session is released everywhere (else at once)


@attrs.frozen
class LanesList:
    id: str


@attrs.frozen
class LanesDrain:
    id: str


@attrs.frozen
class LanesUndrain:
    id: str


@attrs.frozen
class CacheShow:
    id: str


@attrs.frozen
class CacheClear:
    id: str
    disk: bool = False  # the disk tiers too


@attrs.frozen
class Status:
    id: str


@attrs.frozen
class Receipts:
    id: str
    limit: int = 20


# ---------------------------------------------------------------- deployment (skippyctl plan / deploy)
def _sha256(_inst, attribute, value: str) -> None:
    if not re.fullmatch(r"[0-9a-f]{64}", value):
        raise Invalid(f"must be a sha256 (64 lowercase hex digits), got {_show(value)}", attribute.name)


def _non_negative(_inst, attribute, value: int) -> None:
    if value < 0:
        raise Invalid(f"must be at least 0, got {_show(value)}", attribute.name)


@attrs.frozen
class Host:
    """What this host offers a deployment: cores, memory, disk, features, the slices it holds, its stage."""

    id: str


@attrs.frozen
class SliceOffer:
    """Before sending a slice: is it held here (nothing to send), or how much of it has arrived?"""

    id: str
    sha256: str = attrs.field(validator=_sha256)
    size: int = attrs.field(validator=_non_negative)


@attrs.frozen
class SliceChunk:
    """The slice's bytes from `offset` (where those received end), base64."""

    id: str
    sha256: str = attrs.field(validator=_sha256)
    offset: int = attrs.field(validator=_non_negative)
    data: str = ""


@attrs.frozen
class SliceCommit:
    """Every byte sent: check the whole against its sha256 and keep it."""

    id: str
    sha256: str = attrs.field(validator=_sha256)
    size: int = attrs.field(validator=_non_negative)


@attrs.frozen
class Calibrate:
    """Time decode steps through a held middle slice: ms per layer on this host."""

    id: str
    sha256: str = attrs.field(validator=_sha256)
    fresh: bool = False  # time it again rather than answer what an earlier timing found


@attrs.frozen
class StageAssign:
    """Run stage `stage` of `topology` (TOML; stage files named <sha256>.gguf, held here)."""

    id: str
    topology: str
    stage: int = attrs.field(validator=_non_negative)


@attrs.frozen
class StageRelease:
    id: str


@attrs.frozen
class DeployHost:
    """A host of a supervised deployment: its control address as the deployer named it, how to reach it, what
    deploy found there."""

    name: str
    url: str
    memory_bytes: int = attrs.field(default=0, validator=_non_negative)
    ms_per_layer: float | None = None


@attrs.frozen
class Supervise:
    """To the head of a deployment just started: watch its hosts and re-plan as they go and come. The model is
    the copy deploy sent this host (a slice named by its sha256); `token` reaches the other hosts."""

    id: str
    model_sha256: str = attrs.field(validator=_sha256)
    model_name: str  # the model file's name (the slices' model name comes from it)
    hosts: list[DeployHost]
    plan: dict[str, Any]  # the plan deployed, as `skippyctl plan --json` prints it
    token: str
    stage_port: int = attrs.field(validator=_non_negative)
    stages: int = attrs.field(default=0, validator=_non_negative)  # 0: the fewest that fit
    hop_ms: float = 1.0
    ctx: int = attrs.field(default=512, validator=_non_negative)
    lanes: int = attrs.field(default=1, validator=_non_negative)

    def plan_hosts(self) -> list[str]:
        """The plan's hosts in pipeline order (the head first)."""
        return [s["host"] for s in self.plan.get("stages", [])] or [""]


@attrs.frozen
class AddHost:
    """To a supervising head: a host to plan with from now on (a waiting skippyd)."""

    id: str
    name: str
    url: str


Request = (Generate | SessionsList | SessionShow | SessionKill | LanesList | LanesDrain | LanesUndrain | CacheShow
           | CacheClear | Status | Receipts | Host | SliceOffer | SliceChunk | SliceCommit | Calibrate | StageAssign
           | StageRelease | Supervise | AddHost)


# ---------------------------------------------------------------- replies
@attrs.frozen
class Piece:
    id: str
    text: str
    # how many of the generation's pieces (the text one token completed, each) this message joins: more than
    # one when they queued up while the daemon sent the previous message
    pieces: int = 1


@attrs.frozen
class Result:
    id: str
    result: dict[str, Any]


@attrs.frozen
class Data:
    id: str
    data: Any


@attrs.frozen
class Error:
    id: str
    message: str
    # bad_request | not_found | unavailable | failed | unauthorized; a slice transfer's: conflict (out of order),
    # corrupt (arrived damaged: send it again)
    code: str = "bad_request"
    retryable: bool = False


Reply = Piece | Result | Data | Error

configure_tagged_union(Request, converter, tag_generator=_snake, tag_name="type")
configure_tagged_union(Reply, converter, tag_generator=_snake, tag_name="type")


class RequestFailed(Exception):
    """A request the daemon cannot serve, with the Error code its client gets (raised by what serves it)."""

    def __init__(self, message: str, code: str = "bad_request", retryable: bool = False):
        super().__init__(message)
        self.code = code
        self.retryable = retryable


class BadRequest(ValueError):
    def __init__(self, message: str, request_id: str = ""):
        super().__init__(message)
        self.request_id = request_id


def parse_request(text: str) -> Request:
    try:
        raw = json.loads(text)
    except json.JSONDecodeError as exc:
        raise BadRequest(f"malformed JSON: {exc}") from exc
    except RecursionError:  # "[[[[…" deeper than the interpreter's recursion limit
        raise BadRequest("malformed JSON: nested too deeply") from None
    if not isinstance(raw, dict):
        raise BadRequest("a request must be a JSON object")
    request_id = str(raw.get("id", ""))
    known = {_snake(cls) for cls in Request.__args__}
    if raw.get("type") not in known:
        raise BadRequest(f"unknown request type {raw.get('type')!r} @ $.type (one of: {', '.join(sorted(known))})",
                         request_id)
    try:
        return converter.structure(raw, Request)
    except Exception as exc:  # cattrs reports every bad field with its path
        detail = "; ".join(f"{path}: {why}" for path, why in structure_errors(exc, "$"))
        raise BadRequest(f"invalid {raw['type']} request: {detail}", request_id) from exc


def dump(msg: Request | Reply) -> str:
    union = Request if isinstance(msg, Request.__args__) else Reply
    return json.dumps(converter.unstructure(msg, union))


def parse_reply(text: str) -> Reply:
    return converter.structure(json.loads(text), Reply)
