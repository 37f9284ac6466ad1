"""What `qworker jobs` shows, from Redis alone (docs/protocol.md, "Listing jobs"): the jobs in the
work streams (running, or waiting), the delayed ones (`<prefix>:delayed*`), and the jobs that
ended lately (`<prefix>:recent`, written by the workers with each terminal event, and
`<prefix>:dead`). Every read is bounded by `limit`."""

from __future__ import annotations

from dataclasses import asdict, dataclass
from typing import Any

import redis
from pydantic import ValidationError

from qworker_client.connect import is_cluster_client, slot_keys
from qworker_client.found_keys import FoundKeys, dead_keys, delayed_keys
from qworker_client.protocol import (
    DEFAULT_GROUP,
    DEFAULT_TENANT,
    Keys,
    RecentJob,
    TokenEvent,
    entry_ms,
    parse_entry_id,
    parse_event,
)
from qworker_client.stats import model_streams

MAX_LIMIT = 1_000
# the order rows are shown in: what holds a worker first, then what waits, then what ended
ORDER = ("running", "queued", "delayed", "done", "error", "dead")


@dataclass(frozen=True)
class JobRow:
    job_id: str
    status: str  # running | queued | delayed | done | error | dead
    model: str  # "" for a model-less job
    tokens: int | None  # generated so far (None: not known)
    since_ms: int  # queued (running, queued); due (delayed); ended (done, error, dead)
    detail: str = ""  # the finish reason or error code; the worker; the stream
    tenant: str = DEFAULT_TENANT

    def to_dict(self) -> dict[str, Any]:
        return {"id": self.job_id, **{k: v for k, v in asdict(self).items() if k != "job_id"}}


def list_jobs(client: redis.Redis, keys: Keys, limit: int,
              found: FoundKeys | None = None) -> list[JobRow]:
    """Up to `limit` jobs: running and waiting ones (oldest first), delayed ones (soonest
    first), then those that ended (newest first). `found`: the per-model keys as found before
    (else found now, by SCAN)."""
    limit = max(1, min(limit, MAX_LIMIT))
    rows = (queued(client, keys, limit, found) + delayed(client, keys, limit, found)
            + recent(client, keys, limit) + dead(client, keys, limit))
    rows.sort(key=_shown_order)
    return rows[:limit]


def _shown_order(row: JobRow) -> tuple[int, int]:
    """Running, then waiting jobs, oldest first; delayed ones, soonest first; then the ended
    ones, newest first."""
    if row.status in ("running", "queued", "delayed"):
        return ORDER.index(row.status), row.since_ms
    return len(ORDER), -row.since_ms


def queued(client: redis.Redis, keys: Keys, limit: int,
           found: FoundKeys | None = None) -> list[JobRow]:
    """The jobs in the work streams (acked entries are deleted: all of them are unfinished)."""
    entries: list[tuple[str, str, dict[str, str]]] = []
    streams = model_streams(client, keys, None if found is None else found.streams)
    for stream in (*keys.streams, *streams):
        for entry_id, fields in _entries(client.xrange(stream, "-", "+",
                                                       count=limit - len(entries))):
            entries.append((stream, entry_id, fields))
        if len(entries) >= limit:
            break
    pipe = client.pipeline(transaction=False)
    cluster = is_cluster_client(client)
    for stream, entry_id, fields in entries:
        job_id = fields.get("id") or entry_id
        job_keys = slot_keys(keys, cluster, keys.stream_model(stream)) if cluster else keys
        pipe.hmget(job_keys.owner(job_id), ["worker", "t0"])
        pipe.xrevrange(job_keys.out(job_id), count=1)
    replies = pipe.execute()
    over = over_quota(client, keys, {fields.get("tenant") or DEFAULT_TENANT
                                     for _, _, fields in entries})
    rows = []
    for k, (stream, entry_id, fields) in enumerate(entries):
        (token, t0), last = map(_text, replies[2 * k]), _entries(replies[2 * k + 1])
        worker = token.rpartition("/")[0] or token  # a fencing token is `<name>/<run>`
        tenant = fields.get("tenant") or DEFAULT_TENANT
        held = "held: quota " if not worker and tenant in over else ""
        rows.append(JobRow(
            fields.get("id") or entry_id, "running" if worker else "queued",
            keys.stream_model(stream) or fields.get("model", ""), _tokens(last),
            int(t0 or 0) or entry_ms(entry_id) or 0, f"{held}{worker} {stream}".strip(),
            tenant))
    return rows


def over_quota(client: redis.Redis, keys: Keys, tenants: set[str]) -> set[str]:
    """Those of `tenants` whose tokens of this minute have reached their quota: their queued
    jobs are held by the workers' fair read until the next minute."""
    if not tenants:
        return set()
    names = sorted(tenants)
    minute = server_ms(client) // 60_000
    limits = client.hmget(keys.tenants, names)
    used = client.hmget(keys.tpm(minute), names)
    over = set()
    for name, published, counted in zip(names, limits, used, strict=True):
        parts = _text(published).split()
        quota = int(parts[1]) if len(parts) > 1 and parts[1].isdigit() else 0
        if quota and int(_text(counted) or 0) >= quota:
            over.add(name)
    return over


