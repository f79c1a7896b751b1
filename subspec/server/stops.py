"""Stop strings over streamed text: release text as soon as it cannot be part of a stop string."""
from __future__ import annotations


class StopMatcher:
    """Feed the text of an answer piece by piece; :meth:`feed` returns the text safe to show and whether a stop
    string was reached (the stop string itself and everything after it are never shown).

    Text that ends with the beginning of a stop string is held back until the next piece decides it; :meth:`flush`
    releases it when the answer ends without a stop.
    """

    def __init__(self, stops: list[str]):
        self.stops = [s for s in stops if s]
        self.text = ""
        self.shown = 0  # characters of ``text`` released

    def feed(self, new: str) -> tuple[str, bool]:
        self.text += new
        hits = [i for i in (self.text.find(s, self.shown) for s in self.stops) if i >= 0]
        if hits:
            end = min(hits)
            out, self.shown = self.text[self.shown:end], end
            return out, True
        hold = max((k for s in self.stops for k in range(1, len(s)) if self.text.endswith(s[:k])), default=0)
        end = max(self.shown, len(self.text) - hold)
        out, self.shown = self.text[self.shown:end], end
        return out, False

    def flush(self) -> str:
        out, self.shown = self.text[self.shown:], len(self.text)
        return out

    def found_in(self, text: str) -> bool:
        """Whether ``text`` (the answer so far) contains a stop string after the released part."""
        return any(text.find(s, self.shown) >= 0 for s in self.stops)
