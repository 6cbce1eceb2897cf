"""Stop strings over streamed text: a stop may span several tokens and is never emitted."""

from __future__ import annotations


class StopMatcher:
    def __init__(self, stops: list[str] | tuple[str, ...] = ()):
        self.stops = [s for s in stops if s]
        self._held = ""

    def push(self, text: str) -> tuple[str, bool]:
        """Add generated text; return (text safe to emit now, whether a stop string was hit)."""
        if not self.stops:
            return text, False
        buf = self._held + text
        hit = min((i for i in (buf.find(s) for s in self.stops) if i >= 0), default=-1)
        if hit >= 0:
            self._held = ""
            return buf[:hit], True
        # hold back the longest tail that could still become a stop string
        keep = 0
        for stop in self.stops:
            for n in range(min(len(stop) - 1, len(buf)), 0, -1):
                if buf.endswith(stop[:n]):
                    keep = max(keep, n)
                    break
        self._held = buf[len(buf) - keep:] if keep else ""
        return buf[:len(buf) - keep], False

    def flush(self) -> str:
        held, self._held = self._held, ""
        return held
