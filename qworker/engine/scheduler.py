"""Decides each step: who decodes, who prefills how much, who is admitted, who is preempted.

Running sequences go first, oldest first: a decode takes one token, a prefill a chunk of at most
`prefill_chunk` tokens from the step's `max_batched_tokens` budget (decodes do not spend it). When a
running sequence needs a block and none is free, the newest of the worst priority is preempted
(possibly itself), so nobody is preempted for a later arrival of its priority. Waiting sequences
are then admitted in rank order while the budget, `max_num_seqs` and the free blocks (less a
watermark) allow; nothing is admitted in a step that had to preempt. With prefix caching a
sequence starts from its longest cached prefix (block_manager.py): those tokens and blocks are
already there. A waiting sequence whose next block a running one is computing ("in flight": in
its block table, not yet complete) is held back, keeping its slot and blocks, until that block is
cached; those behind it may start meanwhile. So requests that arrive together with a shared
prefix compute it once. It cannot deadlock: the in-flight set is recomputed every step from the
running sequences, so a writer that is preempted, aborted or fails no longer holds anyone back.

Isolation: a sequence with `isolate` set (a job whose earlier runs may have crashed their process)
runs in steps of its own until it has sampled a token: when it is running, or at the head of the
waiting queue with room for its whole prefill, the step is that sequence alone and the others wait;
otherwise nothing is admitted behind it. So whatever it does to a step, no other sequence was in it.

Priority (aging.py): the waiting queue is in rank order (the priority aged by the time waited,
frozen while running; ties by arrival, kept across preemption), the running list in (priority,
arrival) order: a block shortage preempts the worst priority, the newest of equals. A waiting
head that does not fit (no slot, no blocks) preempts running sequences of a worse priority that
it outranks until it fits (`_displace`).
"""

from __future__ import annotations

import bisect
from dataclasses import dataclass, field

from qworker.engine.aging import Aging
from qworker.engine.block_groups import Blocks
from qworker.engine.sequence import Sequence, Status


@dataclass(frozen=True)
class SchedulerLimits:
    max_num_seqs: int
    max_batched_tokens: int
    prefill_chunk: int
    watermark_blocks: int = 0


@dataclass
class ScheduledStep:
    work: list[tuple[Sequence, int]] = field(default_factory=list)  # (sequence, new tokens)
    preempted: list[Sequence] = field(default_factory=list)
    displaced: list[Sequence] = field(default_factory=list)  # of those, preempted for priority
    held: list[Sequence] = field(default_factory=list)  # waiting for a block in flight to land
    prefill_tokens: int = 0  # tokens spent from the step's budget


