"""Calling the worker's server-side scripts (their text and what each does: lua.py): by SHA,
inside pipelines (one round trip); `NoScriptError` (after a Redis restart) is answered by `load`
and a retry of the whole, idempotent, pipeline."""
from __future__ import annotations

import hashlib
import json
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any, cast

import redis

from qworker.service.affinity import Affinity
from qworker.service.fair_jump import NO_JUMPS, Jumps
from qworker.service.lua import (
    APPEND,
    BEAT,
    DEAD_LETTER,
    DROP_CONSUMER,
    LOST_STATE_MESSAGE,
    READ,
    REQUEUE,
    TAKE_OWNER,
)
from qworker.service.lua_affinity import AFFINITY_READ, FAIR_AFFINITY_READ
from qworker.service.lua_delayed import DEFER, PROMOTE
from qworker.service.lua_fair import FAIR_READ, PARKED_CONSUMER
from qworker.service.usage import minute_now
from qworker_client.protocol import LOST_STATE, ErrorEvent, Keys, WireFields, event_to_fields

# new entries parked per job stream per fair read (their order is decided once parked)
PARK_BATCH = 256


def alone_key(keys: Keys, token: str) -> str:
    """Names the job that the worker with fencing token `token` does something with alone now
    (starts it as a reclaimed job, or steps it alone); absent when none. Set before it begins."""
    return keys.alone(token)


def _sha(text: str) -> str:
    return hashlib.sha1(text.encode()).hexdigest()


def _flat(fields: WireFields) -> list[bytes | str]:
    out: list[bytes | str] = []
    for key, value in fields.items():
        out += [key, value]
    return out


# the event the append and requeue scripts end a job with when its owner hash is gone
LOST_STATE_EVENT = json.dumps(_flat(event_to_fields(ErrorEvent(code=LOST_STATE,
                                                               message=LOST_STATE_MESSAGE))))


@dataclass(frozen=True)
class JobAppend:
    """One job's share of an `append` call: its keys, its entry, its new events, how long its
    output lives after its terminal event, whether it was checked under the present lease, and
    the TTL its output gets now while it goes on (0: leave it)."""

    out: str
    owner: str
    source: str
    entry_id: str
    events: Sequence[Mapping[str, str]]
    ttl_s: int
    trusted: bool = False
    refresh_s: int = 0


@dataclass(frozen=True)
class Lease:
    """What an `append` call tells of the worker's lease: the value it set last ('' none), the
    takeovers it saw then, the next value (never used before) and its TTL."""

    key: str
    takeovers_key: str
    held: str
    takeovers: str
    next: str
    ttl_ms: int


