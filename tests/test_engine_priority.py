"""Priority inside the engine: a waiting request of better priority displaces running ones of
worse priority when slots or blocks are short (victim: the worst, newest), the displaced keep
their place, aging bounds starvation, and greedy text does not depend on any of it. On the
simulated engine (the same core as the real one; tests/test_engine_core_agreement.py)."""

from __future__ import annotations

from dataclasses import replace

from hypothesis import given, settings
from hypothesis import strategies as st

from qworker.engine.config import EngineConfig
from qworker.engine.core import EngineCore
from qworker.engine.request import Request, SamplingParams, StepOutput
from qworker.engine.scheduler import ScheduledStep
from qworker.engine.sequence import Status
from qworker.engine.simulated import SimOptions, SimulatedEngine, run_offline

GREEDY = SamplingParams(max_tokens=20, temperature=0.0, ignore_eos=True)


def engine(**settings: object) -> SimulatedEngine:
    config = EngineConfig(**{"model": "sim", "num_blocks": 64, "block_size": 4,
                             "max_num_seqs": 4, "max_batched_tokens": 64, "prefill_chunk": 16,
                             "priority_aging_s": 0.0, **settings})  # type: ignore[arg-type]
    sim = SimulatedEngine(config, SimOptions(step_ms=0))
    sim.clock = FakeClock()
    return sim


class FakeClock:
    """Seconds that pass only when the test says so."""

    def __init__(self) -> None:
        self.now = 1000.0

    def __call__(self) -> float:
        return self.now


def request(rid: str, priority: int, max_tokens: int = 20, prompt_len: int = 8) -> Request:
    first = sum(map(ord, rid)) * 7  # a prompt of its own: no prefix shared with another
    return Request(rid, [(first + 3 * i) % 250 + 1 for i in range(prompt_len)],
                   replace(GREEDY, max_tokens=max_tokens), priority=priority)


def running(e: SimulatedEngine) -> list[str]:
    return sorted(s.request_id for s in e.scheduler.running)


def steps(e: SimulatedEngine, n: int) -> list[StepOutput]:
    return [out for _ in range(n) for out in e.step()]


def test_a_better_priority_displaces_the_worst_newest_when_slots_are_full() -> None:
    e = engine()
    for rid, prio in (("a", 1), ("b", 2), ("c", 2), ("d", 0)):
        e.add(request(rid, prio))
    steps(e, 2)
    assert running(e) == ["a", "b", "c", "d"]
    e.add(request("h", -1, max_tokens=2))
    e.step()
    step = e.last_schedule
    assert [s.request_id for s in step.displaced] == ["c"]  # priority 2, and newer than b
    assert running(e) == ["a", "b", "d", "h"]
    assert [s.request_id for s in e.scheduler.waiting] == ["c"]
    steps(e, 3)  # h finishes; c, displaced, comes back before anything of its rank or worse
    e.add(request("late", 2))
    e.step()
    assert "c" in running(e) and "late" not in running(e)


def test_equal_or_worse_priority_never_displaces() -> None:
    e = engine(max_num_seqs=2)
    e.add(request("a", 0))
    e.add(request("b", 0))
    e.step()
    e.add(request("same", 0))
    e.add(request("worse", 5))
    steps(e, 3)
    assert running(e) == ["a", "b"] and e.num_preemptions == 0


def test_a_better_priority_displaces_for_blocks() -> None:
    # 12 blocks of 4 tokens: two 20-token prompts hold 10 (the watermark is 0)
    e = engine(num_blocks=12, max_num_seqs=8, watermark=0.0)
    e.add(request("low1", 3, prompt_len=20))
    e.add(request("low2", 3, prompt_len=20))
    e.step()
    e.add(request("high", -3, prompt_len=16, max_tokens=2))  # needs 4 blocks, 2 are free
    e.step()
    assert [s.request_id for s in e.last_schedule.displaced] == ["low2"]
    assert running(e) == ["high", "low1"]
    e.blocks.check(e.scheduler.running + e.scheduler.waiting)


