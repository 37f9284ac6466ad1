"""The engine's thread count follows the cores other processes leave it (core_share.py): the rule
on injected readings, and the readings themselves from this machine's /proc."""

from __future__ import annotations

import time

from qworker.engine.core_share import PERIOD_S, CoreShare, CpuTimes, read_cpu_times
from qworker.model.tokenizer.tokenizer import Tokenizer

TWO = frozenset({0, 1})


def share(others_per_reading: list[float], threads: int = 2, cpus: frozenset[int] = TWO,
          ours: float = 1.0) -> list[int]:
    """The threads after each reading, where others take the given cores between readings (and
    this process `ours` cores)."""
    busy, own, at = 0.0, 0.0, 0.0
    readings = [CpuTimes(busy, own, at)]
    for others in others_per_reading:
        at += PERIOD_S
        busy += (others + ours) * PERIOD_S
        own += ours * PERIOD_S
        readings.append(CpuTimes(busy, own, at))
    fed = iter(readings)
    follower = CoreShare(threads, cpus, lambda _cpus, _now: next(fed))
    return [follower.threads_at(r.at_s) for r in readings][1:]


def test_a_core_taken_twice_in_a_row_drops_a_thread_and_its_release_brings_it_back_at_once(
) -> None:
    assert share([0.0, 0.9, 0.9, 0.9, 0.1, 0.0]) == [2, 2, 1, 1, 2, 2]


def test_a_single_burst_or_a_light_neighbour_changes_nothing() -> None:
    assert share([0.9, 0.1, 0.9, 0.2, 0.2, 0.2]) == [2] * 6
    assert share([0.3, 0.3]) == [2, 1]  # a quarter of a core already costs two threads half


def test_each_whole_core_taken_counts_and_one_thread_always_stays() -> None:
    four = frozenset(range(4))
    assert share([1.7, 1.7], threads=4, cpus=four) == [4, 2]  # 1.7 cores: two counted
    assert share([3.9, 3.9, 0.0], threads=4, cpus=four) == [4, 1, 4]
    assert share([1.0, 1.0], threads=2, cpus=four) == [2, 2]  # 3 cores left for 2 threads


def test_readings_closer_than_the_period_are_not_taken() -> None:
    calls: list[float] = []

    def read(_cpus: frozenset[int], now: float) -> CpuTimes:
        calls.append(now)
        return CpuTimes(0.0, 0.0, now)

    follower = CoreShare(2, TWO, read)
    for now in (0.0, 0.1, PERIOD_S / 2, PERIOD_S, PERIOD_S * 1.5):
        follower.threads_at(now)
    assert calls == [0.0, PERIOD_S]


def test_unreadable_proc_keeps_the_threads() -> None:
    follower = CoreShare(2, TWO, lambda _cpus, _now: None)
    assert [follower.threads_at(t) for t in (0.0, 1.0, 2.0)] == [2, 2, 2]


def test_this_process_s_time_is_its_own_not_others() -> None:
    """A busy loop here shows in this process's time and in the CPUs' busy time alike."""
    import os

    cpus = frozenset(os.sched_getaffinity(0))
    cpu = time.process_time()
    before = read_cpu_times(cpus, time.monotonic())
    assert before is not None
    while time.process_time() - cpu < 0.3:  # CPU time, however busy the machine is
        pass
    after = read_cpu_times(cpus, time.monotonic())
    spent = time.process_time() - cpu
    assert after is not None
    ours = after.ours_s - before.ours_s
    assert abs(ours - spent) <= 0.05, (ours, spent)  # clock ticks: 10 ms each
    assert after.busy_s - before.busy_s >= ours - 0.05


def test_the_engine_reports_the_threads_its_steps_run_on(smollm2_tokenizer: Tokenizer) -> None:
    import torch

    from tests.engine_fixtures import tiny_engine, tiny_model

    model = tiny_model(smollm2_tokenizer.vocab_size, dtype=torch.float32)
    assert tiny_engine(smollm2_tokenizer, model).stats()["threads"] == torch.get_num_threads()
    assert "threads" not in tiny_engine(smollm2_tokenizer, model, follow_cores=False).stats()
