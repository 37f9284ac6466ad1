"""Dead letters from Redis alone (docs/protocol.md, "Dead letters"): list, show, retry, purge.

Reading is bounded: the dead-letter stream is trimmed by the workers (`--dead-maxlen`), and no
call here looks at more than MAX_SCAN of its entries.
"""

from __future__ import annotations

import re
from collections.abc import Iterator
from dataclasses import dataclass, field
from typing import Any

import redis

from qworker_client.protocol import (
    DEAD_META_FIELDS,
    JobValidationError,
    Keys,
    band_of,
    entry_ms,
    parse_job_fields,
)
from qworker_client.scripts import RETRY_SCRIPT

MAX_SCAN = 20_000  # dead letters looked at by one call, at most
CHUNK = 500  # entries per XRANGE
_ENTRY_ID = re.compile(r"^[0-9]{1,20}-[0-9]{1,20}$")


@dataclass(frozen=True)
class DeadLetter:
    """One entry of `<prefix>:dead`: why (the meta fields) and a bounded copy of the job."""

    entry_id: str
    fields: dict[str, str] = field(repr=False)

    @property
    def code(self) -> str:
        return self.fields.get("code", "")

    @property
    def reason(self) -> str:
        return self.fields.get("reason", "")

    @property
    def source(self) -> str:
        return self.fields.get("source", "")

    @property
    def source_id(self) -> str:
        return self.fields.get("source_id", "")

    @property
    def job_id(self) -> str:
        """Its `id` field, else the entry id it had (a job without `id` is named by its entry)."""
        return self.fields.get("id") or self.source_id

    @property
    def name(self) -> str:
        return f"dead letter {self.entry_id} (job {self.job_id})"

    @property
    def dead_ms(self) -> int:
        return entry_ms(self.entry_id) or 0

    def original(self) -> dict[str, str]:
        """The job's own fields, as they were queued. ValueError when the copy was cut (a value
        too long, fields left out): that job cannot be rebuilt from its dead letter."""
        cut = [name.removesuffix("_truncated_bytes") for name in self.fields
               if name.endswith("_truncated_bytes")]
        if cut or "dropped_fields" in self.fields:
            what = f"field {cut[0]!r} was cut" if cut else "fields were left out"
            raise ValueError(f"{self.name}: holds a cut copy of its job ({what})")
        return {name.removeprefix("original."): value for name, value in self.fields.items()
                if name not in DEAD_META_FIELDS}

    def to_dict(self) -> dict[str, Any]:
        return {"entry_id": self.entry_id, "job_id": self.job_id, "fields": self.fields}


@dataclass(frozen=True)
class Retried:
    job_id: str
    stream: str  # where it went
    entry_id: str


def newest(client: redis.Redis, keys: Keys, count: int, code: str | None = None
           ) -> list[DeadLetter]:
    """The newest `count` dead letters (of `code` only, when given), newest first."""
    found = []
    for letter in _scan(client, keys, newest_first=True):
        if code is None or letter.code == code:
            found.append(letter)
            if len(found) >= count:
                break
    return found


def find(client: redis.Redis, keys: Keys, ref: str) -> DeadLetter | None:
    """A dead letter by its entry id in `<prefix>:dead`, or the newest of a job id."""
    if _ENTRY_ID.fullmatch(ref):
        hit = _entries(client.xrange(keys.dead, ref, ref))
        if hit:
            return DeadLetter(*hit[0])
    return next((d for d in _scan(client, keys, newest_first=True) if d.job_id == ref), None)


def retry(client: redis.Redis, keys: Keys, letter: DeadLetter, marker_ttl_s: int) -> Retried:
    """Queue the job again under its id, afresh (RETRY_SCRIPT), on its model's stream of its
    priority's band. ValueError when it cannot be: a cut copy, a job that is not valid, or the
    script's refusal (`gone`, `held`, `running`)."""
    fields = letter.original()
    fields["id"] = letter.job_id  # a job without `id` kept its entry id as its id
    try:
        job = parse_job_fields(fields, letter.job_id)
    except JobValidationError as exc:
        raise ValueError(f"{letter.name}: not a valid job: {exc.message}") from None
    stream = keys.jobs_of(keys.stream_model(letter.source) or job.model, band_of(job.priority))
    flat = [item for pair in fields.items() for item in pair]
    script_keys = [keys.dead, stream, keys.out(letter.job_id), keys.owner(letter.job_id),
                   keys.submitted(letter.job_id)]
    done, detail = client.eval(RETRY_SCRIPT, len(script_keys), *script_keys, letter.entry_id,
                               marker_ttl_s, *flat)
    detail = detail.decode() if isinstance(detail, bytes) else str(detail)
    if not int(done):
        raise ValueError(f"{letter.name}: not retried: {_REFUSED.get(detail, detail)}")
    return Retried(letter.job_id, stream, detail)


_REFUSED = {"gone": "it is no longer there (retried or purged)",
            "held": "a job with its id is queued or running again",
            "running": "its output stream does not end: a job with its id is running"}


def purge(client: redis.Redis, keys: Keys, limit: int, code: str | None = None,
          before_ms: int | None = None, dry_run: bool = False) -> list[DeadLetter]:
    """Delete the oldest dead letters (at most `limit`; of `code`, dead before `before_ms`, when
    given); with `dry_run`, only say which."""
    chosen = []
    for letter in _scan(client, keys, newest_first=False):
        if before_ms is not None and letter.dead_ms >= before_ms:
            break  # oldest first: the rest are younger
        if code is None or letter.code == code:
            chosen.append(letter)
            if len(chosen) >= limit:
                break
    if chosen and not dry_run:
        for start in range(0, len(chosen), CHUNK):
            client.xdel(keys.dead, *[d.entry_id for d in chosen[start:start + CHUNK]])
    return chosen


def _scan(client: redis.Redis, keys: Keys, newest_first: bool) -> Iterator[DeadLetter]:
    """The dead letters in order, CHUNK at a time, at most MAX_SCAN."""
    bound, seen = ("+" if newest_first else "-"), 0
    while seen < MAX_SCAN:
        page = _entries(client.xrevrange(keys.dead, bound, "-", count=CHUNK) if newest_first
                        else client.xrange(keys.dead, bound, "+", count=CHUNK))
        for entry_id, fields in page:
            yield DeadLetter(entry_id, fields)
        seen += len(page)
        if len(page) < CHUNK:
            return
        bound = "(" + page[-1][0]


def _entries(reply: Any) -> list[tuple[str, dict[str, str]]]:
    """An XRANGE reply as (entry id, fields) pairs of text."""
    return [(_text(entry_id), {_text(k): _text(v) for k, v in fields.items()})
            for entry_id, fields in reply or ()]


def _text(value: bytes | str) -> str:
    return value.decode("utf-8", "replace") if isinstance(value, bytes) else value
