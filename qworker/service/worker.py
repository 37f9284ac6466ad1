"""The worker loop: engine.step -> settle the last round trip -> intake -> the next round trip.

A turn's Redis round trip (every outbox, requeues, the cancel flags of running jobs and, while the
engine runs, the new entries it has room for) runs on a thread of its own beside the next engine
step, and is settled after it (at once when the engine has nothing to run): the engine does not
wait on Redis. That thread sees copies of the outboxes only; the engine and the table of jobs
(`core.ServiceCore`, where every rule about them lives) are touched only by the loop's thread. The
heartbeat runs in a thread of its own (see heartbeat.py), fed a snapshot of what the worker holds.
`request_stop()` (from a signal handler or another thread) starts a drain; a second call requeues
at once (drain.py). Redis errors (connection lost, restart, failover) back off and retry while the
engine keeps stepping: events wait in each job's outbox, nothing else is lost since every job stays
pending in the group until its terminal event or its requeue is written. An error reply about one
job's keys fails that job alone; one that means the worker cannot work at all ends `run` with
exit code 2 (see errors.py).
"""

from __future__ import annotations

import contextlib
import re
import time
import uuid
from collections.abc import Callable, Iterable
from typing import Any

import redis
from redis.backoff import NoBackoff
from redis.retry import Retry

from qworker.service.admission import Admission, prompt_ids
from qworker.service.affinity import Affinity
from qworker.service.alone import Alone
from qworker.service.backoff import Backoff
from qworker.service.config import ServiceConfig
from qworker.service.core import ServiceCore
from qworker.service.deferral import Deferral
from qworker.service.drain import EXIT_GRACE_S as EXIT_GRACE_S  # where deploy tests look
from qworker.service.drain import Drain
from qworker.service.engine_api import EngineLike
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
from qworker.service.info import report_kernels, say_ready, worker_info
from qworker.service.intake import Intake
from qworker.service.job import ActiveJob, Entry, now_ms
from qworker.service.kv_events import KVEventPublisher
from qworker.service.logs import get_logger
from qworker.service.metrics import Metrics, engine_stats
from qworker.service.on_done import OnDone
from qworker.service.promoter import Promoter
from qworker.service.publisher import Publisher
from qworker.service.round_trip import RoundTrip
from qworker.service.sampling import JOB_NOT_SAMPLING as JOB_NOT_SAMPLING  # their old home
from qworker.service.sampling import default_seed as default_seed
from qworker.service.sampling import sampling_params as sampling_params
from qworker.service.scripts import Scripts
from qworker.service.stream_interval import StreamInterval
from qworker_client.protocol import Job, WorkerInfo
from qworker_client.redis_clients import sync_redis


def connect(config: ServiceConfig) -> redis.Redis:
    """A client for `redis_url` (redis://, rediss:// with TLS, user:password@ for AUTH/ACL,
    redis+sentinel:// for the master that Sentinel names, again after a failover). No retries
    inside redis-py: the worker loop backs off and retries itself."""
    return sync_redis(
        config.redis_url, socket_timeout=config.socket_timeout_s, socket_connect_timeout=5.0,
        retry=Retry(NoBackoff(), 0), client_name=re.sub(r"[^!-~]", "_", f"qworker:{config.name}"))


