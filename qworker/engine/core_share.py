"""The engine's thread count follows the cores it actually gets.

A step's kernels meet at hundreds of barriers, each waiting for the slowest thread. When another
process takes one of the engine's cores, every barrier waits for the thread that lost its core:
beside a process burning one core of two, workload v1 kept 0.26-0.33 of its quiet speed on two
threads, and all of its one-thread speed on one thread, which is 0.57 of the quiet two-thread
figure (AMD EPYC Zen 5, 2 vCPUs; docs/engine.md, "Steady beside a neighbour").

So twice a second the engine reads how much of its CPUs' time other processes took (`/proc/stat`
for the CPUs it may run on, steal time included, less its own time from `/proc/self/stat`) and
runs on the cores left: its threads less each core the others took (counted from a quarter of
one: a neighbour in bursts that add up to 0.25-0.3 of a core already cost two threads half their
speed, 425-432 tok/s against 824-834 quiet, where one thread kept 459-472), at least one.
Fewer threads wait for two readings in a row that agree (a burst does not make it flap); more
come back at the first reading that leaves them room (a spare core costs nothing to take back,
and a core shared at every barrier costs half the speed or more).
"""

from __future__ import annotations

import math
import os
from collections.abc import Callable
from dataclasses import dataclass

PERIOD_S = 0.5  # between readings
TAKEN_FROM = 0.25  # of a core that others use, from which it counts as taken


@dataclass(frozen=True)
class CpuTimes:
    busy_s: float  # the CPUs' busy time (steal included), every process
    ours_s: float  # this process's time
    at_s: float  # when read (monotonic)


def read_cpu_times(cpus: frozenset[int], now: float) -> CpuTimes | None:
    """The CPUs' and this process's CPU seconds so far; None where /proc cannot be read."""
    tick = os.sysconf("SC_CLK_TCK")
    try:
        with open("/proc/stat") as stat:
            lines = stat.read().splitlines()
        with open("/proc/self/stat") as own:
            fields = own.read().rpartition(")")[2].split()
    except OSError:
        return None
    busy = 0
    for line in lines:
        name, *values = line.split()
        if name.startswith("cpu") and name[3:].isdigit() and int(name[3:]) in cpus:
            user, nice, system, _idle, _iowait, irq, softirq, steal = map(int, values[:8])
            busy += user + nice + system + irq + softirq + steal
    ours = int(fields[11]) + int(fields[12])  # utime, stime (fields 14 and 15 of the line)
    return CpuTimes(busy / tick, ours / tick, now)


class CoreShare:
    """The thread count to run at, from readings of the CPUs' time (`threads_at`)."""

    def __init__(self, threads: int, cpus: frozenset[int],
                 read: Callable[[frozenset[int], float], CpuTimes | None] = read_cpu_times
                 ) -> None:
        self.most = threads
        self.threads = threads
        self._cpus = cpus
        self._read = read
        self._last: CpuTimes | None = None
        self._pending: int | None = None  # a change one reading asked for

    def threads_at(self, now: float) -> int:
        """The thread count for a step starting `now` (a reading once every PERIOD_S)."""
        if self._last is not None and now - self._last.at_s < PERIOD_S:
            return self.threads
        reading = self._read(self._cpus, now)
        if reading is None:
            return self.threads
        if self._last is not None:
            self._decide(self._last, reading)
        self._last = reading
        return self.threads

    def _decide(self, before: CpuTimes, after: CpuTimes) -> None:
        spent = (after.busy_s - before.busy_s) - (after.ours_s - before.ours_s)
        others = max(0.0, spent / (after.at_s - before.at_s))  # in cores
        taken = math.floor(others + 1 - TAKEN_FROM)
        want = max(1, min(self.most, len(self._cpus) - taken))
        if want == self.threads:
            self._pending = None
        elif want > self.threads or want == self._pending:
            self.threads, self._pending = want, None
        else:
            self._pending = want
