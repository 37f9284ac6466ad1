"""What each dashboard page reads from Redis. Every page does a bounded number of Redis calls
(commands, pipelined ones counted one by one), whatever Redis holds:

- a fixed part, stated per page below (`*_CALLS`), in terms of the work streams shown (at most
  `MAX_STREAMS`), the workers shown (at most `MAX_WORKERS`) and the rows shown;
- plus, where the page is not given the keys found by SCAN (`found`: the app's `Directory` finds
  them in a thread of its own; the job page too for a job queued to a stream not found yet), the
  SCANs that find the workers' keys, the per-model streams and
  delayed sets: `scan_calls(keys)` per pattern, `keys` the number of keys in the database (SCAN
  looks at `SCAN_COUNT` a call).

tests/test_dashboard_reads.py counts them on a real redis-server."""

from __future__ import annotations

from collections import defaultdict
from dataclasses import dataclass, field
from typing import Any

import redis

from qworker_client import dead as dead_letters
from qworker_client.connect import is_cluster_client
from qworker_client.found_keys import SCAN_COUNT, FoundKeys, dead_keys, find_keys
from qworker_client.jobs import JobRow, find_entry, list_jobs, server_ms
from qworker_client.protocol import (
    BANDS,
    DEFAULT_GROUP,
    DoneEvent,
    Keys,
    TokenEvent,
    entry_ms,
    parse_entry_id,
)
from qworker_client.result import START_ID, OutputState
from qworker_client.stats import live_workers, streams_in_order

MAX_STREAMS = 48  # work streams shown (the model-less six first, then each model's)
MAX_WORKERS = 500  # live workers shown
MINUTES = 60  # the throughput series: the last hour, a minute a point
DEAD_HOUR_MAX = 1_000  # dead letters of the last hour counted, at most
JOBS_READ = 200  # jobs read for the jobs page (filtered among them), of which shown:
JOBS_SHOWN = 100
EVENTS_READ = 4_000  # a job's output events read for its page
RECENT_READ = 300  # `<prefix>:recent` entries looked through for the worker that ended a job
JOB_DEAD_READ = 200  # the newest dead letters looked through for a job's
DEAD_READ = dead_letters.CHUNK  # dead letters read for the dead letters page (codes counted)
DEAD_SHOWN = 100  # of which shown
RETRY_ALL_MAX = 100  # dead letters retried by one "retry all of a reason"
SCAN_PATTERNS = 4  # `find_keys`: the workers', the jobs' and requeue streams', the delayed sets'
DEAD_SCAN_CALLS = dead_letters.MAX_SCAN // dead_letters.CHUNK + 1  # `dead.newest` with a code

# the fixed part of each page's calls (the SCANs aside)
OVERVIEW_CALLS = 1 + 1 + 3 * MAX_STREAMS + MINUTES + 1  # TIME, MGET, per stream 3, minutes, dead
WORKERS_CALLS = 1 + 1 + MAX_WORKERS + 2 + MAX_STREAMS  # TIME, MGET, PTTLs, 2 minutes, consumers
JOBS_CALLS = 1 + MAX_STREAMS + 2 * JOBS_READ + MAX_STREAMS + 3  # TIME, XRANGEs, per job 2,
#   ZRANGE per delayed set (at most one per stream's model), recent, dead, TIME
JOB_CALLS = 1 + 7 + 2 * MAX_STREAMS  # TIME, one pipeline of 7, XRANGE + XPENDING per jobs stream
DEAD_CALLS = 1 + DEAD_SCAN_CALLS  # TIME, the dead letters' pages


def scan_calls(keys_in_db: int) -> int:
    """SCAN calls one pattern costs over a database of `keys_in_db` keys."""
    return keys_in_db // SCAN_COUNT + 1


