"""Chat prompts rendered from the model's own ``tokenizer.chat_template`` (Jinja), as its authors wrote it.

The template runs in Jinja's immutable sandbox with what Hugging Face's
templates expect (transformers' ``apply_chat_template``): ``messages``,
``tools``, ``add_generation_prompt``, ``bos_token`` / ``eos_token`` (the
model's own, as text), ``raise_exception``, ``strftime_now``, a ``tojson``
filter that keeps non-ASCII text, trimmed blocks and ``loopcontrols``.

llama.cpp's built-in renderer (:meth:`Model.apply_chat_template`, which knows
a fixed list of template families by their look) stays as the fallback: a
template that does not compile or fails to render is logged once and the
built-in one is used; if neither can render the messages the caller gets
:class:`~skippyd.runtime.llama.InvalidArgumentError` naming the template's
complaint.

A template that reads ``tools`` knows how to present tools to its model
(:attr:`ChatTemplate.knows_tools`); the OpenAI endpoint gives those templates
the tools and describes them itself to the others.

Images: a message's content may be a list of parts, ``{"type": "text",
"text": ...}`` and ``{"type": "image"}``, as Hugging Face's templates take
them. A template that renders image parts (:attr:`ChatTemplate.image_text`:
what it writes for one, found by rendering a probe once) gets the list, and
the projector's media marker takes the place of what it wrote for each image
(the projector frames the image with the model's own tokens itself). Any
other template, and the built-in renderer, which knows only strings, get
each message's parts joined into a string, the marker where an image was.
"""

from __future__ import annotations

import functools
import json
import logging
from collections.abc import Mapping, Sequence
from datetime import datetime
from typing import Any

import jinja2
import jinja2.ext
import jinja2.meta
import jinja2.nodes
from jinja2.sandbox import ImmutableSandboxedEnvironment

from skippyd.runtime.llama import InvalidArgumentError

__all__ = ["ChatTemplate", "TemplateRefused", "check_template", "render_chat", "template_for"]

log = logging.getLogger("skippyd.chat_template")

_warned: set[tuple[str, int]] = set()  # (what, hash of the template): each fallback is logged once


class TemplateRefused(ValueError):
    """The template itself refused the messages (its ``raise_exception``), or failed rendering them."""


class _Generation(jinja2.ext.Extension):
    """``{% generation %}…{% endgeneration %}`` (transformers' assistant-mask markers): rendered as its body."""

    tags = {"generation"}

    def parse(self, parser):
        lineno = next(parser.stream).lineno
        body = parser.parse_statements(("name:endgeneration",), drop_needle=True)
        return jinja2.nodes.CallBlock(self.call_method("_body"), [], [], body).set_lineno(lineno)

    def _body(self, caller):
        return caller()


def _raise_exception(message: str):
    raise TemplateRefused(str(message))


def _tojson(value: Any, ensure_ascii: bool = False, indent: int | None = None, separators=None,
            sort_keys: bool = False) -> str:
    return json.dumps(value, ensure_ascii=ensure_ascii, indent=indent, separators=separators, sort_keys=sort_keys)


def _strftime_now(fmt: str) -> str:
    return datetime.now().strftime(fmt)


def _environment() -> ImmutableSandboxedEnvironment:
    env = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True,
                                        extensions=[_Generation, jinja2.ext.loopcontrols])
    env.filters["tojson"] = _tojson
    env.globals["raise_exception"] = _raise_exception
    env.globals["strftime_now"] = _strftime_now
    return env


class ChatTemplate:
    """One compiled chat template. ``jinja2.TemplateSyntaxError`` if it does not compile."""

    def __init__(self, source: str, *, bos_token: str = "", eos_token: str = ""):
        self.source = source
        self.bos_token, self.eos_token = bos_token, eos_token
        env = _environment()
        ast = env.parse(source)
        self.knows_tools = "tools" in jinja2.meta.find_undeclared_variables(ast)
        self._template = env.from_string(source)
        self._image_text: str | None = None

    @property
    def image_text(self) -> str:
        """What the template writes for an image part of a user message ("" when it renders none: a template
        for text only). Found once, from a probe with an image between two text parts."""
        if self._image_text is None:
            before, after = "\ue000skippy-before", "skippy-after\ue000"
            probe = [{"role": "user", "content": [{"type": "text", "text": before}, {"type": "image"},
                                                  {"type": "text", "text": after}]}]
            try:
                text = self.render(probe, add_generation_prompt=False)
            except TemplateRefused:
                text = ""
            start, end = text.find(before), text.find(after)
            between = text[start + len(before):end] if 0 <= start < end else ""
            self._image_text = between if between.strip() else ""
        return self._image_text

    def render(self, messages: Sequence[Mapping[str, Any]], *, add_generation_prompt: bool = True,
               tools: Sequence[Mapping[str, Any]] | None = None, **extra: Any) -> str:
        """The prompt text of ``messages`` (Hugging Face's message dicts). TemplateRefused if the template
        raises or cannot render them."""
        try:
            return self._template.render(messages=[dict(m) for m in messages], tools=list(tools) if tools else None,
                                         add_generation_prompt=add_generation_prompt, bos_token=self.bos_token,
                                         eos_token=self.eos_token, **extra)
        except TemplateRefused:
            raise
        except Exception as exc:  # Jinja's errors, and what a template's own expressions raise (TypeError, …)
            raise TemplateRefused(f"{type(exc).__name__}: {exc}") from None


