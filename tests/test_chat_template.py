"""Chat prompts rendered from the model's own Jinja template (skippyd/runtime/chat_template.py), with llama.cpp's
built-in renderer as the fallback: the default model's prompts against the built-in renderer's, templates that
know tools, the sandbox, and the fallback on real (tiny) GGUF files carrying other templates."""

from __future__ import annotations

import logging
from datetime import datetime

import attrs
import jinja2
import pytest

from skippyd.runtime.chat_template import ChatTemplate, TemplateRefused, check_template, render_chat, template_for
from skippyd.runtime.llama import InvalidArgumentError, Model
from tests.tiny_model import write_tiny_llama

# Qwen 2.5's tool-calling template (Hermes format), shortened to its tool parts: what a template that knows
# tools does with them
HERMES = (
    "{%- if tools %}<|im_start|>system\n{% if messages[0]['role'] == 'system' %}{{ messages[0]['content'] }}"
    "\n\n{% endif %}# Tools\n\n<tools>{% for tool in tools %}\n{{ tool | tojson }}{% endfor %}\n</tools>\n\n"
    "Return a call as <tool_call>{\"name\": ..., \"arguments\": ...}</tool_call><|im_end|>\n"
    "{%- elif messages[0]['role'] == 'system' %}<|im_start|>system\n{{ messages[0]['content'] }}<|im_end|>\n"
    "{%- endif %}"
    "{%- for message in messages %}"
    "{%- if message.role == 'user' or (message.role == 'system' and not loop.first) %}"
    "<|im_start|>{{ message.role }}\n{{ message.content }}<|im_end|>\n"
    "{%- elif message.role == 'assistant' %}<|im_start|>assistant{% if message.content %}\n{{ message.content }}"
    "{% endif %}{%- for tool_call in message.tool_calls or [] %}{% set tool_call = tool_call.function %}"
    "\n<tool_call>\n{\"name\": \"{{ tool_call.name }}\", \"arguments\": {{ tool_call.arguments | tojson }}}"
    "\n</tool_call>{%- endfor %}<|im_end|>\n"
    "{%- elif message.role == 'tool' %}<|im_start|>user\n<tool_response>\n{{ message.content }}\n"
    "</tool_response><|im_end|>\n"
    "{%- endif %}{%- endfor %}"
    "{%- if add_generation_prompt %}<|im_start|>assistant\n{% endif %}")

CONVERSATIONS = [
    [{"role": "system", "content": "You are a terse assistant."}, {"role": "user", "content": "Name three colours."}],
    [{"role": "system", "content": "S"}, {"role": "user", "content": "Hi"}, {"role": "assistant", "content": "Yo"},
     {"role": "user", "content": "again?"}],
    [{"role": "system", "content": "Réponds en français. 日本語も。"},
     {"role": "user", "content": "  leading and trailing spaces \n\n"}, {"role": "assistant", "content": ""},
     {"role": "user", "content": "{{ not a template }} {% raw %}"}],
    [{"role": "system", "content": ""}, {"role": "user", "content": "<|im_start|>literal markers<|im_end|>"}],
]


@pytest.fixture(scope="module")
def smol(default_model_path):
    with Model(default_model_path) as m:
        yield m


def _with_template(tmp_path_factory, small_tokenizer_fields, name: str, template: str):
    fields = [attrs.evolve(f, value=template) if f.key == "tokenizer.chat_template" else f
              for f in small_tokenizer_fields]
    return write_tiny_llama(tmp_path_factory.mktemp(name) / f"{name}.gguf", tokenizer_from=fields, n_layer=2)


@pytest.mark.parametrize("conversation", CONVERSATIONS)
@pytest.mark.parametrize("add_generation_prompt", [True, False])
def test_default_model_prompt_is_byte_identical_to_the_builtin_renderer(smol, conversation, add_generation_prompt):
    jinja = render_chat(smol, conversation, add_generation_prompt=add_generation_prompt)
    assert jinja == smol.apply_chat_template(conversation, add_assistant=add_generation_prompt)
    assert template_for(smol) is not None and not template_for(smol).knows_tools


