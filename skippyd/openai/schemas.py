"""OpenAI request bodies: attrs classes, a strict cattrs converter, and the checks that name the bad parameter.

Parsing has two steps. ``parse`` structures the JSON with a converter that
does not coerce (``"5"`` is not an int, ``1.5`` is not an int, ``true`` is not
a number) and refuses unknown keys; then ``*.to_generation`` checks values
(ranges, unsupported features) and builds the engine's ``GenerationRequest``.
Both raise :class:`BadParameter`, which carries the OpenAI ``param``.

Accepted but ignored, because they change nothing here: ``user``, ``store``,
``metadata``, ``service_tier``, ``n=1``,
``response_format={"type": "text"}``, ``echo=false``, ``best_of=1``.
Unsupported values of those (``n=2``, ``echo=true``) are 400s.
``response_format`` ``json_object`` / ``json_schema`` constrain the output on
the final stage (:class:`~skippyd.sampling.Constraint`; completions take it
too, as llama.cpp's server does); a schema that is invalid or uses what the
matcher does not support is a 400 naming ``response_format.json_schema.schema``.
Beyond OpenAI's parameters, llama.cpp server's ``top_k``, ``min_p``,
``repeat_penalty`` and ``ignore_eos`` (go on past the end of generation, to
``max_tokens``) are accepted. ``tools``, ``tool_choice``,
``parallel_tool_calls`` and the history's ``tool_calls`` and ``tool``
messages are checked and shown to the model by :mod:`skippyd.openai.tools`.

A user message's content may hold images: ``{"type": "image_url",
"image_url": {"url": "data:image/png;base64,...", "detail": ...}}`` parts
(``detail`` is accepted and changes nothing). Only data URLs: the daemon
fetches nothing from the network. The parts become Hugging Face's
``{"type": "image"}`` parts, and the images the generation's, in order; the
head holds them to its limits and decodes them (skippyd.head.images).
"""

from __future__ import annotations

import base64
import binascii
import json
import math
import secrets
from typing import Any

import attrs
import cattrs
from cattrs.errors import ClassValidationError, ForbiddenExtraKeysError, IterableValidationError

from skippyd.head.engine import GenerationRequest, ImageInput
from skippyd.sampling import MAX_TOP_LOGPROBS, Constraint, InvalidSampling, SamplingParams

MAX_STOPS = 16
ROLES = {"system": "system", "developer": "system", "user": "user", "assistant": "assistant", "tool": "tool"}
DEFAULT_COMPLETION_MAX_TOKENS = 16  # OpenAI's documented default for /v1/completions


class BadParameter(ValueError):
    """A request body that cannot be served; `param` names the field (OpenAI's error.param)."""

    def __init__(self, message: str, param: str | None = None, code: str | None = "invalid_value"):
        super().__init__(message)
        self.param = param
        self.code = code


class _Invalid(ValueError):
    """Raised by the strict hooks; its text is the whole description."""


# ---------------------------------------------------------------- bodies
@attrs.frozen
class StreamOptions:
    include_usage: bool | None = None
    include_obfuscation: bool | None = None  # OpenAI's; nothing to obfuscate here


@attrs.frozen
class JsonSchemaFormat:
    name: str
    schema: Any = None  # a JSON schema (an object; true/false allowed by JSON Schema); absent: any JSON
    description: str | None = None
    strict: bool | None = None


@attrs.frozen
class ResponseFormat:
    type: str
    json_schema: JsonSchemaFormat | None = None

    def constraint(self) -> Constraint | None:
        """The constraint this format puts on the output (None: plain text); BadParameter naming the field."""
        if self.type == "text":
            return None
        if self.type == "json_object":
            return Constraint.json_object()
        if self.type != "json_schema":
            raise BadParameter(f"response_format type {self.type!r} is not supported (text, json_object, "
                               f"json_schema)", "response_format.type", "unsupported_value")
        if self.json_schema is None:
            raise BadParameter("response_format json_schema needs its json_schema object",
                               "response_format.json_schema", "missing_required_parameter")
        schema = self.json_schema.schema
        if schema is None:
            return Constraint.json_object()
        if not isinstance(schema, (dict, bool)):
            raise BadParameter(f"expected an object, got {_json_type(schema)}", "response_format.json_schema.schema",
                               "invalid_type")
        try:
            return Constraint.json_schema(schema)
        except InvalidSampling as exc:
            raise BadParameter(f"invalid JSON schema: {exc}", "response_format.json_schema.schema") from exc


def _constraint_of(fmt: ResponseFormat | None) -> Constraint | None:
    return None if fmt is None else fmt.constraint()


