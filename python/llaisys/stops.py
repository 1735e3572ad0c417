"""Stop strings over streamed text.

Text arrives in deltas that need not align with a stop string: "<|end" may come in one delta and "|>" in the
next. The matcher therefore holds back any tail that could still grow into a stop string, and emits text only
when no stop string can start inside it. The output, all pieces together, is exactly the full text cut where
the earliest stop string starts (or all of it when none occurs).
"""
from __future__ import annotations


class StopStringMatcher:
    def __init__(self, stops=()):
        stops = (stops,) if isinstance(stops, str) else tuple(stops or ())
        for s in stops:
            if not isinstance(s, str) or not s:
                raise ValueError(f"stop strings must be non-empty strings, got {s!r}")
        self.stops = stops
        self._longest = max(map(len, stops), default=0)
        self._held = ""    # text not yet emitted: it may be the start of a stop string
        self.hit = False   # a stop string was found; everything from it on is dropped

    def feed(self, delta: str) -> tuple[str, bool]:
        """Add `delta`; return (text safe to emit now, whether a stop string was hit)."""
        if self.hit:
            return "", True
        if not self.stops:
            return delta, False
        text = self._held + delta
        cut = self._earliest_match(text)
        hold = self._earliest_partial(text, len(text) if cut is None else cut)
        if hold is not None:  # a stop string may still start before `cut`: wait for more text
            self._held = text[hold:]
            return text[:hold], False
        self._held = ""
        if cut is None:
            return text, False
        self.hit = True
        return text[:cut], True

    def flush(self) -> str:
        """At the end of generation: the held-back text (cut at a stop string if one is complete in it;
        then `hit` becomes True)."""
        text, self._held = self._held, ""
        if self.hit:
            return ""
        cut = self._earliest_match(text)
        if cut is None:
            return text
        self.hit = True
        return text[:cut]

    def _earliest_match(self, text: str) -> int | None:
        found = [i for i in (text.find(s) for s in self.stops) if i >= 0]
        return min(found) if found else None

    def _earliest_partial(self, text: str, limit: int) -> int | None:
        """Smallest i < limit where text[i:] is a proper prefix of a stop string (so it could still become one)."""
        for i in range(max(0, len(text) - self._longest + 1), limit):
            tail = text[i:]
            if any(len(s) > len(tail) and s.startswith(tail) for s in self.stops):
                return i
        return None