def test_free_slots_counts_what_a_priority_would_displace() -> None:
    e = engine()
    for rid, prio in (("a", 0), ("b", 1), ("c", 1), ("d", 2)):
        e.add(request(rid, prio))
    e.step()
    assert e.free_slots() == 0
    assert e.free_slots(2) == 0 and e.free_slots(1) == 1 and e.free_slots(0) == 3
    assert e.free_slots(-1) == 4


def test_displaced_text_is_unchanged_in_engine_and_requeued() -> None:
    lows = [request(f"low{k}", 1, max_tokens=30) for k in range(4)]
    alone = run_offline(engine(), lows)
    for requeue in (False, True):
        e = engine(requeue_preempted=requeue)
        results = {r.request_id: [] for r in lows}  # type: dict[str, list[int]]
        for r in lows:
            e.add(r)
        pending = {r.request_id: r for r in lows}
        step = 0
        while e.has_unfinished() or step < 40:
            if step % 5 == 2 and step < 40:
                high = request(f"high{step}", -1, max_tokens=3)
                pending[high.request_id] = high
                results[high.request_id] = []
                e.add(high)
            for out in e.step():
                if out.preempted:  # the service's requeue: added again with what it streamed
                    e.add(replace(pending[out.request_id],
                                  output_token_ids=list(results[out.request_id])))
                else:
                    results[out.request_id] += out.new_token_ids
            step += 1
        assert e.num_preemptions >= 4
        for r in lows:
            assert results[r.request_id] == alone[r.request_id].token_ids, (requeue, r)


def test_aging_bounds_starvation() -> None:
    """More urgent arrivals than the engine serves: without aging a worse priority runs last;
    with aging of A seconds per level, an arrival overtakes it only within its first 2 * A
    seconds (2 levels apart here), however many come after."""
    for aging in (0.0, 10.0):
        e = engine(max_num_seqs=1, priority_aging_s=aging)
        clock = e.clock
        assert isinstance(clock, FakeClock)
        e.add(request("starved", 2, max_tokens=3))  # arrives at 1000.0 ...
        e.add(request("u0", 0, max_tokens=3))  # ... with a more urgent one
        arrived = {"starved": 1000.0, "u0": 1000.0}
        order: list[str] = []
        for k in range(1, 300):
            clock.now += 1.0
            if k < 60:  # one per step; each takes 3 steps
                e.add(request(f"u{k}", 0, max_tokens=3))
                arrived[f"u{k}"] = clock.now
            e.step()
            order += [rid for rid in running(e) if rid not in order]
        assert not e.has_unfinished() and len(order) == 61
        before = order[:order.index("starved")]
        if not aging:
            assert order[-1] == "starved"
        else:
            assert before and all(arrived[rid] < 1000.0 + 2 * aging for rid in before)
            assert all(arrived[rid] >= 1000.0 + 2 * aging - 1 for rid in order[len(before) + 1:])


def aged(max_num_seqs: int = 1, **settings: object) -> tuple[SimulatedEngine, FakeClock]:
    e = engine(max_num_seqs=max_num_seqs, priority_aging_s=10.0, **settings)
    assert isinstance(e.clock, FakeClock)
    return e, e.clock


def run_ticking(e: SimulatedEngine, clock: FakeClock, n: int, dt: float = 1.0
                ) -> list[StepOutput]:
    outs: list[StepOutput] = []
    for _ in range(n):
        clock.now += dt
        outs += e.step()
    return outs


def test_a_long_running_low_job_stays_displaceable() -> None:
    """Running time does not age: however long a low job has run, a fresh high one displaces it
    (by arrival time it would have aged past the high one's level after 10 s)."""
    e, clock = aged()
    e.add(request("low", 1, max_tokens=200))
    e.step()
    run_ticking(e, clock, 100, dt=10.0)  # 1000 s of running
    assert running(e) == ["low"]
    assert e.free_slots() == 0 and e.free_slots(1) == 0 and e.free_slots(0) == 1
    e.add(request("high", 0, max_tokens=3))
    e.step()
    assert [s.request_id for s in e.last_schedule.displaced] == ["low"]
    assert running(e) == ["high"]


