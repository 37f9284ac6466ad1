"""What a caller hands the engine (a request) and what it gets back every step (outputs)."""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any, Literal

FinishReason = Literal["stop", "length", "cancelled", "tool_calls"]
MAX_LOGPROBS = 20  # the most alternatives `logprobs` / `prompt_logprobs` may ask for


@dataclass(frozen=True)
class StructuredOutputs:
    """Output constrained to exactly one of these (structured.py compiles it)."""

    json: str | None = None  # a JSON Schema, as JSON text
    json_object: bool = False  # any JSON object
    regex: str | None = None
    choice: tuple[str, ...] | None = None  # exactly one of these strings
    grammar: str | None = None  # Lark, or GBNF (a grammar with `::=`)


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
    structured_outputs: StructuredOutputs | None = None  # None: unconstrained
    # log-probabilities from the raw logits: of each sampled token (and its `logprobs` most
    # likely alternatives), of each prompt token from the second on (`prompt_logprobs` top);
    # None: not computed at all
    logprobs: int | None = None
    prompt_logprobs: int | None = None
    # speculative decoding (speculation.py) where the engine has it on; False: this request
    # never speculates (the tokens are the same either way)
    speculate: bool = True

    @property
    def greedy(self) -> bool:
        return self.temperature == 0.0


def sampling_params(given: Mapping[str, Any], model_defaults: Mapping[str, float | int]
                    ) -> SamplingParams:
    """The values `given` (None: unset); an unset one is the model's default where it states
    one (engine.sampling_defaults), else the documented default above (vLLM's neutral ones)."""
    chosen = {name: value for name, value in given.items() if value is not None}
    return SamplingParams(**(dict(model_defaults) | chosen))


@dataclass(frozen=True)
class Prompt:
    """What the engine's front door encodes (EngineCore.encode, chat.py): exactly one of `text`
    (completed as is), `messages` (a chat, OpenAI's message shape) or `token_ids`."""

    text: str | None = None
    messages: tuple[Mapping[str, Any], ...] | None = None
    token_ids: tuple[int, ...] | None = None
    tools: tuple[Mapping[str, Any], ...] = ()  # OpenAI function tools, rendered with the chat


@dataclass(frozen=True)
class ToolCalling:
    """A request's tools (OpenAI `function` objects: name, description, parameters, strict) and
    how they may be called: `choice` auto | required | none | the name of one function."""

    functions: tuple[Mapping[str, Any], ...]
    choice: str = "auto"
    parallel: bool = True

    @property
    def forced(self) -> bool:
        """The whole output is calls (required, or a named function)."""
        return self.choice not in ("auto", "none")

    @property
    def allowed(self) -> tuple[Mapping[str, Any], ...]:
        if self.choice in ("auto", "none", "required"):
            return self.functions
        return tuple(f for f in self.functions if f["name"] == self.choice)


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
    # seconds it already waited before this add (a job: in Redis, not while it ran before a
    # requeue; the service's Taken.waited_ms): it counts for aging (aging.py)
    queued_s: float = 0.0
    # run alone, in a step of its own, until it has produced a token: a job whose earlier runs
    # may have crashed their process (a reclaimed entry delivered more than once)
    isolate: bool = False
    # prefix caching: only requests with the same salt share cached blocks (tenants apart)
    cache_salt: str | None = None
    tools: ToolCalling | None = None  # calls parsed out of the text (and constrained)
    max_reasoning_tokens: int | None = None  # a thinking model's budget: then `</think>`


@dataclass(frozen=True)
class TokenLogprobs:
    """One position's log-probabilities (float32 log_softmax of the model's raw logits, before
    temperature, penalties and bans): of `token_id`, and the `top` most likely, best first."""

    token_id: int
    logprob: float
    top: tuple[tuple[int, float], ...] = ()  # (token id, logprob), k of them


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
    # with SamplingParams.logprobs: one entry per new token
    logprobs: list[TokenLogprobs] | None = None
    # with SamplingParams.prompt_logprobs, on the output of the first generated token: prompt
    # tokens 1 .. P-1 (the first has no context to be predicted from)
    prompt_logprobs: list[TokenLogprobs] | None = None
    # with an output parser (tools, or a model that thinks): `text_delta` is the answer alone,
    # the thinking comes here, and calls as OpenAI streams them (delta.tool_calls)
    reasoning_delta: str = ""
    tool_call_deltas: list[dict[str, Any]] | None = None
    # set when finished: the whole thinking, and the calls (id, type, function: name, arguments)
    reasoning: str | None = None
    tool_calls: list[dict[str, Any]] | None = None


class RequestRejectedError(ValueError):
    """The engine can never run this request (e.g. its prompt does not fit); nothing was taken."""

    def __init__(self, code: str, message: str) -> None:
        super().__init__(message)
        self.code = code  # protocol error code, e.g. "prompt_too_long"
