"""Control-channel messages: attrs classes in tagged unions, one cattrs converter.

Every JSON object carries ``"type"`` (the class name in snake_case) and ``"id"``
(chosen by the client, echoed in every reply to that request). Unknown keys
are errors; a validation error names the path of the bad field.
"""

from __future__ import annotations

import json
import re
from typing import Any, Optional, Union

import attrs
import cattrs
from cattrs.strategies import configure_tagged_union


def _snake(cls: type) -> str:
    return re.sub(r"(?<!^)(?=[A-Z])", "_", cls.__name__).lower()


# ---------------------------------------------------------------- requests
@attrs.frozen
class Generate:
    id: str
    prompt: str = ""
    system: Optional[str] = None
    messages: list[dict[str, str]] = attrs.field(factory=list)
    raw: bool = False
    max_tokens: int = 256
    temperature: float = 0.0
    top_k: int = 0
    top_p: float = 1.0
    min_p: float = 0.0
    repeat_penalty: float = 1.0
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    seed: Optional[int] = None
    stop: list[str] = attrs.field(factory=list)
    stream: bool = True


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
class Status:
    id: str


@attrs.frozen
class Receipts:
    id: str
    limit: int = 20


Request = Union[Generate, SessionsList, SessionShow, SessionKill, LanesList, LanesDrain, LanesUndrain, Status,
                Receipts]


# ---------------------------------------------------------------- replies
@attrs.frozen
class Piece:
    id: str
    text: str


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
    code: str = "bad_request"  # bad_request | not_found | unavailable | failed | unauthorized
    retryable: bool = False


Reply = Union[Piece, Result, Data, Error]

converter = cattrs.Converter(forbid_extra_keys=True)
configure_tagged_union(Request, converter, tag_generator=_snake, tag_name="type")
configure_tagged_union(Reply, converter, tag_generator=_snake, tag_name="type")


class BadRequest(ValueError):
    def __init__(self, message: str, request_id: str = ""):
        super().__init__(message)
        self.request_id = request_id


def parse_request(text: str) -> Request:
    try:
        raw = json.loads(text)
    except json.JSONDecodeError as exc:
        raise BadRequest(f"malformed JSON: {exc}") from exc
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
        try:
            detail = "; ".join(cattrs.transform_error(exc))
        except Exception:
            detail = str(exc)
        raise BadRequest(f"invalid request: {detail}", request_id) from exc


def dump(msg: Request | Reply) -> str:
    union = Request if isinstance(msg, Request.__args__) else Reply
    return json.dumps(converter.unstructure(msg, union))


def parse_reply(text: str) -> Reply:
    return converter.structure(json.loads(text), Reply)
