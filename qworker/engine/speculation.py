"""Speculative decoding by prompt lookup: drafts from a sequence's own tokens, verified exactly.

Drafting. A decoding sequence whose last n tokens (n = 3, then 2) occurred before, in its prompt
or its output, is given the tokens that followed their latest occurrence as a draft, up to k
(`num_speculative_tokens`): code edits, extraction and JSON that repeats its input copy long
spans (a single token that came before is too weak a sign: SmolLM2's acceptance on copy prompts
was 0.45 with 1-token matches, 0.71 without). The step then computes the sequence's pending token
and its draft in one forward, one query row each, attended as decodes (`as_decodes` in batch.py).

Acceptance. The runner samples every row as if the draft before it had been accepted (its
context, penalties, bans and the uniform of that token index), and the draft is accepted up to the
first row whose sampled token differs from it; that row's token is kept too (the correction), or,
with the whole draft accepted, the last row's (the bonus). For a deterministic draft this is
exactly the speculative rejection rule: accept draft token t with probability p(t), else sample
from p with t's mass removed and renormalized. The sampler draws a token by inverse CDF from one
uniform per token index (sampler.py), so the token is t with probability p(t), and otherwise
falls, in proportion, on the others. Greedy and seeded sampling therefore give the very tokens of
decoding without speculation, not only the same distribution.

Rollback. The rejected rows' K/V are simply not counted: the sequence's computed length moves
past the accepted ones alone, and the blocks past its tokens are freed (`BlockManager.shrink`).
Prefix caching registers only blocks of committed tokens, as ever.

When. Only in steps of at most `speculate_max_batch` decoding sequences (a small batch is bound by
reading the weights, so a few more rows cost little), at batch sizes where drafted steps measured
on this CPU make tokens at least as fast as plain ones (speculation_gate.py), never for one that
opted out
(`SamplingParams.speculate`); a sequence whose recent acceptance falls below
`speculate_min_acceptance` pauses, for longer each time. A constrained (structured output)
sequence's draft is cut at the first token its grammar refuses, and each of its rows is masked
by the grammar as it stands after the draft before it.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from weakref import WeakKeyDictionary

from qworker.engine.block_manager import BlockManager
from qworker.engine.scheduler import ScheduledStep
from qworker.engine.sequence import Sequence
from qworker.engine.speculation_gate import SpeculationGate

NGRAM_MAX, NGRAM_MIN = 3, 2
RATE_WEIGHT = 0.25  # of the newest verify in a sequence's recent acceptance rate
FIRST_PAUSE, LONGEST_PAUSE = 16, 512  # output tokens without drafts after the rate fell

Proposer = Callable[[Sequence, int], list[int]]  # (sequence, at most k) -> draft tokens


class NgramIndex:
    """Where each n-gram of a growing token list last ended (NGRAM_MIN <= n <= NGRAM_MAX)."""

    def __init__(self) -> None:
        self._last_end: dict[tuple[int, ...], int] = {}
        self._indexed = 0  # n-grams ending before this position are in the index

    def propose(self, tokens: list[int], k: int) -> list[int]:
        """The up to `k` tokens that followed the latest earlier occurrence of the longest suffix
        of `tokens` (of at most NGRAM_MAX tokens) seen before; [] if none."""
        end = len(tokens) - 1  # the suffix ends here; its earlier occurrences end before
        for e in range(self._indexed, end):
            for n in range(NGRAM_MIN, min(NGRAM_MAX, e + 1) + 1):
                self._last_end[tuple(tokens[e - n + 1 : e + 1])] = e
        self._indexed = max(self._indexed, end)
        for n in range(min(NGRAM_MAX, len(tokens)), NGRAM_MIN - 1, -1):
            last = self._last_end.get(tuple(tokens[-n:]))
            if last is not None:
                return tokens[last + 1 : last + 1 + k]
        return []


def accepted_length(draft: list[int], sampled: list[int]) -> int:
    """How many draft tokens are accepted: those before the first row whose sampled token (row i
    sampled as if draft[:i] had been accepted) differs from the draft's."""
    return next((i for i, (d, t) in enumerate(zip(draft, sampled, strict=False)) if d != t),
                len(draft))


@dataclass(frozen=True)
class SpeculationLimits:
    num_tokens: int  # k: the most draft tokens of one sequence in one step
    max_batch: int  # speculate only in steps of at most this many decoding sequences
    min_acceptance: float  # a sequence whose recent acceptance rate falls below it pauses
    reserve_blocks: int = 0  # free blocks a draft leaves (the watermark)
    measured: bool = True  # the gate decides where within max_batch (speculation_gate.py)


