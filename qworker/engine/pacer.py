"""Paces prefill beside running decodes, so a long prompt cannot stall them.

A step that carries decodes should take about `stretch` times a decode-only step. No fixed token
budget can promise that: a prefill token's cost grows with the context it attends to (late chunks
of a 4,096-token prompt cost several times the first). So the pacer learns from measured steps:
the time of a decode-only step, and the extra time per prefill token in the latest steps that
prefilled. From those it sizes the next step's prefill budget. Decodes get dearer as their
contexts grow, so every `refresh_every`-th paced step prefills nothing and measures them afresh
(else their growth would be blamed on the prefill, and pacing would crawl). Steps without decodes
are not paced.
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass
class PrefillPacer:
    stretch: float  # a step with decodes may take this many times a decode-only step
    max_tokens: int  # the budget of a step without decodes
    min_tokens: int = 4  # never paced below this: a long prompt always advances
    smoothing: float = 0.5  # weight of the newest measurement
    refresh_every: int = 8  # every this many paced steps, one decode-only step to re-measure
    decode_seconds: float | None = None  # a decode-only step, smoothed
    token_seconds: float | None = None  # extra time per prefill token, smoothed
    paced_steps: int = 0

    def __post_init__(self) -> None:
        assert self.stretch > 1 and 1 <= self.min_tokens <= self.max_tokens
        assert self.refresh_every >= 2

    def budget(self, decoding: bool) -> int:
        """Prefill tokens the next step may take."""
        if not decoding:
            return self.max_tokens
        self.paced_steps += 1
        if self.paced_steps % self.refresh_every == 0:
            return 0  # a decode-only step: decode_seconds measured afresh
        if self.decode_seconds is None or self.token_seconds is None:
            return self.min_tokens  # nothing measured yet: learn before spending
        if self.token_seconds <= 0:
            return self.max_tokens
        tokens = int((self.stretch - 1) * self.decode_seconds / self.token_seconds)
        return max(self.min_tokens, min(self.max_tokens, tokens))

    def observe(self, decodes: int, prefill_tokens: int, seconds: float) -> None:
        """A step ran `decodes` decodes and `prefill_tokens` prefill tokens in `seconds`."""
        if prefill_tokens == 0:
            if decodes:
                self.decode_seconds = self._mix(self.decode_seconds, seconds)
            return
        if decodes and self.decode_seconds is None:
            return  # cannot tell the prefill's share yet
        base = self.decode_seconds if decodes and self.decode_seconds is not None else 0.0
        extra = max(seconds - base, 0.0) / prefill_tokens
        self.token_seconds = self._mix(self.token_seconds, extra)

    def _mix(self, old: float | None, new: float) -> float:
        return new if old is None else old + self.smoothing * (new - old)