@attrs.frozen
class ChatMessage:
    role: str
    content: Any = None  # a string, or a list of {"type": "text", "text": ...} parts
    name: str | None = None
    tool_calls: Any = None  # an assistant's calls (checked by skippyd.openai.tools)
    tool_call_id: str | None = None  # the call a tool message answers
    refusal: str | None = None  # an assistant's (OpenAI's clients send it back); not shown to the model


@attrs.frozen(kw_only=True)
class _Sampling:
    """Parameters shared by both endpoints."""

    model: str
    max_tokens: int | None = None
    temperature: float | None = None
    top_p: float | None = None
    seed: int | None = None
    stop: Any = None  # a string or a list of strings
    presence_penalty: float | None = None
    frequency_penalty: float | None = None
    logit_bias: dict[str, float] | None = None
    stream: bool | None = None
    stream_options: StreamOptions | None = None
    n: int | None = None
    user: str | None = None
    # llama.cpp server's extensions
    top_k: int | None = None
    min_p: float | None = None
    repeat_penalty: float | None = None
    ignore_eos: bool | None = None  # the end-of-generation token ends nothing: the reply runs to max_tokens
    # speculative decoding for this request: true or "ngram" ("on"), false or "off"; None: the daemon's setting
    speculate: Any = None

    @property
    def streaming(self) -> bool:
        return bool(self.stream)

    @property
    def include_usage(self) -> bool:
        return bool(self.stream_options and self.stream_options.include_usage)

    def _common(self, n_vocab: int, max_tokens: int | None, default_max_tokens: int, *,
                constraint: Constraint | None = None, logprobs: int | None = None) -> dict:
        if self.n not in (None, 1):
            raise BadParameter("only n=1 is supported", "n", "unsupported_value")
        if self.stream_options is not None and not self.stream:
            raise BadParameter("stream_options is only allowed when stream is true", "stream_options")
        if max_tokens is not None and max_tokens < 1:
            raise BadParameter(f"{max_tokens} is less than the minimum of 1", self._max_tokens_param())
        _in_range(self.temperature, 0.0, 2.0, "temperature")
        _in_range(self.top_p, 0.0, 1.0, "top_p")
        _in_range(self.presence_penalty, -2.0, 2.0, "presence_penalty")
        _in_range(self.frequency_penalty, -2.0, 2.0, "frequency_penalty")
        _in_range(self.min_p, 0.0, 1.0, "min_p")
        if self.top_k is not None and self.top_k < 0:
            raise BadParameter(f"{self.top_k} is less than the minimum of 0", "top_k")
        temperature = 1.0 if self.temperature is None else self.temperature
        top_p = 1.0 if self.top_p is None else self.top_p
        if top_p == 0.0:  # keep only the most likely token: greedy
            temperature, top_p = 0.0, 1.0
        seed = self.seed
        if seed is None:
            seed = secrets.randbits(32) if temperature > 0 else None
        else:
            seed %= 2**32
        try:
            sampling = SamplingParams(
                temperature=temperature, top_p=top_p, top_k=self.top_k or 0, min_p=self.min_p or 0.0,
                repeat_penalty=1.0 if self.repeat_penalty is None else self.repeat_penalty,
                presence_penalty=self.presence_penalty or 0.0, frequency_penalty=self.frequency_penalty or 0.0,
                seed=seed, logit_bias=_logit_bias(self.logit_bias, n_vocab), constraint=constraint,
                logprobs=logprobs)
            sampling.validate(n_vocab)  # what travels as float32 / int32 must still be in range there
        except InvalidSampling as exc:
            raise BadParameter(str(exc), exc.field) from exc
        return dict(max_tokens=default_max_tokens if max_tokens is None else max_tokens, sampling=sampling,
                    stop=_stops(self.stop), speculate=_speculate(self.speculate), ignore_eos=bool(self.ignore_eos))

    def _max_tokens_param(self) -> str:
        return "max_tokens"


