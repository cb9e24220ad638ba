"""Stop strings over streamed text, independent of how the text is chunked.

Text that could be the start of a stop string is held back until the next
chunk decides it; at the end of a request the held text is released.
"""
from __future__ import annotations


class StopStrings:
    def __init__(self, stops: list[str], include_in_output: bool = False) -> None:
        self.stops = [s for s in stops if s]
        self.include = include_in_output
        self._held = ""
        self.stopped = False
        self.matched: str | None = None  # the stop string that ended the text

    def feed(self, text: str) -> str:
        """Returns the text that is safe to emit now; sets `stopped` when a stop string appears."""
        if not self.stops or self.stopped:
            return "" if self.stopped else text
        buf = self._held + text
        # The first stop string to complete, as a token-by-token stream sees it (ties: the longer one).
        hit = min(((i + len(s), -len(s), i) for s in self.stops if (i := buf.find(s)) >= 0), default=None)
        if hit is not None:
            end, _, i = hit
            s = buf[i:end]
            self.stopped = True
            self.matched = s
            self._held = ""
            return buf[: i + len(s)] if self.include else buf[:i]
        keep = self._partial_suffix(buf)
        self._held = buf[len(buf) - keep:] if keep else ""
        return buf[: len(buf) - keep]

    def flush(self) -> str:
        held, self._held = self._held, ""
        return held

    def _partial_suffix(self, buf: str) -> int:
        """Length of the longest suffix of buf that is a proper prefix of a stop string."""
        best = 0
        for s in self.stops:
            for n in range(min(len(s) - 1, len(buf)), best, -1):
                if buf.endswith(s[:n]):
                    best = n
                    break
        return best
