"""Function tools on the chat endpoint: the request's tools checked, shown to the model, its reply parsed.

Two ways to show tools, chosen by the model's chat template:

* **native**: a template that reads ``tools`` (Qwen, Hermes, Llama 3.1, …)
  gets them, and the history's tool calls and ``tool`` results, its own
  way; the reply is parsed in the Hermes / Qwen form, ``<tool_call>{"name":
  …, "arguments": {…}}</tool_call>`` (any number, text around them is the
  content). With ``tool_choice`` ``required`` or a named function, a
  template that uses that form is constrained to one such call.
* **generic**: a template that knows no tools (the default model's) gets a
  system message describing them, and the reply is constrained to JSON that
  is a call, ``{"tool_call": {"name": …, "arguments": {…}}}`` (with
  ``parallel_tool_calls`` set to true: ``{"tool_calls": [{…}, …]}``; unset
  means one call, as llama.cpp's server has it), or, with ``auto``,
  a message, ``{"response": "…"}``. The arguments are constrained to the
  function's ``parameters`` schema. The history's calls become such JSON
  replies and its ``tool`` results user messages ``{"tool_response": …}``.
  (llama.cpp's server does the same.)

Streamed, a generic reply goes out as it is written (the response's text, or
each call's id and name, then its arguments in pieces); a native one once it
is complete, since its text and calls mix freely.

``tool_choice`` ``none`` sends no tools. Every check happens here, before any
stage is touched: a bad tool name, a ``parameters`` that is not a JSON schema
(or one the constraint cannot follow), a ``tool_choice`` naming no tool are
400s naming the field.
"""

from __future__ import annotations

import json
import re
import secrets
from collections.abc import Sequence
from typing import Any

import attrs

from skippyd.head.engine import FinishReason, GenerationRequest, GenerationResult
from skippyd.openai.schemas import BadParameter
from skippyd.runtime.chat_template import template_for
from skippyd.sampling import Constraint, InvalidSampling

NAME = re.compile(r"^[a-zA-Z0-9_-]{1,64}$")
MAX_TOOLS = 128
ARGUMENT_PIECE = 24  # characters of a call's arguments per streamed chunk
_COMPACT_JSON = {"whitespace_flexible": False, "item_separator": ", ", "key_separator": ": "}
_HERMES_CALL = re.compile(r"<tool_call>\s*(.*?)\s*(?:</tool_call>|$)", re.DOTALL)


@attrs.frozen
class Function:
    name: str
    description: str | None
    parameters: dict  # a JSON schema of the arguments object

    def openai(self) -> dict:
        """The tool as OpenAI's request shows it (what a native template reads)."""
        fn = {"name": self.name, "parameters": self.parameters}
        if self.description is not None:
            fn["description"] = self.description
        return {"type": "function", "function": fn}

    def call_schema(self) -> dict:
        return _object({"name": {"const": self.name}, "arguments": _closed(self.parameters)})


_SUBSCHEMAS = ("items", "additionalItems", "not", "if", "then", "else", "contains")
_SCHEMA_LISTS = ("anyOf", "oneOf", "prefixItems")  # not allOf: its parts may name each other's properties
_SCHEMA_MAPS = ("properties", "$defs", "definitions", "patternProperties", "dependentSchemas")


def _closed(schema: Any) -> Any:
    """``schema`` with its objects closed to the properties they name where it does not say otherwise (what
    llama.cpp's schema converter does): a model stays on the arguments the function takes instead of inventing
    more, and what it writes still validates against the original schema."""
    if not isinstance(schema, dict):
        return schema
    out = dict(schema)
    for key in _SUBSCHEMAS:
        if key in out:
            out[key] = _closed(out[key])
    for key in _SCHEMA_LISTS:
        if isinstance(out.get(key), list):
            out[key] = [_closed(s) for s in out[key]]
    for key in _SCHEMA_MAPS:
        if isinstance(out.get(key), dict):
            out[key] = {k: _closed(v) for k, v in out[key].items()}
    if "properties" in out and "additionalProperties" not in out and "patternProperties" not in out \
            and "unevaluatedProperties" not in out:
        out["additionalProperties"] = False
    return out


def _object(properties: dict) -> dict:
    return {"type": "object", "properties": properties, "required": list(properties), "additionalProperties": False}


def _any_of(schemas: list[dict]) -> dict:
    return schemas[0] if len(schemas) == 1 else {"anyOf": schemas}


