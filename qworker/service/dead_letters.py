"""Dead letters: an entry that will not run is copied to `<prefix>:dead` (bounded), its job gets
its error event, and only then is it acked (`scripts.DEAD_LETTER`, one atomic step each)."""

from __future__ import annotations

from collections.abc import Sequence

import redis

from qworker.service.config import ServiceConfig
from qworker.service.errors import job_error
from qworker.service.job import Entry, RawFields, Reject
from qworker.service.scripts import Scripts
from qworker_client.protocol import DEAD_META_FIELDS, ErrorEvent, Keys, event_to_fields

MAX_REASON_CHARS = 1_000
# A dead letter copies at most this much of an entry (a hostile one may hold thousands of fields
# or values of many MiB); what is cut is noted: `<name>_truncated_bytes` (the original size) and
# `dropped_fields` (how many fields were left out).
MAX_DEAD_FIELDS = 64
MAX_DEAD_VALUE_BYTES = 4_096
MAX_DEAD_NAME_BYTES = 256
MAX_DEAD_BYTES = 32_768  # all copied values together


class DeadLetters:
    def __init__(self, client: redis.Redis, keys: Keys, config: ServiceConfig,
                 scripts: Scripts) -> None:
        self.client = client
        self.keys = keys
        self.config = config
        self.scripts = scripts

    def write(self, rejects: Sequence[Reject]) -> None:
        """For each reject still pending: a `<prefix>:dead` entry (reason + the original fields,
        bounded) and the job's error event, then the ack; one round trip, safe to retry. A
        reject whose own keys Redis refuses (an ACL on them; a script's keys are checked before
        it runs) is dead-lettered again without them: no error event, but never left pending."""
        if not rejects:
            return
        replies = self._dead_letters(rejects, with_job_keys=True)
        if any(isinstance(reply, redis.exceptions.NoScriptError) for reply in replies):
            Scripts.load(self.client)  # Redis restarted (or flushed its scripts): again, whole
            replies = self._dead_letters(rejects, with_job_keys=True)
        refused = [r for r, reply in zip(rejects, replies, strict=True)
                   if job_error(reply) is not None]
        if refused:
            for reply in self._dead_letters(refused, with_job_keys=False):
                if isinstance(reply, Exception):
                    raise reply  # the job stream or the dead stream: the worker's own keys

    def _dead_letters(self, rejects: Sequence[Reject], with_job_keys: bool) -> list[object]:
        pipe = self.client.pipeline(transaction=False)
        for r in rejects:
            self._queue_dead_letter(pipe, r, with_job_keys)
        return pipe.execute(raise_on_error=False)

    def _queue_dead_letter(self, pipe: redis.client.Pipeline, r: Reject,
                           with_job_keys: bool = True) -> None:
        message = r.message[:MAX_REASON_CHARS]
        fields = dead_fields(r.entry, r.code, message, self.config.name)
        out = self.keys.out(r.job_id) if r.job_id and with_job_keys else None
        error = event_to_fields(ErrorEvent(code=r.code, message=message))
        owner = self.keys.owner(r.job_id) if out and r.job_id and r.drop_owner else None
        self.scripts.dead_letter(pipe, source=r.entry.stream, dead=self.keys.dead,
                                 group=self.config.group, entry_id=r.entry.entry_id,
                                 ttl_s=self.config.result_ttl_of(r.job),
                                 dead_maxlen=self.config.dead_maxlen, dead_fields=fields,
                                 out=out, error_fields=error, owner=owner)


def dead_fields(entry: Entry, code: str, reason: str, worker: str) -> RawFields:
    """A dead-letter entry: reason, code, source stream and entry, worker, then the original
    fields (one named like a meta field is kept as `original.<name>`), bounded: at most
    MAX_DEAD_FIELDS fields and MAX_DEAD_BYTES of values, each cut to MAX_DEAD_VALUE_BYTES with its
    original size in `<name>_truncated_bytes`; `dropped_fields` counts the fields left out."""
    meta = dict(zip(DEAD_META_FIELDS, (reason, code, entry.stream, entry.entry_id, worker),
                    strict=True))
    fields: RawFields = {k.encode(): v.encode() for k, v in meta.items()}
    budget, dropped = MAX_DEAD_BYTES, 0
    for n, (key, value) in enumerate(entry.fields.items()):
        v = _bytes(value)
        if n >= MAX_DEAD_FIELDS or budget <= 0:
            dropped += 1
            continue
        k = _bytes(key)[:MAX_DEAD_NAME_BYTES]
        if k in fields:
            k = b"original." + k
        cut = min(MAX_DEAD_VALUE_BYTES, budget)
        fields[k] = v[:cut]
        budget -= len(fields[k])
        if len(v) > cut:
            fields[k + b"_truncated_bytes"] = str(len(v)).encode()
    if dropped:
        fields[b"dropped_fields"] = str(dropped).encode()
    return fields


def _bytes(value: object) -> bytes:
    return value if isinstance(value, bytes) else str(value).encode()