def test_a_low_job_that_waited_is_protected_by_its_wait() -> None:
    """A job that waited W seconds before it started is displaced only by a fresh job more
    urgent by more than W / A levels: the starvation bound, in waiting time."""
    for urgent, displaced in ((0, False), (-1, False), (-2, True)):
        e, clock = aged()
        e.add(request("first", 1, max_tokens=25))  # same priority: it only makes "low" wait
        e.step()
        e.add(request("low", 1, max_tokens=80))
        run_ticking(e, clock, 25)  # "first" finishes, "low" starts having waited 25 s: rank -15
        assert running(e) == ["low"]
        run_ticking(e, clock, 30)  # running does not age it further
        assert [e.free_slots(p) for p in (1, 0, -1, -2)] == [0, 0, 0, 1]  # as displacement
        e.add(request("new", urgent, max_tokens=3))  # at its step rank -1, -11, -21
        outs = run_ticking(e, clock, 5)
        assert e.num_preemptions == int(displaced), urgent
        assert any(o.request_id == "new" and o.finished for o in outs) == displaced, urgent


def test_a_displaced_job_ages_on_from_where_it_stopped() -> None:
    e, clock = aged()
    e.add(request("first", 1, max_tokens=7))
    e.step()
    e.add(request("low", 1, max_tokens=60))
    run_ticking(e, clock, 7)  # "low" waits 7 s, then runs: rank 10 - 7 = 3, frozen
    assert running(e) == ["low"]
    run_ticking(e, clock, 20)
    low = e.scheduler.running[0]
    assert e.scheduler.aging.rank(low) == 3.0
    e.add(request("high", 0, max_tokens=4))  # at its step rank -1 < 3: displaces it
    run_ticking(e, clock, 5)  # "low" waits 4 s more while "high" runs, then runs again
    assert running(e) == ["low"] and e.num_preemptions == 1
    assert e.scheduler.aging.rank(low) == -1.0  # 10 - (7 + 4)
    e.add(request("high2", 0, max_tokens=4))  # at its step rank -1: no longer better ...
    run_ticking(e, clock, 1)
    assert running(e) == ["low"] and e.num_preemptions == 1
    run_ticking(e, clock, 1)  # ... until it has waited 1 s more than "low" beyond a level
    assert running(e) == ["high2"] and e.num_preemptions == 2


def test_no_ping_pong_between_equal_priorities_or_two_levels() -> None:
    """Jobs of two levels keep arriving, more than the engine serves: displacements only ever go
    from a better level to a worse one (each job at most once per arrival of a better one),
    and never between equals, however the waiting ones age meanwhile."""
    for levels in ((0,), (0, 1)):
        e, clock = aged(max_num_seqs=2)
        for k in range(40):
            e.add(request(f"j{k}", levels[k % len(levels)], max_tokens=6))
            for _ in range(2):
                clock.now += 1.0
                e.step()
                step = e.last_schedule
                started = [seq for seq, _ in step.work if seq.num_computed == 0]
                for victim in step.displaced:
                    assert all(victim.priority > seq.priority for seq in started)
        run_ticking(e, clock, 200)
        assert not e.has_unfinished()
        if levels == (0,):
            assert e.num_preemptions == 0
        else:  # a priority-1 job is displaced by priority-0 arrivals until it has waited 10 s
            assert 0 < e.num_preemptions < 20


def test_a_block_shortage_preempts_by_priority_and_arrival_not_by_rank() -> None:
    """Three equal jobs that outgrow a pool of 12 blocks: the newest is preempted, waits, and
    comes back last. By rank (which improves while it waits) it would come back ahead and
    preempt another, in turn for ever: nobody finished in 2000 steps that way."""
    e, clock = aged(max_num_seqs=3, num_blocks=12, prefill_chunk=4, watermark=0.0)
    for k in range(3):
        e.add(request(f"j{k}", 0, max_tokens=30, prompt_len=4))
    outs = run_ticking(e, clock, 100)
    assert not e.has_unfinished() and e.num_preemptions <= 6
    assert [o.request_id for o in outs if o.finished] == ["j0", "j1", "j2"]