# ---------------------------------------------------------------- checking the request
def parse_tools(tools: Any) -> tuple[Function, ...]:
    """The request's ``tools``, checked; BadParameter naming the first bad field."""
    if tools is None:
        return ()
    if not isinstance(tools, list):
        raise BadParameter("tools must be an array of function tools", "tools", "invalid_type")
    if len(tools) > MAX_TOOLS:
        raise BadParameter(f"at most {MAX_TOOLS} tools are supported", "tools")
    out, seen = [], set()
    for i, tool in enumerate(tools):
        where = f"tools[{i}]"
        if not isinstance(tool, dict):
            raise BadParameter("a tool is an object", where, "invalid_type")
        if tool.get("type") != "function":
            raise BadParameter(f"tool type {tool.get('type')!r} is not supported (function)", f"{where}.type",
                               "unsupported_value")
        extra = set(tool) - {"type", "function"}
        if extra:
            raise BadParameter(f"unrecognized tool field: {', '.join(sorted(extra))}", f"{where}.{sorted(extra)[0]}",
                               "unrecognized_argument")
        fn = tool.get("function")
        if not isinstance(fn, dict):
            raise BadParameter("a function tool needs its function object", f"{where}.function",
                               "missing_required_parameter")
        name = fn.get("name")
        if not isinstance(name, str) or not NAME.match(name):
            raise BadParameter(f"invalid function name {name!r}: 1 to 64 of a-z, A-Z, 0-9, _ and -",
                               f"{where}.function.name")
        if name in seen:
            raise BadParameter(f"two tools are named {name!r}", f"{where}.function.name")
        seen.add(name)
        description = fn.get("description")
        if description is not None and not isinstance(description, str):
            raise BadParameter("expected a string", f"{where}.function.description", "invalid_type")
        params = fn.get("parameters")
        if params is None:
            params = {"type": "object", "properties": {}}
        if not isinstance(params, dict):
            raise BadParameter(f"parameters must be a JSON schema object, got {type(params).__name__}",
                               f"{where}.function.parameters", "invalid_type")
        try:
            Constraint.json_schema(params)  # a JSON schema, and one the constraint can follow
        except InvalidSampling as exc:
            raise BadParameter(f"invalid parameters schema for {name!r}: {exc}",
                               f"{where}.function.parameters") from exc
        out.append(Function(name, description, params))
    return tuple(out)


def parse_choice(choice: Any, functions: Sequence[Function]) -> tuple[str, str | None]:
    """(``auto`` | ``none`` | ``required`` | ``named``, the named function)."""
    if choice is None:
        return ("auto" if functions else "none"), None
    if isinstance(choice, str):
        if choice not in ("auto", "none", "required"):
            raise BadParameter(f"tool_choice {choice!r} is not one of auto, none, required or a function",
                               "tool_choice", "unsupported_value")
        if choice == "required" and not functions:
            raise BadParameter("tool_choice required needs tools", "tool_choice")
        return choice, None
    if not isinstance(choice, dict) or choice.get("type") != "function" or not isinstance(choice.get("function"),
                                                                                          dict):
        raise BadParameter('tool_choice must be auto, none, required or {"type": "function", "function": '
                           '{"name": NAME}}', "tool_choice", "invalid_type")
    name = choice["function"].get("name")
    if name not in {f.name for f in functions}:
        raise BadParameter(f"tool_choice names {name!r}, which is not one of the request's tools",
                           "tool_choice.function.name")
    return "named", name


def _arguments(raw: Any, param: str) -> Any:
    """A history call's arguments (OpenAI sends a JSON string) as the object a template shows."""
    if isinstance(raw, dict):
        return raw
    if not isinstance(raw, str):
        raise BadParameter("arguments must be a JSON string", param, "invalid_type")
    try:
        return json.loads(raw) if raw.strip() else {}
    except ValueError:
        return raw  # shown as the model wrote it


def _history_calls(calls: Any, param: str) -> list[dict]:
    if not isinstance(calls, list):
        raise BadParameter("tool_calls must be an array", param, "invalid_type")
    out = []
    for j, call in enumerate(calls):
        where = f"{param}[{j}]"
        fn = call.get("function") if isinstance(call, dict) else None
        if not isinstance(fn, dict) or not isinstance(fn.get("name"), str):
            raise BadParameter('a tool call is {"id", "type": "function", "function": {"name", "arguments"}}',
                               where, "invalid_type")
        out.append({"id": str(call.get("id") or ""), "type": "function",
                    "function": {"name": fn["name"], "arguments": _arguments(fn.get("arguments", "{}"),
                                                                              f"{where}.function.arguments")}})
    return out


