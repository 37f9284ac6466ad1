"""The worker loop: engine.step -> settle the last round trip -> intake -> the next round trip.

A turn's Redis round trip (every outbox, requeues, the cancel flags of running jobs and, while the
engine runs, the new entries it has room for) runs on a thread of its own beside the next engine
step, and is settled after it (at once when the engine has nothing to run): the engine does not
wait on Redis. That thread sees copies of the outboxes only; the engine and the in-flight table
are touched only by the loop's thread. The heartbeat runs in a thread of its own (see
heartbeat.py), fed a snapshot of the in-flight entries each turn.
`request_stop()` (from a signal handler or another thread) starts a drain; a second call requeues
at once. Redis errors (connection lost, restart, failover) back off and retry while the engine
keeps stepping: events wait in each job's outbox, nothing else is lost since every job stays
pending in the group until its terminal event or its requeue is written. An error reply about one
job's keys fails that job alone; one that means the worker cannot work at all ends `run` with
exit code 2 (see errors.py).
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import os
import re
import socket
import time
import uuid
from collections.abc import Callable, Sequence
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass, replace
from typing import Any, Protocol

import redis
from redis.backoff import NoBackoff
from redis.retry import Retry

from qworker.engine.request import (
    Request,
    RequestRejectedError,
    SamplingParams,
    StepOutput,
    StructuredOutputs,
)
from qworker.service import publisher as pub
from qworker.service.backoff import Backoff
from qworker.service.config import ServiceConfig
from qworker.service.errors import (
    EXIT_CODE,
    REDIS_DOWN,
    CannotWork,
    cannot_work,
    is_group_gone,
    is_transient,
)
from qworker.service.groups import Groups
from qworker.service.heartbeat import Heartbeat, Held
from qworker.service.intake import BAND_PRIORITY, Intake, Reject, Taken
from qworker.service.job import ActiveJob, Entry, now_ms
from qworker.service.logprobs import token_text, wire_logprobs
from qworker.service.logs import get_logger
from qworker.service.metrics import Metrics
from qworker.service.on_done import OnDone
from qworker.service.publisher import FlushResult, Publisher
from qworker.service.scripts import Scripts, alone_key
from qworker_client.protocol import (
    INTERNAL,
    INVALID_REQUEST,
    LOST_STATE,
    DoneEvent,
    ErrorEvent,
    Job,
    Keys,
    WorkerInfo,
)
from qworker_client.protocol import StructuredOutputs as WireStructuredOutputs

EXIT_GRACE_S = 5.0  # after a drain/requeue deadline, how long to keep retrying Redis writes


class EngineLike(Protocol):
    tokenizer: Any
    max_model_len: int

    def add(self, request: Request) -> None: ...
    def check_prompt_text(self, text: str) -> None: ...
    def abort(self, request_id: str) -> None: ...
    def step(self) -> list[StepOutput]: ...
    def free_slots(self, priority: int | None = None) -> int: ...
    def kernel_report(self) -> dict[str, str]: ...
    def has_unfinished(self) -> bool: ...
    def solo_next(self) -> str | None: ...
    def stats(self) -> dict[str, int]: ...


def connect(config: ServiceConfig) -> redis.Redis:
    """A client for `redis_url` (redis://, rediss:// with TLS, user:password@ for AUTH/ACL). No
    retries inside redis-py: the worker loop backs off and retries itself."""
    return redis.Redis.from_url(
        config.redis_url, socket_timeout=config.socket_timeout_s, socket_connect_timeout=5.0,
        retry=Retry(NoBackoff(), 0), client_name=re.sub(r"[^!-~]", "_", f"qworker:{config.name}"))


@dataclass
class Flight:
    """A round trip under way: how many events of each outbox it writes, and its reply to come."""

    sent: dict[str, int]
    reply: Future[FlushResult]


def default_seed(job_id: str) -> int:
    """A job without a seed still samples reproducibly, so a resumed run continues exactly."""
    return int.from_bytes(hashlib.sha256(job_id.encode()).digest()[:8], "big") >> 1


# the fields of a job that say what to run and when, not how to sample: every other field of a
# Job is the SamplingParams field of the same name (tests/test_settings.py holds them equal)
JOB_NOT_SAMPLING = frozenset({"id", "model", "cache_salt", "prompt", "messages",
                              "prompt_token_ids",
                              "priority", "deadline_ms", "logprobs_text"})


def sampling_params(job: Job, job_id: str) -> SamplingParams:
    """The job's sampling fields by name (lists as tuples); a job without a seed gets its own."""
    values = {name: getattr(job, name) for name in Job.model_fields
              if name not in JOB_NOT_SAMPLING}
    values = {name: tuple(v) if isinstance(v, list) else v for name, v in values.items()}
    if values["seed"] is None:
        values["seed"] = default_seed(job_id)
    values["structured_outputs"] = structured_outputs(job.structured_outputs)
    return SamplingParams(**values)


def structured_outputs(wire: WireStructuredOutputs | None) -> StructuredOutputs | None:
    """The engine's form of a job's constraint (a schema as JSON text, choices as a tuple)."""
    if wire is None:
        return None
    schema = json.dumps(wire.json_schema) if wire.json_schema is not None else None
    choice = tuple(wire.choice) if wire.choice is not None else None
    return StructuredOutputs(json=schema, json_object=bool(wire.json_object), regex=wire.regex,
                             choice=choice, grammar=wire.grammar)


class Worker:
    def __init__(self, engine: EngineLike, config: ServiceConfig,
                 client: redis.Redis | None = None, metrics: Metrics | None = None,
                 on_done: OnDone | None = None) -> None:
        self.engine = engine
        self.on_done = on_done  # RQ callback of finished jobs (--on-done-rq-*)
        self.config = config
        self.client = client or connect(config)
        self.keys = Keys(config.prefix)
        self.token = f"{config.name}/{uuid.uuid4().hex[:12]}"  # fencing token of this process
        self.metrics = metrics or Metrics()
        scripts = Scripts()
        self.intake = Intake(self.client, self.keys, config, scripts, self.token)
        self.publisher = Publisher(self.client, self.keys, config, scripts, self.token)
        self.heartbeat = Heartbeat(self.client, self.keys, config, scripts, self.token)
        self.backoff = Backoff(config.backoff_min_s, config.backoff_max_s)
        self.log = get_logger(worker=config.name)
        self.groups = Groups(self.client, self.intake.streams, config.group, self.log)
        self.kernels = engine.kernel_report()  # what runs each op: logged, exported, shown
        self._token_text = token_text(engine.tokenizer)  # for jobs with logprobs_text
        self.active: dict[str, ActiveJob] = {}
        self.inbox: list[Entry] = []  # read, not yet started or rejected: owned all the same
        self._redis_thread = ThreadPoolExecutor(1, thread_name_prefix=f"{config.name}-redis")
        self._flight: Flight | None = None  # the round trip running beside the engine step
        self._alone: str | None = None  # the job our alone key names (see _move_alone)
        self.draining = False
        self.requeue_now = False
        self._ready = False  # group created and scripts loaded
        self._drain_deadline = float("inf")
        self._exit_by = float("inf")
        self._last_reclaim = float("-inf")
        self._last_cleanup = time.monotonic()  # dead consumers: first look after a while
        self._last_info = float("-inf")
        self._tracked: tuple[tuple[str, ...], ...] | None = None  # the heartbeat's snapshot
        self._started_ms = now_ms()
        self._stop_requests = 0  # request_stop() calls, and how many the loop has acted on
        self._stops_taken = 0

    # ------------------------------------------------------------------ lifecycle

    def request_stop(self) -> None:
        """First call: stop intake and drain. Second: requeue what still runs, at once.

        Only counts the call, so it is safe in a signal handler (which must not log: the
        handler runs on the loop's thread, maybe inside the logger's lock); the loop acts on it,
        and logs, at its next turn."""
        self._stop_requests += 1

    def _take_stop_requests(self) -> None:
        while self._stops_taken < self._stop_requests:
            self._stops_taken += 1
            self._stop()

    def _stop(self) -> None:
        now = time.monotonic()
        if not self.draining:
            self.draining = True
            self._drain_deadline = now + self.config.drain_timeout
            self._exit_by = self._drain_deadline + EXIT_GRACE_S
            self.log.info("draining", timeout_s=self.config.drain_timeout, jobs=len(self.active))
        else:
            self.requeue_now = True
            self._exit_by = min(self._exit_by, now + EXIT_GRACE_S)
            self.log.info("requeueing at once", jobs=len(self.active))

    def run(self) -> int:
        """The loop until drained: 0; or EXIT_CODE (one error line) when Redis refuses what
        every job needs, e.g. an ACL without the job stream. Its jobs stay pending for peers."""
        self.metrics.serve(self.config.metrics_port)
        self.log.info("worker started", group=self.config.group, prefix=self.config.prefix,
                      model=self.config.model, token=self.token)
        self._report_kernels()
        self._track()
        self.heartbeat.start()
        try:
            code = self._loop()
        finally:  # also on a bug: the heartbeat must not outlive the loop
            self._leave()
        self.log.info("worker stopped", exit_code=code)
        return code

    def _loop(self) -> int:
        try:
            while not self._finished():
                self.iterate()
            self._guard(self._land)  # a deadline ended the drain with a round trip still out
        except CannotWork as exc:
            self.log.error("cannot work with this Redis, exiting", error=str(exc),
                           exit_code=EXIT_CODE, jobs_left_pending=len(self.active))
            return EXIT_CODE
        if self.active:
            self.log.warning("exiting with unpublished jobs; they stay pending for reclaim",
                             jobs=sorted(self.active))
        return 0

    def _leave(self) -> None:
        self._redis_thread.shutdown(wait=False, cancel_futures=True)
        try:
            self._move_alone(None)  # a job left pending is not charged for a clean exit
        except redis.RedisError as exc:  # it expires by itself
            self.log.warning("could not remove the alone key", error=str(exc)[:200])
        try:
            self.heartbeat.leave()
        except redis.RedisError as exc:  # it expires by itself
            self.log.warning("could not remove the worker key", error=str(exc)[:200])
        self.metrics.close()

    def _finished(self) -> bool:
        self._take_stop_requests()
        if not self.draining:
            return False
        return not self.active or time.monotonic() >= self._exit_by

    def iterate(self) -> None:
        """One turn of the loop: step, publish what it produced, then reclaim and intake; then
        the heartbeat learns what the worker holds and that the loop made progress."""
        try:
            self._turn()
        finally:
            self._track()
            self.heartbeat.progress()

    def _turn(self) -> None:
        if self.heartbeat.fatal is not None:
            raise self.heartbeat.fatal
        self.metrics.tick(self.engine)  # health: the loop turns; engine gauges
        self._take_stop_requests()
        if self.requeue_now or time.monotonic() >= self._drain_deadline:
            self._requeue_all()
        stepped = self.engine.has_unfinished() and self._step()
        now = time.monotonic()
        if not self.backoff.ready(now):
            if not stepped:
                time.sleep(min(max(self.backoff.until - now, 0.0), 0.1))
            return
        if not self._ready and not self._guard(self._setup):
            return
        # the round trip launched last turn ran beside this step: settle it, then take new work
        if not self._guard(self._land) or not self._guard(self._housekeeping):
            return
        self._launch()
        if not self.engine.has_unfinished():  # no step to run beside it: settle it now
            self._guard(self._land)

    def _setup(self) -> None:
        self.groups.ensure()
        Scripts.load(self.client)
        self._ready = True

    def _guard(self, fn: Callable[[], Any]) -> bool:
        """Run one Redis phase; on a connection problem back off (the loop retries later). An
        error reply that escapes a phase is the worker's, not one job's (those are settled inside
        the phase): unless it is transient it means the worker cannot work (`CannotWork`)."""
        try:
            fn()
        except REDIS_DOWN as exc:
            self._backing_off(exc)
            return False
        except redis.exceptions.NoScriptError:
            self._ready = False  # Redis lost its scripts (restart, SCRIPT FLUSH): load again
            return False
        except redis.ResponseError as exc:
            if is_group_gone(exc):  # Redis forgot it: made again (and said) at the next turn
                self._ready = False
                return False
            if not is_transient(exc):
                raise cannot_work(exc) from None
            self._backing_off(exc)
            return False
        self.backoff.succeeded()
        self.metrics.redis_succeeded()
        return True

    def _backing_off(self, exc: Exception) -> None:
        self.metrics.redis_failed(exc)
        delay = self.backoff.failed(time.monotonic())
        self.log.warning("redis unavailable, retrying", error=str(exc)[:200],
                         retry_in_s=round(delay, 3))

    # ------------------------------------------------------------------ engine

    def _step(self) -> bool:
        """One engine step; False when it could not run: a step that holds one job alone runs
        only once that is recorded (see `_move_alone`), and Redis is unreachable."""
        if not self._mark_alone(self.engine.solo_next()):
            return False
        started = time.perf_counter()
        try:
            outputs = self.engine.step()
        except Exception as exc:  # the engine isolates a request that fails its step; not this
            self._step_failed(exc)
            return True
        self.metrics.observe_step(self.engine, outputs, time.perf_counter() - started, self.active)
        for out in outputs:
            job = self.active.get(out.request_id)
            if job is None or not job.in_engine:
                continue
            if out.error is not None:  # failed inside a step; the engine has let it go
                self._fail(job, INTERNAL, f"failed in an engine step: {out.error}")
                continue
            if out.preempted:
                job.requeue = True
                self.metrics.preemptions.inc()
                self.metrics.requeues.labels("preempted").inc()
                job.log.info("preempted, requeueing", tokens=job.next_index)
                continue
            if out.text_delta and not out.new_token_ids:
                job.log.warning("engine gave text without a token; dropped",
                                chars=len(out.text_delta))
            text = self._token_text if job.job.logprobs_text else None
            if out.prompt_logprobs is not None:
                job.add_prompt_logprobs(wire_logprobs(out.prompt_logprobs, text))
            job.add_tokens(out.first_index, out.new_token_ids, out.text_delta,
                           wire_logprobs(out.logprobs, text) if out.logprobs else None)
            self.metrics.tokens.inc(len(out.new_token_ids))
            if out.finished:
                job.prompt_tokens = out.num_prompt_tokens or job.prompt_tokens
                job.finish(out.finish_reason or "stop", out.first_index + len(out.new_token_ids))
        return True

    def _mark_alone(self, job_id: str | None) -> bool:
        """`_move_alone` within the loop's Redis guard; False when it could not be written."""
        if job_id == self._alone:
            return True
        if not self.backoff.ready(time.monotonic()):
            return False
        return self._guard(lambda: self._move_alone(job_id))

    def _move_alone(self, job_id: str | None) -> None:
        """Records, before it happens, that this worker does something with `job_id` alone (None:
        with no job alone), in its key `<prefix>:alone:<token>`. A worker that dies or stalls
        meanwhile leaves the key behind: the job's next owner charges it a crash, and the
        other jobs the worker held are excused that delivery (scripts.TAKE_OWNER)."""
        if job_id == self._alone:
            return
        key = alone_key(self.keys.prefix, self.token)
        if job_id is None:
            self.client.delete(key)
        else:
            self.client.set(key, job_id, ex=self.config.owner_ttl_s)
        self._alone = job_id

    def _step_failed(self, exc: Exception) -> None:
        """engine.step() raised outside any one request: the jobs it held fail, the worker goes
        on (each job gets its error event; nothing is left half-run in the engine)."""
        self.log.exception("engine step failed; failing the jobs it held",
                           jobs=sum(job.in_engine for job in self.active.values()))
        for job in self.active.values():
            if job.in_engine:
                with contextlib.suppress(Exception):
                    self.engine.abort(job.job_id)
                self._fail(job, INTERNAL, f"the engine step failed: {type(exc).__name__}: {exc}")

    def _fail(self, job: ActiveJob, code: str, message: str) -> None:
        """End a running job with an error event (published like `done`, then acked)."""
        job.outbox.append(ErrorEvent(code=code, message=message[:1000]))
        job.finished = True
        job.log.warning("job failed", code=code, reason=message[:200])
        if code == INTERNAL:  # an engine that fails valid jobs: an operator must hear of it
            self.metrics.internal_errors.inc()
            if self.metrics.registry.get_sample_value("qworker_internal_errors_total") == 1:
                self.log.error("the engine failed a valid job", first_cause=message[:1000])

    def _requeue_all(self) -> None:
        for job in self.active.values():
            if job.in_engine:
                self.engine.abort(job.job_id)
                job.requeue = True
                self.metrics.requeues.labels("shutdown").inc()
                job.log.info("requeued at shutdown", tokens=job.next_index)
        self._drain_deadline = float("inf")

    # ------------------------------------------------------------------ publishing

    def _launch(self) -> None:
        """Start this turn's round trip on the Redis thread, with copies of the outboxes: the
        loop goes on adding to them while it runs."""
        jobs = [replace(job, outbox=list(job.outbox)) for job in self.active.values()
                if job.outbox or job.requeue]
        running = [job.job_id for job in self.active.values() if job.in_engine]
        caps = self._read_caps()
        if not jobs and not running and not caps:
            return
        reply = self._redis_thread.submit(self.publisher.flush, jobs, running, caps,
                                          self.heartbeat.hold)
        self._flight = Flight({job.job_id: len(job.outbox) for job in jobs}, reply)

    def _read_caps(self) -> list[tuple[str, int]]:
        """While the engine runs, new entries come with the round trip (within each band's room);
        with nothing to run, `_housekeeping` reads them itself, blocking while idle."""
        if self.draining or self.inbox or not self.engine.has_unfinished():
            return []
        rooms = self._rooms()
        return self.intake.caps(rooms) if max(rooms.values()) > 0 else []

    def _land(self) -> None:
        """Settle the round trip under way (its reply awaited if still out; its error raised for
        `_guard`, the events kept in their outboxes), then admit the entries it read."""
        flight, self._flight = self._flight, None
        if flight is None:
            return
        result = flight.reply.result()
        self.inbox += result.entries  # ours whatever fails below
        failed: list[Reject] = []
        for job_id, status in result.status.items():
            job = self.active[job_id]  # only a landing removes jobs: it is still here
            if status == pub.FAILED:
                failed.append(self._refused(job, result.errors[job_id]))
            else:
                self._settle(job, status, flight.sent[job_id])
        self._dead_letter(failed)
        self._cancel(result.cancelled)
        self.metrics.running.set(len(self.active))
        if result.error is not None:
            raise result.error
        self._admit()

    def _cancel(self, job_ids: set[str]) -> None:
        for job_id in job_ids:
            job = self.active.get(job_id)
            if job is not None and job.in_engine:
                self.engine.abort(job_id)
                job.finish("cancelled", job.next_index)
                job.log.info("cancelled", tokens=job.next_index)

    def _settle(self, job: ActiveJob, status: str, sent: int) -> None:
        if status == pub.OK:
            del job.outbox[:sent]  # what the engine added since goes with the next round trip
            return
        if self.on_done is not None and status in (pub.DONE, pub.TERMINAL):
            self.on_done.notify(self.client, job)
        if status == pub.DONE:
            self._record_end(job)
        elif status == pub.REQUEUED:
            job.log.info("requeued", tokens=job.next_index)
        elif status == pub.LOST_STATE:
            self.metrics.jobs_failed.labels(LOST_STATE).inc()
            job.log.warning("job state vanished from Redis, ended with lost_state")
        elif status == pub.FENCED:
            self.metrics.fenced.inc()
            job.log.warning("fenced out: another worker owns the job", tokens=job.next_index)
        else:
            job.log.warning("dropping job", status=status)
        if job.in_engine:
            self.engine.abort(job.job_id)
        del self.active[job.job_id]

    def _refused(self, job: ActiveJob, error: str) -> Reject:
        """Redis refused a write to this job's keys: the job fails alone (dead letter, and an
        error event where its stream can take one)."""
        self.metrics.redis_job_errors.inc()
        if job.in_engine:
            self.engine.abort(job.job_id)
        del self.active[job.job_id]
        return Reject(job.entry, INTERNAL, f"Redis refused this job's keys: {error}",
                      job.job_id, drop_owner=True)

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

    # ------------------------------------------------------------------ intake

    def _housekeeping(self) -> None:
        """Drop dead consumers and reclaim idle entries now and then; with nothing to run, read
        new entries (blocking while idle). While the engine runs they come with the round trip."""
        now = time.monotonic()
        if self.draining:
            return
        if self.inbox:  # an admission that a Redis error cut short: finish it first
            self._admit()
            return
        if now - self._last_cleanup >= self.config.consumer_idle_ms / 1000:
            self._last_cleanup = now
            self.metrics.consumers_removed.inc(self.intake.drop_dead_consumers())
        rooms = self._rooms()
        self.metrics.free_slots.set(self.engine.free_slots())
        if max(rooms.values()) <= 0:
            return
        entries: list[Entry] = []
        if now - self._last_reclaim >= self.config.reclaim_s:
            own = {job.entry.entry_id for job in self.active.values()}
            entries = self.intake.reclaim(rooms, own)
            self._last_reclaim = now
            self.metrics.reclaimed.inc(len(entries))
        if not self.engine.has_unfinished():
            idle = not self.active
            block = self.config.block_ms if idle and not entries else None
            entries += self.intake.read(
                {band: room - len(entries) for band, room in rooms.items()}, block)
        self._admit(entries)

    def _rooms(self) -> dict[str, int]:
        """Per band: how many of its jobs the engine takes now (an urgent one displaces a worse)."""
        return {band: self.engine.free_slots(p) for band, p in BAND_PRIORITY.items()}

    def _admit(self, entries: Sequence[Entry] = ()) -> None:
        """Screen, take and start the inbox with `entries` (just read): each stays in it, kept
        owned, until it is started or rejected; a Redis error leaves the rest for the next turn."""
        self.inbox += entries
        self._track()
        good, rejects = self.intake.screen(self.inbox, set(self.active))
        taken, refused = self.intake.take(good) if good else ([], [])
        self.metrics.fenced.inc(len(good) - len(taken) - len(refused))  # a peer had them first
        self.metrics.redis_job_errors.inc(len(refused))
        rejects += refused
        finished_before: list[Entry] = []
        read_ms = now_ms()  # one clock for the batch: the time admission takes is not waiting
        for t in taken:
            if t.readback.terminal:
                finished_before.append(t.entry)
                continue
            reject = self.intake.expired(t) or self.intake.poisoned(t) or self._start(t, read_ms)
            if reject is not None:
                rejects.append(reject)
            else:
                self.inbox.remove(t.entry)
            self.heartbeat.progress()  # a slow admission is progress, not a stall
        if finished_before:
            self.intake.ack(finished_before)
        self._dead_letter(rejects)
        self.inbox = []
        self.metrics.running.set(len(self.active))

    def _dead_letter(self, rejects: list[Reject]) -> None:
        for r in rejects:
            self.metrics.dead_letters.labels(r.code).inc()
            if r.job_id:
                self.metrics.jobs_failed.labels(r.code).inc()
            self.log.info("dead-lettered", job_id=r.job_id, entry=r.entry.entry_id, code=r.code,
                          reason=r.message[:200])
        self.intake.dead_letter(rejects)

    def _track(self) -> None:
        """Tell the heartbeat which entries this worker holds, its jobs' and its inbox's (and, now
        and then, its info); the snapshot is rebuilt only when what the worker holds changed."""
        now = time.monotonic()
        info = None
        if now - self._last_info >= self.config.heartbeat_s / 2:
            self._last_info = now
            info = self._info().model_dump_json()
        holding = (tuple(self.active), tuple(e.entry_id for e in self.inbox))
        if holding == self._tracked and info is None:
            return
        self._tracked = holding
        held = [Held(j.entry.stream, j.entry.entry_id, j.job_id) for j in self.active.values()]
        held += [Held(e.stream, e.entry_id, e.entry_id) for e in self.inbox]
        self.heartbeat.track(held, info)

    def _start(self, t: Taken, read_ms: int) -> Reject | None:
        """Put a taken job into the engine (continuing after what it already showed); it waited
        until `read_ms` before it reached this worker (ties in the engine go by arrival)."""
        job_id = t.job.id or t.entry.entry_id
        log = self.log.bind(job_id=job_id)
        job = ActiveJob(t.job, t.entry, log, t0_ms=t.t0_ms, started_ms=t.started_ms,
                        next_index=len(t.readback.token_ids), text=t.readback.text,
                        first_token_ms=t.readback.first_token_ms)
        if not t.readback.consistent:
            log.warning("output stream is not a clean 0..n-1 token prefix; continuing after it",
                        tokens=job.next_index)
        if t.cancelled or job.next_index >= t.job.max_tokens:
            self.active[job_id] = job
            job.finish("cancelled" if t.cancelled else "length", job.next_index)
            return None
        if t.entry.deliveries > 1:  # tokenized and added alone: a crash in it is its own
            self._move_alone(job_id)  # (a Redis error ends the admission: retried later)
        try:
            prompt = self._prompt_ids(t.job)
            job.prompt_tokens = len(prompt)
            # delivered before: an earlier run may have crashed its process on this job, so it
            # runs alone until it has produced a token and shares no step with others
            self.engine.add(Request(job_id, prompt, sampling_params(t.job, job_id),
                                    queued_s=t.waited_ms(read_ms) / 1000,  # for aging
                                    output_token_ids=list(t.readback.token_ids),
                                    priority=t.job.priority, isolate=t.entry.deliveries > 1,
                                    cache_salt=t.job.cache_salt))
        except RequestRejectedError as exc:
            return Reject(t.entry, exc.code, str(exc), job_id, drop_owner=True)
        except Exception as exc:  # a tokenizer / template failure must not stop the worker
            log.exception("could not start job")
            code = INVALID_REQUEST if isinstance(exc, (ValueError, KeyError)) else INTERNAL
            return Reject(t.entry, code, f"could not start: {exc}", job_id, drop_owner=True)
        self.active[job_id] = job
        source = "reclaimed" if t.entry.reclaimed else (
            "requeue" if self.keys.is_requeue(t.entry.stream) else "jobs")
        self.metrics.jobs_started.labels(source).inc()
        self.metrics.resumed_tokens.inc(job.next_index)
        self.metrics.prompt_tokens.inc(len(prompt))
        log.info("started", source=source, resume_at=job.next_index, prompt_tokens=len(prompt),
                 deliveries=t.entry.deliveries, crashes=t.crashes, excused=t.excused)
        return None

    def _prompt_ids(self, job: Job) -> list[int]:
        if job.prompt_token_ids is not None:
            return list(job.prompt_token_ids)
        tokenizer = self.engine.tokenizer
        text = (tokenizer.apply_chat_template([m.model_dump() for m in job.messages])
                if job.messages is not None else job.prompt or "")
        self.engine.check_prompt_text(text)  # far too long for the context: rejected untokenized
        # a plain prompt gets the special tokens its vocabulary adds (Llama 2's BOS), as vLLM's
        # and llama.cpp's completions do; a rendered chat has them from its template already
        return list(tokenizer.encode(text, add_special_tokens=job.messages is None))

    def _report_kernels(self) -> None:
        """Once at start: which kernels run (in the log and /metrics); loudly when the native
        CPU kernels are missing, since then every op takes the slow torch path."""
        report = self.kernels
        self.metrics.set_kernels(report)
        if report.get("native", "").startswith("missing"):
            self.log.error("native CPU kernels missing: every op runs the slow torch path",
                           reason=report["native"], fix="reinstall with `make install` or the "
                           "wheel (they carry the build), or give the worker a C++ compiler")
        else:
            self.log.info("kernels", **report)

    def _info(self) -> WorkerInfo:
        return WorkerInfo(name=self.config.name, host=socket.gethostname(), pid=os.getpid(),
                          model=self.config.model, group=self.config.group,
                          served_model_name=self.config.served_model or "",
                          started_ms=self._started_ms, running=len(self.active),
                          free_slots=self.engine.free_slots(), draining=self.draining,
                          native=self.kernels.get("native", ""))
