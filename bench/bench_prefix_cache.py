"""The prefix cache: time to first token of a growing chat and of sessions sharing a system prompt.

    .venv/bin/python bench/bench_prefix_cache.py [--turns 8] [--json out.json]
    .venv/bin/python bench/bench_prefix_cache.py --quick          # smoke run: 3 turns, small prompts, 1 stage

Every figure goes through the OpenAI endpoint: streaming chat completions with
the ``openai`` client, greedy (temperature 0), ``stream_options.include_usage``;
TTFT is the time from sending the request to the first non-empty content delta.

Configurations, all started at once and measured in the same run (turns
interleaved across them, so that the VM's drift moves them alike), each on the
default model with ``--threads`` (2) compute threads, ``--lanes 4 --ctx 4096``:

* ``single``, ``2-stage`` skippyd (one process per stage on loopback), each with
  ``--prefix-cache-mb 512`` (``on``) and ``--prefix-cache-mb 0`` (``off``);
* ``llama-server`` built from the same pinned llama.cpp (bench/llama_server.py)
  with its prompt cache on (its defaults: ``--cache-prompt``, the host-memory
  ``--cache-ram``), 4 slots of 4096 tokens, the same threads, flash attention
  off as skippyd has it, and ``--no-jinja`` (llama.cpp's built-in template
  engine, the one skippyd renders chats with; the prompt token counts it
  reports are checked against skippyd's rendering).

Scenarios:

a. a chat of ``--turns`` turns: a fixed system prompt, each turn a ~100-token
   user message (generated from ``--seed``) and a reply of at most 80 tokens;
   each turn sends the whole conversation, the earlier replies as returned.
   Per turn: TTFT, prompt tokens, ``usage.prompt_tokens_details.cached_tokens``.
b. 4 sessions sharing a ~800-token system prompt, each with a short user
   message of its own: client 1 alone, then clients 2-4 at once.

Then the ratios the prefix cache is held to (last turn, 2 stages: cache on /
off and cache on / llama-server; clients 2-4 / client 1; cached tokens over
the previous turn's prompt plus reply), and the greedy replies with the cache
against without it: where they differ, the first differing reply token (both
replies re-tokenized) and, computed here on the whole model from the cache-off
run's prompt and the common reply prefix, the log-probability margin between
the two best candidates there (in one prefill, and as the uncached run
computed it: its reply in decode steps), beside this CPU's rounding band: how
far the same positions computed as decode steps and in one prefill land
apart. A restored reply's KV is decode steps', where a cold prefill of the
next turn computes it in a batch, so a flip inside that band is rounding.

    .venv/bin/python bench/bench_prefix_cache.py --turns 8 --json bench/results/prefix_cache.json
    .venv/bin/python bench/bench_prefix_cache.py --analyse bench/results/prefix_cache.json   # again, no runs
"""

from __future__ import annotations

import argparse
import json
import os
import random
import signal
import subprocess
import sys
import tempfile
import threading
import time
import urllib.request
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import attrs
import numpy as np

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from skippyd.runtime.models import fetch_default_model  # noqa: E402

CACHE_ON_MB = 512
NEAR_TIE = 1e-3  # log-probability margin under which two candidates count as tied


@attrs.frozen
class Sizes:
    turns: int
    chat_system_tokens: int  # the chat's fixed system prompt
    user_tokens: int  # each chat turn's user message
    reply_tokens: int  # max_tokens of a chat reply
    shared_system_tokens: int  # the sessions' shared system prompt
    session_user_tokens: int
    session_reply_tokens: int
    sessions: int = 4


FULL = Sizes(turns=8, chat_system_tokens=60, user_tokens=90, reply_tokens=80, shared_system_tokens=800,
             session_user_tokens=20, session_reply_tokens=32)
QUICK = Sizes(turns=3, chat_system_tokens=30, user_tokens=40, reply_tokens=24, shared_system_tokens=200,
              session_user_tokens=12, session_reply_tokens=16)