# ---------------------------------------------------------------- the plan
@attrs.frozen
class ToolPlan:
    """How one request shows its tools to the model and reads its reply (None from :func:`prepare` when no
    tools are offered: the reply is plain text)."""

    functions: tuple[Function, ...]  # those the model may call
    mode: str  # auto | required | named
    parallel: bool
    native: bool  # the chat template shows the tools itself
    hermes: bool = False  # … and its calls are <tool_call>{json}</tool_call>

    # ------------------------------------------------------------ the prompt
    def system_text(self) -> str:
        """The generic format's description of the tools and of the reply wanted."""
        tools = json.dumps([f.openai()["function"] for f in self.functions], ensure_ascii=False, indent=2)
        one = {"name": self.functions[0].name, "arguments": {}}
        call = ({"tool_calls": [one]} if self.parallel else {"tool_call": one})
        if self.mode == "auto":
            how = ("Respond in JSON, either with `tool_call` (a request to call a tool) or with `response` "
                   "(your reply to the user's request). A tool call looks like this:\n"
                   + json.dumps(call, ensure_ascii=False) + "\nand a reply like this:\n"
                   + json.dumps({"response": "..."}))
        else:
            how = "Respond with a tool call in JSON, like this:\n" + json.dumps(call, ensure_ascii=False)
        return f"You can call the following tools to satisfy the user's requests:\n{tools}\n\n{how}"

    def constraint(self) -> Constraint | None:
        calls = _any_of([f.call_schema() for f in self.functions])
        if self.native:
            if not self.hermes or self.mode == "auto":
                return None
            compact = {**calls, "x-guidance": _COMPACT_JSON}  # no free whitespace (as Constraint.json_schema)
            return Constraint.grammar('start: "<tool_call>\\n" call "\\n</tool_call>"\ncall: %json '
                                      + json.dumps(compact, ensure_ascii=False))
        if self.parallel:
            wanted = _object({"tool_calls": {"type": "array", "items": calls, "minItems": 1}})
        else:
            wanted = _object({"tool_call": calls})
        if self.mode == "auto":
            wanted = {"anyOf": [wanted, _object({"response": {"type": "string"}})]}
        return Constraint.json_schema(wanted)

    # ------------------------------------------------------------ the reply
    def parse(self, text: str) -> tuple[str | None, list[dict]]:
        """(content, OpenAI tool calls) of the model's reply; text that is no call stays content."""
        found = self._hermes_calls(text) if self.native else self._generic_calls(text)
        if found is None:
            return text, []
        content, calls = found
        known = {f.name for f in self.functions}
        raw = [] if self.native else [args for _name, args, _end in _generic_raw_calls(text)]
        out = []
        for i, call in enumerate(calls):
            if not isinstance(call, dict) or call.get("name") not in known:
                return text, []
            args = call.get("arguments", call.get("parameters", {}))
            if len(raw) == len(calls):  # the arguments as the model wrote them (what a stream sent)
                args = raw[i]
            out.append({"id": "call_" + secrets.token_hex(12), "type": "function",
                        "function": {"name": call["name"],
                                     "arguments": args if isinstance(args, str) else
                                     json.dumps(args, ensure_ascii=False)}})
        return content, out

    @staticmethod
    def _generic_calls(text: str) -> tuple[str | None, list] | None:
        try:
            reply = json.loads(text)
        except ValueError:
            return None
        if not isinstance(reply, dict):
            return None
        if isinstance(reply.get("tool_call"), dict):
            return None, [reply["tool_call"]]
        if isinstance(reply.get("tool_calls"), list) and reply["tool_calls"]:
            return None, reply["tool_calls"]
        if isinstance(reply.get("response"), str):
            return reply["response"], []
        return None

    @staticmethod
    def _hermes_calls(text: str) -> tuple[str | None, list] | None:
        calls = []
        for m in _HERMES_CALL.finditer(text):
            try:
                calls.append(json.loads(m.group(1)))
            except ValueError:
                return None
        if not calls:
            return None
        content = _HERMES_CALL.sub("", text).strip()
        return content or None, calls


_GENERIC_CALL = re.compile(r'\{"name": "([a-zA-Z0-9_-]{1,64})", "arguments": ')
_CALL_OPENINGS = ('{"tool_call": ', '{"tool_calls": [')
_RESPONSE_OPENING = '{"response": "'


def _json_end(text: str, start: int) -> int | None:
    """Where the JSON object or array opening at ``start`` ends (exclusive); None while it is incomplete."""
    depth, in_string, escaped = 0, False, False
    for i in range(start, len(text)):
        c = text[i]
        if in_string:
            if escaped:
                escaped = False
            elif c == "\\":
                escaped = True
            elif c == '"':
                in_string = False
        elif c == '"':
            in_string = True
        elif c in "{[":
            depth += 1
        elif c in "}]":
            depth -= 1
            if depth == 0:
                return i + 1
    return None


