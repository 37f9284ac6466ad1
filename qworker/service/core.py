"""The service core: the table of the jobs a worker holds, and every rule about them that needs
neither Redis nor the engine (as the engine core holds the engine's rules without a model).

The loop (worker.py) tells it what happened: a job taken and started, an engine step's outputs,
a round trip's reply, cancel flags, a stop. It answers with what the loop must carry out: the job
ids the engine must let go of (`engine.abort`), the rejects to dead-letter, the jobs whose end is
written. Everything the next round trip writes (each job's outbox, its requeue) is in `jobs`.

A job leaves the table only when a round trip has settled it (its terminal event or its requeue
written, or Redis says it is no longer ours): until then its entry stays owned and pending.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field, replace
from typing import Any

from qworker.engine.request import StepOutput
from qworker.service import outcome
from qworker.service.job import ActiveJob, Reject, Taken
from qworker.service.logprobs import TokenText, wire_logprobs
from qworker.service.metrics import Metrics
from qworker_client.protocol import INTERNAL, LOST_STATE, DoneEvent, ErrorEvent, FinishReason


@dataclass
class Settled:
    """What a round trip's reply asks of the loop."""

    abort: list[str] = field(default_factory=list)  # job ids the engine must let go of
    rejects: list[Reject] = field(default_factory=list)  # Redis refused their keys: dead-letter
    ended: list[ActiveJob] = field(default_factory=list)  # terminal event in Redis (on_done)