# ---------------------------------------------------------------- deterministic text
_CODE = {
    "subject": ["The parser", "This function", "The scheduler", "Our cache layer", "The build script",
                "A worker thread", "The test suite", "The HTTP handler", "The config loader", "That migration",
                "The retry loop", "The tokenizer"],
    "verb": ["reads", "rewrites", "validates", "caches", "streams", "sorts", "merges", "retries", "logs", "skips",
             "serializes", "locks"],
    "object": ["every request header", "the list of pending jobs", "a map from user ids to sessions",
               "the compressed log files", "each row of the CSV export", "the nested JSON payload",
               "the queue of outgoing messages", "the index of source files", "a batch of database writes",
               "the table of feature flags"],
    "tail": ["before the deadline expires", "when the lock is free", "in a background task", "once per minute",
             "unless the input is empty", "and returns an error on overflow", "without copying the buffer",
             "after the connection closes", "so the caller never blocks", "in the order they arrived"],
}
_STORY = {
    "subject": ["The old sailor", "A young baker", "The village mayor", "Her brother", "The lighthouse keeper",
                "A traveling musician", "The clockmaker", "Two children", "The innkeeper", "A stray dog"],
    "verb": ["carried", "painted", "found", "repaired", "buried", "followed", "borrowed", "sold", "hid", "traded"],
    "object": ["a silver compass", "the broken lantern", "a letter from the capital", "the last loaf of bread",
               "a map of the northern islands", "an old wooden flute", "the key to the tower", "a basket of apples",
               "the captain's logbook", "a coat too large for him"],
    "tail": ["before the storm arrived", "while the town slept", "on the first day of spring",
             "under the bridge by the mill", "as the bells rang for noon", "without telling anyone",
             "near the edge of the forest", "when the tide went out", "long after midnight", "to everyone's surprise"],
}


def sentence(rng: random.Random, words: dict[str, list[str]]) -> str:
    return " ".join(rng.choice(words[k]) for k in ("subject", "verb", "object", "tail")) + "."


def grow_text(rng: random.Random, n_tokens: int, count: Callable[[str], int], *, lead: str = "",
              words: dict[str, list[str]] = _STORY) -> str:
    """`lead` followed by sentences drawn from `words` until the text holds at least `n_tokens` tokens."""
    text = lead
    while count(text) < n_tokens:
        text = f"{text} {sentence(rng, words)}" if text else sentence(rng, words)
    return text


def chat_user_messages(seed: int, sizes: Sizes, count: Callable[[str], int]) -> list[str]:
    """One user message per turn, alternating code and story themes."""
    rng = random.Random(seed)
    out = []
    for turn in range(sizes.turns):
        words = _CODE if turn % 2 == 0 else _STORY
        lead = ("Here is what the code does:" if words is _CODE else "Continue the story with this:")
        out.append(grow_text(rng, sizes.user_tokens, count, lead=lead, words=words) + " What do you think?")
    return out


def chat_system(sizes: Sizes, count: Callable[[str], int]) -> str:
    lead = ("You are a careful assistant. You answer in plain sentences, you keep track of the whole "
            "conversation, and you never invent facts about the code or the story you are shown.")
    return grow_text(random.Random(7), sizes.chat_system_tokens, count, lead=lead, words=_CODE)


def shared_system(seed: int, sizes: Sizes, count: Callable[[str], int]) -> str:
    lead = "You are the archivist of a small harbor town. These are the town's records, in order:"
    return grow_text(random.Random(seed + 1000), sizes.shared_system_tokens, count, lead=lead)


def session_questions(seed: int, sizes: Sizes, count: Callable[[str], int]) -> list[str]:
    rng = random.Random(seed + 2000)
    return [grow_text(rng, sizes.session_user_tokens, count, lead=f"Question {i + 1}: what happened here?")
            for i in range(sizes.sessions)]


# ---------------------------------------------------------------- figures
def first_difference(a: list[int], b: list[int]) -> int | None:
    """The first index where `a` and `b` differ (a shorter one ends there), or None if they are equal."""
    for i, (x, y) in enumerate(zip(a, b)):
        if x != y:
            return i
    return None if len(a) == len(b) else min(len(a), len(b))


def log_softmax(logits: np.ndarray) -> np.ndarray:
    x = logits.astype(np.float64)
    return x - (x.max() + np.log(np.exp(x - x.max()).sum()))


def top2_margin(logits: np.ndarray) -> tuple[int, int, float, float]:
    """(best token, second token, their log-probabilities' margin, the best's log-probability)."""
    logp = log_softmax(logits)
    second, best = np.argsort(logp)[-2:]
    return int(best), int(second), float(logp[best] - logp[second]), float(logp[best])


def runs_took_top2(tok_off: int | None, tok_on: int | None, best: int, second: int,
                   is_eog: Callable[[int], bool]) -> bool:
    """Whether the two runs' tokens at the difference are the two best candidates there (None: the reply
    ended, which an end-of-generation candidate accounts for)."""
    top = {best, second}
    return all(any(is_eog(t) for t in top) if tok is None else tok in top for tok in (tok_off, tok_on))


