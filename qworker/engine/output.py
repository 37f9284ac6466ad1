"""One sequence's generated text taken apart as it streams: the thinking (reasoning.py), the
answer, the tool calls (tool_calls.py); and when a grammar must be armed for a while: a call the
model opened (tool_choice `auto`), or the end of thinking once its budget is spent.

Only sequences that ask for it have one (a job with tools, or a model that thinks): every other
sequence streams exactly as before, at the same cost.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from qworker.engine.reasoning import THINK_CLOSE, ThinkSplitter
from qworker.engine.request import ToolCalling
from qworker.engine.tool_calls import ToolCall, ToolCallDelta, ToolCallParser, ToolFormat


@dataclass
class Pieces:
    text: str = ""
    reasoning: str = ""
    tool_calls: list[ToolCallDelta] = field(default_factory=list)


@dataclass(frozen=True)
class Arm:
    """A grammar to arm now: `kind` "call" (its grammar starts at `opener`, and `written`, the
    text since, is already generated) or "think" (the end-of-thinking marker, forced)."""

    kind: str
    opener: str = ""
    written: str = ""


class OutputParser:
    def __init__(self, request_id: str, fmt: ToolFormat, tools: ToolCalling | None,
                 thinks: bool, thinking_from_start: bool,
                 max_reasoning_tokens: int | None) -> None:
        self.fmt = fmt
        self.tools = tools if tools is not None and tools.choice != "none" else None
        self.splitter = ThinkSplitter(thinking_from_start) if thinks else None
        self.calls = ToolCallParser(fmt, request_id) if self.tools is not None else None
        self.budget = max_reasoning_tokens
        self.text = ""
        self.reasoning = ""
        self.think_tokens = 0
        self.armed: str | None = None  # the kind of the temporary grammar now on, if any
        self._region_tried = False  # this call region was armed already (or could not be)

    @property
    def thinking(self) -> bool:
        return self.splitter is not None and self.splitter.inside

    @property
    def tool_calls(self) -> list[ToolCall]:
        return self.calls.calls if self.calls is not None else []

    def count_token(self) -> None:
        if self.thinking:
            self.think_tokens += 1

    def feed(self, delta: str) -> Pieces:
        return self._pieces(*self._split(delta, final=False))

    def finish(self) -> Pieces:
        return self._pieces(*self._split("", final=True))

    def _split(self, delta: str, final: bool) -> tuple[str, str, bool]:
        if self.splitter is None:
            return delta, "", final
        split = self.splitter.finish() if final and not delta else self.splitter.feed(delta)
        if final and delta:
            rest = self.splitter.finish()
            split.text += rest.text
            split.reasoning += rest.reasoning
        return split.text, split.reasoning, final

    def _pieces(self, text: str, reasoning: str, final: bool) -> Pieces:
        out = Pieces(reasoning=reasoning)
        if self.calls is None:
            out.text = text
        else:
            parsed = self.calls.feed(text)
            out.text, out.tool_calls = parsed.text, parsed.tool_calls
            if final:
                end = self.calls.finish()
                out.text += end.text
                out.tool_calls += end.tool_calls
        self.text += out.text
        self.reasoning += out.reasoning
        return out

    def to_arm(self) -> Arm | None:
        """What grammar the next token needs, where none is on."""
        if self.armed is not None:
            return None
        if self.thinking:
            over = self.budget is not None and self.think_tokens >= self.budget
            return Arm("think") if over else None
        if self.calls is None or not self.calls.in_call:
            self._region_tried = False
            return None
        if self._region_tried:
            return None
        self._region_tried = True
        return Arm("call", self.calls.opener, self.calls.region)

    def released(self) -> bool:
        """A temporary grammar is complete: True when that ends the output (one call only)."""
        kind, self.armed = self.armed, None
        return kind == "call" and self.tools is not None and not self.tools.parallel


__all__ = ["THINK_CLOSE", "Arm", "OutputParser", "Pieces"]