def test_default_model_without_a_system_message_gets_its_authors_default_one(smol):
    """SmolLM2's template opens a conversation that has no system message with its own; llama.cpp's built-in
    ChatML renderer leaves that out. The template's text is what the model was trained on."""
    chat = [{"role": "user", "content": "Hi"}]
    default = ("<|im_start|>system\nYou are a helpful AI assistant named SmolLM, trained by Hugging Face"
               "<|im_end|>\n")
    assert render_chat(smol, chat) == default + smol.apply_chat_template(chat)


def test_the_models_own_tokens_and_helpers_are_there(smol):
    t = template_for(smol)
    assert (t.bos_token, t.eos_token) == ("<|im_start|>", "<|im_end|>")
    probe = ChatTemplate("{{ bos_token }}|{{ eos_token }}|{{ strftime_now('%Y') }}|{{ add_generation_prompt }}|"
                         "{{ {'k': 'é'} | tojson }}|{% for m in messages %}{% if loop.index > 1 %}{% break %}"
                         "{% endif %}{{ m.content }}{% endfor %}",
                         bos_token=t.bos_token, eos_token=t.eos_token)
    out = probe.render([{"role": "user", "content": "a"}, {"role": "user", "content": "b"}])
    assert out == f"<|im_start|>|<|im_end|>|{datetime.now().year}|True|{{\"k\": \"é\"}}|a"


def test_raise_exception_and_the_sandbox_refuse():
    strict = ChatTemplate("{% if messages[0].role != 'user' %}{{ raise_exception('first must be user') }}"
                          "{% endif %}ok")
    assert strict.render([{"role": "user", "content": "x"}]) == "ok"
    with pytest.raises(TemplateRefused, match="first must be user"):
        strict.render([{"role": "system", "content": "x"}])
    escape = ChatTemplate("{{ ''.__class__.__mro__[1].__subclasses__() }}")
    with pytest.raises(TemplateRefused, match="SecurityError|unsafe"):
        escape.render([])
    mutate = ChatTemplate("{% set _ = messages.append({'role': 'x'}) %}{{ messages | length }}")
    with pytest.raises(TemplateRefused):
        mutate.render([{"role": "user", "content": "x"}])
    with pytest.raises(jinja2.TemplateSyntaxError):
        ChatTemplate("{% for %}")


def test_a_template_that_knows_tools_renders_them_and_the_tool_history():
    t = ChatTemplate(HERMES)
    assert t.knows_tools
    tool = {"type": "function", "function": {"name": "get_weather", "parameters": {"type": "object"}}}
    chat = [{"role": "user", "content": "Weather in Paris?"},
            {"role": "assistant", "content": "", "tool_calls": [
                {"id": "call_1", "type": "function", "function": {"name": "get_weather",
                                                                  "arguments": {"city": "Paris"}}}]},
            {"role": "tool", "tool_call_id": "call_1", "name": "get_weather", "content": "18 C"}]
    out = t.render(chat, tools=[tool])
    assert '<tools>{"type": "function", "function": {"name": "get_weather"' in out  # (trim_blocks ate "\n")
    assert '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris"}}\n</tool_call>' in out
    assert "<tool_response>\n18 C\n</tool_response>" in out
    assert out.endswith("<|im_start|>assistant\n")
    assert "<tools>" not in t.render(chat[:1])


def test_a_model_with_a_tool_template_renders_it(tmp_path_factory, small_tokenizer_fields):
    path = _with_template(tmp_path_factory, small_tokenizer_fields, "hermes", HERMES)
    with Model(path) as model:
        assert template_for(model).knows_tools
        tool = {"type": "function", "function": {"name": "f", "parameters": {"type": "object"}}}
        assert "<tools>" in render_chat(model, [{"role": "user", "content": "x"}], tools=[tool])


