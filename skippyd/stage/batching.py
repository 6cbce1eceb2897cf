"""Which queued work goes into a stage's next ``llama_decode``, and how long to wait for more.

A pure policy (no I/O, no trio): the scheduler tells it what it decoded and
which sessions ended, and asks it which of the queued jobs form the next
batch and how long that batch may wait for the sessions it expects.

Sessions decoding together come back at slightly different times (each has
its own bookkeeping, frames arrive one after the other); starting a batch
with the first one back would split them into a batch of one and a batch of
the rest, every step. So a decode batch waits a moment for every session of
the last two decode batches (a group split by chance gets together again).

With ``decode_groups`` > 1 the stages compute at the same time (hosts of
their own), and the head (``head``) keeps the sessions decoding at once in
that many groups, one in flight on each stage: it caps a decode batch at
ceil(decoding sessions / decode_groups), waits for the sessions back from
the pipeline (not for those whose step is down it, see ``back``), and merges
groups while more than decode_groups are in flight (sessions that started
apart). Later stages wait at most GATHER_GROUP_S for a group's steps, which
the head sends back to back. With 1 (stages sharing cores, or a single
stage) every session decodes in one batch, which costs less than several
when the stages take turns at the cores.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from typing import Protocol, TypeVar

GATHER_MAX_S = 0.002  # a decode batch waits at most this long for the last batches' other sessions ...
GATHER_SHARE = 0.2  # ... and at most this share of the last decode's compute
# the head taking turns at the cores: a group not here is on another stage, using the cores, so waiting for
# it costs no compute, and one batch of both groups costs much less than two; it waits this long ...
GATHER_MAX_LOCKED_S = 0.02
GATHER_LOCKED_COMPUTES = 3  # ... or this many times its last decode's compute, if longer (a big model, a busy host)
GATHER_GROUP_S = 0.0005  # a later stage with decode groups: the head sends a group's steps back to back


class Work(Protocol):
    """What the policy reads of a queued job: its sequence, and its tokens (1: a decode step); a job may also
    have a true ``window`` attribute (a verify window: a decoding session's step of several tokens) or a true
    ``solo`` one (media rows: computed alone)."""

    seq: int
    n: int


def _solo(job: Work) -> bool:
    return getattr(job, "solo", False)


def _decoding(job: Work) -> bool:
    """A decode step or a verify window (a session decoding), not a prefill chunk (nor media rows)."""
    return (job.n == 1 and not _solo(job)) or getattr(job, "window", False)


W = TypeVar("W", bound=Work)


class BatchPolicy:
    """See the module docstring. ``head``: this stage takes token ids (groups form there); ``takes_turns``:
    it shares the host's cores with other stages (the host compute lock)."""

    def __init__(self, *, max_batch_tokens: int, decode_groups: int = 1, head: bool = False,
                 takes_turns: bool = False):
        self.max_batch_tokens = max_batch_tokens
        self.decode_groups = max(1, decode_groups)
        self.head = head
        self.takes_turns = takes_turns
        self._forms_groups = self.decode_groups > 1 and head  # (read for every decode step)
        self._expected: set[int] = set()  # the sequences of the last two decode batches
        self._previous: set[int] = set()  # ... of the last one
        self._decoding: set[int] = set()  # the head with groups: sequences decoding, not ended (forget)
        self._away: set[int] = set()  # ... those whose step is down the pipeline (see back)
        self._batch_no: dict[int, int] = {}  # ... each one's last decode batch (its group), numbered
        self._batches_done = 0

    # ---------------------------------------------------------------- what happened
    def decoded(self, seqs: set[int]) -> None:
        """The sequences of the decode steps of a batch just computed."""
        self._expected, self._previous = seqs | self._previous, seqs
        if self._forms_groups:
            self._decoding |= seqs
            self._away |= seqs  # their steps go down the pipeline now
            self._batches_done += 1
            for seq in seqs:
                self._batch_no[seq] = self._batches_done

    def forget(self, seq: int) -> None:
        """`seq` ended: no batch waits for it any more."""
        self._expected.discard(seq)
        self._previous.discard(seq)
        self._decoding.discard(seq)
        self._away.discard(seq)
        self._batch_no.pop(seq, None)

    def back(self, seq: int) -> None:
        """The head: `seq`'s prediction came back from the pipeline; its next step follows at once."""
        self._away.discard(seq)

    def stopped_waiting(self, steps: set[int]) -> None:
        """A wait for more ended with the decode steps of `steps` queued: one that did not come back is not
        waited for again."""
        self._expected &= steps
        self._previous &= steps

    # ---------------------------------------------------------------- decisions
    def ready(self, steps: set[int]) -> bool:
        """Whether a decode batch may start with the decode steps of the sequences `steps` queued: every
        session of the last two decode batches is here, or, at the head with groups, a group's worth is here
        or every session not down the pipeline is (and no more groups are in flight than stages)."""
        if self._forms_groups:
            if len(steps) >= self._group_size(steps):
                return True
            if not (self._decoding - self._away) <= steps:
                return False  # back from the pipeline, about to send its step
            in_flight = {self._batch_no[seq] for seq in self._away if seq in self._batch_no}
            return len(in_flight) < self.decode_groups  # more groups than stages: wait for the next to merge
        return self._expected <= steps

    def wait_s(self, decode_s: float) -> float:
        """How long a decode batch that is not ``ready`` waits at most for the rest; `decode_s`: the native
        time of the last batch of decode steps only."""
        if self._forms_groups:
            return self.locked_wait_s(decode_s)  # merging groups: the next one is a stage's compute away
        if self.decode_groups > 1:
            return min(GATHER_GROUP_S, GATHER_SHARE * decode_s)
        if self.takes_turns and self.head:
            # only the head waits this long: groups form there, and a later stage waiting for a group the head
            # holds would hold the head's group in turn
            return self.locked_wait_s(decode_s)
        return min(GATHER_MAX_S, GATHER_SHARE * decode_s)

    @staticmethod
    def locked_wait_s(decode_s: float) -> float:
        """How long the head waits for a group on another stage: about that stage's compute of it, which is
        about the head's own."""
        return max(GATHER_MAX_LOCKED_S, GATHER_LOCKED_COMPUTES * decode_s)

    def take(self, queued: Sequence[W]) -> list[W]:
        """The next batch from `queued` (which it leaves as it is), in sequence order (llama.cpp decodes
        rows that way faster): decode steps and verify windows first (all of them, windows while they fit;
        at the head with groups, a group's worth), then prefill chunks, smallest first, while they fit (only
        one if there is no decode step or window); one job per sequence. Media rows (``solo``) go alone, the
        first queued before anything else: they hold the others up for one compute, and are never put off
        by a stream of decode steps."""
        for job in queued:
            if _solo(job):
                return [job]
        budget = self.max_batch_tokens
        batch: list[W] = []
        seqs: set[int] = set()
        steps_left = len(queued)
        if self._forms_groups:  # this group; the rest go next
            steps_left = self._group_size(decode_steps(queued))
        chunks_only = True  # no decode step or window taken yet
        for job in sorted(queued, key=lambda j: (not _decoding(j), j.n)):
            if job.seq in seqs or job.n > budget:
                continue
            if _decoding(job):
                if steps_left == 0:
                    continue
                steps_left -= 1
                chunks_only = False
            elif batch and chunks_only:
                continue  # a batch of prefill chunks only takes one
            batch.append(job)
            seqs.add(job.seq)
            budget -= job.n
        batch.sort(key=lambda j: j.seq)
        return batch

    def _group_size(self, steps: set[int]) -> int:
        return -(-len(self._decoding | steps) // self.decode_groups)


def decode_steps(queued: Iterable[Work]) -> set[int]:
    """The sequences with a decode step (one token) or a verify window among `queued`."""
    return {j.seq for j in queued if _decoding(j)}