@attrs.frozen(kw_only=True)
class ChatCompletionRequest(_Sampling):
    messages: list[ChatMessage]
    max_completion_tokens: int | None = None
    logprobs: bool | None = None
    top_logprobs: int | None = None
    response_format: ResponseFormat | None = None
    store: bool | None = None
    metadata: dict[str, str] | None = None
    service_tier: str | None = None
    parallel_tool_calls: bool | None = None
    tools: Any = None  # a list of function tools (checked by skippyd.openai.tools)
    tool_choice: Any = None  # auto | none | required | {"type": "function", "function": {"name": ...}}

    def _max_tokens_param(self) -> str:
        return "max_completion_tokens" if self.max_completion_tokens is not None else "max_tokens"

    def chat_messages(self) -> tuple[tuple[dict, ...], tuple[ImageInput, ...]]:
        """The messages as the chat template takes them, and their images in order."""
        if not self.messages:
            raise BadParameter("messages must hold at least one message", "messages")
        out = []
        images: list[ImageInput] = []
        for i, msg in enumerate(self.messages):
            role = ROLES.get(msg.role)
            if role is None:
                raise BadParameter(f"role {msg.role!r} is not supported (system, developer, user, assistant, "
                                   f"tool)", f"messages[{i}].role", "unsupported_value")
            one = {"role": role, "content": _content(msg.content, role, f"messages[{i}].content", images)}
            if msg.tool_calls is not None and role == "assistant":
                one["tool_calls"] = msg.tool_calls
            if role == "tool":
                one["tool_call_id"] = msg.tool_call_id
            out.append(one)
        return tuple(out), tuple(images)

    def to_generation(self, n_vocab: int, n_ctx: int) -> GenerationRequest:
        if self.top_logprobs is not None:
            _in_range(self.top_logprobs, 0, MAX_TOP_LOGPROBS, "top_logprobs")
            if not self.logprobs:
                raise BadParameter("top_logprobs needs logprobs set to true", "top_logprobs")
        logprobs = (self.top_logprobs or 0) if self.logprobs else None
        constraint = _constraint_of(self.response_format)
        max_tokens = self.max_completion_tokens if self.max_completion_tokens is not None else self.max_tokens
        # chat has no default limit: the engine stops at the end of the context
        params = self._common(n_vocab, max_tokens, n_ctx, constraint=constraint, logprobs=logprobs)
        messages, images = self.chat_messages()
        return GenerationRequest(messages=messages, images=images, **params)


@attrs.frozen(kw_only=True)
class CompletionRequest(_Sampling):
    prompt: Any  # a string, a list of token ids, or a one-element list of either
    echo: bool | None = None
    best_of: int | None = None
    logprobs: int | None = None
    suffix: str | None = None
    response_format: ResponseFormat | None = None  # llama.cpp server's, as on chat

    def to_generation(self, n_vocab: int, n_ctx: int) -> GenerationRequest:
        if self.echo:
            raise BadParameter("echo is not supported", "echo", "unsupported_value")
        if self.best_of not in (None, 1):
            raise BadParameter("only best_of=1 is supported", "best_of", "unsupported_value")
        _in_range(self.logprobs, 0, MAX_TOP_LOGPROBS, "logprobs")
        if self.suffix:
            raise BadParameter("suffix is not supported", "suffix", "unsupported_value")
        params = self._common(n_vocab, self.max_tokens, DEFAULT_COMPLETION_MAX_TOKENS,
                              constraint=_constraint_of(self.response_format), logprobs=self.logprobs)
        prompt = self.prompt
        if isinstance(prompt, list) and len(prompt) == 1 and isinstance(prompt[0], (str, list)):
            prompt = prompt[0]  # a batch of one
        if isinstance(prompt, str):
            return GenerationRequest(prompt=prompt, raw=True, **params)
        if isinstance(prompt, list) and prompt and all(type(t) is int for t in prompt):
            bad = [t for t in prompt if not 0 <= t < n_vocab]
            if bad:
                raise BadParameter(f"token {bad[0]} is outside the vocabulary [0, {n_vocab})", "prompt")
            return GenerationRequest(prompt_tokens=tuple(prompt), raw=True, **params)
        if isinstance(prompt, list) and len(prompt) > 1 and all(isinstance(p, (str, list)) for p in prompt):
            raise BadParameter("only one prompt per request is supported", "prompt", "unsupported_value")
        raise BadParameter("prompt must be a string or a non-empty list of token ids", "prompt", "invalid_type")


# ---------------------------------------------------------------- value checks
def _in_range(value: float | None, lo: float, hi: float, param: str) -> None:
    if value is None:
        return
    if value < lo:
        raise BadParameter(f"{value} is less than the minimum of {lo:g}", param)
    if value > hi:
        raise BadParameter(f"{value} is greater than the maximum of {hi:g}", param)


def _speculate(value: Any) -> bool | None:
    if value is None or isinstance(value, bool):
        return value
    if value in ("off", "ngram", "on"):
        return value != "off"
    raise BadParameter(f'speculate must be true, false, "ngram", "on" or "off", not {json.dumps(value)}', "speculate")