def _generic_raw_calls(text: str) -> list[tuple[str, str, bool]]:
    """The calls of a generic-format reply so far, in order: (name, the arguments' text so far, complete)."""
    if not text.startswith(_CALL_OPENINGS):
        return []
    out, at = [], 0
    while True:
        m = _GENERIC_CALL.search(text, at)
        if m is None:
            return out
        start = m.end()
        end = _json_end(text, start) if start < len(text) and text[start] in "{[" else None
        if end is None:
            out.append((m.group(1), text[start:], False))
            return out
        out.append((m.group(1), text[start:end], True))
        at = end


_OPEN_ESCAPE = re.compile(r"(?<!\\)(?:\\\\)*(\\(?:u[0-9a-fA-F]{0,3})?)$")  # \ or \uXY at the end, unfinished
_HIGH_SURROGATE = re.compile(r"(?<!\\)(?:\\\\)*(\\u[dD][89abAB][0-9a-fA-F]{2})$")  # half a pair at the end


def _partial_string(raw: str) -> str:
    """The decoded text of a JSON string's body so far (``raw`` stops anywhere, its closing quote excluded):
    an escape not complete yet, or the first half of a surrogate pair, waits for the rest."""
    for pattern in (_OPEN_ESCAPE, _HIGH_SURROGATE):
        m = pattern.search(raw)
        if m:
            raw = raw[:m.start(1)]
    try:
        return json.loads('"' + raw + '"')
    except ValueError:
        return ""


class ReplyStream:
    """A tool-offering reply streamed as the model writes it: in the generic format, the ``response`` text and
    each call's id, name and arguments as they come; in a native one (text and calls mixed freely), the whole
    message once it is complete. The ids match those of the finished message."""

    def __init__(self, plan: ToolPlan):
        self.plan = plan
        self.text = ""
        self.content_sent = ""
        self.calls: list[tuple[str, str]] = []  # (id, arguments sent) of each call announced
        self.streaming = not plan.native

    def feed(self, piece: str) -> list[dict]:
        self.text += piece
        if not self.streaming:
            return []
        text = self.text
        if not text.startswith(_CALL_OPENINGS) and not text.startswith(_RESPONSE_OPENING):
            if not any(o.startswith(text) for o in (*_CALL_OPENINGS, _RESPONSE_OPENING)):
                self.streaming = False  # not the format asked for: the whole reply at the end
            return []
        if text.startswith(_RESPONSE_OPENING):
            body = text[len(_RESPONSE_OPENING):]
            close = _json_end('{"r": "' + body, 0)  # where the string (and its object) ends, once it does
            shown = _partial_string(body if close is None else body[:close - 7 - 2])
            return self._content(shown)
        out = []
        for index, (name, args, _done) in enumerate(_generic_raw_calls(text)):
            if index == len(self.calls):
                self.calls.append(("call_" + secrets.token_hex(12), ""))
                out.append({"tool_calls": [{"index": index, "id": self.calls[index][0], "type": "function",
                                            "function": {"name": name, "arguments": ""}}]})
            call_id, sent = self.calls[index]
            if len(args) > len(sent):
                out.append({"tool_calls": [{"index": index, "function": {"arguments": args[len(sent):]}}]})
                self.calls[index] = (call_id, args)
        return out

    def _content(self, shown: str) -> list[dict]:
        if not shown.startswith(self.content_sent) or len(shown) == len(self.content_sent):
            return []
        new, self.content_sent = shown[len(self.content_sent):], shown
        return [{"content": new}]

    def finish(self, result: GenerationResult) -> tuple[list[dict], str]:
        """What is left to send of the finished reply, and its finish_reason."""
        msg, finish = message(self.plan, result)
        if not self.streaming:
            return deltas(msg), finish
        out = []
        if msg.get("content"):
            out += self._content(msg["content"])
        for index, call in enumerate(msg.get("tool_calls", ())):
            args = call["function"]["arguments"]
            if index < len(self.calls):
                call_id, sent = self.calls[index]
                if args.startswith(sent) and len(args) > len(sent):
                    out.append({"tool_calls": [{"index": index, "function": {"arguments": args[len(sent):]}}]})
            else:
                out += [{"tool_calls": [{**d["tool_calls"][0], "index": index}]}
                        for d in deltas({"tool_calls": [call]})]
        return out, finish