class Scheduler:
    def __init__(self, limits: SchedulerLimits, blocks: Blocks, aging: Aging) -> None:
        self.limits = limits
        self.blocks = blocks
        self.aging = aging
        self.waiting: list[Sequence] = []  # sorted by aging.wait_key
        self.running: list[Sequence] = []  # by aging.preemption_key (after admission appends)

    def add(self, seq: Sequence) -> None:
        """It waits (new, or preempted: it ages again from what it had waited)."""
        seq.status = Status.WAITING
        self.aging.start_waiting(seq)
        bisect.insort(self.waiting, seq, key=self.aging.wait_key)

    def remove(self, seq: Sequence) -> None:
        """Take a sequence out (finished, aborted or handed back) and free its blocks."""
        if seq.status is Status.RUNNING:
            self.running.remove(seq)
        elif seq.status is Status.WAITING:
            self.waiting.remove(seq)
            self.aging.stop_waiting(seq)
        self.blocks.release(seq)
        seq.status = Status.FINISHED

    def has_decodes(self) -> bool:
        return any(not seq.is_prefill for seq in self.running)

    def schedule(self, budget: int | None = None) -> ScheduledStep:
        """budget: prefill tokens this step may take (at most, and by default, the limit's)."""
        step = ScheduledStep()
        limit = self.limits.max_batched_tokens
        self.running.sort(key=self.aging.preemption_key)  # admission appends; in order again
        if not self._schedule_alone(step, limit):
            total = limit if budget is None else min(budget, limit)
            self._schedule_running(step, total)
            if not step.preempted:
                self._admit(step, total)
        assert len(step.work) == 1 or not any(seq.isolate for seq, _ in step.work), \
            "an isolated sequence shares a step"
        return step

    def next_alone(self) -> Sequence | None:
        """The isolated sequence that the next step runs alone, if any (nothing changes)."""
        seq = next((s for s in self.running if s.isolate), None)
        if seq is not None:
            return seq
        if not self.waiting or not self.waiting[0].isolate:
            return None
        seq = self.waiting[0]
        # room for its whole prefill: nobody else runs meanwhile, so it never has to
        # preempt itself between chunks (and start over, alone again, for ever)
        reserve = self.limits.watermark_blocks if self.running else 0
        full = len(self.running) >= self.limits.max_num_seqs
        if full or not self.blocks.can_grow(seq, len(seq.token_ids), reserve):
            return None  # no room yet: the others run, and admission stops at it
        return seq

    def _schedule_alone(self, step: ScheduledStep, budget: int) -> bool:
        """A step of one isolated sequence, if one is running or may start now."""
        seq = self.next_alone()
        if seq is None:
            return False
        if seq.status is Status.WAITING:
            self.waiting.pop(0)
            self.aging.stop_waiting(seq)
            self.blocks.share(seq, self.blocks.cached_prefix(seq))
            seq.status = Status.RUNNING
            bisect.insort(self.running, seq, key=self.aging.preemption_key)
        n = min(seq.num_pending, self.limits.prefill_chunk, budget)
        if self._make_room(seq, seq.num_computed + n, step):
            self.blocks.grow(seq, seq.num_computed + n)
            step.work.append((seq, n))
            step.prefill_tokens += n
        return True

    def _schedule_running(self, step: ScheduledStep, budget: int) -> int:
        i = 0
        while i < len(self.running):
            seq = self.running[i]
            n = 1 if not seq.is_prefill else min(seq.num_pending, self.limits.prefill_chunk, budget)
            if n == 0:  # a prefill that must wait for budget
                i += 1
                continue
            if not self._make_room(seq, seq.num_computed + n, step):
                break  # seq preempted itself: it was the newest, nothing left after it
            self.blocks.grow(seq, seq.num_computed + n)
            step.work.append((seq, n))
            if seq.is_prefill:
                budget -= n
                step.prefill_tokens += n
            i += 1
        return budget

    def _make_room(self, seq: Sequence, num_tokens: int, step: ScheduledStep) -> bool:
        while not self.blocks.can_grow(seq, num_tokens):
            victim = self.running.pop()
            self.blocks.release(victim)
            self.add(victim)
            step.preempted.append(victim)
            if victim is seq:
                return False
        return True

    def _admit(self, step: ScheduledStep, total: int) -> None:
        """Admits waiting sequences in queue order; where the head does not fit and outranks the
        worst running sequence, that one is preempted for it and admission goes on."""
        self._admit_waiting(step, total - step.prefill_tokens)
        while self._displace(step, total - step.prefill_tokens):
            self._admit_waiting(step, total - step.prefill_tokens)

    def _displace(self, step: ScheduledStep, budget: int) -> bool:
        """Preempts a running sequence for the waiting head, if the head was stopped by slots or
        blocks (not by the budget, not isolated): of those it may displace (a worse priority and
        a worse rank, `Aging.displaces`), the worst ranked, the newest of equals. The victim is of
        a worse priority, so it never displaces the head back, whatever it waits."""
        if not self.waiting or not self.running or budget <= 0:
            return False
        head = self.waiting[0]
        if head in step.held or head.isolate:
            return False  # it waits for a block in flight, not for room; or it starts alone
        victims = [seq for seq in self.running if self.aging.displaces(head, seq)]
        if not victims:
            return False
        victim = max(victims, key=self.aging.key)
        for k, (seq, n) in enumerate(step.work):
            if seq is victim:  # scheduled earlier in this step: it gives its tokens back
                del step.work[k]
                step.prefill_tokens -= n if seq.is_prefill else 0
                break
        self.running.remove(victim)
        self.blocks.release(victim)
        self.add(victim)
        step.preempted.append(victim)
        step.displaced.append(victim)
        return True

    def _admit_waiting(self, step: ScheduledStep, budget: int) -> None:
        """Admits waiting sequences in queue order while they fit. One whose next block a running
        sequence is computing (in flight) is held back, keeping a slot and the blocks of its first
        chunk: it finds that block cached in a later step instead of computing it too. Those
        behind it may still start."""
        step.held.clear()
        if not self.waiting:
            return
        in_flight = {h for seq in self.running for h in self.blocks.in_flight(seq)}
        held, held_blocks = 0, 0
        i = 0
        while (i < len(self.waiting) and budget > 0
               and len(self.running) + held < self.limits.max_num_seqs):
            seq = self.waiting[i]
            if seq.isolate:
                return  # it starts alone, in a step of its own
            if seq in step.displaced:
                return  # displaced in this step: not back before the next
            prefix = self.blocks.cached_prefix(seq)  # counted as there: no prefill, no new block
            awaited = self.blocks.awaited_prefix(seq, len(prefix), in_flight)
            if awaited > len(prefix):
                held += 1
                held_blocks += self._first_chunk_blocks(seq, awaited)
                step.held.append(seq)
                i += 1
                continue
            start = len(prefix) * self.blocks.block_size
            n = min(seq.num_pending - start, self.limits.prefill_chunk, budget)
            reserve = held_blocks + (self.limits.watermark_blocks if self.running else 0)
            if not self.blocks.can_admit(seq, prefix, start + n, reserve):
                return
            self.waiting.pop(i)
            self.aging.stop_waiting(seq)
            self.blocks.share(seq, prefix)
            self.blocks.grow(seq, start + n)
            seq.status = Status.RUNNING
            self.running.append(seq)
            step.work.append((seq, n))
            budget -= n
            step.prefill_tokens += n
            in_flight.update(self.blocks.in_flight(seq))

    def _first_chunk_blocks(self, seq: Sequence, prefix_blocks: int) -> int:
        """New blocks the first chunk of `seq` takes if it starts from `prefix_blocks` cached."""
        start = prefix_blocks * self.blocks.block_size
        n = min(seq.num_pending - start, self.limits.prefill_chunk)
        return self.blocks.blocks_for(start + n) - prefix_blocks