def reuse_ratios(turns: list[dict]) -> list[float | None]:
    """Turns 2..N: cached_tokens / (previous turn's prompt_tokens + completion_tokens); None where the cached
    count is not reported."""
    out = []
    for prev, cur in zip(turns, turns[1:]):
        cached = cur.get("cached_tokens")
        base = prev["prompt_tokens"] + prev["completion_tokens"]
        out.append(None if cached is None or base == 0 else cached / base)
    return out


def verdict(value: float | None, op: str, bound: float) -> str:
    if value is None:
        return "n/a"
    met = value <= bound if op == "<=" else value >= bound
    return "met" if met else "NOT met"


# ---------------------------------------------------------------- endpoints
@attrs.define
class Endpoint:
    name: str
    base_url: str
    stop: Callable[[], None]
    model_id: str = ""
    extra_body: dict | None = None  # sent with every request (llama-server's cache_prompt)

    def client(self):
        from openai import OpenAI

        return OpenAI(base_url=self.base_url, api_key="none", max_retries=0, timeout=600)


def free_port() -> int:
    from tests.procs import free_ports

    return free_ports(1)[0]


def wait_http(url: str, timeout: float, alive: Callable[[], bool], what: str) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if not alive():
            raise RuntimeError(f"{what} exited while starting")
        try:
            with urllib.request.urlopen(url, timeout=5) as resp:
                if resp.status == 200:
                    return
        except OSError:
            pass
        time.sleep(0.3)
    raise TimeoutError(f"{what} not answering {url} after {timeout}s")


def start_skippy(name: str, model: Path, work: Path, stages: int, cache_mb: int, common: list[str]) -> Endpoint:
    from tests.procs import Pipeline, SingleStage, split_for_test

    port = free_port()
    extra = [*common, "--openai", f"127.0.0.1:{port}", "--prefix-cache-mb", str(cache_mb)]
    work.mkdir(parents=True)
    if stages == 1:
        pipe = SingleStage(model, work, extra)
    else:
        split_for_test(model, stages, work)
        pipe = Pipeline(work / "topology.toml", work, extra=extra).start()
    head = pipe.head
    wait_http(f"http://127.0.0.1:{port}/v1/models", 60, lambda: head.proc.poll() is None, name)
    return Endpoint(name, f"http://127.0.0.1:{port}/v1", pipe.stop)


def start_llama_server(model: Path, work: Path, threads: int, ctx: int, slots: int, *,
                       cache_prompt: bool = True) -> Endpoint:
    """llama-server; with ``cache_prompt`` False every request asks it to compute its whole prompt (a server of
    its own, so that its slots never hold a prompt for the cached one to reuse)."""
    name = "llama-server" if cache_prompt else "llama-server off"
    work = work / name.replace(" ", "-")
    work.mkdir(parents=True, exist_ok=True)
    from bench.llama_server import ensure_llama_server

    binary = ensure_llama_server()
    port = free_port()
    log = open(work / "llama-server.log", "ab")
    cmd = [str(binary), "-m", str(model), "--host", "127.0.0.1", "--port", str(port), "-t", str(threads),
           "-tb", str(threads), "-c", str(ctx * slots), "-np", str(slots), "-fa", "off", "--no-jinja",
           "--cache-prompt"]
    proc = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT)

    def stop() -> None:
        if proc.poll() is None:
            proc.send_signal(signal.SIGTERM)
            try:
                proc.wait(20)
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait()
        log.close()

    try:
        wait_http(f"http://127.0.0.1:{port}/health", 120, lambda: proc.poll() is None, "llama-server")
    except BaseException:
        stop()
        print((work / "llama-server.log").read_text(errors="replace")[-3000:], file=sys.stderr)
        raise
    return Endpoint(name, f"http://127.0.0.1:{port}/v1", stop,
                    extra_body=None if cache_prompt else {"cache_prompt": False})


