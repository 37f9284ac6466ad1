"""The simulated engine's model: the next token is a hash of the tokens before it.

The hash covers prompt and output tokens and the request's seed (0 when it has none), so a text
is a pure function of the request: a job resumed after preemption or on another worker continues
exactly as an uninterrupted run. Tokens are printable ASCII; with `eos_every` N, a token whose
hash is divisible by N is EOS. As the real sampler, it never samples a stop token id or EOS before
`min_tokens`. Each step sleeps `step_ms`, plus `token_us` per computed token. Logprobs, when asked,
are a deterministic function of the context's hash (`_logprobs`).
"""

from __future__ import annotations

import time
from weakref import WeakKeyDictionary

from qworker.engine.byte_tokenizer import EOS_TOKEN_ID, VOCAB_SIZE
from qworker.engine.request import TokenLogprobs
from qworker.engine.sequence import Sequence
from qworker.engine.structured import Matcher, allowed_masks

_MASK = (1 << 64) - 1
_FNV_PRIME = 0x100000001B3
_FNV_OFFSET = 0xCBF29CE484222325
_PRINTABLE = range(32, 127)


def _mix(h: int) -> int:
    """splitmix64 finalizer: spreads a rolling hash over all bits."""
    h = (h ^ (h >> 30)) * 0xBF58476D1CE4E5B9 & _MASK
    h = (h ^ (h >> 27)) * 0x94D049BB133111EB & _MASK
    return h ^ (h >> 31)


class HashRunner:
    vocab_size = VOCAB_SIZE

    def __init__(self, max_context: int, step_ms: float = 0.0, token_us: float = 0.0,
                 eos_every: int = 0) -> None:
        self.max_context = max_context
        self.step_ms, self.token_us, self.eos_every = step_ms, token_us, eos_every
        # FNV-1a over a sequence's first n tokens, as (n, hash): tokens are only ever appended
        self._hashed: WeakKeyDictionary[Sequence, tuple[int, int]] = WeakKeyDictionary()

    def run(self, work: list[tuple[Sequence, int]]) -> dict[Sequence, int]:
        computed = sum(n for _, n in work)
        time.sleep((self.step_ms + self.token_us * computed / 1000) / 1000)
        for seq, n in work:
            self._prompt_logprobs(seq, n)
        return {seq: self._verify(seq) for seq, n in work if seq.reaches_end(n)}

    def _verify(self, seq: Sequence) -> int:
        """Its next token; with a draft, the token after the draft's accepted part (as the torch
        runner: each position sampled after the draft before it, accepted while they agree)."""
        h, i = self._hash(seq), 0
        seq.sampled_logprobs = []
        while True:
            token = self._sample(seq, h, seq.num_output_tokens + i)
            if seq.params.logprobs is not None:
                seq.sampled_logprobs.append(_logprobs(h, token, seq.params.logprobs))
            if i == len(seq.draft) or token != seq.draft[i]:
                seq.num_accepted = i
                if seq.matcher is not None:
                    seq.matcher.rollback(i)  # it followed the accepted ones to mask after them
                return token
            if seq.matcher is not None:
                assert seq.matcher.advance(token), "a draft its grammar refuses"
            h, i = ((h ^ token) * _FNV_PRIME) & _MASK, i + 1

    def warm_up(self) -> None:
        pass

    def kernel_report(self) -> dict[str, str]:
        return {"native": "none: simulated engine"}

    def _sample(self, seq: Sequence, context: int, index: int) -> int:
        """Token `index` of its output after tokens hashing to `context`."""
        p = seq.params
        h = _mix(context ^ ((p.seed or 0) * 0x9E3779B97F4A7C15 & _MASK))
        banned = set(p.stop_token_ids) if index < p.min_tokens else set()
        may_end = not p.ignore_eos and index >= p.min_tokens
        if seq.matcher is not None:
            return _constrained(seq.matcher, h, banned if may_end else banned | {EOS_TOKEN_ID})
        if self.eos_every and may_end and h % self.eos_every == 0:
            return EOS_TOKEN_ID
        start = (h >> 8) % len(_PRINTABLE)
        if _PRINTABLE[start] not in banned:
            return _PRINTABLE[start]
        others = [*_PRINTABLE[start:], *_PRINTABLE[:start], *range(1, 32), *range(127, 256)]
        return next(t for t in others if t not in banned)

    def _prompt_logprobs(self, seq: Sequence, n: int) -> None:
        positions = seq.prompt_logprob_positions(n)
        if not positions:
            return
        assert seq.prompt_logprobs is not None
        assert len(seq.prompt_logprobs) == positions.start, "a prompt position was skipped"
        h = _FNV_OFFSET
        for p, token in enumerate(seq.token_ids[: positions.stop]):
            h = ((h ^ token) * _FNV_PRIME) & _MASK
            if p >= positions.start:
                seq.prompt_logprobs.append(_logprobs(h, seq.token_ids[p + 1],
                                                     seq.params.prompt_logprobs or 0))

    def _hash(self, seq: Sequence) -> int:
        done, h = self._hashed.get(seq, (0, _FNV_OFFSET))
        for token in seq.token_ids[done:]:
            h = ((h ^ token) * _FNV_PRIME) & _MASK
        self._hashed[seq] = (len(seq.token_ids), h)
        return h


def _logprobs(h: int, token: int, k: int) -> TokenLogprobs:
    """Deterministic stand-in logprobs for `token` after a context hashing to `h`: the token
    itself is the most likely, then the ids after it, one nat apart each."""
    first = -(_mix(h) % 4096) / 1024
    top = tuple(((token + j) % VOCAB_SIZE, first - j) for j in range(k))
    return TokenLogprobs(token, first, top)


def _constrained(matcher: Matcher, h: int, banned: set[int]) -> int:
    """Structured output: the hash picks among the tokens the grammar allows next."""
    mask = allowed_masks([matcher])[0]
    allowed = [t for t in range(len(mask)) if mask[t] and t not in banned]
    return allowed[(h >> 8) % len(allowed)] if allowed else EOS_TOKEN_ID
