"""A failing step costs only the requests that fail it, and a job that may have crashed its
process runs alone until it has produced a token: the engine (tiny random model, float64, greedy)
and the worker around the simulated engine."""

from __future__ import annotations

import random
from collections.abc import Callable

import pytest
import redis
from structlog.testing import capture_logs

from qworker.engine.config import EngineConfig
from qworker.engine.engine import Engine
from qworker.engine.request import Request, SamplingParams, StepOutput
from qworker.engine.sequence import Sequence
from qworker.engine.simulated import SimulatedEngine
from qworker.model.decoder import DecoderModel
from qworker.model.tokenizer.tokenizer import Tokenizer
from qworker_client.protocol import DoneEvent, ErrorEvent
from tests.engine_fixtures import tiny_engine, tiny_model
from tests.service_harness import (
    KEYS,
    check_stream,
    group_pending,
    sim_engine,
    submit,
    thread_worker,
    wait_for,
    wait_terminal,
)

GREEDY = SamplingParams(max_tokens=10, temperature=0.0, ignore_eos=True)
TEXTS = ["The sky", "Seven small owls", "A river runs", "Bread and", "Chess is a game of",
         "Rain", "Clocks tick in the old hall"]


@pytest.fixture(scope="module")
def model(smollm2_tokenizer: Tokenizer) -> DecoderModel:
    return tiny_model(smollm2_tokenizer.vocab_size)


def requests(tokenizer: Tokenizer, isolate: str | None = None) -> list[Request]:
    return [Request(f"r{k}", tokenizer.encode(text), GREEDY, isolate=f"r{k}" == isolate)
            for k, text in enumerate(TEXTS)]


def run(engine: Engine, reqs: list[Request],
        watch: Callable[[Engine], None] | None = None) -> dict[str, list[StepOutput]]:
    for r in reqs:
        engine.add(r)
    return drain(engine, [r.request_id for r in reqs], watch)


def drain(engine: Engine, request_ids: list[str],
          watch: Callable[[Engine], None] | None = None) -> dict[str, list[StepOutput]]:
    outputs: dict[str, list[StepOutput]] = {rid: [] for rid in request_ids}
    while engine.has_unfinished():
        for out in engine.step():
            outputs[out.request_id].append(out)
        if watch is not None:
            watch(engine)
        engine.blocks.check(engine.scheduler.running + engine.scheduler.waiting)
    assert engine.blocks.num_free == engine.blocks.num_blocks
    return outputs


def ids(outputs: list[StepOutput]) -> list[int]:
    return [t for out in outputs for t in out.new_token_ids]


def clean_run(tokenizer: Tokenizer, model: DecoderModel) -> dict[str, list[int]]:
    return {rid: ids(outs) for rid, outs in run(tiny_engine(tokenizer, model),
                                                requests(tokenizer)).items()}


def failing_runner(engine: Engine, fails: Callable[[Sequence], bool],
                   exc: Exception) -> list[tuple[list[str], bool]]:
    """The runner raises for any step that holds a sequence `fails` picks; returns the calls
    (request ids, whether it raised)."""
    real_run = engine.runner.run
    calls: list[tuple[list[str], bool]] = []

    def run_step(work: list[tuple[Sequence, int]]) -> dict[Sequence, int]:
        raises = any(fails(seq) for seq, _ in work)
        calls.append(([seq.request_id for seq, _ in work], raises))
        if raises:
            raise exc
        return real_run(work)

    engine.runner.run = run_step  # type: ignore[method-assign]
    return calls


def test_a_request_that_fails_mid_run_costs_only_itself(smollm2_tokenizer: Tokenizer,
                                                        model: DecoderModel) -> None:
    want = clean_run(smollm2_tokenizer, model)
    engine = tiny_engine(smollm2_tokenizer, model)
    calls = failing_runner(engine, lambda s: s.request_id == "r3" and s.num_output_tokens >= 4,
                           RuntimeError("boom in the sampler"))
    got = run(engine, requests(smollm2_tokenizer))
    *tokens, last = got["r3"]
    assert ids(tokens) == want["r3"][:4]  # what it streamed before is its own, unchanged
    assert last.finished and last.finish_reason is None and not last.new_token_ids
    assert last.error == "RuntimeError: boom in the sampler" and last.first_index == 4
    for rid, outs in got.items():
        if rid != "r3":
            assert ids(outs) == want[rid] and outs[-1].finished and outs[-1].error is None, rid
    first = next(i for i, (_, raised) in enumerate(calls) if raised)
    assert len(calls[first][0]) == 7
    assert calls[first + 1:first + 7] == [  # halving: six runs for seven sequences
        (["r0", "r1", "r2"], False), (["r3", "r4", "r5", "r6"], True), (["r3", "r4"], True),
        (["r3"], True), (["r4"], False), (["r5", "r6"], False)]
    assert sum(raised for _, raised in calls) == 4  # the step, a half, a quarter, r3 alone