def page_bound(page: str, keys_in_db: int, found: bool = False) -> int:
    """The most Redis calls `page` makes (docs: this module's); `found`: given the keys found."""
    # the job page finds the keys again for a job queued but not in a stream found (new model)
    scans = (0 if (found and page != "job") or page == "dead"
             else SCAN_PATTERNS * scan_calls(keys_in_db))
    return scans + {"overview": OVERVIEW_CALLS, "workers": WORKERS_CALLS, "jobs": JOBS_CALLS,
                    "job": JOB_CALLS, "dead": DEAD_CALLS}[page]


def streams(keys: Keys, found: FoundKeys) -> list[str]:
    """The work streams, model-less first, at most MAX_STREAMS."""
    fixed = [keys.jobs_of(None, band) for band in BANDS] + [keys.requeue_of(None, band)
                                                            for band in BANDS]
    return (fixed + streams_in_order(keys, found.streams))[:MAX_STREAMS]


# ---------------------------------------------------------------- overview


@dataclass
class QueueRow:
    """One model's band: its jobs' and its requeue stream together."""

    model: str
    band: str
    queued: int = 0  # new jobs not yet taken
    running: int = 0  # taken, not yet acked (both streams)
    requeued: int = 0  # preempted or drained, waiting to resume
    oldest_ms: int | None = None  # the oldest unfinished entry's time
    dead_hour: int = 0


@dataclass
class Series:
    """A model's last hour, a minute a point (oldest first): tokens and jobs ended."""

    model: str
    tokens: list[int] = field(default_factory=lambda: [0] * MINUTES)
    jobs: list[int] = field(default_factory=lambda: [0] * MINUTES)

    @property
    def peak(self) -> int:
        return max(self.tokens) or 1

    @property
    def tokens_per_s(self) -> float:
        """Over the last full minute."""
        return self.tokens[-2] / 60


@dataclass
class Overview:
    now_ms: int
    queues: list[QueueRow]
    series: list[Series]
    workers: int
    dead_hour: int  # capped at DEAD_HOUR_MAX
    dead_hour_capped: bool


def overview(client: redis.Redis, keys: Keys, group: str = DEFAULT_GROUP,
             found: FoundKeys | None = None) -> Overview:
    found = found or find_keys(client, keys)
    now = server_ms(client)
    names = streams(keys, found)
    workers = live_workers(client, keys, found.workers)
    minute = now // 60_000
    pipe = client.pipeline(transaction=False)
    for stream in names:
        pipe.xlen(stream)
        pipe.xinfo_groups(stream)
        pipe.xrange(stream, "-", "+", count=1)
    for m in range(minute - MINUTES + 1, minute + 1):
        pipe.hgetall(keys.throughput(m))
    dead_names = dead_keys(keys, is_cluster_client(client), found.streams)
    for name in dead_names:
        pipe.xrevrange(name, "+", str(now - 3_600_000), count=DEAD_HOUR_MAX)
    replies = pipe.execute(raise_on_error=False)
    rows: dict[tuple[str, str], QueueRow] = {}
    for k, stream in enumerate(names):
        length, groups, first = replies[3 * k: 3 * k + 3]
        model, band = keys.stream_model(stream) or "", keys.stream_band(stream)
        row = rows.setdefault((model, band), QueueRow(model, band))
        pending = _pending(groups, group)
        waiting = max(_int(length) - pending, 0)
        row.running += pending
        if keys.is_requeue(stream):
            row.requeued += waiting
        else:
            row.queued += waiting
        if isinstance(first, list) and first:
            ms = entry_ms(_text(first[0][0])) or now
            row.oldest_ms = ms if row.oldest_ms is None else min(row.oldest_ms, ms)
    minutes = replies[3 * len(names): 3 * len(names) + MINUTES]
    dead_reply = [entry for reply in replies[len(replies) - len(dead_names):]
                  if isinstance(reply, list) for entry in reply]
    for _, fields in dead_reply:
        source = _fields(fields).get("source", "")
        key = (keys.stream_model(source) or "", keys.stream_band(source) if source else "")
        rows.setdefault(key, QueueRow(*key)).dead_hour += 1
    shown = [r for r in rows.values() if r.queued or r.running or r.requeued or r.dead_hour
             or (r.model == "" and r.band == "")]
    shown.sort(key=lambda r: (r.model, BANDS.index(r.band) if r.band in BANDS else 9))
    return Overview(now, shown, _series(minutes), len(workers), len(dead_reply),
                    len(dead_reply) >= DEAD_HOUR_MAX)


