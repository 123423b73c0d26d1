"""Incremental detokenization of one request, cut at its first stop string."""
from __future__ import annotations

from collections.abc import Callable


class TextStream:
    """Turns a request's tokens into text deltas, stopping at the first stop string.

    The text sent is always a prefix of the final text: the last len(longest stop) - 1 characters
    (a stop string may be starting there) and an incomplete UTF-8 character at the end are held
    back until more tokens settle them. Streaming and non-streaming answers join the same deltas.
    """

    def __init__(self, decode: Callable[[list[int]], str], stop: list[str]):
        self.decode = decode
        self.stop = [s for s in stop if s]
        self.hold = max(map(len, self.stop), default=1) - 1
        self.token_ids: list[int] = []  # tokens up to the one that completed a stop string
        self.text = ""  # decoded so far, cut before the stop string once found
        self.sent = 0  # characters of text already given out
        self.stopped = False  # a stop string was found

    def add(self, token_ids: list[int]) -> str:
        """Take a step's new tokens; return the text now safe to send."""
        for t in token_ids:
            if self.stopped:
                break
            self.token_ids.append(t)
            text = self.decode(self.token_ids)
            if self.stop:
                # A stop string wholly inside the sent text would have been found earlier.
                start = max(0, self.sent - self.hold)
                hits = [i for i in (text.find(s, start) for s in self.stop) if i >= 0]
                if hits:
                    text, self.stopped = text[: min(hits)], True
            self.text = text
        return self._release(final=self.stopped)

    def finish(self) -> str:
        """The text still held back, once the request has ended."""
        return self._release(final=True)

    def _release(self, final: bool) -> str:
        end = len(self.text)
        if not final:
            end -= self.hold
            while end > self.sent and self.text[end - 1] == "\ufffd":
                end -= 1
        if end <= self.sent:
            return ""
        out = self.text[self.sent : end]
        self.sent = end
        return out
