"""Whether speculation pays at a batch size, measured on the CPU at hand.

A verify step reads the weights once for a few more rows each, which pays while a step is bound
by reading the weights (small batches) and stops paying where the rows' arithmetic or attention
takes over: where that is depends on the CPU, the model and the workload's acceptance. So for
each number of decoding sequences (up to `speculate_max_batch`), the gate keeps the seconds per
token of decode-only steps with drafts and of those without (a moving average), and lets a step
draft while the drafted ones make tokens at least as fast. It learns by alternating until it has
a few of each, and then one step in PROBE_EVERY goes the other way, so that a change (another
workload, a neighbour) is seen.
"""

from __future__ import annotations

from dataclasses import dataclass

LEARN_STEPS = 4  # of each kind at a batch size before the gate judges it
PROBE_EVERY = 32  # once judged, one step in this many at a batch size goes the other way
WEIGHT = 0.125  # of the newest step in the moving averages


@dataclass
class _Timings:
    drafted: float = 0.0  # seconds per token of the steps with drafts (moving average)
    plain: float = 0.0  # the same without
    drafted_steps: int = 0
    plain_steps: int = 0
    asked: int = 0  # steps that asked the gate

    def learning(self) -> bool:
        return min(self.drafted_steps, self.plain_steps) < LEARN_STEPS

    def pays(self) -> bool:
        return self.drafted <= self.plain


class SpeculationGate:
    def __init__(self) -> None:
        self._at: dict[int, _Timings] = {}

    def allows(self, decodes: int) -> bool:
        """Whether a step of `decodes` decoding sequences drafts (asked once per such step)."""
        t = self._at.setdefault(decodes, _Timings())
        t.asked += 1
        if t.learning():  # the kind it has fewer of
            return t.drafted_steps <= t.plain_steps
        return t.pays() != (t.asked % PROBE_EVERY == 0)

    def observe(self, decodes: int, drafted: bool, seconds: float, tokens: int) -> None:
        """A decode-only step of `decodes` sequences made `tokens` in `seconds`; `drafted`:
        some of them had a draft."""
        if tokens <= 0:
            return
        t = self._at.setdefault(decodes, _Timings())
        per_token = seconds / tokens
        if drafted:
            t.drafted = per_token if t.drafted_steps == 0 else (
                t.drafted + WEIGHT * (per_token - t.drafted))
            t.drafted_steps += 1
        else:
            t.plain = per_token if t.plain_steps == 0 else t.plain + WEIGHT * (per_token - t.plain)
            t.plain_steps += 1

    def report(self) -> dict[int, bool]:
        """Per batch size judged so far, whether speculation pays there."""
        return {d: t.pays() for d, t in sorted(self._at.items()) if not t.learning()}
