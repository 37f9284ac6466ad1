"""The recent-jobs stream (`<prefix>:recent`, what `qworker jobs` shows of ended jobs): one entry
per job whose terminal event this worker wrote, added right after it (not in the same atomic step:
an entry may be missing, e.g. when the worker dies in between), trimmed to about `recent_maxlen`.
Best effort: a Redis error costs only the entries, never a job (an ACL without the key is said
once in the log). With them, the minute's throughput counters (`Keys.throughput`: tokens and jobs
per model, tokens per worker; the dashboard's last hour), by this worker's clock."""

from __future__ import annotations

import time
from collections.abc import Mapping, Sequence

import redis
from redis.typing import EncodableT, FieldT

from qworker.service.config import ServiceConfig
from qworker.service.job import ActiveJob
from qworker.service.logs import get_logger
from qworker.service.outcome import DONE
from qworker_client.protocol import THROUGHPUT_TTL_S, DoneEvent, ErrorEvent, Keys, RecentJob


class Recent:
    def __init__(self, client: redis.Redis, keys: Keys, config: ServiceConfig) -> None:
        self.client = client
        self.keys = keys
        self.config = config
        self.log = get_logger(worker=config.name)
        self._failing = ""  # the last error, said once

    def add(self, jobs: Sequence[ActiveJob], status: Mapping[str, str]) -> None:
        """An entry for each of `jobs` whose terminal event was just written (status DONE)."""
        records = [r for job in jobs if status.get(job.job_id) == DONE
                   and (r := self.record(job)) is not None]
        if not records:
            return
        pipe = self.client.pipeline(transaction=False)
        minute = self.keys.throughput(int(time.time()) // 60)
        for record in records:
            fields: dict[FieldT, EncodableT] = {k: v for k, v in record.items()}  # its types
            pipe.xadd(self.keys.recent, fields, maxlen=self.config.recent_maxlen,
                      approximate=True)
            tokens = int(record.get("tokens", "0") or 0)
            pipe.hincrby(minute, f"tokens:{record.get('model', '')}", tokens)
            pipe.hincrby(minute, f"jobs:{record.get('model', '')}", 1)
            pipe.hincrby(minute, f"worker:{self.config.name}", tokens)
        pipe.expire(minute, THROUGHPUT_TTL_S)
        try:
            errors = [r for r in pipe.execute(raise_on_error=False) if isinstance(r, Exception)]
        except redis.RedisError as exc:
            errors = [exc]
        if errors and str(errors[0]) != self._failing:
            self.log.warning("could not add to the recent-jobs stream", error=str(errors[0])[:200])
        self._failing = str(errors[0]) if errors else ""

    def record(self, job: ActiveJob) -> dict[str, str] | None:
        """The job's entry, when its outbox ends it."""
        last = job.outbox[-1] if job.outbox else None
        model = self.keys.stream_model(job.entry.stream) or job.job.model or ""
        if isinstance(last, DoneEvent):
            record = RecentJob(id=job.job_id, model=model, tenant=job.job.tenant_or_default,
                               status="done",
                               reason=last.finish_reason, tokens=last.completion_tokens,
                               worker=self.config.name)
        elif isinstance(last, ErrorEvent):
            record = RecentJob(id=job.job_id, model=model, tenant=job.job.tenant_or_default,
                               status="error", reason=last.code,
                               tokens=job.next_index, worker=self.config.name)
        else:
            return None
        return record.to_fields()
