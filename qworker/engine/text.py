"""A sequence's text as it streams: detokenized deltas, stop strings held back and cut off."""

from __future__ import annotations

from typing import Protocol


class Detokenizer(Protocol):
    def add(self, token_id: int) -> str: ...

    def flush(self) -> str: ...  # at the end: the text still held back (an unfinished character)


class TextStream:
    """Turns generated tokens into text deltas.

    Text that could still be the start of a stop string is held back until it cannot; a stop string
    ends the text just before it. Joined deltas always equal `final_text`.
    """

    def __init__(self, detokenizer: Detokenizer, stop: tuple[str, ...] = ()) -> None:
        self._detokenizer = detokenizer
        self._stop = tuple(s for s in stop if s)
        self._longest_stop = max((len(s) for s in self._stop), default=0)
        self.text = ""
        self._emitted = 0
        self.stopped = False

    def add(self, token_id: int, check_stop: bool = True) -> str:
        """Append a token; returns the text that is now safe to show."""
        assert not self.stopped, "token after a stop string"
        before = len(self.text)
        self.text += self._detokenizer.add(token_id)
        if check_stop and self._stop and self._cut_at_stop(before):
            return self._emit(len(self.text))
        return self._emit(len(self.text) - self._held_back())

    def flush(self) -> str:
        """The sequence ended for another reason: what was held back is final now."""
        if not self.stopped:  # the detokenizer's held-back text, cut at a stop string it ends
            before = len(self.text)
            self.text += self._detokenizer.flush()
            if self._stop:
                self._cut_at_stop(before)
        return self._emit(len(self.text))

    @property
    def final_text(self) -> str:
        return self.text

    def _emit(self, end: int) -> str:
        delta = self.text[self._emitted : end]
        self._emitted = max(self._emitted, end)
        return delta

    def _cut_at_stop(self, new_from: int) -> bool:
        window_start = max(0, new_from - self._longest_stop + 1)
        hits = [i for s in self._stop if (i := self.text.find(s, window_start)) >= 0]
        if not hits:
            return False
        assert self._emitted <= min(hits), "emitted text that a stop string covers"
        self.text = self.text[: min(hits)]
        self.stopped = True
        return True

    def _held_back(self) -> int:
        """Length of the longest tail of the text that a stop string starts with."""
        for size in range(min(self._longest_stop - 1, len(self.text)), 0, -1):
            tail = self.text[-size:]
            if any(s.startswith(tail) for s in self._stop):
                return size
        return 0
