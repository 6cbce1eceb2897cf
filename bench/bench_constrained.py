"""Constrained decoding: decode speed with a JSON-schema constraint against the same prompt unconstrained, and
the validity of constrained replies over 20 prompts and schemas.

    .venv/bin/python bench/bench_constrained.py [--rounds 5] [--json out.json]
    .venv/bin/python bench/bench_constrained.py --validity-only
    .venv/bin/python bench/bench_constrained.py --beside-only [--rounds 5]

One 2-stage pipeline of skippyd processes on loopback (the default model, ``--threads`` compute threads each).

a. Speed, through the control channel, in interleaved rounds: the same prompt (a JSON request) greedy with
   no constraint, with logprobs only (the final stage's Python path without a mask), and with a JSON schema;
   each generation runs to ``--tokens`` tokens or its end. Decode rate: the daemon's decode_tokens_per_s
   (tokens after the first over the time from the first to the last). Reported: medians (min-max) and the
   constrained / unconstrained ratio.
b. Beside another session (``--beside``): a plain streamed generation (the victim) while a second session
   decodes next to it, in interleaved rounds: a plain neighbour, or a constrained one whose schema is new each
   round (so that its compile on the final stage falls inside the victim's decode). Reported: the victim's
   decode rate and its longest gap between two streamed pieces, median over the rounds, constrained against
   plain neighbour: a constraint must not stall the sessions beside it.
c. Validity, through the OpenAI endpoint with the official client: 20 prompts, each with its schema (nested
   objects, arrays, enums, required fields), temperature 0.7, max_tokens 300. A reply that finishes must parse
   and validate (jsonschema); the count that finish is reported.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

import jsonschema
import openai
import trio

from skippyctl.client import open_control
from skippyd.control import messages as m
from skippyd.runtime.models import fetch_default_model
from tests.procs import Pipeline, free_ports, split_for_test

MODEL_ID = "SmolLM2-135M-Instruct.Q4_1"
SPEED_PROMPT = "Describe a fictional employee as JSON: name, age, department, skills and address."
COUNTING = "1, 2, 3, 4, 5, 6, 7, 8, 9, 10,"  # a raw prompt the model continues for as long as it is let
SPEED_SCHEMA = {
    "type": "object",
    "properties": {
        "name": {"type": "string"}, "age": {"type": "integer"},
        "department": {"enum": ["engineering", "sales", "support", "finance"]},
        "skills": {"type": "array", "items": {"type": "string"}},
        "address": {"type": "object", "properties": {"street": {"type": "string"}, "city": {"type": "string"}},
                    "required": ["street", "city"]}},
    "required": ["name", "age", "department", "skills", "address"],
}


def _obj(props: dict, required: list[str] | None = None) -> dict:
    return {"type": "object", "properties": props, "required": list(props) if required is None else required,
            "additionalProperties": False}


S, INT, N, B = {"type": "string"}, {"type": "integer"}, {"type": "number"}, {"type": "boolean"}
CASES = [
    ("Describe a person.", _obj({"name": S, "age": INT})),
    ("Give me a city and its country.", _obj({"city": S, "country": S})),
    ("Rate today's weather.", _obj({"sky": {"enum": ["sunny", "cloudy", "rainy"]}, "temperature_c": N})),
    ("List three colours.", _obj({"colours": {"type": "array", "items": S, "minItems": 3, "maxItems": 3}})),
    ("Describe a book and its author.", _obj({"title": S, "author": _obj({"first": S, "last": S}),
                                              "year": {"type": "integer", "minimum": 1000, "maximum": 2100}})),
    ("Is the sea salty?", _obj({"answer": B, "reason": S}, ["answer"])),
    ("Pick a fruit.", {"enum": ["apple", "banana", "cherry"]}),
    ("Give two small numbers.", {"type": "array", "items": {"type": "integer", "minimum": 0, "maximum": 99},
                                 "minItems": 2, "maxItems": 2}),
    ("Describe a car.", _obj({"make": S, "model": S, "year": INT, "electric": B})),
    ("Plan a meal.", _obj({"starter": S, "main": S, "dessert": S})),
    ("Describe a company with two employees.", _obj({
        "company": S, "employees": {"type": "array", "items": _obj({"name": S, "role": S}), "maxItems": 2}})),
    ("Name a planet and its moons.", _obj({"planet": S, "moons": {"type": "array", "items": S, "maxItems": 4}})),
    ("Give a movie review.", _obj({"title": S, "stars": {"type": "integer", "minimum": 1, "maximum": 5},
                                   "summary": {"type": "string", "maxLength": 120}})),
    ("Describe an order in a shop.", _obj({
        "order_id": INT, "items": {"type": "array", "items": _obj({"product": S, "quantity": INT}), "minItems": 1,
                                 "maxItems": 3},
        "status": {"enum": ["pending", "shipped", "delivered"]}})),
    ("What is 2 + 2?", _obj({"result": INT})),
    ("Describe a pet.", _obj({"species": {"enum": ["cat", "dog", "bird", "fish"]}, "name": S,
                              "age_years": N}, ["species", "name"])),
    ("Describe a server's status.", _obj({"host": S, "up": B, "load": {"type": "array", "items": N,
                                                                        "minItems": 3, "maxItems": 3}})),
    ("Translate 'hello' into French and Spanish.", _obj({"french": S, "spanish": S})),
    ("Describe a weekly schedule entry.", _obj({
        "day": {"enum": ["monday", "tuesday", "wednesday", "thursday", "friday"]},
        "slot": _obj({"start": {"type": "string", "pattern": "^[0-2][0-9]:[0-5][0-9]$"},
                      "end": {"type": "string", "pattern": "^[0-2][0-9]:[0-5][0-9]$"}}),
        "title": S})),
    ("Give a user profile with settings.", _obj({
        "username": S, "settings": _obj({"theme": {"enum": ["light", "dark"]}, "notifications": B}),
        "tags": {"type": "array", "items": S, "maxItems": 3}}, ["username", "settings"])),
]


def _median(xs: list[float]) -> str:
    return f"{statistics.median(xs):.1f} ({min(xs):.1f}-{max(xs):.1f})" if xs else "-"


async def _speed(pipe: Pipeline, rounds: int, tokens: int) -> dict:
    kinds = {
        "unconstrained": {},
        "logprobs only": {"logprobs": 0},
        "json_schema": {"json_schema": json.dumps(SPEED_SCHEMA)},
    }
    rates: dict[str, list[float]] = {k: [] for k in kinds}
    lengths: dict[str, list[int]] = {k: [] for k in kinds}
    async with open_control(pipe.head.url, pipe.head.token_file) as client:
        for r in range(rounds + 1):  # round 0 warms up (the final stage's first matcher builds its vocabulary)
            for kind, extra in kinds.items():
                result = await client.call(m.Generate(id=client.new_id(), prompt=SPEED_PROMPT, max_tokens=tokens,
                                                      stream=False, **extra))
                if r:
                    rates[kind].append(result["timings"]["decode_tokens_per_s"])
                    lengths[kind].append(result["usage"]["completion_tokens"])
                if kind == "json_schema" and result["finish_reason"] == "stop":
                    jsonschema.validate(json.loads(result["text"]), SPEED_SCHEMA)
    out = {k: {"tok_s": rates[k], "tokens": lengths[k]} for k in kinds}
    base = statistics.median(rates["unconstrained"])
    for k in kinds:
        out[k]["ratio"] = statistics.median(rates[k]) / base
    return out


async def _victim(pipe: Pipeline, tokens: int) -> dict:
    """A plain streamed generation: its decode rate and the longest gap between its pieces (after the first)."""
    arrivals = []
    async with open_control(pipe.head.url, pipe.head.token_file) as client:
        async for reply in client.replies(m.Generate(id=client.new_id(), prompt=COUNTING, raw=True,
                                                     max_tokens=tokens, stream=True)):
            if isinstance(reply, m.Piece):
                arrivals.append(time.perf_counter())
            elif isinstance(reply, m.Result):
                rate = reply.result["timings"]["decode_tokens_per_s"]
            else:
                raise RuntimeError(f"the victim failed: {reply}")
    gaps = [b - a for a, b in zip(arrivals[1:], arrivals[2:])]
    return {"tok_s": rate, "max_gap_ms": 1e3 * max(gaps)}


async def _victim_into(got: dict, pipe: Pipeline, tokens: int) -> None:
    got.update(await _victim(pipe, tokens))


async def _beside(pipe: Pipeline, rounds: int, tokens: int) -> dict:
    rows: dict[str, list[dict]] = {"plain neighbour": [], "constrained neighbour": []}
    async with open_control(pipe.head.url, pipe.head.token_file) as client:
        for r in range(rounds + 1):  # round 0 warms up
            for kind in rows:
                extra = {}
                if kind == "constrained neighbour":  # a schema not seen before: compiled during the victim's run
                    schema = dict(SPEED_SCHEMA, properties=dict(SPEED_SCHEMA["properties"], **{f"note{r}": S}))
                    extra = {"json_schema": json.dumps(schema)}
                got: dict = {}
                async with trio.open_nursery() as nursery:
                    nursery.start_soon(_victim_into, got, pipe, tokens)
                    await trio.sleep(0.3)  # the victim decoding
                    await client.call(m.Generate(id=client.new_id(), prompt=SPEED_PROMPT, max_tokens=tokens // 2,
                                                 stream=False, **extra))
                if r:
                    rows[kind].append(got)
    out = {}
    for kind, runs in rows.items():
        out[kind] = {"tok_s": [x["tok_s"] for x in runs], "max_gap_ms": [x["max_gap_ms"] for x in runs]}
    plain, constrained = out["plain neighbour"], out["constrained neighbour"]
    out["ratio"] = {"tok_s": statistics.median(constrained["tok_s"]) / statistics.median(plain["tok_s"]),
                    "max_gap_ms": statistics.median(constrained["max_gap_ms"]) / statistics.median(plain["max_gap_ms"])}
    return out


def _validity(base_url: str) -> dict:
    client = openai.OpenAI(base_url=base_url, api_key="unused", max_retries=0, timeout=600)
    rows = []
    for i, (prompt, schema) in enumerate(CASES):
        started = time.perf_counter()
        got = client.chat.completions.create(
            model=MODEL_ID, messages=[{"role": "user", "content": prompt}], temperature=0.7, seed=1000 + i,
            max_tokens=300, response_format={"type": "json_schema",
                                             "json_schema": {"name": f"case{i}", "schema": schema, "strict": True}})
        choice = got.choices[0]
        valid = None
        if choice.finish_reason == "stop":
            try:
                jsonschema.validate(json.loads(choice.message.content), schema)
                valid = True
            except (ValueError, jsonschema.ValidationError) as exc:
                valid = False
                print(f"  case {i}: INVALID: {exc}: {choice.message.content!r}", flush=True)
        rows.append({"case": i, "finish": choice.finish_reason, "tokens": got.usage.completion_tokens,
                     "valid": valid, "s": round(time.perf_counter() - started, 2)})
        print(f"  case {i:2d}: {choice.finish_reason:6s} {got.usage.completion_tokens:3d} tokens, valid {valid}",
              flush=True)
    finished = sum(r["finish"] == "stop" for r in rows)
    return {"cases": rows, "finished": finished, "valid": sum(bool(r["valid"]) for r in rows),
            "invalid": sum(r["valid"] is False for r in rows)}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--tokens", type=int, default=120)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--validity-only", action="store_true")
    ap.add_argument("--speed-only", action="store_true")
    ap.add_argument("--beside-only", action="store_true")
    ap.add_argument("--json", type=Path)
    args = ap.parse_args()
    work = Path(tempfile.mkdtemp(prefix="bench-constrained-"))
    split_for_test(fetch_default_model(), 2, work)
    port = free_ports(1)[0]
    pipe = Pipeline(work / "topology.toml", work, extra=["--openai", f"127.0.0.1:{port}", "--ctx", "2048",
                                                         "--lanes", "2", "--threads", str(args.threads)]).start()
    report: dict = {}
    try:
        client = openai.OpenAI(base_url=f"http://127.0.0.1:{port}/v1", api_key="unused", max_retries=0)
        for _ in range(300):
            try:
                client.models.list()
                break
            except openai.APIConnectionError:
                time.sleep(0.1)
        if args.beside_only:
            report["beside"] = beside = trio.run(_beside, pipe, args.rounds, args.tokens)
            print("a plain streamed generation beside another session, median (min-max):")
            for kind in ("plain neighbour", "constrained neighbour"):
                row = beside[kind]
                print(f"  {kind:22s} decode tok/s {_median(row['tok_s'])}  longest gap ms {_median(row['max_gap_ms'])}")
            print(f"  constrained / plain neighbour: decode x{beside['ratio']['tok_s']:.3f}, "
                  f"longest gap x{beside['ratio']['max_gap_ms']:.3f}")
        elif not args.validity_only:
            report["speed"] = speed = trio.run(_speed, pipe, args.rounds, args.tokens)
            print("decode tok/s, median (min-max), and against unconstrained:")
            for kind, row in speed.items():
                print(f"  {kind:14s} {_median(row['tok_s'])}  x{row['ratio']:.3f}  tokens {row['tokens']}")
        if not (args.speed_only or args.beside_only):
            print("validity: 20 prompts and schemas, temperature 0.7, max_tokens 300")
            report["validity"] = v = _validity(f"http://127.0.0.1:{port}/v1")
            print(f"  finished {v['finished']}/20, valid {v['valid']}, invalid {v['invalid']}")
    finally:
        pipe.stop()
    if args.json:
        args.json.write_text(json.dumps(report, indent=1))


if __name__ == "__main__":
    main()