# ---------------------------------------------------------------- one request
def stream_chat(client, model_id: str, messages: list[dict], max_tokens: int, extra_body: dict | None = None) -> dict:
    """One streamed greedy chat completion: TTFT (ms, to the first non-empty content delta), usage, text."""
    started = time.perf_counter()
    ttft = None
    parts: list[str] = []
    usage = None
    finish = None
    stream = client.chat.completions.create(model=model_id, messages=messages, max_tokens=max_tokens,
                                            temperature=0, stream=True, stream_options={"include_usage": True},
                                            extra_body=extra_body)
    for chunk in stream:
        for choice in chunk.choices:
            if choice.delta and choice.delta.content:
                if ttft is None:
                    ttft = (time.perf_counter() - started) * 1e3
                parts.append(choice.delta.content)
            if choice.finish_reason:
                finish = choice.finish_reason
                if ttft is None:  # a reply that ended at once: its first event is the end
                    ttft = (time.perf_counter() - started) * 1e3
        if chunk.usage is not None:
            usage = chunk.usage
    elapsed = (time.perf_counter() - started) * 1e3
    details = getattr(usage, "prompt_tokens_details", None) if usage is not None else None
    cached = getattr(details, "cached_tokens", None) if details is not None else None
    return {"ttft_ms": ttft, "elapsed_ms": elapsed, "text": "".join(parts), "finish_reason": finish,
            "prompt_tokens": usage.prompt_tokens if usage else None,
            "completion_tokens": usage.completion_tokens if usage else None, "cached_tokens": cached}


def model_id_of(ep: Endpoint) -> str:
    models = ep.client().models.list()
    return models.data[0].id if models.data else "default"


# ---------------------------------------------------------------- scenarios
def warm_up(ep: Endpoint) -> None:
    """One unrelated short request: the first one pays one-off costs (its share no prefix with the scenarios)."""
    stream_chat(ep.client(), ep.model_id, [{"role": "user", "content": "Say hello."}], 4)


def run_chat(endpoints: list[Endpoint], system: str, users: list[str], max_tokens: int) -> dict[str, list[dict]]:
    """Turn by turn, every endpoint in turn; each conversation carries its own replies."""
    convs = {ep.name: [{"role": "system", "content": system}] for ep in endpoints}
    out: dict[str, list[dict]] = {ep.name: [] for ep in endpoints}
    clients = {ep.name: ep.client() for ep in endpoints}
    for turn, user in enumerate(users, 1):
        for ep in endpoints:
            conv = convs[ep.name]
            conv.append({"role": "user", "content": user})
            r = stream_chat(clients[ep.name], ep.model_id, conv, max_tokens, ep.extra_body)
            r["turn"] = turn
            r["messages"] = [dict(m) for m in conv]
            conv.append({"role": "assistant", "content": r["text"]})
            out[ep.name].append(r)
            print(f"  chat turn {turn} {ep.name:18} TTFT {fmt_ms(r['ttft_ms']):>8} ms  "
                  f"prompt {fmt_int(r['prompt_tokens']):>5}  cached {fmt_int(r['cached_tokens']):>5}  "
                  f"reply {fmt_int(r['completion_tokens'])} tokens", flush=True)
    return out


def session_request(ep: Endpoint, system: str, question: str, session: int, max_tokens: int,
                    barrier: threading.Barrier | None = None) -> dict:
    client = ep.client()
    messages = [{"role": "system", "content": system}, {"role": "user", "content": question}]
    if barrier is not None:
        barrier.wait()
    r = stream_chat(client, ep.model_id, messages, max_tokens, ep.extra_body)
    r["session"] = session
    r["messages"] = messages
    return r


def run_sessions(endpoints: list[Endpoint], system: str, questions: list[str], max_tokens: int) -> dict[str, list]:
    """Session 1 alone, then the rest at once, on each endpoint in turn."""
    out: dict[str, list[dict]] = {}
    for ep in endpoints:
        results = [session_request(ep, system, questions[0], 1, max_tokens)]
        rest = questions[1:]
        barrier = threading.Barrier(len(rest))
        with ThreadPoolExecutor(len(rest)) as pool:
            futures = [pool.submit(session_request, ep, system, q, i, max_tokens, barrier)
                       for i, q in enumerate(rest, 2)]
            results += [f.result() for f in futures]
        out[ep.name] = results
        print(f"  sessions {ep.name:18} TTFT " + "  ".join(fmt_ms(r["ttft_ms"]) for r in results) + " ms  cached "
              + " ".join(fmt_int(r["cached_tokens"]) for r in results), flush=True)
    return out