def test_real_out_of_vocabulary_fault_is_found_and_the_others_finish(
        smollm2_tokenizer: Tokenizer, model: DecoderModel) -> None:
    """A token id past the embedding (slipped past the front door) raises IndexError in the
    embedding lookup itself: two such culprits in one batch, both found, nothing else lost."""
    want = clean_run(smollm2_tokenizer, model)
    engine = tiny_engine(smollm2_tokenizer, model)
    reqs = requests(smollm2_tokenizer)
    for r in reqs:
        engine.add(r)
    for rid in ("r1", "r5"):
        engine._seqs[rid].token_ids[0] = engine.limits.vocab_size + 7
    outputs = drain(engine, [r.request_id for r in reqs])
    for rid in ("r1", "r5"):
        assert len(outputs[rid]) == 1 and outputs[rid][0].error, rid
        assert outputs[rid][0].error.startswith("IndexError"), outputs[rid][0].error
    for rid, outs in outputs.items():
        if rid not in ("r1", "r5"):
            assert ids(outs) == want[rid], rid


def test_no_failure_costs_nothing_extra(smollm2_tokenizer: Tokenizer, model: DecoderModel) -> None:
    engine = tiny_engine(smollm2_tokenizer, model)
    calls = failing_runner(engine, lambda s: False, RuntimeError())
    run(engine, requests(smollm2_tokenizer))
    assert len(calls) == engine.num_steps  # one forward per step, no re-runs


def test_a_step_that_always_fails_fails_each_request_once(smollm2_tokenizer: Tokenizer,
                                                          model: DecoderModel) -> None:
    engine = tiny_engine(smollm2_tokenizer, model)
    failing_runner(engine, lambda s: True, MemoryError("no memory"))
    got = run(engine, requests(smollm2_tokenizer))
    assert all(len(outs) == 1 and outs[0].error == "MemoryError: no memory"
               for outs in got.values())