class Worker:
    def __init__(self, engine: EngineLike, config: ServiceConfig,
                 client: redis.Redis | None = None, metrics: Metrics | None = None,
                 on_done: OnDone | None = None) -> None:
        self.engine = engine
        self.on_done = on_done  # RQ callback of finished jobs (--on-done-rq-*)
        self.config = config
        self.client = client or connect(config)
        self.keys = config.keys
        self.token = f"{config.name}/{uuid.uuid4().hex[:12]}"  # fencing token of this process
        self.metrics = metrics or Metrics()
        self.log = get_logger(worker=config.name)
        affinity = (Affinity(self.keys, config.affinity_ms, config.affinity_live_ms)
                    if config.affinity_ms > 0 else None)
        scripts = Scripts(affinity=affinity)
        self.intake = Intake(self.client, self.keys, config, scripts, self.token)
        self.publisher = Publisher(self.client, self.keys, config, scripts, self.token)
        self.heartbeat = Heartbeat(self.client, self.keys, config, scripts, self.token)
        self.backoff = Backoff(config.backoff_min_s, config.backoff_max_s)
        self.groups = Groups(self.client, self.intake.streams, config.group, self.log)
        self.kernels = engine.kernel_report()  # what runs each op: logged, exported, shown
        self.core = ServiceCore(self.metrics, engine.token_text)
        self.alone = Alone(self.client, self.keys, self.token, config.owner_ttl_s)
        self.drain = Drain(config.drain_timeout, self.log)
        self.promoter = Promoter(self.client, self.keys, config, scripts)
        deferral = Deferral(self.client, self.keys, config, scripts)
        self.admission = Admission(engine, self.core, self.intake, deferral, self.heartbeat,
                                   self.alone, self.metrics, config, self.log,
                                   prompt_ids=lambda job: self._prompt_ids(job),
                                   track=self._track)
        self.trip = RoundTrip(self.publisher, self.heartbeat.hold, config.name)
        self.interval = StreamInterval(config.stream_interval_ms)
        self.kv_events = (KVEventPublisher(self.client, self.keys, config, engine, self.token,
                                           self.log) if config.kv_events else None)
        self._ready = False  # group created and scripts loaded
        self._said_ready = False  # the "ready" line, once: at the first setup
        self._last_info = float("-inf")
        self._tracked: tuple[tuple[str, ...], ...] | None = None  # the heartbeat's snapshot
        self._started_ms = now_ms()

    @property
    def active(self) -> dict[str, ActiveJob]:
        """The jobs this worker holds, by id."""
        return self.core.jobs

    @property
    def inbox(self) -> list[Entry]:
        return self.admission.inbox

    @inbox.setter
    def inbox(self, entries: list[Entry]) -> None:
        self.admission.inbox = entries

    @property
    def draining(self) -> bool:
        return self.drain.draining

    # ------------------------------------------------------------------ lifecycle

    def request_stop(self) -> None:
        """First call: stop intake and drain. Second: requeue what still runs, at once. Safe in
        a signal handler (see `Drain.request`)."""
        self.drain.request()

    def run(self) -> int:
        """The loop until drained: 0; or EXIT_CODE (one error line) when Redis refuses what
        every job needs, e.g. an ACL without the job stream. Its jobs stay pending for peers."""
        self.metrics.serve(self.config.metrics_port)
        self.log.info("worker started", group=self.config.group, prefix=self.config.prefix,
                      model=self.config.model, token=self.token)
        report_kernels(self.kernels, self.metrics, self.log)
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
        self.trip.shutdown()
        if self.kv_events is not None:
            self.kv_events.close()
        try:
            self.alone.move(None)  # a job left pending is not charged for a clean exit
        except redis.RedisError as exc:  # it expires by itself
            self.log.warning("could not remove the alone key", error=str(exc)[:200])
        try:
            self.intake.leave()
        except redis.RedisError as exc:  # it ages out of the readers by itself
            self.log.warning("could not leave the readers", error=str(exc)[:200])
        try:
            self.heartbeat.leave()
        except redis.RedisError as exc:  # it expires by itself
            self.log.warning("could not remove the worker key", error=str(exc)[:200])
        self.metrics.close()

    def _finished(self) -> bool:
        self.drain.take(len(self.active))
        return self.drain.finished(holding=bool(self.active))

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
        self.drain.take(len(self.active))
        if self.drain.requeue_due():
            self._abort(self.core.requeue_all())
            self.drain.requeued()
        self._abort(self.core.time_out(now_ms()))
        stepped = self.engine.has_unfinished() and self._step()
        if self.kv_events is not None:
            self.kv_events.turn()  # its own thread and retries: nothing here waits on Redis
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
        self.publisher.lease.check_access(self.client)
        if not self._said_ready:
            say_ready(self.log, self.config, self.intake.streams, self.kernels,
                      self.engine.sampling_defaults)
            self._said_ready = True
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
        only once that is recorded (see `Alone.move`), and Redis is unreachable."""
        if not self._mark_alone(self.engine.solo_next()):
            return False
        started = time.perf_counter()
        try:
            outputs = self.engine.step()
        except Exception as exc:  # the engine isolates a request that fails its step; not this
            self.log.exception("engine step failed; failing the jobs it held",
                               jobs=len(self.core.running()))
            for job_id in self.core.step_failed(exc):
                with contextlib.suppress(Exception):
                    self.engine.abort(job_id)
            return True
        self.metrics.observe_step(self.engine, outputs, time.perf_counter() - started, self.active)
        self.core.apply(outputs)
        return True

    def _mark_alone(self, job_id: str | None) -> bool:
        """`Alone.move` within the loop's Redis guard; False when it could not be written."""
        if job_id == self.alone.job_id:
            return True
        if not self.backoff.ready(time.monotonic()):
            return False
        return self._guard(lambda: self.alone.move(job_id))

    def _abort(self, job_ids: Iterable[str]) -> None:
        for job_id in job_ids:
            self.engine.abort(job_id)

    def _prompt_ids(self, job: Job) -> list[int]:
        return prompt_ids(self.engine, job)

    # ------------------------------------------------------------------ Redis round trip

    def _launch(self) -> None:
        """Start this turn's round trip beside the next engine step (with --stream-interval-ms,
        once the interval has passed or a client waits on something)."""
        now = time.monotonic()
        busy = self.engine.has_unfinished() and not self.draining
        if not self.interval.due(now, self.active.values(), busy):
            return
        self.interval.launched(now)
        self.trip.launch(self.core.outgoing(), self.core.running(),
                         self.admission.caps(self.draining))

    def _land(self) -> None:
        """Settle the round trip under way (its reply awaited if still out; its error raised for
        `_guard`, the events kept in their outboxes), then admit the entries it read."""
        landed = self.trip.land()
        if landed is None:
            return
        result, sent = landed
        self.inbox += result.entries  # ours whatever fails below
        settled = self.core.settle(result.status, result.errors, sent)
        self._abort(settled.abort)
        if self.on_done is not None:
            for job in settled.ended:
                self.on_done.notify(self.client, job)
        self.admission.dead_letter(settled.rejects)
        self._abort(self.core.cancel(result.cancelled))
        if result.error is not None:
            raise result.error
        self.admission.admit()

    def _housekeeping(self) -> None:
        """Delayed jobs whose time has come back to their streams, then intake (an idle read
        waits no longer than the next of them)."""
        if not self.draining:
            now = time.monotonic()
            self.promoter.promote(now)
            self.admission.housekeeping(block_cap_s=self.promoter.wait_s(now))

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

    def _info(self) -> WorkerInfo:
        return worker_info(self.config, self._started_ms, len(self.active),
                           self.engine.free_slots(), self.draining, self.kernels,
                           chat=self.engine.has_chat_template,
                           engine=engine_stats(self.engine))