@dataclass(frozen=True)
class Scripts:
    """The scripts' SHAs; `append` / `requeue` / `dead_letter` queue an EVALSHA on a pipeline;
    `affinity`: the worker's prefix affinity, when on (its reads are the affinity reads)."""

    append_sha: str = _sha(APPEND)
    requeue_sha: str = _sha(REQUEUE)
    dead_letter_sha: str = _sha(DEAD_LETTER)
    beat_sha: str = _sha(BEAT)
    take_owner_sha: str = _sha(TAKE_OWNER)
    drop_consumer_sha: str = _sha(DROP_CONSUMER)
    read_sha: str = _sha(READ)
    fair_read_sha: str = _sha(FAIR_READ)
    affinity_read_sha: str = _sha(AFFINITY_READ)
    fair_affinity_read_sha: str = _sha(FAIR_AFFINITY_READ)
    affinity: Affinity | None = None
    defer_sha: str = _sha(DEFER)
    promote_sha: str = _sha(PROMOTE)

    @staticmethod
    def load(client: redis.Redis) -> None:
        for text in (APPEND, REQUEUE, DEAD_LETTER, BEAT, DROP_CONSUMER, TAKE_OWNER, READ, DEFER,
                     PROMOTE, FAIR_READ, AFFINITY_READ, FAIR_AFFINITY_READ):
            client.script_load(text)

    def read(self, client: redis.Redis | redis.client.Pipeline, *, group: str, consumer: str,
             caps: Sequence[tuple[str, int]], fair: Keys | None = None,
             jumps: Jumps | None = None) -> Any:
        """New entries of the (stream, cap) pairs in order, within the caps (READ; with `fair`,
        the keys of the fair share, FAIR_READ: each job stream's tenants in proportion to their
        weights, within their tokens per minute when some have a quota); on a pipeline the reply
        comes with the pipeline's (`intake.capped_entries` reads it). With `self.affinity`,
        the reads that offer a session's job to its worker first (lua_affinity.py): their reply
        is {that reply, wake ms} (`affinity.split_reply`). `jumps`: a full worker's offer to
        preempt for a fair share (fair_jump.py; the fair reads only)."""
        affinity = self.affinity
        if fair is None:
            return self._plain_read(client, group, consumer, caps)
        k = fair
        keys = [k.tenants, k.tpm(minute_now()), k.running]
        args: list[str | int] = [group, consumer, PARKED_CONSUMER, PARK_BATCH,
                                 k.ready_of(k.jobs)]
        if affinity is not None:
            more_keys, more_args = affinity.head()
            keys += more_keys
            args += more_args
        for stream, cap in caps:
            keys += ([stream] if k.is_requeue(stream) else
                     [stream, k.ready_of(stream), k.vtime_of(stream), k.held_of(stream)])
            if affinity is not None:
                keys += affinity.stream_keys(stream)
            args.append(cap)
        args.append(jumps.arg() if jumps is not None else NO_JUMPS)
        sha = self.fair_read_sha if affinity is None else self.fair_affinity_read_sha
        return client.evalsha(sha, len(keys), *keys, *args)

    def _plain_read(self, client: redis.Redis | redis.client.Pipeline, group: str,
                    consumer: str, caps: Sequence[tuple[str, int]]) -> Any:
        """READ, or AFFINITY_READ with `self.affinity`."""
        if self.affinity is None:
            return client.evalsha(self.read_sha, len(caps), *(s for s, _ in caps), group,
                                  consumer, *(cap for _, cap in caps))
        keys, args = self.affinity.head()
        for stream, _ in caps:
            keys += [stream, *self.affinity.stream_keys(stream)]
        return client.evalsha(self.affinity_read_sha, len(keys), *keys, group, consumer, *args,
                              *(cap for _, cap in caps))

    def append(self, pipe: redis.client.Pipeline, *, token: str, group: str,
               jobs: Sequence[JobAppend], lease: Lease) -> None:
        """One EVALSHA appending the events of all `jobs`; its reply: [one status per job, the
        takeovers counter, 1 if the lease held]."""
        keys = [key for job in jobs for key in (job.out, job.owner, job.source)]
        keys += [lease.key, lease.takeovers_key]
        payload: list[object] = []
        for job in jobs:
            payload += [job.entry_id, job.ttl_s, int(job.trusted), job.refresh_s, len(job.events)]
            for fields in job.events:
                flat = _flat(fields)
                payload.append(len(flat))
                payload += flat
        pipe.evalsha(self.append_sha, len(keys), *keys, token, group,
                     json.dumps(payload, ensure_ascii=False, separators=(",", ":")),
                     LOST_STATE_EVENT, lease.held, lease.takeovers, lease.next, lease.ttl_ms)

    def requeue(self, pipe: redis.client.Pipeline, *, owner: str, source: str, requeue: str,
                out: str, token: str, group: str, entry_id: str, ttl_s: int,
                fields: WireFields) -> None:
        pipe.evalsha(self.requeue_sha, 4, owner, source, requeue, out, token, group, entry_id,
                     ttl_s, LOST_STATE_EVENT, *_flat(fields))

    def dead_letter(self, pipe: redis.client.Pipeline, *, source: str, dead: str, group: str,
                    entry_id: str, ttl_s: int, dead_maxlen: int, dead_fields: WireFields,
                    out: str | None = None, error_fields: WireFields | None = None,
                    owner: str | None = None) -> None:
        """Reply: 0 (not pending: done before), 1 (dead-lettered), 2 (and the error event)."""
        keys: list[str] = [source, dead]
        if out is not None:
            keys.append(out)
            if owner is not None:
                keys.append(owner)
        flat = _flat(dead_fields)
        args = [group, entry_id, ttl_s, dead_maxlen, len(flat), *flat]
        if out is not None:
            args += _flat(error_fields or {})
        pipe.evalsha(self.dead_letter_sha, len(keys), *keys, *args)

    def take_owner(self, pipe: redis.client.Pipeline, *, owner: str, token: str, job_id: str,
                   keys: Keys, stream: str, group: str, consumer: str, entry_id: str,
                   t0_ms: int, now_ms: int, ttl_s: int) -> None:
        """Reply: [crashes, excused, t0, started, 1 if first started now] of the job, the
        previous owner's death counted; None when another consumer holds the entry."""
        pipe.evalsha(self.take_owner_sha, 3, owner, stream, keys.takeovers, token,
                     job_id, alone_key(keys, ""), group, consumer, entry_id, t0_ms, now_ms,
                     ttl_s)

    def beat(self, client: redis.Redis | redis.client.Pipeline, *, group: str, consumer: str,
             token: str, owner_ttl_s: int, worker_key: str, info: str, liveness_ms: int,
             entries: Sequence[tuple[str, str, str]]) -> object:
        """`entries`: (stream, entry id, owner hash) of each in-flight job. Reply: how many
        entries were still ours and got re-claimed."""
        keys: list[str] = []
        for stream, _, owner in entries:
            keys += [stream, owner]
        ids = [entry_id for _, entry_id, _ in entries]
        return client.evalsha(self.beat_sha, len(keys) + 1, *keys, worker_key, group, consumer,
                              token, owner_ttl_s, info, liveness_ms, *ids)

    def drop_consumer(self, client: redis.Redis, *, stream: str, worker_key: str, group: str,
                      consumer: str, min_idle_ms: int) -> bool:
        return bool(client.evalsha(self.drop_consumer_sha, 2, stream, worker_key, group,
                                   consumer, min_idle_ms))


    def defer(self, pipe: redis.client.Pipeline, *, stream: str, delayed: str,
              delayed_jobs: str, group: str, consumer: str, entry_id: str, job_id: str,
              delay_ms: int, not_before_ms: int, job_json: str) -> None:
        """Reply: [-1 (not ours) | 0 (due: run it) | 1 (delayed) | 2 (its id is delayed
        already), the job's time in unix ms]."""
        pipe.evalsha(self.defer_sha, 3, stream, delayed, delayed_jobs, group, consumer,
                     entry_id, job_id, delay_ms, not_before_ms, job_json)

    def promote(self, client: redis.Redis, *, delayed: str, delayed_jobs: str,
                streams: Sequence[str], count: int) -> tuple[int, int]:
        """(jobs moved, ms until the next one's time or -1) of one delayed set; `streams`: its
        model's job streams of the bands high, normal, low."""
        moved, wait_ms = cast(list[int], client.evalsha(self.promote_sha, 5, delayed,
                                                        delayed_jobs, *streams, count))
        return int(moved), int(wait_ms)


def decode_status(value: object) -> str:
    if isinstance(value, bytes):
        return value.decode()
    if isinstance(value, list):
        return decode_status(value[0])
    return str(value)
