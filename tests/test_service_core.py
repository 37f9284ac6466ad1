"""The service core on its own: no Redis, no engine. What a step's outputs do to the table of
jobs, what a round trip's reply settles, and what the engine must let go of (cancel, requeue,
a failed step, a job fenced out)."""

from __future__ import annotations

import ast
import importlib.util
from pathlib import Path

import pytest

from qworker.engine.request import StepOutput
from qworker.service import outcome
from qworker.service.core import ServiceCore
from qworker.service.job import ActiveJob, Entry, Readback, Taken
from qworker.service.logs import get_logger
from qworker.service.metrics import Metrics
from qworker_client.protocol import (
    INTERNAL,
    DoneEvent,
    ErrorEvent,
    Job,
    PromptLogprobsEvent,
    TokenEvent,
)

LOG = get_logger(test="core")


def taken(job_id: str, *, tokens: list[int] = (), text: str = "", cancelled: bool = False,
          deliveries: int = 1, **fields: object) -> Taken:
    job = Job.model_validate({"id": job_id, "prompt": "p", **fields})
    readback = Readback(token_ids=list(tokens), text=text)
    return Taken(Entry("qw:jobs", f"1-{job_id}", {}, deliveries=deliveries), job, readback,
                 cancelled=cancelled, t0_ms=1_000, started_ms=1_500)


def running(core: ServiceCore, *ids: str, **fields: object) -> list[ActiveJob]:
    jobs = []
    for job_id in ids:
        t = taken(job_id, **fields)
        job = core.open(t, LOG.bind(job_id=job_id))
        assert not core.end_unstarted(job, t, now_ms=1_600)
        core.started(job, t, "jobs", prompt_tokens=3)
        jobs.append(job)
    return jobs


@pytest.fixture
def core() -> ServiceCore:
    return ServiceCore(Metrics(), lambda token_id: f"<{token_id}>")


def test_a_step_s_tokens_and_end_go_to_the_outbox(core: ServiceCore) -> None:
    (job,) = running(core, "a")
    core.apply([StepOutput("a", [7, 8], "xy", first_index=0)])
    core.apply([StepOutput("a", [9], "z", first_index=2, finished=True, finish_reason="stop",
                           num_prompt_tokens=4)])
    assert [(e.i, e.token_id, e.text) for e in job.outbox if isinstance(e, TokenEvent)] == [
        (0, 7, ""), (1, 8, "xy"), (2, 9, "z")]  # a step's text goes with its last token
    done = job.outbox[-1]
    assert isinstance(done, DoneEvent) and (done.finish_reason, done.text) == ("stop", "xyz")
    assert (done.prompt_tokens, done.completion_tokens) == (4, 3)
    assert not job.in_engine and core.running() == []


def test_a_resumed_job_continues_after_what_its_stream_shows(core: ServiceCore) -> None:
    (job,) = running(core, "r", tokens=[1, 2], text="ab")
    core.apply([StepOutput("r", [3], "c", first_index=2, finished=True, finish_reason="length")])
    assert [e.i for e in job.outbox if isinstance(e, TokenEvent)] == [2]
    done = job.outbox[-1]
    assert isinstance(done, DoneEvent) and (done.text, done.completion_tokens) == ("abc", 3)


def test_logprobs_text_only_for_the_jobs_that_ask(core: ServiceCore) -> None:
    from qworker.engine.request import TokenLogprobs

    plain, texted = running(core, "plain"), running(core, "texted", logprobs_text=True,
                                                    logprobs=1, prompt_logprobs=0)
    lp = [TokenLogprobs(5, -0.5, ((5, -0.5),))]
    core.apply([StepOutput("plain", [5], "", logprobs=lp),
                StepOutput("texted", [5], "", logprobs=lp, prompt_logprobs=lp)])
    first = texted[0].outbox[0]
    assert isinstance(first, PromptLogprobsEvent) and first.prompt_logprobs[0].token == "<5>"
    (token,) = [e for e in texted[0].outbox if isinstance(e, TokenEvent)]
    assert token.token == "<5>" and token.logprob == -0.5
    assert [e.token for e in plain[0].outbox if isinstance(e, TokenEvent)] == [None]