def _stops(stop: Any) -> tuple[str, ...]:
    if stop is None:
        return ()
    if isinstance(stop, str):
        return (stop,) if stop else ()
    if isinstance(stop, list) and all(isinstance(s, str) for s in stop):
        if len(stop) > MAX_STOPS:
            raise BadParameter(f"at most {MAX_STOPS} stop sequences are supported", "stop")
        return tuple(s for s in stop if s)
    raise BadParameter("stop must be a string or a list of strings", "stop", "invalid_type")


def _logit_bias(bias: dict[str, float] | None, n_vocab: int) -> tuple[tuple[int, float], ...]:
    out = []
    for key, value in (bias or {}).items():
        if not key.isascii() or not key.isdigit():
            raise BadParameter(f"logit_bias keys are token ids, not {key!r}", "logit_bias")
        token = int(key)
        if token >= n_vocab:
            raise BadParameter(f"logit_bias token {token} is outside the vocabulary [0, {n_vocab})", "logit_bias")
        if not -100.0 <= value <= 100.0:
            raise BadParameter(f"logit_bias for token {token} must be in [-100, 100]", "logit_bias")
        out.append((token, float(value)))
    return tuple(out)


def _content(content: Any, role: str, param: str, images: list[ImageInput]) -> str | list[dict]:
    """A message's content: its text, or (a user message with images) its parts, Hugging Face's way; the images
    join `images`."""
    if isinstance(content, str):
        return content
    if content is None and role == "assistant":
        return ""
    if isinstance(content, list):
        parts: list[dict] = []
        for i, part in enumerate(content):
            kind = part.get("type") if isinstance(part, dict) else type(part).__name__
            if kind == "image_url":
                if role != "user":
                    raise BadParameter(f"images go in user messages, not in a {role} message", f"{param}[{i}]",
                                       "unsupported_value")
                images.append(ImageInput(_image_url(part, f"{param}[{i}]"), f"{param}[{i}]"))
                parts.append({"type": "image"})
                continue
            if kind != "text":
                raise BadParameter(f"content part of type {kind!r} is not supported (text, image_url)",
                                   f"{param}[{i}].type", "unsupported_value")
            if set(part) - {"type", "text"} or not isinstance(part.get("text"), str):
                raise BadParameter("a text content part is {\"type\": \"text\", \"text\": STRING}", f"{param}[{i}]")
            parts.append({"type": "text", "text": part["text"]})
        if any(p["type"] == "image" for p in parts):
            return parts
        return "".join(p["text"] for p in parts)
    raise BadParameter("content must be a string or a list of parts", param, "invalid_type")


def _image_url(part: dict, param: str) -> bytes:
    """The image bytes of an image_url part: a base64 data URL's."""
    spec = part.get("image_url")
    if set(part) - {"type", "image_url"} or not isinstance(spec, dict) or set(spec) - {"url", "detail"}:
        raise BadParameter('an image part is {"type": "image_url", "image_url": {"url": "data:image/...;base64,..."}}',
                           param)
    url = spec.get("url")
    if not isinstance(url, str):
        raise BadParameter("expected a string", f"{param}.image_url.url", "invalid_type")
    scheme = url.split(":", 1)[0].lower() if ":" in url else ""
    if scheme in ("http", "https"):
        raise BadParameter("the server fetches nothing from the network: send the image itself, as a data URL "
                           "(data:image/png;base64,...)", f"{param}.image_url.url", "unsupported_value")
    if scheme != "data":
        raise BadParameter("an image URL must be a data URL (data:image/png;base64,...)", f"{param}.image_url.url",
                           "invalid_value")
    header, comma, payload = url[5:].partition(",")
    if not comma or not header.lower().endswith(";base64"):
        raise BadParameter("an image's data URL must be base64 (data:image/png;base64,...)",
                           f"{param}.image_url.url")
    try:
        return _b64decode(payload)
    except (binascii.Error, ValueError) as exc:
        raise BadParameter(f"the image's data URL is not valid base64: {exc}", f"{param}.image_url.url") from None


_B64_PIECE = 1 << 20  # characters decoded per call: no one call holds the GIL for long


def _b64decode(text: str) -> bytes:
    """Strict base64 (whitespace allowed, as in a wrapped data URL), decoded a piece at a time: an image of
    megabytes in a body parsed in a worker thread lets the event loop in between pieces. Whole groups of four
    before any padding decode alone as they do within the whole; the rest is decoded at the end, as one."""
    out, rest = [], ""
    for start in range(0, len(text), _B64_PIECE):
        rest += "".join(text[start:start + _B64_PIECE].split())
        if "=" not in rest and start + _B64_PIECE < len(text):
            cut = len(rest) - len(rest) % 4
            out.append(base64.b64decode(rest[:cut], validate=True))
            rest = rest[cut:]
    out.append(base64.b64decode(rest, validate=True))
    return b"".join(out)