def prepare(req, greq: GenerationRequest, model) -> tuple[GenerationRequest, ToolPlan | None]:
    """The chat request's tools and history in the model's terms: the generation to run, and how to read its
    reply (None: plain text). BadParameter, naming the field, for anything wrong."""
    functions = parse_tools(req.tools)
    mode, named = parse_choice(req.tool_choice, functions)
    history = any(m["role"] == "tool" or m.get("tool_calls") is not None for m in greq.messages)
    if not functions and not history:
        return greq, None  # a plain chat
    template = template_for(model)
    native = bool(template is not None and template.knows_tools)
    plan = None
    if mode != "none" and functions:
        if req.response_format is not None and req.response_format.type != "text":
            raise BadParameter("response_format cannot be combined with tools (set tool_choice to none)",
                               "response_format", "unsupported_value")
        offered = tuple(f for f in functions if f.name == named) if mode == "named" else functions
        plan = ToolPlan(offered, mode, bool(req.parallel_tool_calls), native,
                        hermes=native and "<tool_call>" in template.source)
    messages = _history(greq.messages, native)
    tools = ()
    if plan is not None and native:
        tools = tuple(f.openai() for f in plan.functions)
    elif plan is not None:
        messages = _with_system(messages, plan.system_text())
    sampling = greq.sampling
    if plan is not None:
        try:
            constraint = plan.constraint()
        except InvalidSampling as exc:
            raise BadParameter(f"the tools cannot constrain the reply: {exc}", "tools") from exc
        if constraint is not None:
            sampling = attrs.evolve(sampling, constraint=constraint)
    return attrs.evolve(greq, messages=messages, tools=tools, sampling=sampling), plan


def _history(messages: Sequence[dict], native: bool) -> tuple[dict, ...]:
    """The history's tool calls and results: as OpenAI sends them for a native template (arguments as
    objects, results named), as generic JSON turns otherwise."""
    names: dict[str, str] = {}
    out = []
    for i, msg in enumerate(messages):
        if msg["role"] == "assistant" and msg.get("tool_calls") is not None:
            calls = _history_calls(msg["tool_calls"], f"messages[{i}].tool_calls")
            names.update({c["id"]: c["function"]["name"] for c in calls})
            if native:
                out.append({**msg, "tool_calls": calls})
            else:
                shown = [{"name": c["function"]["name"], "arguments": c["function"]["arguments"]} for c in calls]
                reply = {"tool_call": shown[0]} if len(shown) == 1 else {"tool_calls": shown}
                out.append({"role": "assistant", "content": json.dumps(reply, ensure_ascii=False)})
        elif msg["role"] == "tool":
            call_id = msg.get("tool_call_id")
            if not isinstance(call_id, str):
                raise BadParameter("a tool message needs the tool_call_id it answers", f"messages[{i}].tool_call_id",
                                   "missing_required_parameter")
            if native:
                out.append({**msg, "name": names.get(call_id, "")})
            else:
                response = {"tool": names.get(call_id, ""), "tool_call_id": call_id, "content": msg["content"]}
                out.append({"role": "user", "content": json.dumps({"tool_response": response}, ensure_ascii=False)})
        else:
            out.append(msg)
    return tuple(out)


def _with_system(messages: Sequence[dict], text: str) -> tuple[dict, ...]:
    if messages and messages[0]["role"] == "system":
        first = messages[0]
        return ({**first, "content": f"{first['content']}\n\n{text}" if first["content"] else text},
                *messages[1:])
    return ({"role": "system", "content": text}, *messages)


# ---------------------------------------------------------------- the response
def message(plan: ToolPlan, result: GenerationResult) -> tuple[dict, str]:
    """The assistant message and finish_reason of a finished generation."""
    content, calls = plan.parse(result.text)
    msg = {"role": "assistant", "content": content, "refusal": None}
    if calls:
        msg["tool_calls"] = calls
    finish = "tool_calls" if calls and result.finish_reason == FinishReason.STOP else str(result.finish_reason)
    return msg, finish


def deltas(msg: dict) -> list[dict]:
    """A message as streamed deltas, the way OpenAI's clients assemble them: the content, then each call's
    index, id, type and name with empty arguments, then its arguments in pieces."""
    out = []
    if msg.get("content"):
        out.append({"content": msg["content"]})
    for index, call in enumerate(msg.get("tool_calls", ())):
        fn = call["function"]
        out.append({"tool_calls": [{"index": index, "id": call["id"], "type": "function",
                                    "function": {"name": fn["name"], "arguments": ""}}]})
        args = fn["arguments"]
        for at in range(0, len(args), ARGUMENT_PIECE):
            out.append({"tool_calls": [{"index": index, "function": {"arguments": args[at:at + ARGUMENT_PIECE]}}]})
    return out
