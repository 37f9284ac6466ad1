"""Priority aging by waiting time: a sequence's rank in the queues, and who may displace whom.

With `level_s` = A seconds a level, a sequence's rank (lower first) is priority * A less the
seconds it has waited: in the waiting queue, including what its request waited before it reached
the engine (`Request.queued_s`), and again after each preemption. It does not age while it runs:
its rank is frozen then. All waiting sequences age at the same rate, so their order is fixed while
they wait: the queue is sorted by `wait_key`, which does not change with the clock, and a
sequence's current rank is that key less the clock. A = 0 is strict priority (rank = priority).

Displacement needs a strictly better priority *and* a better rank (`displaces`): equal priorities
never displace each other (no time-slicing), two levels never in both directions (no ping-pong),
and a sequence that waited (levels apart) x A is displaced by no newer arrival of a level.

A block shortage among running sequences preempts by `preemption_key` instead: the worst
priority, the newest of equals. It must not change when a sequence is preempted: a rank that
improves while the preempted one waits would make it preempt the others in turn when it comes
back, and sequences of one level could take turns being recomputed for ever (a pool too small
for all of them: nobody finishes). It agrees with displacement: the head only displaces worse
priorities, the first to go when blocks run short.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass, field

from qworker.engine.sequence import Sequence


@dataclass
class Aging:
    level_s: float  # seconds of waiting worth one priority level; 0: strict priority
    clock: Callable[[], float] = field(default=time.monotonic)  # tests set their own

    def new_rank(self, priority: int, waited_s: float = 0.0) -> float:
        """The rank of a request of `priority` that has waited `waited_s` seconds."""
        if not self.level_s:
            return float(priority)
        return round(priority * self.level_s - waited_s, 3)  # in ms: same-ms ties go by arrival

    def rank(self, seq: Sequence) -> float:
        """Its rank now: frozen while it runs, improving while it waits."""
        waited = seq.waited_s
        if seq.waiting_since is not None:
            waited += self.clock() - seq.waiting_since
        return self.new_rank(seq.priority, waited)

    def key(self, seq: Sequence) -> tuple[float, int]:
        """Its rank now, ties by arrival (kept across preemption: the older first)."""
        return (self.rank(seq), seq.arrival)

    @staticmethod
    def preemption_key(seq: Sequence) -> tuple[int, int]:
        """The running list's order: a block shortage preempts the last (it never changes)."""
        return (seq.priority, seq.arrival)

    def wait_key(self, seq: Sequence) -> tuple[float, int]:
        """The waiting queue's order: the rank it had at clock 0 had it waited all along, which
        stays put while it waits (every waiting rank falls by the same seconds)."""
        assert seq.waiting_since is not None, "not waiting"
        if not self.level_s:
            return (float(seq.priority), seq.arrival)
        return (self.new_rank(seq.priority, seq.waited_s - seq.waiting_since), seq.arrival)

    def start_waiting(self, seq: Sequence) -> None:
        assert seq.waiting_since is None, "already waiting"
        seq.waiting_since = self.clock()

    def stop_waiting(self, seq: Sequence) -> None:
        """It starts running: what it waited counts, and its rank is frozen."""
        assert seq.waiting_since is not None, "not waiting"
        seq.waited_s += max(0.0, self.clock() - seq.waiting_since)
        seq.waiting_since = None

    def displaces(self, head: Sequence, victim: Sequence) -> bool:
        """Whether waiting `head` may preempt running `victim` for room."""
        return self.may_displace(head.priority, self.rank(head), victim)

    def may_displace(self, priority: int, rank: float, victim: Sequence) -> bool:
        """Whether a waiting sequence of `priority` and `rank` may preempt running `victim`."""
        return priority < victim.priority and rank < self.rank(victim)
