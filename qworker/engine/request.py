"""What a caller hands the engine (a request) and what it gets back every step (outputs)."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Literal

FinishReason = Literal["stop", "length", "cancelled"]


@dataclass(frozen=True)
class SamplingParams:
    max_tokens: int = 256
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = 0  # 0: off
    min_p: float = 0.0
    seed: int | None = None  # None: the engine draws one
    stop: tuple[str, ...] = ()
    stop_token_ids: tuple[int, ...] = ()
    ignore_eos: bool = False
    min_tokens: int = 0
    repetition_penalty: float = 1.0
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0

    @property
    def greedy(self) -> bool:
        return self.temperature == 0.0


@dataclass
class Request:
    """One generation request.

    `output_token_ids` are tokens already generated (and already shown to the client) by an earlier
    run of the same request; the engine recomputes their KV and continues at the next index.
    """

    request_id: str
    prompt_token_ids: list[int]
    params: SamplingParams = field(default_factory=SamplingParams)
    output_token_ids: list[int] = field(default_factory=list)
    priority: int = 0  # lower runs first, as in vLLM
    # run alone, in a step of its own, until it has produced a token: a job whose earlier runs
    # may have crashed their process (a reclaimed entry delivered more than once)
    isolate: bool = False


@dataclass
class StepOutput:
    """What happened to one request in one engine step."""

    request_id: str
    new_token_ids: list[int]
    text_delta: str = ""
    first_index: int = 0  # index (from 0) of new_token_ids[0] among the generated tokens
    finished: bool = False
    finish_reason: FinishReason | None = None
    preempted: bool = False  # released by the engine; the caller must requeue it
    num_prompt_tokens: int = 0
    text: str | None = None  # the whole final text, set when finished
    # set (with finished=True, no finish_reason) when the request failed inside a step: names the
    # exception; the engine has let it go and freed its blocks
    error: str | None = None


class RequestRejectedError(ValueError):
    """The engine can never run this request (e.g. its prompt does not fit); nothing was taken."""

    def __init__(self, code: str, message: str) -> None:
        super().__init__(message)
        self.code = code  # protocol error code, e.g. "prompt_too_long"
