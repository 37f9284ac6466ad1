"""Intake: read entries only as fast as the engine admits them, reclaim idle ones, screen them
(validation, deliveries), take ownership and read back what was already shown (a job that never
started and is past its deadline expires; one whose workers died running it alone is poison), and
dead-letter what cannot run."""

from __future__ import annotations

from collections.abc import Iterable, Mapping, Sequence
from typing import Any, cast

import redis
from redis.typing import KeyT, StreamIdT, StreamRangeResponse

from qworker.service.affinity import is_affinity_reply, split_reply
from qworker.service.config import ServiceConfig
from qworker.service.dead_letters import MAX_DEAD_FIELDS as MAX_DEAD_FIELDS  # their old home
from qworker.service.dead_letters import MAX_DEAD_VALUE_BYTES as MAX_DEAD_VALUE_BYTES
from qworker.service.dead_letters import DeadLetters
from qworker.service.dead_letters import dead_fields as dead_fields
from qworker.service.errors import job_error
from qworker.service.fair_jump import Jumps, mark_jumped, split_jumped
from qworker.service.fair_share import mark_charged, stale_running
from qworker.service.job import Entry, Readback, now_ms
from qworker.service.job import Reject as Reject  # where intake's callers find them
from qworker.service.job import Taken as Taken
from qworker.service.logs import get_logger
from qworker.service.lua_fair import PARKED_CONSUMER
from qworker.service.scripts import Scripts
from qworker.service.verdicts import expired, poisoned
from qworker_client.protocol import (
    INTERNAL,
    INVALID_REQUEST,
    Job,
    JobValidationError,
    Keys,
    entry_ms,
    parse_job_fields,
)

# Pending entries looked at per reclaim call, whatever the free slots (Redis filters by idle time
# while it scans, so entries of live workers cost no round trips).
RECLAIM_SCAN = 100
# The priority whose room (engine free_slots) a band's entries are read by: its least urgent one;
# None: the free slots alone (a low job displaces nothing it could be sure to outrank).
BAND_PRIORITY: dict[str, int | None] = {"high": -1, "": 0, "low": None}


def _s(value: object) -> str:
    """A name or id in a reply, whether the client decodes responses or not."""
    return value.decode() if isinstance(value, bytes) else str(value)


def capped_entries(reply: Any, keys: Keys) -> list[Entry]:
    """The entries of a READ script's reply (`Scripts.read`), stream by stream in its order
    (those the fair read charged marked so, those handed to a full worker with the tenant to
    preempt for them); an affinity read's too."""
    if is_affinity_reply(reply):
        reply, _ = split_reply(reply)
    reply, victims = split_jumped(reply)
    entries = [Entry(_s(stream), _s(eid), _pairs(flat))
               for stream, items in reply or () for eid, flat in items]
    mark_charged(reply, entries, keys)
    mark_jumped(entries, victims)
    return entries


def _entries(stream: str, items: Iterable[tuple[Any, Any]] | None) -> list[Entry]:
    """The entries of an XREADGROUP or XCLAIM reply, but deleted ones (fields nil, or none: an
    XADD has at least one field), which some Redis versions and clients still give."""
    return [Entry(stream, _s(eid), dict(fields)) for eid, fields in items or () if fields]


