"""BatchPolicy: which queued jobs form a stage's next llama_decode, and how long it waits for more (no model, no
trio: its decisions from given jobs and times)."""

from __future__ import annotations

import attrs
import pytest

from skippyd.stage.batching import (
    GATHER_GROUP_S,
    GATHER_LOCKED_COMPUTES,
    GATHER_MAX_LOCKED_S,
    GATHER_MAX_S,
    GATHER_SHARE,
    BatchPolicy,
    decode_steps,
)


@attrs.frozen
class J:
    seq: int
    n: int = 1  # a decode step


def seqs(batch) -> list[tuple[int, int]]:
    return [(j.seq, j.n) for j in batch]


def test_a_batch_takes_every_decode_step_then_prefill_chunks_that_fit_in_sequence_order():
    policy = BatchPolicy(max_batch_tokens=64)
    queued = [J(5, 40), J(3), J(4, 20), J(1), J(2, 30), J(0)]
    batch = policy.take(queued)
    assert seqs(batch) == [(0, 1), (1, 1), (2, 30), (3, 1), (4, 20)]  # smallest first, while they fit
    assert len(queued) == 6  # left to the caller
    assert seqs(policy.take([J(2, 10), J(1, 10)])) == [(2, 10)]  # no decode step: one chunk
    assert seqs(policy.take([J(1, 64), J(2, 65)])) == [(1, 64)]  # a chunk larger than the budget waits
    assert seqs(policy.take([J(1, 63), J(2), J(3)])) == [(2, 1), (3, 1)]  # no room left for the chunk
    assert seqs(policy.take([J(1), J(1, 8)])) == [(1, 1)]  # one job per sequence


def test_a_decode_batch_is_ready_once_the_sessions_of_the_last_two_batches_are_back():
    policy = BatchPolicy(max_batch_tokens=512)
    assert policy.ready({7})  # nothing decoded yet: nothing to wait for
    policy.decoded({0, 1, 2})
    policy.decoded({3})  # a group split by chance: the last two batches are waited for together
    assert not policy.ready({0, 1, 2}) and not policy.ready({3})
    assert policy.ready({0, 1, 2, 3})
    policy.forget(3)  # ended: waited for no more
    assert policy.ready({0, 1, 2})
    policy.stopped_waiting({0, 1})  # 2 did not come back in time: not waited for again
    assert policy.ready({0, 1})
    assert decode_steps([J(0), J(1, 30), J(2)]) == {0, 2}


def test_how_long_a_decode_batch_waits_for_the_rest():
    decode_s = 0.004
    assert BatchPolicy(max_batch_tokens=512).wait_s(decode_s) == min(GATHER_MAX_S, GATHER_SHARE * decode_s)
    assert BatchPolicy(max_batch_tokens=512).wait_s(0.05) == GATHER_MAX_S
    # the head taking turns at the cores: the group on the other stage is about one of its own computes away
    head = BatchPolicy(max_batch_tokens=512, head=True, takes_turns=True)
    assert head.wait_s(decode_s) == GATHER_MAX_LOCKED_S
    # only the head waits that long: a later stage waiting for a group would hold the head's in turn
    assert BatchPolicy(max_batch_tokens=512, takes_turns=True).wait_s(decode_s) == min(GATHER_MAX_S,
                                                                                       GATHER_SHARE * decode_s)
    # decode groups: a later stage gets a group's steps back to back, the head merges groups
    later = BatchPolicy(max_batch_tokens=512, decode_groups=2)
    assert later.wait_s(0.05) == GATHER_GROUP_S and later.wait_s(0.001) == GATHER_SHARE * 0.001
    assert BatchPolicy(max_batch_tokens=512, decode_groups=2, head=True).wait_s(decode_s) == GATHER_MAX_LOCKED_S


def test_the_heads_wait_for_a_group_on_another_stage_grows_with_its_compute():
    """The head waits for the group on the other stage as long as a few of its own decode computes, at least
    GATHER_MAX_LOCKED_S: a fixed wait split the sessions into two groups for good once a busy host slowed
    every step past it."""
    assert BatchPolicy.locked_wait_s(0) == GATHER_MAX_LOCKED_S  # nothing decoded yet
    assert BatchPolicy.locked_wait_s(0.002) == GATHER_MAX_LOCKED_S  # a small model: the floor
    assert BatchPolicy.locked_wait_s(0.06) == pytest.approx(GATHER_LOCKED_COMPUTES * 0.06)  # a big model


def test_the_head_with_decode_groups_keeps_groups_one_in_flight_per_stage():
    policy = BatchPolicy(max_batch_tokens=512, decode_groups=2, head=True)
    batch = policy.take([J(s) for s in range(4)])  # 4 sessions start decoding together
    assert seqs(batch) == [(0, 1), (1, 1)]  # half of them: the other half is the next group
    policy.decoded({0, 1})
    assert policy.ready({2, 3})  # a group's worth
    assert seqs(policy.take([J(2), J(3)])) == [(2, 1), (3, 1)]
    policy.decoded({2, 3})
    # group {0, 1} comes back from the pipeline: it waits for both of its sessions, not for the group down it
    policy.back(0)
    assert not policy.ready({0})
    policy.back(1)
    assert policy.ready({0, 1})
    policy.forget(3)  # a session ends: the groups are sized on the sessions still decoding
    assert seqs(policy.take([J(0), J(1), J(2)])) == [(0, 1), (1, 1)]


def test_the_head_merges_groups_while_more_are_in_flight_than_stages():
    policy = BatchPolicy(max_batch_tokens=512, decode_groups=2, head=True)
    for seq in range(3):  # three sessions that started apart: three groups of one in flight
        policy.decoded({seq})
    policy.back(0)
    assert not policy.ready({0})  # three groups in flight: wait to merge with the next one back
    policy.back(1)
    assert policy.ready({0, 1})  # two groups in flight now (and a group's worth here)
