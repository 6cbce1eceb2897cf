"""Sessions on one stage: which KV sequence each generation holds, and who owns it.

A session is keyed by (connection, session id): the upstream connection that
created it owns it, so when that connection ends every session it owned is
released (``UpstreamConnection.serve``, skippyd/stage/connection.py).
Releasing a session (``StageCore.release``) clears its KV sequence through the
scheduler, so that it never races a compute, then frees its sequence slot and
sampler here (:meth:`SessionTable.forget`).
"""

from __future__ import annotations

import enum
import heapq
import time
from typing import Any

import attrs
import numpy as np

from skippyd.runtime.llama import Sampler
from skippyd.stage.boundary import BoundaryRows
from skippyd.wire.messages import StatsTotal


class NoFreeSlot(Exception):
    pass


class SessionState(enum.StrEnum):
    PREFILL = "prefill"  # configured, its prompt coming in
    DECODE = "decode"
    RELEASED = "released"


@attrs.define(eq=False)
class StageSession:
    conn_id: int
    session_id: int
    request_id: int
    seq: int
    created: float = attrs.field(factory=time.monotonic)
    position: int = 0  # positions held on this stage: where its next message starts
    sampler: Sampler | None = None
    generated: int = 0
    state: SessionState = SessionState.PREFILL
    direct_return: bool = False  # predictions go to the head on the token-return connection
    # how this session's decode steps are answered (skippyd/stage/handlers.py AnswerPath): chosen when the
    # session is created or configured, so that no step tests the session's flags
    answer: Any = None
    # the final stage: where the session's last verify window's answer leaves it (the position after its
    # accepted drafts, and the token predicted there): what a chained window must start with to be computed
    follows: tuple[int, int] | None = None
    # a middle stage's reports of the decode steps it did not acknowledge (DIRECT_RETURN): they go up with
    # the session's next reply on the lane (its Stop's, usually); summed in place, as they come every token
    unreported: StatsTotal = attrs.field(factory=StatsTotal)
    # the leading positions of the generation's prompt this stage held (restored) rather than computed: where
    # its first compute of the prompt began (None: not yet; reported by its Stop's answer)
    prompt_cached: int | None = None
    # the key of each position this stage holds KV for (what the prefix cache keys an entry by): its token id,
    # or a media position's key (negative)
    _keys: np.ndarray = attrs.field(factory=lambda: np.empty(0, dtype=np.int32), repr=False)
    # a stage before the final one: the hidden states it sent on for the positions it holds (what lets it
    # answer a prefill of positions it holds without computing them; skippyd/stage/boundary.py)
    rows: BoundaryRows = attrs.field(factory=BoundaryRows, repr=False)

    def computed(self, pos: int, keys: np.ndarray) -> None:
        """The positions [pos, pos + len(keys)) were computed (their KV: the rows of those tokens, or media rows
        taking those positions): the session now holds up to there."""
        end = pos + len(keys)
        if end > len(self._keys):
            grown = np.empty(max(end, 2 * len(self._keys), 256), dtype=np.int32)
            grown[:len(self._keys)] = self._keys
            self._keys = grown
        self._keys[pos:end] = keys
        self.position = end

    def held_keys(self) -> np.ndarray:
        """The keys of the positions this session holds (a view: copy it to keep it)."""
        return self._keys[:self.position]

    def describe(self) -> dict:
        return {
            "session_id": self.session_id,
            "request_id": self.request_id,
            "connection": self.conn_id,
            "seq": self.seq,
            "position": self.position,
            "state": self.state,
            "generated": self.generated,
            "direct_return": self.direct_return,
            "age_s": round(time.monotonic() - self.created, 3),
        }


class SessionTable:
    """Sequence slots [0, n_seq_max) shared by every connection of a stage."""

    def __init__(self, n_seq_max: int):
        self.n_seq_max = n_seq_max
        # a min-heap: the lowest free slot first, so live sessions stay on low, adjacent sequence ids (a batch
        # over sequences 0-3 decodes ~30% faster than one over 1, 3, 5, 7: llama.cpp spans the KV streams
        # from the lowest to the highest id in the batch)
        self._free = list(range(n_seq_max))
        self._sessions: dict[tuple[int, int], StageSession] = {}

    def open(self, conn_id: int, session_id: int, request_id: int) -> StageSession:
        key = (conn_id, session_id)
        if key in self._sessions:
            return self._sessions[key]
        if not self._free:
            raise NoFreeSlot(f"all {self.n_seq_max} sequence slots are in use")
        session = StageSession(conn_id, session_id, request_id, heapq.heappop(self._free))
        self._sessions[key] = session
        return session

    def get(self, conn_id: int, session_id: int) -> StageSession | None:
        return self._sessions.get((conn_id, session_id))

    def owned_by(self, conn_id: int) -> list[StageSession]:
        return [s for (c, _), s in self._sessions.items() if c == conn_id]

    def forget(self, session: StageSession) -> bool:
        """Free the slot and sampler. Idempotent; True if the session was live."""
        if self._sessions.pop((session.conn_id, session.session_id), None) is None:
            return False
        if session.sampler is not None:
            session.sampler.close()
            session.sampler = None
        heapq.heappush(self._free, session.seq)
        session.state = SessionState.RELEASED
        return True

    @property
    def live(self) -> list[StageSession]:
        return list(self._sessions.values())

    @property
    def free_slots(self) -> int:
        return len(self._free)

    def snapshot(self) -> dict:
        return {
            "sessions": [s.describe() for s in self._sessions.values()],
            "live_sessions": len(self._sessions),
            "free_slots": len(self._free),
            "n_seq_max": self.n_seq_max,
        }