@pytest.mark.internal_errors_expected  # on purpose: a step's failure is the point
def test_a_preempted_job_is_requeued_and_a_failed_one_fails_alone(core: ServiceCore) -> None:
    pre, bad, fine = running(core, "pre", "bad", "fine")
    core.apply([StepOutput("pre", [], preempted=True),
                StepOutput("bad", [], finished=True, error="RuntimeError: x"),
                StepOutput("fine", [4], "d")])
    assert pre.requeue and not pre.outbox
    error = bad.outbox[-1]
    assert isinstance(error, ErrorEvent) and error.code == INTERNAL
    assert "RuntimeError" in error.message
    assert core.running() == ["fine"]
    assert core.metrics.registry.get_sample_value("qworker_internal_errors_total") == 1
    assert core.metrics.registry.get_sample_value("qworker_preemptions_total") == 1


def test_outputs_for_jobs_the_core_let_go_are_ignored(core: ServiceCore) -> None:
    (job,) = running(core, "c")
    assert core.cancel(["c", "unknown"]) == ["c"]
    core.apply([StepOutput("c", [1], "late"), StepOutput("stranger", [1], "x")])
    assert len(job.outbox) == 1 and isinstance(job.outbox[0], DoneEvent)
    assert job.outbox[0].finish_reason == "cancelled"
    assert core.cancel(["c"]) == []  # already ended: nothing for the engine to let go


def test_a_job_that_need_not_run_ends_at_once(core: ServiceCore) -> None:
    for t, reason in ((taken("cx", cancelled=True), "cancelled"),
                      (taken("full", tokens=[1, 2], text="ab", max_tokens=2), "length")):
        job = core.open(t, LOG)
        assert core.end_unstarted(job, t, now_ms=2_000)
        done = job.outbox[-1]
        assert isinstance(done, DoneEvent) and done.finish_reason == reason
    assert core.running() == [] and set(core.jobs) == {"cx", "full"}


def test_a_round_trip_removes_only_what_it_wrote(core: ServiceCore) -> None:
    (job,) = running(core, "a")
    core.apply([StepOutput("a", [1, 2], "ab")])
    (copy,) = core.outgoing()
    core.apply([StepOutput("a", [3], "c", first_index=2)])  # while the round trip runs
    assert len(copy.outbox) == 2 and len(job.outbox) == 3
    settled = core.settle({"a": outcome.OK}, {}, {"a": len(copy.outbox)})
    assert settled.abort == [] and settled.rejects == [] and settled.ended == []
    assert [e.i for e in job.outbox if isinstance(e, TokenEvent)] == [2]


def test_settling_drops_each_job_as_redis_says(core: ServiceCore) -> None:
    done, fenced, lost, refused, requeued = running(core, "done", "fenced", "lost", "refused",
                                                    "requeued")
    core.apply([StepOutput("done", [1], "a", finished=True, finish_reason="stop")])
    core.apply([StepOutput("requeued", [], preempted=True)])
    sent = {job_id: len(job.outbox) for job_id, job in core.jobs.items()}
    settled = core.settle({"done": outcome.DONE, "fenced": outcome.FENCED,
                           "lost": outcome.LOST_STATE, "refused": outcome.FAILED,
                           "requeued": outcome.REQUEUED},
                          {"refused": "WRONGTYPE"}, sent)
    assert core.jobs == {}
    assert sorted(settled.abort) == ["fenced", "lost", "refused"]  # the engine still ran them
    assert settled.ended == [done]
    (reject,) = settled.rejects
    assert (reject.job_id, reject.code, reject.drop_owner) == ("refused", INTERNAL, True)
    assert "WRONGTYPE" in reject.message and reject.entry is refused.entry
    value = core.metrics.registry.get_sample_value
    assert value("qworker_jobs_fenced_total") == 1
    assert value("qworker_jobs_failed_total", {"code": "lost_state"}) == 1
    assert value("qworker_jobs_finished_total", {"finish_reason": "stop"}) == 1
    assert value("qworker_jobs_in_flight") == 0