def test_a_broken_template_falls_back_to_the_builtin_renderer_logged_once(tmp_path_factory, small_tokenizer_fields,
                                                                          caplog):
    # ChatML by its markers (llama.cpp's built-in renderer recognises it), but not valid Jinja
    broken = "{% for message in messages %}<|im_start|>{{ message['role'] }\n{{ message['content'] }}<|im_end|>"
    path = _with_template(tmp_path_factory, small_tokenizer_fields, "broken", broken)
    chat = [{"role": "user", "content": "Hi"}]
    with Model(path) as model, caplog.at_level(logging.WARNING, logger="skippyd.chat_template"):
        assert template_for(model) is None
        assert render_chat(model, chat) == model.apply_chat_template(chat) == \
            "<|im_start|>user\nHi<|im_end|>\n<|im_start|>assistant\n"
        render_chat(model, chat)
        with pytest.raises(InvalidArgumentError, match="cannot render"):  # the built-in one knows no tools
            render_chat(model, chat, tools=[{"type": "function", "function": {"name": "f"}}])
    assert sum("does not compile" in r.getMessage() for r in caplog.records) == 1


def test_a_template_that_fails_at_render_time_falls_back_once(tmp_path_factory, small_tokenizer_fields, caplog):
    failing = "<|im_start|>{{ messages[0].content.nope() }}<|im_end|>"  # compiles; the call fails when rendered
    path = _with_template(tmp_path_factory, small_tokenizer_fields, "failing", failing)
    chat = [{"role": "user", "content": "Hi"}]
    with Model(path) as model, caplog.at_level(logging.WARNING, logger="skippyd.chat_template"):
        assert render_chat(model, chat) == model.apply_chat_template(chat)
        assert render_chat(model, chat) == model.apply_chat_template(chat)
    assert sum("failed to render" in r.getMessage() for r in caplog.records) == 1


GEMMA_TURNS = ("{{ bos_token }}{% for m in messages %}<start_of_turn>{{ 'model' if m.role == 'assistant' else "
               "m.role }}\n{{ m.content }}<end_of_turn>\n{% endfor %}"
               "{% if add_generation_prompt %}<start_of_turn>model\n{% endif %}")


@pytest.fixture(scope="module")
def base_model(tmp_path_factory, small_tokenizer_fields):
    """A model whose GGUF has no chat template (a base model)."""
    fields = [f for f in small_tokenizer_fields if f.key != "tokenizer.chat_template"]
    path = write_tiny_llama(tmp_path_factory.mktemp("base") / "base.gguf", tokenizer_from=fields, n_layer=2)
    with Model(path) as m:
        yield m


def test_a_model_without_a_template_names_the_way_to_give_one(base_model):
    assert base_model.chat_template is None
    with pytest.raises(InvalidArgumentError, match=r"has no chat template.*skippyd --chat-template FILE"):
        render_chat(base_model, [{"role": "user", "content": "Hi"}])


def test_the_operators_template_renders_where_the_model_has_none(base_model, smol):
    chat = [{"role": "user", "content": "Hi"}, {"role": "assistant", "content": "Yo"}]
    bos = base_model.token_piece(base_model.bos, special=True).decode()
    assert render_chat(base_model, chat, template_source=GEMMA_TURNS) == (
        f"{bos}<start_of_turn>user\nHi<end_of_turn>\n<start_of_turn>model\nYo<end_of_turn>\n<start_of_turn>model\n")
    # and in place of a model's own
    assert render_chat(smol, chat, template_source=GEMMA_TURNS).startswith("<|im_start|><start_of_turn>user")


@pytest.mark.parametrize("source, message", [("", "empty"), ("{% for m in messages %}", "does not compile")])
def test_a_template_that_cannot_be_used_is_refused_before_any_chat(source, message):
    with pytest.raises(TemplateRefused, match=message):
        check_template(source)
