"""One request's state inside the engine."""

from __future__ import annotations

from dataclasses import dataclass, field
from enum import Enum, auto
from typing import TYPE_CHECKING

from qworker.engine.request import FinishReason, SamplingParams, TokenLogprobs
from qworker.engine.text import TextStream

if TYPE_CHECKING:
    from qworker.engine.output import OutputParser
    from qworker.engine.structured import Matcher


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
    matcher: Matcher | None = None  # its place in its structured_outputs grammar (structured.py)
    output: OutputParser | None = None  # thinking and tool calls apart from the answer
    status: Status = Status.NEW
    finish_reason: FinishReason | None = None
    # priority aging (aging.py): seconds it has waited (as of `waiting_since` while it waits,
    # counting its request's `queued_s`), and the clock when it last began waiting (None: not
    # waiting, its rank is frozen)
    waited_s: float = 0.0
    waiting_since: float | None = None
    isolate: bool = False  # runs alone in its steps until it samples a token (Request.isolate)
    cache_salt: str | None = None  # isolates its prefix cache entries (Request.cache_salt)
    # prefix caching (prefix_cache.py): the chained hashes of its full blocks, as far as computed,
    # and how many of its blocks the cache knows (its shared prefix, then each one it completed)
    block_hashes: list[bytes] = field(default_factory=list)
    num_registered: int = 0
    # a model's second KV group (its sliding-window layers beside full-attention ones,
    # block_groups.py): its block table, and how many of those blocks the group's cache knows
    window_table: list[int] = field(default_factory=list)
    window_registered: int = 0
    # logprobs, written by the runner, taken by the core with the tokens they belong to: of the
    # tokens the last run gave it, in order; of prompt tokens 1.. (None: not asked, or already
    # handed out)
    sampled_logprobs: list[TokenLogprobs] = field(default_factory=list)
    prompt_logprobs: list[TokenLogprobs] | None = None
    # speculative decoding (speculation.py): this step's draft, computed after its pending token,
    # and how many of it the runner accepted
    draft: list[int] = field(default_factory=list)
    num_accepted: int = 0

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

    def reaches_end(self, n: int) -> bool:
        """Whether computing its next `n` scheduled tokens (its draft included) reaches its last
        token: then it samples."""
        return self.num_computed + n - len(self.draft) == len(self.token_ids)

    @property
    def wants_prompt_logprobs(self) -> bool:
        """Still collecting its prompt's logprobs: every prompt position must be computed (a
        prefix cache must not skip any of them for this sequence)."""
        return self.prompt_logprobs is not None

    def prompt_logprob_positions(self, n: int) -> range:
        """Of the next `n` tokens to compute, the positions whose logits give a prompt token's
        logprob not yet collected (position p predicts token p + 1)."""
        if self.prompt_logprobs is None:
            return range(0)
        start = max(self.num_computed, len(self.prompt_logprobs))
        return range(start, min(self.num_computed + n, self.num_prompt_tokens - 1))