def check_priority(engine: EngineCore) -> None:
    """Wraps the scheduler: after each decision no running sequence outranks a victim, and
    (unless the step preempted for blocks, ran alone or spent its budget) the waiting head
    outranks no running sequence: it would have displaced it."""
    scheduler = engine.scheduler
    schedule = scheduler.schedule

    def checked(budget: int | None = None) -> ScheduledStep:
        step = schedule(budget)
        aging = scheduler.aging
        pressure = len(step.preempted) > len(step.displaced)
        if pressure:
            order = aging.preemption_key
            worst = max((order(seq) for seq in scheduler.running), default=(-10**9, -1))
            assert worst < min(map(order, step.preempted)), "a better one preempted"
        assert all(any(seq is p for p in step.preempted) for seq in step.displaced)
        # each for one of a better priority and rank: started in this step, or still the head
        # (it displaces the worst first until it fits, and may not fit even then)
        started = [seq for seq, _ in step.work if seq.status is Status.RUNNING]
        for victim in step.displaced:
            assert any(aging.may_displace(seq.priority, aging.rank(seq), victim)
                       for seq in started + scheduler.waiting[:1] if seq is not victim)
        alone = any(seq.isolate for seq in scheduler.running)
        head = scheduler.waiting[0] if scheduler.waiting else None
        if (head is not None and not pressure and not alone and head not in step.displaced
                and not head.isolate
                and step.prefill_tokens < scheduler.limits.max_batched_tokens):
            assert not any(aging.displaces(head, seq) for seq in scheduler.running), \
                "priority inversion"
        return step

    scheduler.schedule = checked  # type: ignore[method-assign]


arrivals = st.lists(st.tuples(st.integers(0, 20),  # step it arrives at
                              st.integers(1, 40),  # prompt length
                              st.integers(1, 20),  # max_tokens
                              st.integers(-3, 3),  # priority
                              st.one_of(st.none(), st.integers(0, 40)),  # aborted at, or never
                              st.booleans()),  # isolated
                    min_size=1, max_size=20)


@settings(max_examples=50, deadline=None)
@given(plan=arrivals, max_num_seqs=st.integers(1, 6), max_batched_tokens=st.integers(1, 48),
       prefill_chunk=st.integers(1, 32), num_blocks=st.integers(12, 60),
       aging=st.sampled_from([0.0, 2.0, 5.0]), requeue=st.booleans())
def test_priority_invariants_under_random_schedules(
        plan: list[tuple[int, int, int, int, int | None, bool]], max_num_seqs: int,
        max_batched_tokens: int, prefill_chunk: int, num_blocks: int, aging: float,
        requeue: bool) -> None:
    """Victims are the worst ranked, no inversion survives a step that could fix it, every
    request still gets all its tokens, with the service's requeue or the engine's own."""
    e = engine(max_num_seqs=max_num_seqs, max_batched_tokens=max_batched_tokens,
               prefill_chunk=prefill_chunk, num_blocks=num_blocks, priority_aging_s=aging,
               requeue_preempted=requeue, watermark=0.0)
    check_priority(e)
    clock = e.clock
    assert isinstance(clock, FakeClock)
    requests = {f"r{k}": replace(request(f"r{k}", prio, max_tokens, prompt_len), isolate=iso)
                for k, (_, prompt_len, max_tokens, prio, _, iso) in enumerate(plan)}
    got: dict[str, list[int]] = {rid: [] for rid in requests}
    aborted: set[str] = set()
    step = 0
    while step <= 40 or e.has_unfinished():
        assert step < 3000, "no progress"
        for k, (at, _, _, _, abort_at, _) in enumerate(plan):
            if at == step:
                e.add(requests[f"r{k}"])
            if abort_at == step and at <= step:
                e.abort(f"r{k}")
                aborted.add(f"r{k}")
        for out in e.step():
            if out.preempted:
                e.add(replace(requests[out.request_id], output_token_ids=list(got[out.request_id])))
            else:
                got[out.request_id] += out.new_token_ids
        e.blocks.check(e.scheduler.running + e.scheduler.waiting)
        clock.now += 1.0
        step += 1
    for rid, r in requests.items():
        if rid not in aborted:
            want = min(r.params.max_tokens, e.max_seq_len - len(r.prompt_token_ids))
            assert len(got[rid]) == want, rid
