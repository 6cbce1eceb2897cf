"""Client libraries run unmodified against the OpenAI endpoint and return validated objects: instructor (TOOLS and
JSON_SCHEMA modes) and langchain-openai (``with_structured_output``, ``bind_tools`` with a forced tool), on a real
2-stage pipeline of the default model."""

from __future__ import annotations

from typing import Literal

import pytest
from pydantic import BaseModel, Field

from tests.openai_api import run, serving

instructor = pytest.importorskip("instructor")
langchain_openai = pytest.importorskip("langchain_openai")

MODEL_ID = "SmolLM2-135M-Instruct.Q4_1"
pytestmark = pytest.mark.slow


class Weather(BaseModel):
    """The weather asked about."""

    city: str
    unit: Literal["celsius", "fahrenheit"]


class Person(BaseModel):
    """A person mentioned in the text."""

    name: str = Field(max_length=40)
    age: int = Field(ge=0, le=130)


@pytest.fixture(scope="module")
def api(default_model_path, tmp_path_factory):
    with serving(default_model_path, tmp_path_factory.mktemp("clients"), ctx=2048) as a:
        yield a


def _chat(api):
    return langchain_openai.ChatOpenAI(model=MODEL_ID, base_url=f"{api.base}/v1", api_key="unused", temperature=0,
                                       max_tokens=120, max_retries=0, timeout=120)


@pytest.mark.parametrize("mode", ["TOOLS", "JSON_SCHEMA"])
async def test_instructor(api, mode):
    client = instructor.from_openai(api.client, mode=getattr(instructor.Mode, mode))

    def ask():
        return client.chat.completions.create(
            model=MODEL_ID, response_model=Person, max_retries=0, max_tokens=120, temperature=0,
            messages=[{"role": "user", "content": "Ada Lovelace was 36 years old. Extract the person."}])

    person = await run(ask)
    assert isinstance(person, Person) and person.name and 0 <= person.age <= 130


async def test_langchain_with_structured_output(api):
    structured = _chat(api).with_structured_output(Weather)
    got = await run(structured.invoke, "What's the weather in Paris, in celsius?")
    assert isinstance(got, Weather) and got.city


async def test_langchain_bind_tools_forced(api):
    bound = _chat(api).bind_tools([Weather], tool_choice="Weather")
    message = await run(bound.invoke, "Is it hot in Madrid? Fahrenheit.")
    (call,) = message.tool_calls
    assert call["name"] == "Weather" and call["id"].startswith("call_")
    assert isinstance(Weather.model_validate(call["args"]), Weather)