class Intake:
    def __init__(self, client: redis.Redis, keys: Keys, config: ServiceConfig, scripts: Scripts,
                 token: str) -> None:
        self.client = client
        self.keys = keys
        self.config = config
        self.scripts = scripts
        self.token = token
        # band by band, most urgent first; in each, requeued work first (its model's, then
        # model-less), then new jobs in the same order
        self.streams = keys.streams_for(config.served_model)
        self._bands = [keys.stream_band(stream) for stream in self.streams]
        self._cursors = dict.fromkeys(self.streams, "-")  # reclaim scan: where the next begins
        self.log = get_logger(worker=config.name)
        self.dead_letters = DeadLetters(client, keys, config, scripts)
        self.fair = keys if config.fair_share else None  # the fair read's keys
        self._running_cursor = "-"  # the quotas' running set: where the next repair looks

    @property
    def consumer(self) -> str:
        return self.config.name

    # ------------------------------------------------------------------ reading

    def caps(self, rooms: int | Mapping[str, int]) -> list[tuple[str, int]]:
        """Each stream with the most entries to have taken in all once it is read: its band's
        room (rooms: band -> how many jobs of that band the engine would take now; an int: the
        same for every band)."""
        return [(stream, rooms if isinstance(rooms, int) else rooms[band])
                for stream, band in zip(self.streams, self._bands, strict=True)]

    def read(self, rooms: int | Mapping[str, int], block_ms: int | None) -> list[Entry]:
        """New entries from `self.streams` in order (the most urgent band first, requeued work
        first in each), each band's only while fewer than its room were taken; one round trip.
        Blocks (`block_ms`) only when nothing is there and the caller is idle; woken, it takes
        what else arrived meanwhile too (a burst starts in one step)."""
        caps = self.caps(rooms)
        entries, wake_ms = self._read_capped(caps)
        count = max(cap for _, cap in caps)
        if not entries and block_ms and count > 0 and self._reads_by_script:
            # wait for news without taking any: what arrives is taken by the script (an entry
            # added between the two round trips waits at most block_ms); an offer this worker
            # could not take yet is taken once it expires, so the wait ends then
            wait_ms = block_ms if wake_ms < 0 else max(1, min(block_ms, wake_ms + 1))
            self.client.xread(dict.fromkeys(self.streams, "$"), count=1, block=wait_ms)
            return self._read_capped(caps)[0]
        if not entries and block_ms and count > 0:
            streams: dict[KeyT, StreamIdT] = dict.fromkeys(self.streams, ">")
            reply = self.client.xreadgroup(self.config.group, self.consumer, streams, count=1,
                                           block=block_ms)
            entries += self._parse_read(reply)
            if entries:
                entries += self._read_capped([(s, cap - len(entries)) for s, cap in caps])[0]
        return entries

    @property
    def _reads_by_script(self) -> bool:
        """Whether new entries are taken only by a script (the fair read, the affinity read): an
        idle worker then waits for news without taking any."""
        return self.fair is not None or self.scripts.affinity is not None

    def _read_capped(self, caps: list[tuple[str, int]]) -> tuple[list[Entry], int]:
        """The entries read, and the ms until an offer this worker could not take expires (-1:
        none, or no affinity)."""
        if not any(cap > 0 for _, cap in caps):
            return [], -1
        try:
            reply = self.scripts.read(self.client, group=self.config.group,
                                      consumer=self.consumer, caps=caps, fair=self.fair)
        except redis.exceptions.NoScriptError:  # Redis restarted or flushed its scripts
            Scripts.load(self.client)
            reply = self.scripts.read(self.client, group=self.config.group,
                                      consumer=self.consumer, caps=caps, fair=self.fair)
        wake_ms = split_reply(reply)[1] if is_affinity_reply(reply) else -1
        return capped_entries(reply, self.keys), wake_ms

    def jump(self, jumps: Jumps) -> list[Entry]:
        """The jobs fair preemption hands a full worker (fair_jump.py), each with the tenant
        to preempt for it."""
        reply = self.scripts.read(self.client, group=self.config.group, consumer=self.consumer,
                                  caps=self.caps(0), fair=self.keys, jumps=jumps)
        return capped_entries(reply, self.keys)

    def leave(self) -> None:
        """A worker that stops is offered nothing more (its offers go to others at once)."""
        if self.scripts.affinity is not None:
            self.client.zrem(self.keys.readers, self.consumer)

    @staticmethod
    def _parse_read(reply: Any) -> list[Entry]:
        out: list[Entry] = []
        for stream, items in reply or ():
            out += _entries(_s(stream), items)
        return out

    def reclaim(self, rooms: int | Mapping[str, int], skip_entry_ids: set[str]) -> list[Entry]:
        """Entries idle longer than claim_idle (their worker died or stalled), with their
        delivery counts, within each band's room as `read`. Scans RECLAIM_SCAN pending entries per
        stream from a cursor kept across calls, and claims only the ones that fit: the others
        keep their delivery counts."""
        entries: list[Entry] = []
        for stream, cap in self.caps(rooms):
            want = cap - len(entries)
            if want <= 0:
                continue
            entries += self._reclaim_stream(stream, want, skip_entry_ids)
        for entry in entries:
            entry.reclaimed = True
        if self.fair is not None:
            self._drop_stale_running()
        return entries

    def _drop_stale_running(self) -> None:
        """Repairs the quotas' running set: a job whose end was not counted (its worker died
        between its terminal event and the count) stops counting once seen not pending."""
        stale, self._running_cursor = stale_running(self.client, self.keys, self.config.group,
                                                    self._running_cursor)
        if stale:
            self.client.zrem(self.keys.running, *stale)

    def _reclaim_stream(self, stream: str, want: int, skip: set[str]) -> list[Entry]:
        rows = self.client.xpending_range(stream, self.config.group, min=self._cursors[stream],
                                          max="+", count=RECLAIM_SCAN,
                                          idle=self.config.claim_idle_ms)
        # parked entries (the fair read's, waiting their turn) are no dead worker's; offered ones
        # are taken by the affinity read when their offer expires (this is their last resort)
        found = [r for r in rows if _s(r["message_id"]) not in skip
                 and _s(r["consumer"]) != PARKED_CONSUMER]
        chosen = found[:want]
        if len(found) > want:  # full: the next call starts after the last one taken
            self._cursors[stream] = "(" + _s(chosen[-1]["message_id"])
        elif len(rows) == RECLAIM_SCAN:
            self._cursors[stream] = "(" + _s(rows[-1]["message_id"])
        else:
            self._cursors[stream] = "-"
        if not chosen:
            return []
        deliveries = {_s(r["message_id"]): int(r["times_delivered"]) + 1 for r in chosen}
        # min-idle again: one that a peer claimed in between is not idle now and stays its own.
        # Entries deleted while pending are dropped from the group by XCLAIM itself (Redis 7).
        # without JUSTID the reply is entries (redis-py types both replies as one)
        items = cast(StreamRangeResponse, self.client.xclaim(
            stream, self.config.group, self.consumer, self.config.claim_idle_ms,
            list(deliveries)))
        entries = _entries(stream, items)
        for entry in entries:
            entry.deliveries = deliveries.get(entry.entry_id, entry.deliveries)
        claimed = {entry.entry_id for entry in entries}
        self._note_deleted(stream, [i for i in deliveries if i not in claimed])
        return entries

    def _note_deleted(self, stream: str, missed: list[str]) -> None:
        """Of the entries XCLAIM did not give: those deleted from the stream while pending (an
        XTRIM or XDEL; XCLAIM drops them from the group), not those a peer claimed in between.
        Their jobs cannot be resumed, nor named: the job id was in the entry's fields."""
        if not missed:
            return
        pipe = self.client.pipeline(transaction=False)
        for entry_id in missed:
            pipe.xrange(stream, entry_id, entry_id)
        deleted = [i for i, found in zip(missed, pipe.execute(), strict=True) if not found]
        if deleted:
            self.log.warning("pending entries deleted from their stream (trimmed?): their jobs "
                             "cannot be resumed", stream=stream, entries=deleted[:20],
                             count=len(deleted))

    def drop_dead_consumers(self, limit: int = 100) -> int:
        """Remove consumers that own nothing, idle for `consumer_idle_ms`, with no live worker
        key (a worker that died with nothing in hand, or whose jobs were all reclaimed)."""
        removed = 0
        for stream in self.streams:
            for c in self.client.xinfo_consumers(stream, self.config.group)[:limit]:
                name = _s(c["name"])
                if (name == self.consumer or int(c["pending"]) != 0
                        or int(c["idle"]) < self.config.consumer_idle_ms):
                    continue
                removed += self.scripts.drop_consumer(
                    self.client, stream=stream, worker_key=self.keys.worker(name),
                    group=self.config.group, consumer=name,
                    min_idle_ms=self.config.consumer_idle_ms)
        return removed

    # ------------------------------------------------------------------ screening

    def screen(self, entries: Iterable[Entry], busy_job_ids: set[str]
               ) -> tuple[list[tuple[Entry, Job]], list[Reject]]:
        """Split entries into runnable jobs and rejects (invalid, duplicate). The deadline and
        poison are checked once taken, when it is known whether the job ever started and how
        its earlier workers ended."""
        good: list[tuple[Entry, Job]] = []
        rejects: list[Reject] = []
        for entry in entries:
            try:
                job = parse_job_fields(entry.fields, entry.entry_id)
            except JobValidationError as exc:
                rejects.append(Reject(entry, exc.code, exc.message, exc.job_id))
                continue
            job_id = job.id or entry.entry_id
            misplaced = self._misplaced(entry, job)
            if misplaced:
                rejects.append(Reject(entry, INVALID_REQUEST, misplaced, job_id, job=job))
            elif job_id in busy_job_ids:
                rejects.append(Reject(entry, INVALID_REQUEST,
                                      f"duplicate: job {job_id} is already running here", None))
            else:
                busy_job_ids.add(job_id)
                good.append((entry, job))
        return good, rejects

    def _misplaced(self, entry: Entry, job: Job) -> str | None:
        """Why the entry's `model` field does not fit its stream, if it does not. A stream names
        the model of its jobs; on a model-less stream a job must name none (every worker, of any
        model, would take it there): that is refused the same way by all workers."""
        stream_model = self.keys.stream_model(entry.stream)
        if job.model is None or job.model == stream_model:
            return None
        if stream_model is None:
            return (f"job names model {job.model!r}: submit it to "
                    f"{self.keys.jobs_of(job.model)}, not {entry.stream}")
        return f"job names model {job.model!r} but was queued on {entry.stream}"

    # ------------------------------------------------------------------ taking

    def take(self, items: Sequence[tuple[Entry, Job]]) -> tuple[list[Taken], list[Reject]]:
        """Become each job's owner (fencing out any earlier one), then read back its stream and
        cancel flag; one round trip (two when Redis lost its scripts). A job whose keys Redis
        refuses (a foreign key of the wrong type, an ACL on them) is a reject; one whose entry a
        peer reclaimed meanwhile is neither (it is the peer's now); the others go on."""
        now = now_ms()
        replies = self._take_round_trip(items, now)
        if any(isinstance(reply, redis.exceptions.NoScriptError) for reply in replies):
            Scripts.load(self.client)  # Redis restarted (or flushed its scripts): again, whole
            replies = self._take_round_trip(items, now)
        return self._taken(items, replies, now)

    def _take_round_trip(self, items: Sequence[tuple[Entry, Job]], now: int) -> list[Any]:
        pipe = self.client.pipeline(transaction=False)
        for entry, job in items:
            job_id = job.id or entry.entry_id
            self.scripts.take_owner(pipe, owner=self.keys.owner(job_id), token=self.token,
                                    job_id=job_id, keys=self.keys, stream=entry.stream,
                                    group=self.config.group, consumer=self.consumer,
                                    entry_id=entry.entry_id, t0_ms=entry_ms(entry.entry_id) or now,
                                    now_ms=now, ttl_s=self.config.owner_ttl_s)
            pipe.exists(self.keys.cancel(job_id))
            pipe.xrange(self.keys.out(job_id), "-", "+")
        return pipe.execute(raise_on_error=False)

    def _taken(self, items: Sequence[tuple[Entry, Job]], replies: list[Any], now: int
               ) -> tuple[list[Taken], list[Reject]]:
        taken: list[Taken] = []
        rejects: list[Reject] = []
        for k, (entry, job) in enumerate(items):
            mine = replies[3 * k:3 * k + 3]
            error = next((e for e in map(job_error, mine) if e is not None), None)
            if error is not None:
                rejects.append(Reject(entry, INTERNAL, f"Redis refused this job's keys: {error}",
                                      job.id or entry.entry_id, drop_owner=True, job=job))
                continue
            if mine[0] is None:  # pending to another consumer: a peer reclaimed it meanwhile
                self.log.warning("fenced out: a peer reclaimed the entry before it was taken",
                                 entry=entry.entry_id, job_id=job.id or entry.entry_id)
                continue
            crashes, excused, t0, started, fresh = mine[0]
            readback = Readback.parse(mine[2])
            before = not fresh or bool(readback.token_ids) or self.keys.is_requeue(entry.stream)
            taken.append(Taken(entry, job, readback, cancelled=bool(mine[1]),
                               t0_ms=int(t0 or now), started_ms=int(started or now),
                               started_before=before, crashes=int(crashes),
                               excused=int(excused), requeued=self.keys.is_requeue(entry.stream)))
        return taken, rejects

    def poisoned(self, t: Taken) -> Reject | None:
        """See `verdicts.poisoned`."""
        return poisoned(t, self.config.max_crashes, self.config.max_deliveries)

    @staticmethod
    def expired(t: Taken) -> Reject | None:
        """See `verdicts.expired`."""
        return expired(t, now_ms())

    def ack(self, entries: Iterable[Entry]) -> None:
        pipe = self.client.pipeline(transaction=False)
        for e in entries:
            pipe.xack(e.stream, self.config.group, e.entry_id)
            pipe.xdel(e.stream, e.entry_id)
        pipe.execute()

    # ------------------------------------------------------------------ dead letters

    def dead_letter(self, rejects: Sequence[Reject]) -> None:
        """See `DeadLetters.write`."""
        self.dead_letters.write(rejects)


def _pairs(flat: Sequence[Any]) -> dict[Any, Any]:
    """A flat [field, value, ...] reply as a dict."""
    return dict(zip(flat[::2], flat[1::2], strict=True))