def _series(minutes: list[Any]) -> list[Series]:
    by_model: dict[str, Series] = {}
    for k, counters in enumerate(minutes):
        if not isinstance(counters, dict):
            continue
        for name, value in counters.items():
            kind, _, model = _text(name).partition(":")
            if kind in ("tokens", "jobs"):
                series = by_model.setdefault(model, Series(model))
                getattr(series, kind)[k] = _int(value)
    return [by_model[m] for m in sorted(by_model)]


def _pending(groups: Any, group: str) -> int:
    if not isinstance(groups, list):
        return 0  # no stream (an error reply), or no groups
    for info in groups:
        if _text(info.get("name", "")) == group:
            return _int(info.get("pending", 0))
    return 0


# ---------------------------------------------------------------- workers


@dataclass
class WorkerRow:
    info: dict[str, Any]
    beat_age_ms: int | None  # since its last beat (None: not known)
    tokens_per_s: float  # over the last full minute

    @property
    def name(self) -> str:
        return str(self.info.get("name", ""))

    @property
    def stalled(self) -> bool:
        """It missed a beat (it beats three times per TTL): stuck, or cut off from Redis."""
        liveness = int(self.info.get("liveness_ms") or 0)
        return bool(liveness and self.beat_age_ms is not None
                    and self.beat_age_ms > liveness // 2)


@dataclass
class GoneWorker:
    """A consumer of the group with no liveness key: a worker that died (or left uncleanly)."""

    name: str
    stream: str
    pending: int
    idle_ms: int


@dataclass
class Workers:
    now_ms: int
    live: list[WorkerRow]
    gone: list[GoneWorker]


def workers(client: redis.Redis, keys: Keys, group: str = DEFAULT_GROUP,
            found: FoundKeys | None = None) -> Workers:
    found = found or find_keys(client, keys)
    now = server_ms(client)
    live = live_workers(client, keys, found.workers[:MAX_WORKERS])
    names = streams(keys, found)
    minute = now // 60_000
    pipe = client.pipeline(transaction=False)
    for info in live:
        pipe.pttl(keys.worker(str(info.get("name", ""))))
    pipe.hgetall(keys.throughput(minute - 1))
    pipe.hgetall(keys.throughput(minute))
    for stream in names:
        pipe.xinfo_consumers(stream, group)
    replies = pipe.execute(raise_on_error=False)
    last_minute = _fields(replies[len(live)] if isinstance(replies[len(live)], dict) else {})
    rows = []
    for info, ttl in zip(live, replies[:len(live)], strict=True):
        liveness = int(info.get("liveness_ms") or 0)
        age = liveness - _int(ttl) if liveness and _int(ttl) > 0 else None
        tokens = _int(last_minute.get(f"worker:{info.get('name', '')}", 0))
        rows.append(WorkerRow(info, age, tokens / 60))
    alive = {row.name for row in rows}
    gone = []
    for stream, consumers in zip(names, replies[len(live) + 2:], strict=True):
        for consumer in consumers if isinstance(consumers, list) else ():
            name = _text(consumer.get("name", ""))
            if name not in alive:
                gone.append(GoneWorker(name, stream, _int(consumer.get("pending", 0)),
                                       _int(consumer.get("idle", 0))))
    gone.sort(key=lambda g: (-g.pending, g.idle_ms))
    return Workers(now, rows, gone[:MAX_WORKERS])


# ---------------------------------------------------------------- jobs


@dataclass
class Jobs:
    now_ms: int
    rows: list[JobRow]
    models: list[str]
    read: int  # rows read before filtering (at most JOBS_READ)


def jobs(client: redis.Redis, keys: Keys, status: str = "", model: str = "",
         found: FoundKeys | None = None) -> Jobs:
    """The first JOBS_READ jobs (`qworker jobs`' order: running, queued, delayed, then the ended
    ones newest first), of `status` and `model` when given (`-`: the model-less jobs), at most
    JOBS_SHOWN."""
    now = server_ms(client)
    rows = list_jobs(client, keys, JOBS_READ, found or find_keys(client, keys))
    models = sorted({r.model for r in rows})
    wanted = "" if model == "-" else model
    chosen = [r for r in rows if (not status or r.status == status)
              and (not model or r.model == wanted)]
    return Jobs(now, chosen[:JOBS_SHOWN], models, len(rows))


# ---------------------------------------------------------------- one job


@dataclass
class Job:
    job_id: str
    now_ms: int
    status: str  # queued | running | done | error | dead | unknown
    fields: dict[str, str]  # its own fields, when found (queued, running, or its dead letter)
    stream: str  # where it was found queued ("" when not)
    owner: dict[str, str]  # worker (fencing token), t0, started, crashes, excused
    deliveries: int | None  # its entry's deliveries (XPENDING), when running
    text: str  # the text so far
    tokens: int
    last_entry: str  # the last output entry id read: where the live stream resumes
    first_token_ms: int | None
    ended_ms: int | None
    finish_reason: str
    error: str
    workers: list[str]  # the workers seen running or ending it
    dead: dead_letters.DeadLetter | None
    cancel_flagged: bool
    events_capped: bool

    @property
    def queued_ms(self) -> int | None:
        """When it was first queued: its owner hash's `t0`, else its entry's time, else (ended)
        its end less its total time."""
        t0 = self.owner.get("t0")
        if t0 and t0.isdigit():
            return int(t0)
        if self.fields_entry:
            return entry_ms(self.fields_entry)
        if self.done is not None and self.ended_ms is not None:
            return self.ended_ms - self.done.total_ms
        return None

    fields_entry: str = ""

    done: DoneEvent | None = None

    @property
    def ttft_ms(self) -> int | None:
        if self.done is not None:
            return self.done.ttft_ms
        q = self.queued_ms
        return None if q is None or self.first_token_ms is None else self.first_token_ms - q

    @property
    def total_ms(self) -> int | None:
        if self.done is not None:
            return self.done.total_ms
        q = self.queued_ms
        return None if q is None or self.ended_ms is None else self.ended_ms - q

    @property
    def ended(self) -> bool:
        return self.status in ("done", "error", "dead")


def job(client: redis.Redis, keys: Keys, job_id: str, group: str = DEFAULT_GROUP,
        found: FoundKeys | None = None) -> Job:
    now = server_ms(client)
    pipe = client.pipeline(transaction=False)
    pipe.hgetall(keys.owner(job_id))
    pipe.get(keys.submitted(job_id))
    pipe.xrange(keys.out(job_id), "-", "+", count=EVENTS_READ)
    pipe.xrevrange(keys.out(job_id), "+", "-", count=1)
    pipe.exists(keys.cancel(job_id))
    pipe.xrevrange(keys.recent, "+", "-", count=RECENT_READ)
    pipe.xrevrange(keys.dead, "+", "-", count=JOB_DEAD_READ)
    owner_raw, marker, first, last, flagged, recent, dead_raw = pipe.execute()
    owner = {_text(k): _text(v) for k, v in (owner_raw or {}).items()}
    events = [(_text(e), _fields(f)) for e, f in first]
    if last and _text(last[0][0]) != (events[-1][0] if events else ""):
        events.append((_text(last[0][0]), _fields(last[0][1])))  # the end, past EVENTS_READ
    text, tokens, first_ms, ended_ms, done, error = _read_events(events)
    letter = next((dead_letters.DeadLetter(_text(e), _fields(f)) for e, f in dead_raw
                   if (_fields(f).get("id") or _fields(f).get("source_id")) == job_id), None)
    found_entry = find_entry(client, keys, job_id, _text(marker),
                             _job_streams(keys, found or find_keys(client, keys)), group)
    if marker and not found_entry[0] and found is not None:  # queued to a stream found since?
        found_entry = find_entry(client, keys, job_id, _text(marker),
                                 _job_streams(keys, find_keys(client, keys)), group)
    stream, entry, fields, deliveries = found_entry
    if not fields and letter is not None:
        fields = {k: v for k, v in letter.fields.items()}
    worker = owner.get("worker", "").rpartition("/")[0] or owner.get("worker", "")
    seen = [worker] if worker else []
    for _, f in recent:
        fields_r = _fields(f)
        if fields_r.get("id") == job_id and fields_r.get("worker") not in seen:
            seen.append(fields_r.get("worker", ""))
            break
    status = ("done" if done is not None else "error" if error
              else "dead" if letter is not None else "running" if worker or tokens
              else "queued" if stream or marker else "unknown")
    return Job(job_id, now, status, fields, stream, owner, deliveries, text, tokens,
               events[-1][0] if events else "0-0", first_ms, ended_ms,
               done.finish_reason if done else "", error, [w for w in seen if w], letter,
               bool(flagged), len(first) >= EVENTS_READ, fields_entry=entry, done=done)


def _job_streams(keys: Keys, found: FoundKeys) -> list[str]:
    return [s for s in streams(keys, found) if not keys.is_requeue(s)]


def _read_events(events: list[tuple[str, dict[str, str]]]
                 ) -> tuple[str, int, int | None, int | None, DoneEvent | None, str]:
    """The text, tokens, first token's time, end's time, done event and error of `events`, read
    as the client reads them (`OutputState`)."""
    state = OutputState("", START_ID)
    parts: list[str] = []
    first_ms = ended_ms = None
    for entry_id, fields in events:
        try:
            event = state.apply(entry_id, fields)
        except ValueError:
            continue  # not an event
        if isinstance(event, TokenEvent):
            parts.append(event.text)
            first_ms = first_ms if first_ms is not None else entry_ms(entry_id)
        elif event is not None:
            ended_ms = entry_ms(entry_id)
    text = state.done.text if state.done is not None else "".join(parts)
    error = f"{state.error.code}: {state.error.message}" if state.error is not None else ""
    return text, state.next_index, first_ms, ended_ms, state.done, error


# ---------------------------------------------------------------- dead letters


@dataclass
class Dead:
    now_ms: int
    letters: list[dead_letters.DeadLetter]  # the newest DEAD_SHOWN
    codes: dict[str, int]  # among the newest DEAD_READ: how many of each code
    read: int


def dead(client: redis.Redis, views: list[Keys], code: str = "") -> Dead:
    """The newest dead letters (on a Cluster `views` are each model's keys: theirs, merged)."""
    now = server_ms(client)
    letters = sorted((letter for keys in views
                      for letter in dead_letters.newest(client, keys, DEAD_READ, code or None)),
                     key=lambda d: parse_entry_id(d.entry_id) or (0, 0),
                     reverse=True)[:DEAD_READ]
    codes: dict[str, int] = defaultdict(int)
    for letter in letters:
        codes[letter.code] += 1
    return Dead(now, letters[:DEAD_SHOWN], dict(sorted(codes.items())), len(letters))


# ---------------------------------------------------------------- helpers


def _fields(raw: Any) -> dict[str, str]:
    return {_text(k): _text(v) for k, v in (raw or {}).items()}


def _text(value: Any) -> str:
    if value is None:
        return ""
    return value.decode("utf-8", "replace") if isinstance(value, bytes) else str(value)


def _int(value: Any) -> int:
    try:
        return int(value)
    except (TypeError, ValueError):
        return 0