@dataclass
class _Drafting:
    """One sequence's speculation state."""

    index: NgramIndex = field(default_factory=NgramIndex)
    rate: float = 1.0  # recent acceptance: each verify's accepted share, the newest weighted most
    resume_at: int = 0  # output tokens: no draft before it has this many
    pause: int = FIRST_PAUSE  # the next pause's length (doubled each time)


class Speculator:
    """Gives a step's decodes their drafts and keeps the acceptance figures."""

    def __init__(self, limits: SpeculationLimits, blocks: BlockManager, max_seq_len: int,
                 proposer: Proposer | None = None) -> None:
        self.limits = limits
        self.blocks = blocks
        self.max_seq_len = max_seq_len
        self.proposer = proposer or self._lookup
        self.drafted = 0  # draft tokens verified, in all
        self.accepted = 0  # of those, accepted
        self.gate = SpeculationGate()
        self._states: WeakKeyDictionary[Sequence, _Drafting] = WeakKeyDictionary()

    def wants(self, decodes: int) -> bool:
        """Whether a step of this many decoding sequences speculates: small batches only (their
        step is bound by reading the weights, so a few more rows cost little), and where the
        gate has measured that it pays (speculation_gate.py)."""
        return 0 < decodes <= self.limits.max_batch and (
            not self.limits.measured or self.gate.allows(decodes))

    def observe(self, decodes: int, drafted: bool, seconds: float, tokens: int) -> None:
        """A decode-only step's time and the tokens it made, for the gate."""
        if decodes <= self.limits.max_batch:
            self.gate.observe(decodes, drafted, seconds, tokens)

    def draft(self, step: ScheduledStep) -> bool:
        """Gives the step's eligible decodes a draft (`Sequence.draft`): each one's work grows to
        1 + its length, its blocks to hold it (free ones beyond the reserve only: a draft never
        preempts). True if any got one."""
        decodes = [i for i, (seq, n) in enumerate(step.work) if n == seq.num_pending == 1]
        if not self.wants(len(decodes)):
            return False
        drafted = False
        for i in decodes:
            seq = step.work[i][0]
            draft = self._draft(seq)
            if draft:
                seq.draft = draft
                step.work[i] = (seq, 1 + len(draft))
                drafted = True
        return drafted

    def settle(self, seq: Sequence) -> None:
        """After a verify of `seq`'s draft (`seq.num_accepted` of it accepted): the figures, and
        a pause for a sequence whose recent acceptance fell below the floor."""
        drafted, accepted = len(seq.draft), seq.num_accepted
        self.drafted += drafted
        self.accepted += accepted
        state = self._state(seq)
        state.rate += RATE_WEIGHT * (accepted / drafted - state.rate)
        if state.rate < self.limits.min_acceptance:
            state.resume_at = seq.num_output_tokens + accepted + 1 + state.pause
            state.pause = min(2 * state.pause, LONGEST_PAUSE)
            state.rate = 1.0  # judged afresh when it resumes

    def stats(self) -> dict[str, int]:
        return {"spec_drafted": self.drafted, "spec_accepted": self.accepted}

    def _draft(self, seq: Sequence) -> list[int]:
        p = seq.params
        if not p.speculate or seq.prompt_logprobs is not None or seq.output is not None:
            return []  # opted out; still owing its prompt's logprobs; or parsed (tools, thinking:
            # a grammar armed at a call's marker must see every token after it)
        if seq.num_output_tokens < self._state(seq).resume_at:
            return []
        # accepting j drafts and one more token must keep it within max_tokens and its length
        room = min(self.limits.num_tokens, p.max_tokens - seq.num_output_tokens - 1,
                   self.max_seq_len - len(seq.token_ids) - 1)
        if room <= 0:
            return []
        draft = self.proposer(seq, room)[:room]
        if seq.matcher is not None:  # structured output: cut at the first token it refuses
            draft = draft[: seq.matcher.valid_prefix(draft)]
        length = len(seq.token_ids)  # its draft takes the slots after its tokens
        spare = self.blocks.num_free - self.limits.reserve_blocks
        if self.blocks.blocks_needed(seq, length + len(draft)) > spare:
            draft = draft[: max(0, len(seq.block_table) * self.blocks.block_size - length)]
        self.blocks.grow(seq, length + len(draft))
        return draft

    def _lookup(self, seq: Sequence, k: int) -> list[int]:
        return self._state(seq).index.propose(seq.token_ids, k)

    def _state(self, seq: Sequence) -> _Drafting:
        state = self._states.get(seq)
        if state is None:
            state = self._states[seq] = _Drafting()
        return state
