"""Tool calls on the OpenAI endpoint: do forced calls come back well formed on varied prompts?

Starts a 2-stage pipeline of the default model (the generic tool format, constrained on the final stage),
sends 20 varied prompts with ``tool_choice="required"`` and 20 with a named function through the official
``openai`` client (sampled, temperature 0.7, a seed per prompt), and counts the replies whose
``finish_reason`` is ``tool_calls`` and whose every call names an offered tool with arguments that parse and
validate (jsonschema) against its parameters. Prints one line per call and a JSON summary.

    .venv/bin/python bench/tool_calls.py [--model FILE.gguf] [--prompts N]
"""

from __future__ import annotations

import argparse
import json
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

import jsonschema
import openai

from skippyd.runtime.models import fetch_default_model
from tests.openai_api import Api, wait_healthy
from tests.procs import Pipeline, free_ports, split_for_test
from tests.test_tools import TOOLS

EXTRA = [
    {"type": "function", "function": {
        "name": "convert_currency", "description": "Convert an amount between currencies",
        "parameters": {"type": "object", "properties": {
            "amount": {"type": "number", "exclusiveMinimum": 0},
            "from": {"type": "string", "pattern": "^[A-Z]{3}$"}, "to": {"type": "string", "pattern": "^[A-Z]{3}$"}},
            "required": ["amount", "from", "to"], "additionalProperties": False}}},
    {"type": "function", "function": {
        "name": "send_email", "description": "Send an email",
        "parameters": {"type": "object", "properties": {
            "to": {"type": "array", "items": {"type": "string"}, "minItems": 1, "maxItems": 3},
            "subject": {"type": "string", "maxLength": 60}, "urgent": {"type": "boolean"}},
            "required": ["to", "subject"]}}},
    {"type": "function", "function": {
        "name": "search_flights", "description": "Search flights",
        "parameters": {"type": "object", "properties": {
            "origin": {"type": "string"}, "destination": {"type": "string"},
            "date": {"type": "string", "pattern": "^2026-[01][0-9]-[0-3][0-9]$"},
            "cabin": {"enum": ["economy", "business", "first"]}, "passengers": {"type": "integer", "minimum": 1,
                                                                               "maximum": 9}},
            "required": ["origin", "destination", "date", "cabin"]}}},
]
ALL = TOOLS + EXTRA
SCHEMAS = {t["function"]["name"]: t["function"]["parameters"] for t in ALL}
PROMPTS = [  # (prompt, the function a named choice forces)
    ("What's the weather in Paris?", "get_weather"),
    ("Is it raining in Manchester? Fahrenheit please.", "get_weather"),
    ("Tell me how hot it is in Cairo.", "get_weather"),
    ("What time is it in Tokyo right now?", "get_time"),
    ("I need the current time in New York.", "get_time"),
    ("Which hour is it in Sydney?", "get_time"),
    ("Book a table for 2 at Luigi's, no vegetarians.", "book_table"),
    ("Reserve dinner for six people at The Green Leaf, all vegetarian.", "book_table"),
    ("Can you get us a table at Sushi Zen for 3?", "book_table"),
    ("How much is 100 US dollars in euros?", "convert_currency"),
    ("Convert 2500 yen to British pounds.", "convert_currency"),
    ("What are 42.5 Swiss francs in USD?", "convert_currency"),
    ("Email alice@example.com that the meeting moved to 3pm.", "send_email"),
    ("Send an urgent note to bob@example.com and carol@example.com: server down.", "send_email"),
    ("Write to the team (team@example.com) with subject 'Friday lunch'.", "send_email"),
    ("Find me a flight from Lisbon to Berlin on 2026-03-14, economy.", "search_flights"),
    ("Business class from JFK to LHR on 2026-12-20 for two.", "search_flights"),
    ("Any first class seats Dubai to Singapore on 2026-07-01?", "search_flights"),
    ("I'm going from Oslo to Rome on 2026-05-09 with my 3 kids, cheapest cabin.", "search_flights"),
    ("Hi! What can you do for me?", "get_time"),
]


def check(choice, allowed: set[str]) -> str | None:
    """None if the reply is well formed, else why not."""
    if choice.finish_reason != "tool_calls" or not choice.message.tool_calls:
        return f"finish_reason {choice.finish_reason}, content {choice.message.content!r}"
    for call in choice.message.tool_calls:
        if call.function.name not in allowed:
            return f"called {call.function.name}"
        try:
            jsonschema.validate(json.loads(call.function.arguments), SCHEMAS[call.function.name])
        except (ValueError, jsonschema.ValidationError) as exc:
            return f"arguments {call.function.arguments!r}: {str(exc).splitlines()[0]}"
    return None


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", type=Path, default=None)
    ap.add_argument("--prompts", type=int, default=len(PROMPTS))
    args = ap.parse_args()
    model = args.model or fetch_default_model()
    model_id = model.stem
    work = Path(tempfile.mkdtemp(prefix="bench-tools-"))
    split_for_test(model, 2, work)
    port = free_ports(1)[0]
    pipe = Pipeline(work / "topology.toml", work, extra=["--openai", f"127.0.0.1:{port}", "--ctx", "2048"]).start()
    summary = {}
    try:
        api = Api(pipe, port)
        wait_healthy(api)
        client: openai.OpenAI = api.client
        for mode in ("required", "named"):
            ok, seconds, tokens = 0, 0.0, 0
            for i, (prompt, name) in enumerate(PROMPTS[:args.prompts]):
                choice = "required" if mode == "required" else {"type": "function", "function": {"name": name}}
                allowed = set(SCHEMAS) if mode == "required" else {name}
                started = time.perf_counter()
                got = client.chat.completions.create(model=model_id, tools=ALL, tool_choice=choice, max_tokens=160,
                                                     messages=[{"role": "user", "content": prompt}],
                                                     temperature=0.7, seed=1000 + i)
                seconds += time.perf_counter() - started
                tokens += got.usage.completion_tokens
                why = check(got.choices[0], allowed)
                ok += why is None
                calls = [(c.function.name, c.function.arguments) for c in got.choices[0].message.tool_calls or ()]
                print(f"{mode:8} {i:2} {'ok ' if why is None else 'BAD'} {calls} {why or ''}", flush=True)
            n = min(args.prompts, len(PROMPTS))
            summary[mode] = {"valid": ok, "of": n, "mean_s": round(seconds / n, 3),
                             "completion_tokens_mean": round(tokens / n, 1)}
    finally:
        pipe.stop()
    print(json.dumps(summary))
    return 0 if all(s["valid"] == s["of"] for s in summary.values()) else 1


if __name__ == "__main__":
    sys.exit(main())
