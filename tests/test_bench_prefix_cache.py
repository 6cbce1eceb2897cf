"""The prefix-cache benchmark's pure helpers: its generated text, the reuse and near-tie figures."""

from __future__ import annotations

import math
import random

import numpy as np

from bench.bench_prefix_cache import (
    FULL,
    QUICK,
    chat_user_messages,
    first_difference,
    grow_text,
    ratios,
    reuse_ratios,
    runs_took_top2,
    top2_margin,
    verdict,
)


def words(text: str) -> int:
    return len(text.split())


def test_generated_text_is_deterministic_and_long_enough():
    a = chat_user_messages(3, QUICK, words)
    assert a == chat_user_messages(3, QUICK, words)
    assert a != chat_user_messages(4, QUICK, words)
    assert len(a) == QUICK.turns and len(set(a)) == QUICK.turns
    assert all(words(t) >= QUICK.user_tokens for t in a)
    text = grow_text(random.Random(0), 50, words, lead="Start:")
    assert text.startswith("Start: ") and words(text) >= 50


def test_first_difference():
    assert first_difference([1, 2, 3], [1, 2, 3]) is None
    assert first_difference([1, 2, 3], [1, 5, 3]) == 1
    assert first_difference([1, 2], [1, 2, 3]) == 2
    assert first_difference([], [7]) == 0


def test_top2_margin_is_the_log_probability_gap():
    logits = np.array([0.0, 3.0, 2.5, -1.0], dtype=np.float32)
    best, second, margin, logp = top2_margin(logits)
    assert (best, second) == (1, 2)
    assert math.isclose(margin, 0.5, rel_tol=1e-9)
    assert math.isclose(logp, 3.0 - math.log(np.exp(logits.astype(np.float64)).sum()), rel_tol=1e-9)


def test_runs_took_top2():
    def is_eog(t):
        return t == 9

    assert runs_took_top2(4, 5, 5, 4, is_eog)
    assert not runs_took_top2(4, 6, 5, 4, is_eog)
    assert runs_took_top2(None, 4, 4, 9, is_eog)  # one reply ended where the other went on
    assert not runs_took_top2(None, 4, 4, 5, is_eog)


def test_reuse_ratios_against_the_previous_prompt_and_reply():
    turns = [{"prompt_tokens": 100, "completion_tokens": 20, "cached_tokens": 0},
             {"prompt_tokens": 230, "completion_tokens": 30, "cached_tokens": 114},
             {"prompt_tokens": 360, "completion_tokens": 10, "cached_tokens": None}]
    assert reuse_ratios(turns) == [114 / 120, None]


def test_targets_and_verdicts():
    def turn(ms, cached=None):
        return {"ttft_ms": ms, "prompt_tokens": 100, "completion_tokens": 10, "cached_tokens": cached}

    chat = {"2-stage on": [turn(900), turn(100, 108)], "2-stage off": [turn(1000), turn(1000)],
            "llama-server": [turn(800), turn(90, 105)]}
    sessions = {"2-stage on": [{"ttft_ms": 1000.0}, {"ttft_ms": 100.0}, {"ttft_ms": 200.0}, {"ttft_ms": 300.0}]}
    rows = {r["label"]: r for r in ratios(chat, sessions, 2)}
    assert rows["turn 2 TTFT 2-stage: cache on / off"]["value"] == 0.1
    assert rows["turn 2 TTFT 2-stage: cache on / off"]["verdict"] == "met"
    assert math.isclose(rows["turn 2 TTFT 2-stage cache on / llama-server"]["value"], 100 / 90)
    assert rows["clients 2-4 / client 1, worst: 2-stage on"]["value"] == 0.3
    assert rows["clients 2-4 / client 1, worst: 2-stage on"]["verdict"] == "met"
    assert math.isclose(rows["cached / previous prompt + reply, turns 2-2, lowest: 2-stage on"]["value"], 108 / 110)
    assert verdict(0.95, ">=", 0.9) == "met" and verdict(0.25, "<=", 0.2) == "NOT met"
    assert verdict(None, "<=", 0.2) == "n/a"
    assert FULL.turns == 8 and FULL.sessions == 4