# ---------------------------------------------------------------- greedy comparison
class Offline:
    """The whole default model in this process, one sequence: log-probabilities after a token prefix."""

    def __init__(self, model_path: Path, threads: int, n_ctx: int):
        from skippyd.runtime.llama import Context, ContextParams, Model

        self.model = Model(model_path)
        self.ctx = Context(self.model, ContextParams(n_ctx_per_seq=n_ctx, n_seq_max=1, n_threads=threads))

    def close(self) -> None:
        self.ctx.close()
        self.model.close()

    def prompt_tokens(self, messages: list[dict]) -> list[int]:
        """The head's rendering of a chat (skippyd/head/engine.py): the built-in template, special tokens
        parsed, no BOS added."""
        text = self.model.apply_chat_template(messages, add_assistant=True)
        return self.model.tokenize(text, add_special=False, parse_special=True).tolist()

    def reply_tokens(self, text: str) -> list[int]:
        return self.model.tokenize(text, add_special=False, parse_special=False).tolist()

    def piece(self, token: int | None) -> str:
        return "<end>" if token is None else self.model.token_piece(token, special=True).decode("utf-8", "replace")

    def after(self, tokens: list[int], stepped: list[int] = ()) -> np.ndarray:
        """Logits after ``tokens`` computed in batches (a prefill), then ``stepped`` one at a time (decode
        steps), as a run computes a prompt and then the reply it generates."""
        self.ctx.kv_clear_seq(0)
        arr = np.asarray(tokens, dtype=np.int32)
        step = self.ctx.n_batch
        for lo in range(0, len(arr), step):
            part = arr[lo:lo + step]
            self.ctx.decode(np.arange(lo, lo + len(part), dtype=np.int32), np.zeros(len(part), dtype=np.int32),
                            tokens=part)
        for pos, token in enumerate(stepped, start=len(arr)):
            self.ctx.decode(np.array([pos], dtype=np.int32), np.zeros(1, dtype=np.int32),
                            tokens=np.array([token], dtype=np.int32))
        return self.ctx.logits(0)

    def rounding_band(self, tokens: list[int], stepped: int = 40) -> float:
        """How far apart two exact computations of the same positions land on this CPU: the log-probabilities
        (the five best) after ``tokens`` computed in one prefill, against the last ``stepped`` of them computed
        as decode steps (the KV a generation leaves, and so a restored reply's)."""
        whole = log_softmax(self.after(tokens))
        steps = log_softmax(self.after(tokens[:-stepped], tokens[-stepped:]))
        top = np.argsort(whole)[-5:]
        return float(np.abs(whole[top] - steps[top]).max())


def compare_replies(offline: Offline, label: str, off: dict, on: dict) -> dict:
    """One reply with the cache against the same prompt's reply without it."""
    if off["text"] == on["text"]:
        return {"where": label, "equal": True}
    a, b = offline.reply_tokens(off["text"]), offline.reply_tokens(on["text"])
    pos = first_difference(a, b)
    if pos is None:  # the texts differ but tokenize alike (cannot happen for real text; kept honest)
        return {"where": label, "equal": False, "position": None}
    prompt = offline.prompt_tokens(off["messages"])
    best, second, margin, _ = top2_margin(offline.after(prompt + a[:pos]))
    tok_off = a[pos] if pos < len(a) else None
    tok_on = b[pos] if pos < len(b) else None
    # the cache-off run itself, as it computed: the prompt in a prefill, its reply in decode steps; how much
    # it preferred its token over the one the cached run took (an end of the reply: the end-of-generation one)
    logp = log_softmax(offline.after(prompt, a[:pos]))
    eog = next((int(t) for t in np.argsort(logp)[::-1][:1000] if offline.model.is_eog(int(t))), None)
    off_tok, on_tok = (eog if t is None else t for t in (tok_off, tok_on))
    run_margin = None if off_tok is None or on_tok is None else float(logp[off_tok] - logp[on_tok])
    return {"where": label, "equal": False, "position": pos, "off": offline.piece(tok_off),
            "on": offline.piece(tok_on), "top1": offline.piece(best), "top2": offline.piece(second),
            "margin": margin, "near_tie": margin <= NEAR_TIE, "margin_in_uncached_run": run_margin,
            "top2_are_the_runs_tokens": runs_took_top2(tok_off, tok_on, best, second, offline.model.is_eog)}


