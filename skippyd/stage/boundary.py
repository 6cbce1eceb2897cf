"""A stage's boundary rows: the hidden states it sent on for each position it holds.

A stage before the final one records, for every position of a session from
position 0, the hidden state it computed there and sent to the next stage
(its output rows: ``n_embd`` float32 each). The prefix cache keeps them with
the KV of an entry, so that when this stage holds a prefix and the next one
does not (it evicted it, or restarted), this stage answers the prefill of
those positions with the rows it recorded instead of computing them: only the
stages that miss compute (skippyd/stage/handlers.py, skippyd/head/sequence.py).
They cost ``4 * n_embd`` bytes a position, beside the KV of the stage's layers
(for SmolLM2-135M, 2.3 KiB against 11.3 KiB of KV on each half of the model);
the final stage records none. A live session's rows count where the stage's
memory is: the deploy planner's need of a stage (skippyd/deploy/planner.py,
``boundary_bytes``) and its status (``boundary_rows_bytes``).
"""

from __future__ import annotations

import numpy as np


class BoundaryRows:
    """The rows of positions [0, held) of one sequence; a row written past ``held`` (a gap) is not kept."""

    def __init__(self) -> None:
        self._rows: np.ndarray | None = None
        self.held = 0

    def wrote(self, pos: int, rows) -> None:
        """The rows of positions [pos, pos + len(rows)) were computed: kept if they continue what is held
        (what lay past them is stale now)."""
        rows = np.asarray(rows, dtype=np.float32)
        if rows.ndim != 2 or pos > self.held:
            self.held = min(self.held, pos)
            return
        end = pos + rows.shape[0]
        buf = self._rows
        if buf is None or buf.shape[1] != rows.shape[1] or end > buf.shape[0]:
            grown = np.empty((max(end, 2 * (0 if buf is None else buf.shape[0]), 256), rows.shape[1]), np.float32)
            if buf is not None and buf.shape[1] == rows.shape[1]:
                grown[:pos] = buf[:pos]
            elif pos:  # another width: nothing before is usable
                self.held = 0
                return
            self._rows = buf = grown
        buf[pos:end] = rows
        self.held = end

    @property
    def nbytes(self) -> int:
        """The memory its buffer takes (it grows ahead of what is held)."""
        return 0 if self._rows is None else self._rows.nbytes

    def trim(self, n: int) -> None:
        """Hold positions [0, n) at most (the sequence was trimmed)."""
        self.held = min(self.held, n)

    def view(self, lo: int, hi: int) -> np.ndarray:
        """The rows of positions [lo, hi) (a view; held must cover them)."""
        assert self._rows is not None and hi <= self.held
        return self._rows[lo:hi]

    def copy(self, n: int) -> np.ndarray | None:
        """The rows of positions [0, min(n, held)), copied; None when none are held."""
        n = min(n, self.held)
        return None if n <= 0 or self._rows is None else self._rows[:n].copy()

    def load(self, rows: np.ndarray | None, n: int) -> None:
        """Hold the first ``n`` of ``rows`` (a restored entry's), or none."""
        self.held = 0
        if rows is not None and n > 0:
            self.wrote(0, rows[:n])