# ---------------------------------------------------------------- the converter
def _strict(kind: str, ok) -> Any:
    def hook(value: Any, _type: Any) -> Any:
        if not ok(value):
            raise _Invalid(f"expected {kind}, got {_json_type(value)}")
        return float(value) if kind == "a number" else value

    return hook


def _json_type(value: Any) -> str:
    return {bool: "a boolean", int: "an integer", float: "a number", str: "a string", list: "an array",
            dict: "an object", type(None): "null"}.get(type(value), type(value).__name__)


def _finite(value: Any) -> bool:
    return type(value) in (int, float) and math.isfinite(value)


converter = cattrs.Converter(forbid_extra_keys=True, detailed_validation=True)
converter.register_structure_hook(int, _strict("an integer", lambda v: type(v) is int))
converter.register_structure_hook(float, _strict("a number", _finite))
converter.register_structure_hook(str, _strict("a string", lambda v: type(v) is str))
converter.register_structure_hook(bool, _strict("a boolean", lambda v: type(v) is bool))
converter.register_structure_hook(Any, lambda v, _: v)


def _json_shape(hint: Any, json_type: type, what: str):
    """cattrs' hook for `hint`, refusing first a value that is not a JSON `what` (cattrs would coerce it)."""
    inner = converter.get_structure_hook(hint)

    def hook(value: Any, type_: Any):
        if not isinstance(value, json_type):
            raise _Invalid(f"expected {what}, got {_json_type(value)}")
        return inner(value, type_)

    return hook


for _cls in (StreamOptions, JsonSchemaFormat, ResponseFormat, ChatMessage):  # before the containers that hold them
    converter.register_structure_hook(_cls, _json_shape(_cls, dict, "an object"))
for _type, _hook in ((list[ChatMessage], _json_shape(list[ChatMessage], list, "an array")),
                     (dict[str, float], _json_shape(dict[str, float], dict, "an object")),
                     (dict[str, str], _json_shape(dict[str, str], dict, "an object"))):
    converter.register_structure_hook_func(lambda t, _type=_type: t == _type, _hook)


def _reject_constant(name: str) -> float:
    raise ValueError(f"{name} is not valid JSON")


def parse(body: bytes, cls: type):
    """JSON bytes → an instance of `cls`, or BadParameter naming the first bad field."""
    try:
        raw = json.loads(body, parse_constant=_reject_constant)
    except (ValueError, UnicodeDecodeError) as exc:
        raise BadParameter(f"the request body is not valid JSON: {exc}", None, "invalid_json") from exc
    except RecursionError:  # "[[[[…" deeper than the interpreter's recursion limit
        raise BadParameter("the request body is not valid JSON: nested too deeply", None, "invalid_json") from None
    if not isinstance(raw, dict):
        raise BadParameter("the request body must be a JSON object", None, "invalid_json")
    try:
        return converter.structure(raw, cls)
    except (ClassValidationError, IterableValidationError) as exc:
        errors = list(_leaves(exc, ""))
        path, leaf = errors[0] if errors else ("", exc)
        raise BadParameter(_describe(leaf, path), path or None,
                           "unrecognized_argument" if isinstance(leaf, ForbiddenExtraKeysError) else
                           "missing_required_parameter" if isinstance(leaf, KeyError) else "invalid_type") from exc


def _leaves(exc: BaseException, path: str):
    """(path, exception) for each failure, paths like OpenAI's params: messages[0].role."""
    if isinstance(exc, (ClassValidationError, IterableValidationError)):
        with_notes, without = exc.group_exceptions()
        for sub, note in with_notes:
            step = f"[{note.index}]" if isinstance(exc, IterableValidationError) else f".{note.name}"
            yield from _leaves(sub, f"{path}{step}".lstrip("."))
        for sub in without:
            yield from _leaves(sub, path)
    elif isinstance(exc, ForbiddenExtraKeysError):
        first = sorted(exc.extra_fields)[0]
        yield (f"{path}.{first}" if path else first), exc
    else:
        yield path, exc


def _describe(exc: BaseException, path: str) -> str:
    where = f" ({path})" if path else ""
    if isinstance(exc, ForbiddenExtraKeysError):
        names = ", ".join(sorted(exc.extra_fields))
        return f"unrecognized request argument supplied: {names}"
    if isinstance(exc, KeyError):
        return f"missing required parameter: {path}"
    if isinstance(exc, _Invalid):
        return f"invalid type for {path}: {exc}" if path else str(exc)
    return f"invalid value{where}: {exc}"