def greedy_comparison(offline: Offline, chat: dict[str, list[dict]], sessions: dict[str, list[dict]],
                      topologies: list[str]) -> list[dict]:
    out = []
    pairs = [(topo, f"{topo} off", f"{topo} on") for topo in topologies]
    pairs.append(("llama-server", "llama-server off", "llama-server"))  # its own prompt cache, same question
    for topo, off, on in pairs:
        if off not in chat or on not in chat:
            continue
        for r_off, r_on in zip(chat[off], chat[on]):
            label = f"{topo} chat turn {r_off['turn']}"
            if r_off["messages"] != r_on["messages"]:
                out.append({"where": label, "equal": None, "note": "not compared: an earlier reply differed"})
                continue
            out.append(compare_replies(offline, label, r_off, r_on))
        for r_off, r_on in zip(sessions.get(off, []), sessions.get(on, [])):
            out.append(compare_replies(offline, f"{topo} session {r_off['session']}", r_off, r_on))
    return out


def template_check(offline: Offline, chat: dict[str, list[dict]], sessions: dict[str, list[dict]]) -> list[dict]:
    """llama-server's reported prompt tokens against skippyd's rendering of the same messages."""
    rows = []
    for r in chat.get("llama-server", []) + sessions.get("llama-server", []):
        ours = len(offline.prompt_tokens(r["messages"]))
        where = f"chat turn {r['turn']}" if "turn" in r else f"session {r['session']}"
        rows.append({"where": where, "llama_server": r["prompt_tokens"], "skippyd_rendering": ours})
    return rows


# ---------------------------------------------------------------- report
def fmt_int(v) -> str:
    return "-" if v is None else str(v)


def fmt_margin(v) -> str:
    return "-" if v is None else f"{v:.2e}"


def fmt_ms(v) -> str:
    return "-" if v is None else f"{v:.1f}"


def print_grid(title: str, rows: list[str], cols: list[str], cell: Callable[[str, int], str]) -> None:
    print(f"\n{title}")
    print(f"{'':12}" + "".join(f"{c:>16}" for c in cols))
    for i, row in enumerate(rows):
        print(f"{row:12}" + "".join(f"{cell(c, i):>16}" for c in cols))


