"""Drafting from the session's own context and the window sizing (the final stage's acceptance of drafts:
test_verify_window.py)."""

from __future__ import annotations

import random

import pytest

from skippyd.head.drafting import NgramProposer, WindowSizer, expected_tokens
from skippyd.head.speculation import Speculation, SpeculationTotals


def test_proposes_what_followed_the_latest_earlier_occurrence_of_the_longest_ngram():
    p = NgramProposer(min_n=2, max_n=3)
    p.extend([1, 2, 3, 4, 5, 9, 2, 3, 7, 8, 1, 2, 3])
    # [1, 2, 3] occurred at the start (followed by 4 5); [2, 3] more recently (followed by 7 8): the longer wins
    assert p.propose(2) == [4, 5]
    p.extend([6])
    assert p.propose(4) == []  # [3, 6] and [2, 3, 6] never occurred
    assert p.propose(0) == []


def test_a_proposal_that_runs_into_the_present_continues_the_repetition():
    p = NgramProposer(min_n=2, max_n=2)
    p.extend([5, 6, 5, 6])
    assert p.propose(5) == [5, 6, 5, 6, 5]


def test_the_index_matches_a_brute_force_search():
    rng = random.Random(7)
    p = NgramProposer(min_n=1, max_n=3)
    toks: list[int] = []
    for _ in range(400):
        t = rng.randrange(6)
        p.extend([t])
        toks.append(t)
        want: list[int] = []
        for n in range(min(3, len(toks)), 0, -1):
            gram = toks[-n:]
            starts = [i for i in range(len(toks) - n) if toks[i:i + n] == gram]
            if starts:
                follow = list(toks[starts[-1] + n:])
                while len(follow) < 4:
                    follow.append(follow[len(follow) - (len(toks) - starts[-1] - n)])
                want = follow[:4]
                break
        assert p.propose(4) == want, toks


def test_expected_tokens():
    assert expected_tokens(0.0, 8) == 1.0
    assert expected_tokens(1.0, 8) == 9.0
    assert expected_tokens(0.5, 2) == pytest.approx(1.75)


def test_the_sizer_drafts_wide_when_drafts_are_right_and_stops_when_they_are_not():
    s = WindowSizer()
    for _ in range(60):
        s.judge(7, 7)
    assert s.a > 0.95 and s.choose() >= 8
    for _ in range(60):
        s.judge(7, 8)
    assert s.choose() == 0 and not s.drafting  # a window costs more than the one token it yields
    for _ in range(30):
        s.judge(None, 8)  # no draft: nothing learnt
    assert s.choose() == 0


def test_judged_tokens_turn_drafting_back_on():
    s = WindowSizer(a0=0.0)
    assert s.choose() == 0
    for _ in range(20):
        s.judge(42, 42)  # the proposer would have been right
    assert s.choose() > 0


def test_windows_that_slow_the_sessions_sharing_the_batch_are_narrower_or_not_sent():
    """Sharing the batch with three other sessions, a window's rows cost all four: the same acceptance drafts
    fewer, and a middling one none."""
    s = WindowSizer(a0=0.9)
    assert s.choose(4) < s.choose(1)
    middling = WindowSizer(a0=0.45)
    assert middling.choose(1) > 0 and middling.choose(4) == 0
    assert s.gain(3, 1) == pytest.approx(expected_tokens(s.a, 3) / (1 + s.b * 3))  # alone: the plain model


def _run(answers_by_window: list[list[int]], context: list[int]) -> tuple[list[int], float]:
    """Feed a Speculation the given answers (a plain step: one token; a window: its drafts and the next);
    returns the draft counts it chose before each and its final acceptance."""
    spec = Speculation(16, SpeculationTotals())
    spec.begin(context)
    chosen = []
    for answer in answers_by_window:
        chosen.append(spec.sizer.choose())
        spec.done(answer[:-1], answer)
    return chosen, spec.sizer.a


def test_the_choice_follows_the_tokens_not_the_steps_that_carried_them():
    """The acceptance is judged token by token, so the same tokens carried by windows of other shapes (or by
    plain steps) leave the same estimate, and no clock enters the choice: a run reproduces itself."""
    rng = random.Random(3)
    context = [rng.randrange(50) for _ in range(200)]
    tokens = context[40:120]  # a copy of part of the context: the proposer is mostly right
    one_by_one, a1 = _run([[t] for t in tokens], context)
    in_fours, a4 = _run([tokens[i:i + 4] for i in range(0, len(tokens), 4)], context)
    assert a1 == pytest.approx(a4) and a1 > 0.8
    assert one_by_one[-1] == in_fours[-1] > 0
    assert _run([[t] for t in tokens], context) == (one_by_one, a1)


def test_the_daemon_drafts_by_ngram_unless_told_off():
    """runtime.speculate: "ngram" by default ("on" the same), "off" decodes token by token; the flag takes the
    same values."""
    from skippyd.cli import build_parser, read_settings
    from skippyd.config import Config, with_values
    from skippyd.plan import head_options

    assert Config().runtime.speculate == "ngram"
    for mode, drafts in (("ngram", 16), ("on", 16), ("off", 0)):
        config = with_values(Config(), {"runtime.speculate": mode})
        assert head_options(config).speculate_max_draft == drafts
        flags = read_settings(build_parser().parse_args(["--speculate", mode]), environ={}).config
        assert flags.runtime.speculate == mode


def test_a_proposal_after_tokens_in_flight_drafts_as_if_they_were_in_the_context():
    seq = [1, 2, 3, 4, 5, 6, 7, 8, 9, 1, 2, 3]
    for cut in range(len(seq) - 3, len(seq)):
        p = NgramProposer(min_n=2, max_n=3)
        p.extend(seq[:cut])
        whole = NgramProposer(min_n=2, max_n=3)
        whole.extend(seq)
        # the n-grams that end inside the tokens in flight are not indexed, so only the ones the context holds match
        assert p.propose(3, seq[cut:]) == whole.propose(3) == [4, 5, 6]
    p = NgramProposer(min_n=2, max_n=2)
    p.extend([5, 6, 5])
    assert p.propose(4, [6]) == [5, 6, 5, 6]  # through the tokens in flight into the repetition
    assert p.propose(2, [9]) == []


def test_a_window_goes_behind_those_in_flight_only_while_they_are_likely_to_hold():
    totals = SpeculationTotals(max_draft=8)
    spec = Speculation(8, totals)
    spec.begin([1, 2, 3, 4, 1, 2, 3, 4, 1, 2])
    for _ in range(12):  # the proposer right every time: high acceptance
        spec.sizer.judge(1, 1)
    window = spec.chained([3, 4], room=8)
    assert window[:3] == [1, 2, 3] and 2 <= len(window) <= 9  # the guess after the drafts, then drafts
    assert spec.chained([3, 4] * 30, room=8) == []  # all 60 right in a row: too unlikely
    assert spec.chained([3, 4], room=-1) == []  # no room in the reply for anything behind
    for _ in range(30):
        spec.sizer.judge(1, 2)
    assert spec.chained([3, 4], room=8) == []  # the drafts have been wrong lately
    spec.dropped(1)
    assert spec.describe()["chained"] == 1 and spec.describe()["dropped"] == 1
    assert totals.chained == 1 and totals.dropped == 1
    shared = Speculation(8, SpeculationTotals(max_draft=8), sharing=lambda: 2)
    shared.begin([1, 2, 3, 4, 1, 2, 3, 4, 1, 2])
    for _ in range(12):
        shared.sizer.judge(1, 1)
    assert shared.chained([3, 4], room=8) == []  # never while sharing batches: the others pay for a void window
