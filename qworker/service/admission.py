"""Admission: the loop's side of intake. How much to read (each band's room in the engine), when
to reclaim idle entries and drop dead consumers, and the inbox: entries read and not yet started
or rejected, kept owned all the same, screened, taken and started in the engine (or dead-lettered)
in one pass."""

from __future__ import annotations

import time
from collections.abc import Callable, Sequence
from typing import Any, Protocol

from qworker.engine.request import Prompt, Request, RequestRejectedError
from qworker.service.alone import Alone
from qworker.service.config import ServiceConfig
from qworker.service.core import ServiceCore
from qworker.service.deferral import Deferral
from qworker.service.fair_jump import NORMAL_BAND, OFFER_EVERY_S, newest_of, offer
from qworker.service.heartbeat import Heartbeat
from qworker.service.intake import BAND_PRIORITY, Intake
from qworker.service.job import Entry, Reject, Taken, now_ms
from qworker.service.metrics import Metrics
from qworker.service.sampling import (
    prompt_of,
    reasoning_budget,
    sampling_params,
    tool_calling,
)
from qworker_client.protocol import INTERNAL, INVALID_REQUEST, Job


class AdmittingEngine(Protocol):
    sampling_defaults: dict[str, float | int]

    def encode(self, prompt: Prompt) -> list[int]: ...
    def add(self, request: Request) -> None: ...
    def abort(self, request_id: str) -> None: ...
    def free_slots(self, priority: int | None = None) -> int: ...
    def has_unfinished(self) -> bool: ...


def prompt_ids(engine: AdmittingEngine, job: Job) -> list[int]:
    """The job's prompt as token ids, by the engine's front door (it owns text)."""
    return engine.encode(prompt_of(job))