def decode_rate(rows: list[dict] | None) -> float | None:
    """Median over the turns of a reply's tokens after the first per second after the first."""
    rates = sorted((r["completion_tokens"] - 1) / (r["elapsed_ms"] - r["ttft_ms"]) * 1e3 for r in rows or ()
                   if (r.get("completion_tokens") or 0) > 1 and r.get("ttft_ms") is not None
                   and (r.get("elapsed_ms") or 0) > r["ttft_ms"])
    return rates[len(rates) // 2] if rates else None


def ratios(chat: dict[str, list[dict]], sessions: dict[str, list[dict]], turns: int) -> list[dict]:
    """The targets: (label, value, op, bound) rows; op None for the figures beside them."""
    out = []

    def ttft(name: str, turn: int) -> float | None:
        rows = chat.get(name)
        return rows[turn - 1]["ttft_ms"] if rows and len(rows) >= turn else None

    def row(label: str, value: float | None, op: str | None = None, bound: float | None = None) -> None:
        out.append({"label": label, "value": value, "op": op, "bound": bound if op else None,
                    "verdict": verdict(value, op, bound) if op else ""})

    def div(a: float | None, b: float | None) -> float | None:
        return None if a is None or not b else a / b

    for topo in ("2-stage", "single"):
        main = topo == "2-stage"
        on, off = ttft(f"{topo} on", turns), ttft(f"{topo} off", turns)
        if on is not None:
            row(f"turn {turns} TTFT {topo}: cache on / off", div(on, off), "<=" if main else None, 0.2)
            row(f"turn {turns} TTFT {topo} cache on / llama-server", div(on, ttft("llama-server", turns)),
                "<=" if main else None, 1.2)
    for name, results in sessions.items():
        first, rest = results[0]["ttft_ms"], [r["ttft_ms"] for r in results[1:]]
        timed = None not in rest
        cached = name.endswith(" on")
        row(f"clients 2-{len(results)} / client 1, worst: {name}", div(max(rest), first) if timed else None,
            "<=" if cached else None, 0.3)
        row(f"clients 2-{len(results)} / client 1, mean: {name}",
            div(sum(rest) / len(rest), first) if timed else None)
    for topo in ("2-stage", "single"):
        on, off = decode_rate(chat.get(f"{topo} on")), decode_rate(chat.get(f"{topo} off"))
        if on is not None:
            row(f"decode tokens/s {topo}, median of the turns: cache on / off", div(on, off))
    for name, rows in chat.items():
        if name.endswith(" off"):
            continue
        reuse = reuse_ratios(rows)
        known = [r for r in reuse if r is not None]
        row(f"cached / previous prompt + reply, turns 2-{turns}, lowest: {name}", min(known) if known else None,
            ">=" if name.endswith(" on") else None, 0.9)
    return out


def report(chat: dict, sessions: dict, targets: list[dict], greedy: list[dict], template: list[dict],
           band: float | None = None) -> None:
    names = list(chat)
    turns = len(next(iter(chat.values())))
    print_grid("chat: TTFT ms per turn", [f"turn {i + 1}" for i in range(turns)], names,
               lambda n, i: fmt_ms(chat[n][i]["ttft_ms"]))
    print_grid("chat: prompt tokens / cached tokens per turn", [f"turn {i + 1}" for i in range(turns)], names,
               lambda n, i: f"{fmt_int(chat[n][i]['prompt_tokens'])}/{fmt_int(chat[n][i]['cached_tokens'])}")
    n_sessions = len(next(iter(sessions.values())))
    print_grid("4 sessions sharing a system prompt: TTFT ms (client 1 alone, then the rest at once)",
               [f"session {i + 1}" for i in range(n_sessions)], list(sessions),
               lambda n, i: fmt_ms(sessions[n][i]["ttft_ms"]))
    print_grid("sessions: prompt tokens / cached tokens", [f"session {i + 1}" for i in range(n_sessions)],
               list(sessions),
               lambda n, i: f"{fmt_int(sessions[n][i]['prompt_tokens'])}/{fmt_int(sessions[n][i]['cached_tokens'])}")
    print("\ntargets (same run):")
    for t in targets:
        value = "-" if t["value"] is None else f"{t['value']:.3f}"
        bound = f"{t['op']} {t['bound']}" if t["op"] else ""
        print(f"  {t['label']:64} {value:>8}  {bound:8} {t['verdict']}")
    print("\ngreedy replies, cache on against off:")
    for g in greedy:
        if g["equal"]:
            print(f"  {g['where']:28} equal")
        elif g["equal"] is None:
            print(f"  {g['where']:28} {g['note']}")
        elif g.get("position") is None:
            print(f"  {g['where']:28} texts differ, tokens alike")
        else:
            print(f"  {g['where']:28} differ at reply token {g['position']}: off {g['off']!r} on {g['on']!r}; "
                  f"one prefill: top-2 {g['top1']!r} {g['top2']!r}, margin {g['margin']:.2e}; the uncached run "
                  f"preferred its token by {fmt_margin(g['margin_in_uncached_run'])}"
                  f"{'' if g['top2_are_the_runs_tokens'] else '; the top-2 are not the runs tokens'}")
    differing = [g for g in greedy if g["equal"] is False and g.get("position") is not None]
    if differing:
        ok = all(g.get("near_tie") for g in differing)
        print(f"  every difference at a near-tie (margin <= {NEAR_TIE:g}): {'yes' if ok else 'NO'}")
        if band is not None:
            inside = all(g["margin_in_uncached_run"] is not None and abs(g["margin_in_uncached_run"]) <= band
                         for g in differing)
            print(f"  rounding band on this CPU (the same tokens as decode steps or in one prefill, top-5 "
                  f"log-probabilities): {band:.2e}; every difference inside it: {'yes' if inside else 'NO'}")
    if template:
        mismatched = [t for t in template if t["llama_server"] != t["skippyd_rendering"]]
        print(f"\nllama-server's prompt tokens against skippyd's rendering of the same messages: "
              f"{'the same on all ' + str(len(template)) if not mismatched else 'DIFFERENT'}")
        for t in mismatched:
            print(f"  {t['where']}: llama-server {t['llama_server']}, skippyd {t['skippyd_rendering']}")


# ---------------------------------------------------------------- main
def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--turns", type=int, default=None, help="chat turns (default 8; 3 with --quick)")
    ap.add_argument("--quick", action="store_true", help="smoke run: 3 turns, smaller prompts, single stage only")
    ap.add_argument("--threads", type=int, default=2, help="compute threads of every stage and of llama-server")
    ap.add_argument("--ctx", type=int, default=4096, help="context tokens per session (and per llama-server slot)")
    ap.add_argument("--seed", type=int, default=1)
    ap.add_argument("--model", type=Path, default=None, help="GGUF (default: the embedded default model)")
    ap.add_argument("--no-llama-server", action="store_true", help="skip the llama-server reference")
    ap.add_argument("--json", type=Path, default=None, help="write the figures here")
    ap.add_argument("--analyse", type=Path, default=None, metavar="FILE",
                    help="run nothing: the ratios and the greedy comparison of the runs a --json FILE holds")
    args = ap.parse_args()
    sizes = QUICK if args.quick else FULL
    if args.turns is not None:
        sizes = attrs.evolve(sizes, turns=args.turns)
    model = args.model or fetch_default_model()
    if args.analyse is not None:
        saved = json.loads(args.analyse.read_text())
        sizes = attrs.evolve(sizes, **saved["sizes"])
        topologies = {"single": 1} if "2-stage on" not in saved["chat"] else {"single": 1, "2-stage": 2}
        return analyse(args, model, sizes, topologies, saved["chat"], saved["sessions"])

    from skippyd.runtime.llama import Model

    vocab = Model(model, vocab_only=True)

    def count(text: str) -> int:
        return len(vocab.tokenize(text, add_special=False, parse_special=False))

    system = chat_system(sizes, count)
    users = chat_user_messages(args.seed, sizes, count)
    shared = shared_system(args.seed, sizes, count)
    questions = session_questions(args.seed, sizes, count)
    vocab.close()
    if not args.no_llama_server:
        from bench.llama_server import ensure_llama_server

        ensure_llama_server()  # before anything is timed: a first build takes long
    common = ["--lanes", str(sizes.sessions), "--ctx", str(args.ctx), "--threads", str(args.threads)]
    topologies = {"single": 1} if args.quick else {"single": 1, "2-stage": 2}
    endpoints: list[Endpoint] = []
    with tempfile.TemporaryDirectory() as tmp:
        tmp = Path(tmp)
        # the daemons take turns at the cores with each other, not with another run's stages on this host
        os.environ.setdefault("SKIPPY_COMPUTE_LOCK", str(tmp / "compute.lock"))
        try:
            for topo, n in topologies.items():
                for state, mb in (("on", CACHE_ON_MB), ("off", 0)):
                    name = f"{topo} {state}"
                    print(f"starting {name}", flush=True)
                    endpoints.append(start_skippy(name, model, tmp / name.replace(" ", "-"), n, mb, common))
            if not args.no_llama_server:
                print("starting llama-server", flush=True)
                endpoints.append(start_llama_server(model, tmp, args.threads, args.ctx, sizes.sessions))
                endpoints.append(start_llama_server(model, tmp, args.threads, args.ctx, sizes.sessions,
                                                    cache_prompt=False))
            for ep in endpoints:
                ep.model_id = model_id_of(ep)
                warm_up(ep)
            print(f"chat: {sizes.turns} turns, user messages of ~{sizes.user_tokens} tokens, replies of at most "
                  f"{sizes.reply_tokens}", flush=True)
            chat = run_chat(endpoints, system, users, sizes.reply_tokens)
            print(f"{sizes.sessions} sessions sharing a ~{sizes.shared_system_tokens}-token system prompt", flush=True)
            sessions = run_sessions(endpoints, shared, questions, sizes.session_reply_tokens)
        finally:
            for ep in endpoints:
                ep.stop()
    return analyse(args, model, sizes, topologies, chat, sessions)


def analyse(args, model: Path, sizes, topologies: dict, chat: dict, sessions: dict) -> int:
    """The ratios, the greedy comparison (margins computed here) and the report; written to --json."""
    targets = ratios(chat, sessions, sizes.turns)
    offline = Offline(model, args.threads, args.ctx)
    try:
        greedy = greedy_comparison(offline, chat, sessions, list(topologies))
        template = template_check(offline, chat, sessions)
        first = next(iter(chat.values()))
        band = offline.rounding_band(offline.prompt_tokens(first[-1]["messages"]))
    finally:
        offline.close()
    print(f"\nmodel {model.name}, {os.cpu_count()} cores, {args.threads} threads, --ctx {args.ctx}, seed {args.seed}")
    report(chat, sessions, targets, greedy, template, band)
    if args.json:
        args.json.parent.mkdir(parents=True, exist_ok=True)
        args.json.write_text(json.dumps({"model": model.name, "cores": os.cpu_count(), "threads": args.threads,
                                         "ctx": args.ctx, "seed": args.seed, "sizes": attrs.asdict(sizes),
                                         "chat": chat, "sessions": sessions, "targets": targets,
                                         "greedy": greedy, "template": template, "rounding_band": band},
                                        indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
