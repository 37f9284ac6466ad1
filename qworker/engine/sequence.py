"""One request's state inside the engine."""

from __future__ import annotations

from dataclasses import dataclass, field
from enum import Enum, auto

from qworker.engine.request import FinishReason, SamplingParams
from qworker.engine.text import TextStream


class Status(Enum):
    NEW = auto()
    WAITING = auto()
    RUNNING = auto()
    FINISHED = auto()


@dataclass(eq=False)
class Sequence:
    request_id: str
    token_ids: list[int]  # prompt, then generated tokens
    num_prompt_tokens: int
    params: SamplingParams
    seed: int
    priority: int
    arrival: int  # order of arrival; preserved across preemption, so a preempted one goes first
    text: TextStream
    num_computed: int = 0  # tokens whose K/V are in the cache
    block_table: list[int] = field(default_factory=list)
    status: Status = Status.NEW
    finish_reason: FinishReason | None = None
    isolate: bool = False  # runs alone in its steps until it samples a token (Request.isolate)

    @property
    def num_output_tokens(self) -> int:
        return len(self.token_ids) - self.num_prompt_tokens

    @property
    def output_ids(self) -> list[int]:
        return self.token_ids[self.num_prompt_tokens :]

    @property
    def num_pending(self) -> int:
        """Tokens still to compute before the next token can be sampled."""
        return len(self.token_ids) - self.num_computed

    @property
    def is_prefill(self) -> bool:
        return self.num_pending > 1

    @property
    def queue_key(self) -> tuple[int, int]:
        return (self.priority, self.arrival)