def test_an_isolated_request_runs_alone_until_its_first_token(smollm2_tokenizer: Tokenizer,
                                                               model: DecoderModel) -> None:
    want = clean_run(smollm2_tokenizer, model)
    engine = tiny_engine(smollm2_tokenizer, model, prefill_chunk=2)  # r6: 4 chunks, each alone
    reqs = requests(smollm2_tokenizer, isolate="r6")
    alone: list[int] = []

    def watch(e: Engine) -> None:
        work = e.last_schedule.work
        if any(seq.request_id == "r6" for seq, _ in work):
            alone.append(len(work))

    got = run(engine, reqs, watch)
    prompt = len(reqs[6].prompt_token_ids)
    chunks = -(-prompt // 2)
    assert alone[:chunks] == [1] * chunks  # its prefill: steps of its own
    assert max(alone[chunks:]) > 1  # then it shares steps like any other
    assert {rid: ids(outs) for rid, outs in got.items()} == want


def test_isolation_under_random_arrivals_keeps_its_invariant(smollm2_tokenizer: Tokenizer,
                                                            model: DecoderModel) -> None:
    """Random prompts, some isolated, a small cache (preemption): the scheduler's assertion holds
    every step, every request finishes and no block leaks (the model is stubbed out)."""
    rng = random.Random(7)
    engine = tiny_engine(smollm2_tokenizer, model, num_blocks=24, block_size=4, max_num_seqs=4,
                         max_batched_tokens=16, prefill_chunk=8)
    engine.runner.run = lambda work: {  # type: ignore[method-assign]
        seq: 100 for seq, n in work if seq.num_computed + n == len(seq.token_ids)}
    reqs = [Request(f"q{k}", [7] * rng.randint(1, 30), SamplingParams(max_tokens=rng.randint(1, 12),
                                                                     ignore_eos=True),
                    isolate=rng.random() < 0.3) for k in range(40)]

    def watch(e: Engine) -> None:
        work = e.last_schedule.work
        assert len(work) == 1 or not any(seq.isolate for seq, _ in work)

    got = run(engine, reqs, watch)
    assert all(outs and outs[-1].finished for outs in got.values())


def test_simulated_engine_isolates_the_same_way() -> None:
    engine = SimulatedEngine.from_config(EngineConfig(model="sim:step_ms=0", prefill_chunk=4))
    for k in range(3):
        engine.add(Request(f"s{k}", list(b"a normal prompt"), SamplingParams(max_tokens=6)))
    engine.add(Request("iso", list(b"twelve bytes"), SamplingParams(max_tokens=6), isolate=True))
    steps: list[list[str]] = []
    while engine.has_unfinished():
        engine.step()
        steps.append([seq.request_id for seq, _ in engine.last_schedule.work])
    with_iso = [s for s in steps if "iso" in s]
    assert with_iso[:3] == [["iso"]] * 3  # 12 bytes in chunks of 4, alone
    assert any(len(s) > 1 for s in with_iso[3:])


# ---------------------------------------------------------------------------- the worker


@pytest.mark.internal_errors_expected
def test_worker_publishes_a_step_failure_as_internal_and_goes_on(redis_url: str) -> None:
    client = redis.Redis.from_url(redis_url)
    engine = sim_engine("sim:step_ms=1")
    real_step = engine.step

    def step() -> list[StepOutput]:
        outputs = real_step()
        for out in outputs:
            if out.request_id == "culprit" and out.first_index >= 2 and not out.finished:
                engine.abort("culprit")  # as the real engine does: it lets the culprit go
                return [o for o in outputs if o is not out] + [StepOutput(
                    "culprit", [], first_index=out.first_index, finished=True,
                    error="IndexError: index out of range in self")]
        return outputs

    engine.step = step  # type: ignore[method-assign]
    with thread_worker(redis_url, "w", engine) as w:
        for job_id in ("a", "culprit", "b"):
            submit(client, job_id, prompt=f"hello {job_id}", max_tokens=8)
        got = wait_terminal(client, ["a", "culprit", "b"])
        assert w.thread.is_alive()
        assert w.stop() == 0
    assert isinstance(got["culprit"], ErrorEvent) and got["culprit"].code == "internal"
    assert "IndexError: index out of range" in got["culprit"].message
    assert client.xlen(KEYS.out("culprit")) == 3  # tokens 0 and 1, then the error
    for job_id in ("a", "b"):
        assert check_stream(client, job_id).completion_tokens == 8
    assert group_pending(client) == 0


@pytest.mark.internal_errors_expected
def test_worker_survives_an_engine_step_that_raises(redis_url: str) -> None:
    client = redis.Redis.from_url(redis_url)
    engine = sim_engine("sim:step_ms=1")
    real_step = engine.step
    raised: list[bool] = []

    def step() -> list[StepOutput]:
        if not raised and engine.has_unfinished():
            raised.append(True)
            raise AssertionError("an isolated sequence shares a step")
        return real_step()

    engine.step = step  # type: ignore[method-assign]
    with thread_worker(redis_url, "w", engine) as w:
        submit(client, "first", prompt="hello", max_tokens=4)
        first = wait_terminal(client, ["first"])["first"]
        submit(client, "after", prompt="hello again", max_tokens=4)
        after = wait_terminal(client, ["after"])["after"]
        assert w.thread.is_alive()
        assert w.stop() == 0
    assert isinstance(first, ErrorEvent) and first.code == "internal"
    assert "AssertionError: an isolated sequence shares a step" in first.message
    assert isinstance(after, DoneEvent)
    assert not engine.has_unfinished() and group_pending(client) == 0


@pytest.mark.internal_errors_expected
def test_a_worker_whose_engine_fails_valid_jobs_says_so_loudly(redis_url: str) -> None:
    """Each such failure counted (qworker_internal_errors_total); the first cause logged once,
    as an error, where the warnings of each failed job are easily missed."""
    client = redis.Redis.from_url(redis_url)
    engine = sim_engine("sim:step_ms=1")
    real_step = engine.step

    def step() -> list[StepOutput]:
        outputs = real_step()
        failed = [StepOutput(out.request_id, [], first_index=out.first_index, finished=True,
                             error=f"RuntimeError: broken {out.request_id}")
                  for out in outputs if out.request_id.startswith("bad")]
        for out in failed:
            engine.abort(out.request_id)
        return [out for out in outputs if not out.request_id.startswith("bad")] + failed

    engine.step = step  # type: ignore[method-assign]
    with capture_logs() as logs, thread_worker(redis_url, "w", engine) as w:
        for job_id in ("bad-1", "ok", "bad-2"):
            submit(client, job_id, prompt=f"hello {job_id}", max_tokens=4)
        got = wait_terminal(client, ["bad-1", "ok", "bad-2"])
        assert w.stop() == 0
    assert isinstance(got["ok"], DoneEvent)
    assert w.worker.metrics.registry.get_sample_value("qworker_internal_errors_total") == 2
    loud = [e for e in logs if e["log_level"] == "error"]
    assert [e["event"] for e in loud] == ["the engine failed a valid job"], loud
    assert loud[0]["first_cause"].startswith("failed in an engine step: RuntimeError: broken bad-")


def test_worker_isolates_a_reclaimed_entry_and_not_a_fresh_one(redis_url: str) -> None:
    client = redis.Redis.from_url(redis_url)
    client.xgroup_create(KEYS.jobs, "workers", id="0", mkstream=True)
    submit(client, "orphan", prompt="left by a dead worker", max_tokens=4)
    client.xreadgroup("workers", "dead-worker", {KEYS.jobs: ">"}, count=1)  # then it died
    engine = sim_engine("sim:step_ms=1")
    added: dict[str, bool] = {}
    real_add = engine.add

    def add(request: Request) -> None:
        added[request.request_id] = request.isolate
        real_add(request)

    engine.add = add  # type: ignore[method-assign]
    with thread_worker(redis_url, "w", engine, claim_idle_ms=200) as w:
        submit(client, "fresh", prompt="new work", max_tokens=4)
        wait_terminal(client, ["orphan", "fresh"])
        wait_for(lambda: group_pending(client) == 0, what="acks")
        assert w.stop() == 0
    assert added == {"orphan": True, "fresh": False}
    assert check_stream(client, "orphan").completion_tokens == 4


def test_an_isolated_prompt_waits_for_room_and_nobody_starves(smollm2_tokenizer: Tokenizer,
                                                              model: DecoderModel) -> None:
    """A cache too small for everyone: the isolated request starts only once its whole prompt
    has room (so it never preempts itself between its chunks), and everyone finishes."""
    # no prefix cache: the prompts repeat one token, and iso would find a's blocks cached
    engine = tiny_engine(smollm2_tokenizer, model, num_blocks=8, block_size=4, max_num_seqs=4,
                         max_batched_tokens=16, prefill_chunk=4, prefix_caching=False)
    engine.runner.run = lambda work: {  # type: ignore[method-assign]
        seq: 100 for seq, n in work if seq.num_computed + n == len(seq.token_ids)}
    params = SamplingParams(max_tokens=12, ignore_eos=True)
    for rid in ("a", "b"):
        engine.add(Request(rid, [7] * 8, params))
    for _ in range(4):  # a and b hold 6 of the 8 blocks: room for a chunk of iso, not its prompt
        engine.step()
    engine.add(Request("iso", [7] * 16, params, isolate=True))
    iso = engine._seqs["iso"]
    finished: set[str] = set()
    alone: list[int] = []
    for _ in range(500):
        if not engine.has_unfinished():
            break
        isolated = iso.isolate
        finished |= {out.request_id for out in engine.step() if out.finished}
        work = engine.last_schedule.work
        if isolated and any(seq is iso for seq, _ in work):
            alone.append(len(work))
    assert finished == {"a", "b", "iso"}, "a request starved"
    assert alone == [1, 1, 1, 1]  # four chunks of its prompt, each alone, none repeated


def test_generate_reports_the_failed_one_and_completes_the_rest(smollm2_tokenizer: Tokenizer,
                                                                model: DecoderModel) -> None:
    want = clean_run(smollm2_tokenizer, model)
    engine = tiny_engine(smollm2_tokenizer, model)
    failing_runner(engine, lambda s: s.request_id == "generate-2", ValueError("bad row"))
    done = engine.generate(TEXTS, GREEDY)
    assert done[2].error == "ValueError: bad row" and done[2].finish_reason == ""
    for k, c in enumerate(done):
        if k != 2:
            assert c.error is None and c.token_ids == want[f"r{k}"], k
