"""The real engine (tiny random Llama) and the simulated engine are one core over two runners: a
random schedule (arrivals, priorities, cancels, isolated jobs, shared prompt prefixes and cache
salts, a small block pool that preempts) run through both makes the same decision every step.
Requests ignore EOS and have no stop strings, so when a sequence ends does not depend on which
tokens its runner samples."""

from __future__ import annotations

import sys
from dataclasses import dataclass, replace
from typing import Any

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from qworker.engine.config import EngineConfig
from qworker.engine.core import EngineCore
from qworker.engine.engine import Engine
from qworker.engine.request import Request, SamplingParams
from qworker.engine.sequence import Sequence
from qworker.engine.simulated import SimOptions, SimulatedEngine
from qworker.model.decoder import DecoderModel
from qworker.model.tokenizer.tokenizer import Tokenizer
from tests.engine_fixtures import blocks_computed_twice, tiny_model

VOCAB = 256  # the simulated engine's: prompts are valid for both


@dataclass(frozen=True)
class Job:
    arrival: int  # step at which it is added
    prompt_len: int
    max_tokens: int
    priority: int
    cancel: int | None  # step at which it is aborted, or never
    isolate: bool
    shared: int = 0  # leading tokens of the prompt that every job with the same salt shares
    salt: str | None = None


jobs = st.builds(Job, st.integers(0, 15), st.integers(1, 30), st.integers(1, 12),
                 st.integers(-2, 2), st.one_of(st.none(), st.integers(0, 40)),
                 st.sampled_from([False, False, False, True]), st.integers(0, 24),
                 st.sampled_from([None, None, "b"]))
configs = st.builds(
    EngineConfig, model=st.just("sim"), num_blocks=st.integers(8, 24), block_size=st.just(4),
    max_num_seqs=st.integers(1, 5), max_batched_tokens=st.integers(2, 24),
    prefill_chunk=st.integers(1, 12), requeue_preempted=st.booleans(),
    watermark=st.sampled_from([0.0, 0.1]), prefix_caching=st.booleans())


@pytest.fixture(scope="module")
def model() -> DecoderModel:
    return tiny_model(VOCAB)


def trace(engine: EngineCore, plan: list[Job]) -> list[tuple[Any, ...]]:
    """Drives `engine` through `plan` as the worker would (a handed-back job is added again with
    what it streamed); one record per step: the runner's batch, preemptions, outputs (in no
    particular order: the torch runner returns its tokens in its own batch order), gauges."""
    batches: list[tuple[tuple[str, int, int], ...]] = []
    twice: list[str] = []
    run = engine.runner.run

    def recording_run(work: list[tuple[Sequence, int]]) -> dict[Sequence, int]:
        batches.append(tuple((seq.request_id, seq.num_computed, n) for seq, n in work))
        if engine.config.prefix_caching:  # a shared block in flight is waited for
            twice.extend(blocks_computed_twice(work, engine.config.block_size))
        return run(work)

    engine.runner.run = recording_run  # type: ignore[method-assign]
    requests = {f"j{k}": Request(f"j{k}", [(3 + i) % VOCAB for i in range(job.shared)]
                                 + [(7 * k + i) % VOCAB  # the smallest pool holds 32 tokens
                                    for i in range(min(job.prompt_len, 31 - job.shared))],
                                 SamplingParams(max_tokens=job.max_tokens, temperature=0.0,
                                                ignore_eos=True),
                                 priority=job.priority, isolate=job.isolate,
                                 cache_salt=job.salt)
                for k, job in enumerate(plan)}
    streamed: dict[str, list[int]] = {rid: [] for rid in requests}
    records: list[tuple[Any, ...]] = []
    last = max(max(job.arrival, job.cancel or 0) for job in plan)
    step = 0
    engine.clock = lambda: float(step)  # priority aging by steps: the same in both engines
    while step <= last or engine.has_unfinished():
        assert step < 2000, "no progress"
        for k, job in enumerate(plan):
            if job.arrival == step:
                engine.add(requests[f"j{k}"])
            if job.cancel == step:
                engine.abort(f"j{k}")
        batches.clear()
        outputs = engine.step()
        for out in outputs:
            streamed[out.request_id] += out.new_token_ids
            if out.preempted:
                engine.add(replace(requests[out.request_id],
                                   output_token_ids=list(streamed[out.request_id])))
        records.append((
            step, tuple(batches), tuple(s.request_id for s in engine.last_schedule.preempted),
            tuple(s.request_id for s in engine.last_schedule.displaced),
            sorted((o.request_id, o.first_index, len(o.new_token_ids), o.finished,
                    str(o.finish_reason), o.preempted, str(o.error)) for o in outputs),
            engine.free_slots(), tuple(sorted(
                (k, v) for k, v in engine.stats().items() if k != "threads"))))  # the runner's
        engine.blocks.check(engine.scheduler.running + engine.scheduler.waiting)
        assert not twice, twice
        step += 1
    assert engine.blocks.num_free == engine.blocks.num_blocks
    return records


def both(tokenizer: Tokenizer, model: DecoderModel, config: EngineConfig
         ) -> tuple[Engine, SimulatedEngine]:
    real = Engine(model, tokenizer, replace(config, model="tiny", max_model_len=64))
    sim = SimulatedEngine(replace(config, max_model_len=64), SimOptions(step_ms=0))
    return real, sim


@settings(max_examples=20, deadline=None,
          suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(plan=st.lists(jobs, min_size=1, max_size=10), config=configs,
       aging=st.sampled_from([0.0, 3.0, 60.0]))
def test_real_and_simulated_engines_schedule_alike(smollm2_tokenizer: Tokenizer,
                                                   model: DecoderModel, plan: list[Job],
                                                   config: EngineConfig, aging: float) -> None:
    real, sim = both(smollm2_tokenizer, model, replace(config, priority_aging_s=aging))
    assert trace(real, plan) == trace(sim, plan)


def test_a_small_pool_preempts_alike_in_both(smollm2_tokenizer: Tokenizer,
                                             model: DecoderModel) -> None:
    """A fixed schedule that is sure to preempt (the property above covers it only by chance)."""
    plan = [Job(k // 3, 10 + 3 * k, 12, k % 2, 9 if k == 4 else None, k == 5, shared=8 * (k % 2))
            for k in range(8)]
    for requeue in (False, True):
        config = EngineConfig(model="sim", num_blocks=12, block_size=4, max_num_seqs=4,
                              max_batched_tokens=16, prefill_chunk=8, requeue_preempted=requeue)
        real, sim = both(smollm2_tokenizer, model, config)
        got = trace(real, plan)
        assert got == trace(sim, plan)
        assert real.num_preemptions == sim.num_preemptions > 0
        assert real.stats()["prefix_cache_hits"] == sim.stats()["prefix_cache_hits"] > 0
        assert any(preempted for _, _, preempted, *_ in got)


def test_the_core_and_the_simulated_engine_do_not_import_torch() -> None:
    import subprocess

    code = ("import sys; import qworker.engine.core, qworker.engine.simulated; "
            "sys.exit('torch' in sys.modules)")
    assert subprocess.run([sys.executable, "-c", code], check=False).returncode == 0
