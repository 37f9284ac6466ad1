"""Thinking apart from the answer: `<think>...</think>` (Qwen3, DeepSeek-R1 distills) split off
the generated text as it streams, and the budget after which the end of thinking is forced.

Character by character, as the tool-call parser, so a stream's split is the whole text's split.
A model thinks when its chat template speaks of `</think>`; its output is thinking from the start
when the rendered prompt ends inside `<think>` (R1's templates open it for the model), else when
the output itself opens with `<think>`. The whitespace just after `</think>` is not answer.
"""

from __future__ import annotations

from dataclasses import dataclass

from qworker.engine.tool_calls import partial_suffix

THINK_OPEN, THINK_CLOSE = "<think>", "</think>"


def thinks(template: str | None) -> bool:
    return THINK_CLOSE in (template or "")


def prompt_opens_thinking(prompt: str) -> bool:
    """The rendered prompt leaves the model inside a `<think>` it opened for it."""
    tail = prompt.rstrip()
    return tail.endswith(THINK_OPEN)


@dataclass
class Split:
    text: str = ""
    reasoning: str = ""


class ThinkSplitter:
    def __init__(self, inside: bool) -> None:
        self.inside = inside
        self._at_start = not inside  # may still open with `<think>`
        self._after_close = False  # dropping the whitespace after `</think>`
        self._held = ""
        self.reasoning = ""

    def feed(self, text: str) -> Split:
        out = Split()
        for char in text:
            self._char(char, out)
        return out

    def finish(self) -> Split:
        out = Split()
        if self.inside:
            self._think(self._held, out)
        elif not self._after_close:
            out.text += self._held
        self._held = ""
        return out

    def _char(self, char: str, out: Split) -> None:
        if self._at_start:
            self._held += char
            stripped = self._held.lstrip()
            if stripped == THINK_OPEN:
                self._at_start, self.inside, self._held = False, True, ""
            elif not THINK_OPEN.startswith(stripped):
                self._at_start, text, self._held = False, self._held, ""
                out.text += text
            return
        if self.inside:
            self._held += char
            if self._held.endswith(THINK_CLOSE):
                self._think(self._held[: -len(THINK_CLOSE)], out)
                self._held, self.inside, self._after_close = "", False, True
                return
            keep = partial_suffix(self._held, THINK_CLOSE)
            self._think(self._held[: len(self._held) - keep], out)
            self._held = self._held[len(self._held) - keep:]
            return
        if self._after_close and char.isspace():
            return
        self._after_close = False
        out.text += char

    def _think(self, text: str, out: Split) -> None:
        out.reasoning += text
        self.reasoning += text