class Admission:
    def __init__(self, engine: AdmittingEngine, core: ServiceCore, intake: Intake,
                 deferral: Deferral, heartbeat: Heartbeat, alone: Alone, metrics: Metrics,
                 config: ServiceConfig, log: Any, prompt_ids: Callable[[Job], list[int]],
                 track: Callable[[], None]) -> None:
        self.engine = engine
        self.core = core
        self.intake = intake
        self.deferral = deferral
        self.heartbeat = heartbeat
        self.alone = alone
        self.metrics = metrics
        self.config = config
        self.keys = config.keys
        self.log = log
        self.prompt_ids = prompt_ids  # the worker's: where tests time it
        self.track = track  # tells the heartbeat what the worker holds
        self.inbox: list[Entry] = []  # read, not yet started or rejected: owned all the same
        self._last_reclaim = float("-inf")
        self._last_cleanup = time.monotonic()  # dead consumers: first look after a while
        self._offered_at = float("-inf")  # when a full worker last offered to preempt

    def rooms(self) -> dict[str, int]:
        """Per band: how many of its jobs the engine takes now (an urgent one displaces a worse)."""
        return {band: self.engine.free_slots(p) for band, p in BAND_PRIORITY.items()}

    def caps(self, draining: bool) -> list[tuple[str, int]]:
        """While the engine runs, new entries come with the round trip (within each band's room);
        with nothing to run, `housekeeping` reads them itself, blocking while idle."""
        if draining or self.inbox or not self.engine.has_unfinished():
            return []
        rooms = self.rooms()
        return self.intake.caps(rooms) if max(rooms.values()) > 0 else []

    def housekeeping(self, block_cap_s: float = float("inf")) -> None:
        """Drop dead consumers and reclaim idle entries now and then; with nothing to run, read
        new entries (blocking while idle, at most `block_cap_s`). While the engine runs they
        come with the round trip."""
        now = time.monotonic()
        if self.inbox:  # an admission that a Redis error cut short: finish it first
            self.admit()
            return
        if now - self._last_cleanup >= self.config.consumer_idle_ms / 1000:
            self._last_cleanup = now
            self.metrics.consumers_removed.inc(self.intake.drop_dead_consumers())
        rooms = self.rooms()
        self.metrics.free_slots.set(self.engine.free_slots())
        if rooms[NORMAL_BAND] <= 0:
            self.offer_to_preempt(now)
        if max(rooms.values()) <= 0:
            return
        entries: list[Entry] = []
        if now - self._last_reclaim >= self.config.reclaim_s:
            own = {job.entry.entry_id for job in self.core.jobs.values()}
            entries = self.intake.reclaim(rooms, own)
            self._last_reclaim = now
            self.metrics.reclaimed.inc(len(entries))
        if not self.engine.has_unfinished():
            idle = not self.core.jobs
            block_ms = max(1, min(self.config.block_ms, int(block_cap_s * 1000)))
            block = block_ms if idle and not entries else None
            entries += self.intake.read(
                {band: room - len(entries) for band, room in rooms.items()}, block)
        self.admit(entries)

    def offer_to_preempt(self, now: float) -> None:
        """A worker with no room for its normal band takes, between two steps, the jobs of
        tenants below their share on it that fair preemption hands it (fair_jump.py), at most
        every OFFER_EVERY_S: one round trip, so they start in the next step."""
        if (not (self.config.fair_share and self.config.fair_preemption)
                or now - self._offered_at < OFFER_EVERY_S):
            return
        self._offered_at = now
        jumps = offer(self.core.jobs.values(), self.intake.streams, self.keys)
        entries = self.intake.jump(jumps) if jumps is not None else []
        if entries:
            self.admit(entries)

    def admit(self, entries: Sequence[Entry] = ()) -> None:
        """Screen, take and start the inbox with `entries` (just read): each stays in it, kept
        owned, until it is started or rejected; a Redis error leaves the rest for the next turn."""
        self.inbox += entries
        self.track()
        good, rejects = self.intake.screen(self.inbox, set(self.core.jobs))
        good, not_deferred = self.deferral.defer(good) if good else (good, [])
        rejects += not_deferred
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
            reject = self.intake.expired(t) or self.intake.poisoned(t) or self.start(t, read_ms)
            if reject is not None:
                rejects.append(reject)
            else:
                self.inbox.remove(t.entry)
            self.heartbeat.progress()  # a slow admission is progress, not a stall
        if finished_before:
            self.intake.ack(finished_before)
        self.dead_letter(rejects)
        self.inbox = []
        self.metrics.running.set(len(self.core.jobs))

    def preempt_for(self, tenant: str, job_id: str) -> None:
        """A fair share's preemption (fair_jump.py): the newest job of `tenant` here goes back to
        its queue, recomputed where it stopped, to make room for `job_id` (none left: a job of
        it ended meanwhile and left the room)."""
        victim = newest_of(list(self.core.jobs.values()), tenant, self.keys)
        if victim is None:
            return
        self.core.requeue(victim, "fair_share")
        self.engine.abort(victim.job_id)
        victim.log.info("preempted for a fair share", tokens=victim.next_index, tenant=tenant,
                        for_job=job_id)

    def dead_letter(self, rejects: list[Reject]) -> None:
        for r in rejects:
            self.metrics.dead_letters.labels(r.code).inc()
            if r.job_id:
                self.metrics.jobs_failed.labels(r.code).inc()
            self.log.info("dead-lettered", job_id=r.job_id, entry=r.entry.entry_id, code=r.code,
                          reason=r.message[:200])
        self.intake.dead_letter(rejects)

    def start(self, t: Taken, read_ms: int) -> Reject | None:
        """Put a taken job into the engine (continuing after what it already showed); it waited
        until `read_ms` before it reached this worker (ties in the engine go by arrival)."""
        job = self.core.open(t, self.log.bind(job_id=t.job_id))
        if self.core.end_unstarted(job, t, read_ms):
            return None
        if t.entry.deliveries > 1:  # tokenized and added alone: a crash in it is its own
            self.alone.move(t.job_id)  # (a Redis error ends the admission: retried later)
        try:
            prompt = self.prompt_ids(t.job)
            # delivered before: an earlier run may have crashed its process on this job, so it
            # runs alone until it has produced a token and shares no step with others
            params = sampling_params(t.job, t.job_id, self.engine.sampling_defaults)
            self.engine.add(Request(t.job_id, prompt, params,
                                    queued_s=t.waited_ms(read_ms) / 1000,  # for aging
                                    output_token_ids=list(t.readback.token_ids),
                                    priority=t.job.priority, isolate=t.entry.deliveries > 1,
                                    cache_salt=t.job.cache_salt, tools=tool_calling(t.job),
                                    max_reasoning_tokens=reasoning_budget(t.job)))
        except RequestRejectedError as exc:
            return Reject(t.entry, exc.code, str(exc), t.job_id, drop_owner=True, job=t.job)
        except Exception as exc:  # a tokenizer / template failure must not stop the worker
            job.log.exception("could not start job")
            code = INVALID_REQUEST if isinstance(exc, (ValueError, KeyError)) else INTERNAL
            return Reject(t.entry, code, f"could not start: {exc}", t.job_id, drop_owner=True,
                          job=t.job)
        if t.entry.displaces is not None:  # added: its room is made (a refused job takes none)
            self.preempt_for(t.entry.displaces, t.job_id)
        source = "reclaimed" if t.entry.reclaimed else (
            "requeue" if self.keys.is_requeue(t.entry.stream) else "jobs")
        self.core.started(job, t, source, len(prompt))
        return None