@pytest.mark.internal_errors_expected
def test_a_failed_step_fails_every_job_it_held(core: ServiceCore) -> None:
    a, b = running(core, "a", "b")
    core.apply([StepOutput("a", [1], "x", finished=True, finish_reason="stop")])
    assert core.step_failed(RuntimeError("boom")) == ["b"]
    error = b.outbox[-1]
    assert isinstance(error, ErrorEvent) and "RuntimeError: boom" in error.message
    assert isinstance(a.outbox[-1], DoneEvent)


def test_a_stop_that_cannot_wait_requeues_what_runs(core: ServiceCore) -> None:
    a, b = running(core, "a", "b")
    core.apply([StepOutput("a", [1], "x", finished=True, finish_reason="stop")])
    assert core.requeue_all() == ["b"]
    assert b.requeue and not a.requeue
    assert core.requeue_all() == []
    assert [j.job_id for j in core.outgoing()] == ["a", "b"]  # a's done, b's requeue


def _imports(module: str) -> set[str]:
    """The modules `module`'s source imports (`from package import module` counts the module)."""
    spec = importlib.util.find_spec(module)
    assert spec is not None and spec.origin is not None
    found: set[str] = set()
    for node in ast.walk(ast.parse(Path(spec.origin).read_text(encoding="utf-8"))):
        if isinstance(node, ast.Import):
            found |= {alias.name for alias in node.names}
        elif isinstance(node, ast.ImportFrom) and node.module:
            found.add(node.module)
            if node.module.startswith("qworker."):
                found |= {f"{node.module}.{a.name}" for a in node.names
                          if _is_module(f"{node.module}.{a.name}")}
    return found


def _is_module(name: str) -> bool:
    try:
        return importlib.util.find_spec(name) is not None
    except ModuleNotFoundError:
        return False


def test_the_core_knows_neither_redis_nor_the_engine() -> None:
    """Of the worker's own modules the core reaches, none imports redis, and of the engine only
    its request types (what it is told of a step)."""
    todo, reached = ["qworker.service.core"], set()
    while todo:
        module = todo.pop()
        if module in reached:
            continue
        reached.add(module)
        imports = _imports(module)
        assert not any(m == "redis" or m.startswith("redis.") for m in imports), module
        todo += [m for m in imports if m.startswith("qworker.") and _is_module(m)]
    assert {m for m in reached if m.startswith("qworker.engine")} == {"qworker.engine.request"}
    assert {"qworker.service.job", "qworker.service.outcome"} <= reached


def test_a_job_past_its_run_time_ends_timeout(core: ServiceCore) -> None:
    limited, free = running(core, "limited", "free", timeout_ms=500)[0], running(core, "free")[0]
    core.apply([StepOutput("limited", [1, 2], "ab"), StepOutput("free", [1], "a")])
    assert core.time_out(now_ms=1_999) == []  # started at 1,500: its limit is 2,000
    assert core.time_out(now_ms=2_000) == ["limited"]
    done = limited.outbox[-1]
    assert isinstance(done, DoneEvent) and done.finish_reason == "timeout"
    assert (done.text, done.completion_tokens) == ("ab", 2)  # its text so far
    assert core.time_out(now_ms=10_000) == [] and free.in_engine


def test_a_job_resumed_after_its_run_time_ends_at_once(core: ServiceCore) -> None:
    t = taken("resumed", tokens=[1], text="a", timeout_ms=100)  # first started at 1,500
    job = core.open(t, LOG)
    assert core.end_unstarted(job, t, now_ms=1_600)
    done = job.outbox[-1]
    assert isinstance(done, DoneEvent) and (done.finish_reason, done.text) == ("timeout", "a")
