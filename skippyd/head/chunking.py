"""The prefill chunk size, adapted to the measured compute and link times.

A prompt goes down the pipeline in chunks, at most ``credit`` of them
unacknowledged on the head's link, so stage k computes chunk i+1 while chunk
i is on the wire or on stage k+1. Two costs pull the chunk size apart:

* the tail: after the head's last chunk, every later stage still has that
  chunk to compute, so smaller chunks give a shorter tail;
* the link: the head may run ``credit`` chunks ahead of their acks; if
  computing them takes less than the link's round trip, the head stalls
  with nothing to do. Covering the round trip needs
  ``chunk >= round_trip / (credit * compute_per_token)``.

The configured chunk (``runtime.prefill_chunk``) is the floor, what a fast link
gets; on a slow link the chunk grows to cover its round trip (with a
quarter to spare), up to the batch size. The head measures both inputs as
it goes: its own compute per prompt token (prefill), and the round trip of
each decode step less the compute the other stages reported for it.
"""

from __future__ import annotations

EWMA = 0.2  # weight of the newest measurement
MARGIN = 1.25


class PrefillChunker:
    def __init__(self, floor: int, ceiling: int, credit: int):
        self.floor = max(1, min(floor, ceiling))
        self.ceiling = max(self.floor, ceiling)
        self.credit = max(1, credit)
        self.us_per_token = 0.0  # the head's prefill compute per token
        self.round_trip_us = 0.0  # the link's round trip, without the other stages' compute

    @staticmethod
    def _blend(old: float, new: float) -> float:
        return new if old == 0.0 else (1 - EWMA) * old + EWMA * new

    def observe_prefill(self, tokens: int, compute_us: int) -> None:
        if tokens > 0 and compute_us > 0:
            self.us_per_token = self._blend(self.us_per_token, compute_us / tokens)

    def observe_round_trip(self, wait_us: int, downstream_compute_us: int) -> None:
        self.round_trip_us = self._blend(self.round_trip_us, max(0, wait_us - downstream_compute_us))

    @property
    def size(self) -> int:
        if self.us_per_token <= 0.0:
            return self.floor
        needed = MARGIN * self.round_trip_us / (self.credit * self.us_per_token)
        return int(min(self.ceiling, max(self.floor, needed)))

    def describe(self) -> dict:
        return {"prefill_chunk": self.size, "floor": self.floor, "ceiling": self.ceiling, "credit": self.credit,
                "us_per_token": round(self.us_per_token, 1), "round_trip_us": round(self.round_trip_us, 1)}