@functools.lru_cache(maxsize=16)
def _compiled(source: str, bos_token: str, eos_token: str) -> ChatTemplate | None:
    try:
        return ChatTemplate(source, bos_token=bos_token, eos_token=eos_token)
    except jinja2.TemplateError as exc:
        _warn_once("compile", source, "the model's chat template does not compile (%s); llama.cpp's built-in "
                   "renderer is used instead", exc)
        return None


def _warn_once(what: str, source: str, msg: str, *args: Any) -> None:
    key = (what, hash(source))
    if key not in _warned:
        _warned.add(key)
        log.warning(msg, *args)


def _token_text(model, token: int) -> str:
    if token is None or token < 0:
        return ""
    return model.token_piece(token, special=True).decode("utf-8", "replace")


def check_template(source: str) -> None:
    """TemplateRefused if `source` is not a chat template that compiles."""
    if not source.strip():
        raise TemplateRefused("the template is empty")
    try:
        ChatTemplate(source)
    except jinja2.TemplateError as exc:
        raise TemplateRefused(f"does not compile: {exc}") from None


def template_for(model, source: str | None = None) -> ChatTemplate | None:
    """`source` (an operator's template), else the model's own chat template, compiled (cached by its text);
    None if there is none or it does not compile."""
    source = source or model.chat_template
    if not source:
        return None
    return _compiled(source, _token_text(model, model.bos), _token_text(model, model.eos))


def _plain(messages: Sequence[Mapping[str, Any]]) -> bool:
    return all(isinstance(m.get("content"), str) and set(m) <= {"role", "content"} for m in messages)


def _image_parts(messages: Sequence[Mapping[str, Any]]) -> int:
    return sum(1 for m in messages if isinstance(m.get("content"), list)
               for part in m["content"] if part.get("type") == "image")


def _joined(messages: Sequence[Mapping[str, Any]], marker: str) -> list[dict]:
    """Each message's content parts as one string: the text parts' text, `marker` where an image was."""
    out = []
    for m in messages:
        content = m.get("content")
        if isinstance(content, list):
            content = "".join(marker if part.get("type") == "image" else part.get("text", "") for part in content)
        out.append({**m, "content": content})
    return out


def render_chat(model, messages: Sequence[Mapping[str, Any]], *, add_generation_prompt: bool = True,
                tools: Sequence[Mapping[str, Any]] | None = None, template_source: str | None = None,
                media_marker: str | None = None) -> str:
    """``messages`` as the model's prompt: its Jinja template (or `template_source`, the operator's, in its
    place), or llama.cpp's built-in renderer when the template cannot render them (logged once per template).
    InvalidArgumentError when neither can. Image parts (see the module docstring) become `media_marker`, one
    per image, in order."""
    source = template_source or model.chat_template
    template = template_for(model, source)
    if source is None:
        raise InvalidArgumentError("apply chat template", f"{model.name} has no chat template (a base model?); "
                                   "start the head with skippyd --chat-template FILE")
    images = _image_parts(messages)
    if images:
        if media_marker is None:
            raise InvalidArgumentError("apply chat template", "image parts need the projector's media marker")
        if template is not None and template.image_text:
            try:
                text = template.render(messages, add_generation_prompt=add_generation_prompt, tools=tools)
            except TemplateRefused:
                text = ""
            if text.count(template.image_text) == images:
                return text.replace(template.image_text, media_marker)
        messages = _joined(messages, media_marker)
    refusal = None
    if template is not None:
        try:
            return template.render(messages, add_generation_prompt=add_generation_prompt, tools=tools)
        except TemplateRefused as exc:
            refusal = exc
    if tools or not _plain(messages):  # the built-in renderer knows only role and content
        raise InvalidArgumentError("apply chat template", f"the chat template cannot render these messages: "
                                   f"{refusal or 'it does not compile'}")
    try:
        text = model.apply_chat_template(messages, add_assistant=add_generation_prompt, template=source)
    except InvalidArgumentError:
        if refusal is not None:
            raise InvalidArgumentError("apply chat template", f"the chat template refused the messages: "
                                       f"{refusal}") from None
        raise
    if refusal is not None:
        _warn_once("render", source, "the chat template failed to render a chat (%s); "
                   "llama.cpp's built-in renderer is used when it does", refusal)
    return text