class ServiceCore:
    def __init__(self, metrics: Metrics, token_text: TokenText) -> None:
        self.metrics = metrics
        self.token_text = token_text  # a token's own text, for jobs with logprobs_text
        self.jobs: dict[str, ActiveJob] = {}

    def running(self) -> list[str]:
        """The jobs in the engine (not finished, not to be requeued)."""
        return [job.job_id for job in self.jobs.values() if job.in_engine]

    # ------------------------------------------------------------------ taking a job

    def open(self, t: Taken, log: Any) -> ActiveJob:
        """A taken job, continuing after what its output stream already shows."""
        job = ActiveJob(t.job, t.entry, log, t0_ms=t.t0_ms, started_ms=t.started_ms,
                        next_index=len(t.readback.token_ids), text=t.readback.text,
                        reasoning=t.readback.reasoning,
                        first_token_ms=t.readback.first_token_ms)
        if not t.readback.consistent:
            log.warning("output stream is not a clean 0..n-1 token prefix; continuing after it",
                        tokens=job.next_index)
        return job

    def end_unstarted(self, job: ActiveJob, t: Taken, now_ms: int) -> bool:
        """A job that need not run (cancelled, already at max_tokens, out of run time: resumed
        after its `timeout_ms`) ends at once: held until its `done` is written. False: it is to
        run."""
        reason: FinishReason | None = (
            "cancelled" if t.cancelled else "length" if job.next_index >= t.job.max_tokens
            else "timeout" if job.out_of_time(now_ms) else None)
        if reason is None:
            return False
        self.jobs[job.job_id] = job
        job.finish(reason, job.next_index)
        return True

    def started(self, job: ActiveJob, t: Taken, source: str, prompt_tokens: int) -> None:
        """A job the engine has taken (`source`: jobs, requeue or reclaimed)."""
        job.prompt_tokens = prompt_tokens
        self.jobs[job.job_id] = job
        self.metrics.jobs_started.labels(source).inc()
        self.metrics.resumed_tokens.inc(job.next_index)
        self.metrics.prompt_tokens.inc(prompt_tokens)
        job.log.info("started", source=source, resume_at=job.next_index,
                     prompt_tokens=prompt_tokens, deliveries=t.entry.deliveries,
                     crashes=t.crashes, excused=t.excused)

    # ------------------------------------------------------------------ an engine step

    def apply(self, outputs: Iterable[StepOutput]) -> None:
        """A step's outputs into each job's outbox (a job the engine no longer runs for us, e.g.
        cancelled meanwhile, takes nothing)."""
        for out in outputs:
            job = self.jobs.get(out.request_id)
            if job is None or not job.in_engine:
                continue
            if out.error is not None:  # failed inside a step; the engine has let it go
                self.fail(job, INTERNAL, f"failed in an engine step: {out.error}")
            elif out.preempted:
                job.requeue = True
                self.metrics.preemptions.inc()
                self.metrics.requeues.labels("preempted").inc()
                job.log.info("preempted, requeueing", tokens=job.next_index)
            else:
                self._add_output(job, out)

    def _add_output(self, job: ActiveJob, out: StepOutput) -> None:
        if out.text_delta and not out.new_token_ids:
            job.log.warning("engine gave text without a token; dropped", chars=len(out.text_delta))
        text = self.token_text if job.job.logprobs_text else None
        if out.prompt_logprobs is not None:
            job.add_prompt_logprobs(wire_logprobs(out.prompt_logprobs, text))
        job.add_tokens(out.first_index, out.new_token_ids, out.text_delta,
                       wire_logprobs(out.logprobs, text) if out.logprobs else None,
                       out.reasoning_delta, out.tool_call_deltas)
        self.metrics.tokens.inc(len(out.new_token_ids))
        if out.finished:
            job.prompt_tokens = out.num_prompt_tokens or job.prompt_tokens
            job.tool_calls = out.tool_calls
            job.finish(out.finish_reason or "stop", out.first_index + len(out.new_token_ids))

    def step_failed(self, exc: Exception) -> list[str]:
        """engine.step() raised outside any one request: the jobs it held fail (each gets its
        error event); the engine must let go of every one (returned)."""
        failed = self.running()
        for job_id in failed:
            self.fail(self.jobs[job_id], INTERNAL,
                      f"the engine step failed: {type(exc).__name__}: {exc}")
        return failed

    def fail(self, job: ActiveJob, code: str, message: str) -> None:
        """End a running job with an error event (published like `done`, then acked)."""
        job.outbox.append(ErrorEvent(code=code, message=message[:1000]))
        job.finished = True
        job.log.warning("job failed", code=code, reason=message[:200])
        if code == INTERNAL:  # an engine that fails valid jobs: an operator must hear of it
            self.metrics.internal_errors.inc()
            if self.metrics.registry.get_sample_value("qworker_internal_errors_total") == 1:
                job.log.error("the engine failed a valid job", first_cause=message[:1000])

    # ------------------------------------------------------------------ asked from outside

    def cancel(self, job_ids: Iterable[str]) -> list[str]:
        """Jobs whose cancel flag is set end `cancelled` with what they showed; returned: those
        the engine must let go of."""
        aborted = []
        for job_id in job_ids:
            job = self.jobs.get(job_id)
            if job is not None and job.in_engine:
                job.finish("cancelled", job.next_index)
                job.log.info("cancelled", tokens=job.next_index)
                aborted.append(job_id)
        return aborted

    def time_out(self, now_ms: int) -> list[str]:
        """Running jobs past their run-time limit end `timeout` with their text so far; returned:
        the engine must let go of them."""
        ended = [job_id for job_id in self.running() if self.jobs[job_id].out_of_time(now_ms)]
        for job_id in ended:
            job = self.jobs[job_id]
            job.finish("timeout", job.next_index)
            job.log.info("timed out", tokens=job.next_index, timeout_ms=job.job.timeout_ms)
        return ended

    def requeue_all(self) -> list[str]:
        """A stop that cannot wait: every running job goes back to its queue (returned: the
        engine must let go of them)."""
        requeued = self.running()
        for job_id in requeued:
            job = self.jobs[job_id]
            self.requeue(job, "shutdown")
            job.log.info("requeued at shutdown", tokens=job.next_index)
        return requeued

    def requeue(self, job: ActiveJob, reason: str) -> None:
        """A running job goes back to its queue (the caller has the engine let go of it)."""
        job.requeue = True
        self.metrics.requeues.labels(reason).inc()

    # ------------------------------------------------------------------ a round trip

    def outgoing(self) -> list[ActiveJob]:
        """What the next round trip writes: the jobs with events or a requeue, each with a copy
        of its outbox (the loop goes on adding to the job's own while the round trip runs)."""
        return [replace(job, outbox=list(job.outbox)) for job in self.jobs.values()
                if job.outbox or job.requeue]

    def settle(self, status: Mapping[str, str], errors: Mapping[str, str],
               sent: Mapping[str, int]) -> Settled:
        """A round trip's reply: per job its status (`outcome`), Redis' error for the failed,
        and how many events of its outbox that round trip wrote."""
        settled = Settled()
        for job_id, code in status.items():
            job = self.jobs[job_id]  # only a settle removes jobs: it is still here
            if code == outcome.OK:
                del job.outbox[:sent[job_id]]  # what came since goes with the next round trip
                continue
            if code == outcome.FAILED:
                settled.rejects.append(self._refused(job, errors[job_id]))
            else:
                self._dropped(job, code, settled)
            if job.in_engine:
                settled.abort.append(job_id)
            del self.jobs[job_id]
        self.metrics.running.set(len(self.jobs))
        return settled

    def _dropped(self, job: ActiveJob, code: str, settled: Settled) -> None:
        if code in (outcome.DONE, outcome.TERMINAL):
            settled.ended.append(job)
        if code == outcome.DONE:
            self._record_end(job)
        elif code == outcome.REQUEUED:
            job.log.info("requeued", tokens=job.next_index)
        elif code == outcome.LOST_STATE:
            self.metrics.jobs_failed.labels(LOST_STATE).inc()
            job.log.warning("job state vanished from Redis, ended with lost_state")
        elif code == outcome.FENCED:
            self.metrics.fenced.inc()
            job.log.warning("fenced out: another worker owns the job", tokens=job.next_index)
        else:
            job.log.warning("dropping job", status=code)

    def _refused(self, job: ActiveJob, error: str) -> Reject:
        """Redis refused a write to this job's keys: the job fails alone (dead letter, and an
        error event where its stream can take one)."""
        self.metrics.redis_job_errors.inc()
        return Reject(job.entry, INTERNAL, f"Redis refused this job's keys: {error}",
                      job.job_id, drop_owner=True, job=job.job)

    def _record_end(self, job: ActiveJob) -> None:
        last = job.outbox[-1]
        if isinstance(last, DoneEvent):
            self.metrics.jobs_finished.labels(last.finish_reason).inc()
            self.metrics.queue_seconds.observe(last.queue_ms / 1000)
            self.metrics.ttft_seconds.observe(last.ttft_ms / 1000)
            self.metrics.total_seconds.observe(last.total_ms / 1000)
            job.log.info("done", finish_reason=last.finish_reason,
                         completion_tokens=last.completion_tokens, total_ms=last.total_ms)
        elif isinstance(last, ErrorEvent):
            self.metrics.jobs_failed.labels(last.code).inc()
            job.log.info("failed", code=last.code)