def held_detail(client: redis.Redis, keys: Keys, job_id: str) -> str:
    """`held: quota` for a queued job whose tenant has used this minute's tokens (the fair read
    holds it until the next minute), else "". Its entry is found by its submit marker."""
    names = [s for s in (*keys.streams, *model_streams(client, keys)) if not keys.is_requeue(s)]
    _, _, fields, _ = find_entry(client, keys, job_id, _text(client.get(keys.submitted(job_id))),
                                 names)
    tenant = fields.get("tenant") or DEFAULT_TENANT
    return "held: quota" if fields and over_quota(client, keys, {tenant}) else ""


def find_entry(client: redis.Redis, keys: Keys, job_id: str, marker: str, names: list[str],
               group: str = DEFAULT_GROUP) -> tuple[str, str, dict[str, str], int | None]:
    """The job's entry in one of the job streams `names` (by its submit marker's entry id): the
    stream, the entry id, its fields, its deliveries in `group`; empty when it is not queued
    there (ended, requeued)."""
    if parse_entry_id(marker) is None:
        return "", "", {}, None
    pipe = client.pipeline(transaction=False)
    for stream in names:
        pipe.xrange(stream, marker, marker)
        pipe.xpending_range(stream, group, marker, marker, 1)
    replies = pipe.execute(raise_on_error=False)
    for k, stream in enumerate(names):
        hit, pending = replies[2 * k], replies[2 * k + 1]
        if isinstance(hit, list) and hit:
            fields = _entries(hit)[0][1]
            if (fields.get("id") or marker) != job_id:
                continue
            deliveries = (int(pending[0]["times_delivered"])
                          if isinstance(pending, list) and pending else None)
            return stream, marker, fields, deliveries
    return "", "", {}, None


def delayed(client: redis.Redis, keys: Keys, limit: int,
            found: FoundKeys | None = None) -> list[JobRow]:
    """The delayed jobs, the soonest of each delayed set (the model-less one, each model's)."""
    sets = {keys.delayed_of(None): ""}
    head = keys.delayed_of(None) + ":{"
    for key in delayed_keys(client, keys) if found is None else found.delayed:
        sets[key] = key[len(head):-1]
    rows = []
    for key, model in sets.items():
        pairs: Any = client.zrange(key, 0, limit - 1, withscores=True)
        rows += [JobRow(_text(job_id), "delayed", model, None, int(due), key)
                 for job_id, due in pairs]
    return rows


def recent(client: redis.Redis, keys: Keys, limit: int) -> list[JobRow]:
    rows = []
    for entry_id, fields in _entries(client.xrevrange(keys.recent, count=limit)):
        try:
            job = RecentJob.model_validate(fields)
        except ValidationError:
            continue  # not a worker's line
        rows.append(JobRow(job.id, job.status, job.model, job.tokens, entry_ms(entry_id) or 0,
                           f"{job.reason} {job.worker}".strip(), job.tenant))
    return rows


def dead(client: redis.Redis, keys: Keys, limit: int) -> list[JobRow]:
    """The newest dead letters (on a Cluster, each model's newest: `limit` of each)."""
    rows = []
    cluster = is_cluster_client(client)
    names = dead_keys(keys, cluster, model_streams(client, keys) if cluster else [])
    letters = [entry for name in names for entry in _entries(client.xrevrange(name, count=limit))]
    for entry_id, fields in letters:
        source = fields.get("source", "")
        rows.append(JobRow(fields.get("id") or fields.get("source_id", ""), "dead",
                           keys.stream_model(source) or fields.get("model", ""), None,
                           entry_ms(entry_id) or 0, fields.get("code", ""),
                           fields.get("tenant") or DEFAULT_TENANT))
    return rows


def _tokens(last: list[tuple[str, dict[str, str]]]) -> int:
    """Tokens generated so far, from the last event of the job's output stream."""
    if not last:
        return 0
    try:
        event = parse_event(last[0][1])
    except ValueError:
        return 0
    return event.i + 1 if isinstance(event, TokenEvent) else 0


def _entries(reply: Any) -> list[tuple[str, dict[str, str]]]:
    return [(_text(entry_id), {_text(k): _text(v) for k, v in (fields or {}).items()})
            for entry_id, fields in reply or ()]


def _text(value: bytes | str | None) -> str:
    if value is None:
        return ""
    return value.decode("utf-8", "replace") if isinstance(value, bytes) else value


def server_ms(client: redis.Redis) -> int:
    """Redis' clock (the one entry ids are made by), in unix ms."""
    seconds, micros = client.time()
    return int(seconds) * 1000 + int(micros) // 1000


def age(ms: int) -> str:
    """A duration as a short human text: 850ms, 12s, 5m, 3h, 2d."""
    for unit, size in (("d", 86_400_000), ("h", 3_600_000), ("m", 60_000), ("s", 1_000)):
        if abs(ms) >= size:
            return f"{ms // size}{unit}"
    return f"{ms}ms"
