"""Counting what each tenant uses, in Redis (docs/protocol.md, "Quotas and usage"): each day's
jobs, tokens and errors per tenant and model (`<prefix>:usage:<day>`), and, while some tenant has
a tokens-per-minute quota, the correction of what the fair read charged a job to this minute's
tokens (`<prefix>:tpm:<minute>`) by what it really made. Written right after the events they
count were confirmed, in one pipeline; best effort like the recent-jobs stream: a Redis error
costs counts, never a job."""

from __future__ import annotations

import time
from collections import Counter
from collections.abc import Mapping, Sequence

import redis

from qworker.service.config import ServiceConfig
from qworker.service.fair_share import max_tokens_of, prompt_charge, running_member
from qworker.service.job import ActiveJob
from qworker.service.logs import get_logger
from qworker.service.outcome import DONE, OK
from qworker_client.protocol import DoneEvent, ErrorEvent, Event, Keys, TokenEvent

TPM_TTL_S = 120  # a minute's counts, kept while the next one runs
USAGE_TTL_S = 90 * 86_400  # a day's usage, kept 90 days


def minute_now() -> int:
    return int(time.time()) // 60


def day_of(unix_s: float) -> str:
    return time.strftime("%Y-%m-%d", time.gmtime(unix_s))


class Usage:
    def __init__(self, client: redis.Redis, keys: Keys, config: ServiceConfig) -> None:
        self.client = client
        self.keys = keys
        self.log = get_logger(worker=config.name)
        self._failing = ""

    def add(self, jobs: Sequence[ActiveJob], status: Mapping[str, str]) -> None:
        """Counts the ends among the confirmed events of `jobs` (their outboxes, just written:
        status ok or done)."""
        tokens: Counter[str] = Counter()
        day: Counter[str] = Counter()
        ended: list[str] = []
        for job in jobs:
            if status.get(job.job_id) not in (OK, DONE):
                continue
            tenant = job.job.tenant_or_default
            model = self.keys.stream_model(job.entry.stream) or job.job.model or "-"
            for event in job.outbox:
                if isinstance(event, DoneEvent):
                    for name, n in (("jobs", 1), ("prompt_tokens", event.prompt_tokens),
                                    ("completion_tokens", event.completion_tokens)):
                        day[f"{tenant}|{model}|{name}"] += n
                elif isinstance(event, ErrorEvent):
                    day[f"{tenant}|{model}|errors"] += 1
                if job.entry.charged:  # charged its estimate when handed out: corrected here
                    tokens[tenant] += self._correction(job, event)
                    if isinstance(event, (DoneEvent, ErrorEvent)):
                        ended.append(running_member(tenant, job.entry))
        if tokens or day:
            self._write(tokens, day)

    @staticmethod
    def _correction(job: ActiveJob, event: Event) -> int:
        """What the fair read's charge of the job misses, known at this event: its prompt's
        real tokens with its first token; its unused `max_tokens` at its end."""
        fields = job.entry.fields
        prompt = job.prompt_tokens - prompt_charge(fields)
        if isinstance(event, TokenEvent):
            return prompt if event.i == 0 else 0
        if isinstance(event, DoneEvent):
            return event.completion_tokens - max_tokens_of(fields)
        if isinstance(event, ErrorEvent):  # ended before any token: its prompt too
            unshown = prompt if job.next_index == 0 else 0
            return job.next_index - max_tokens_of(fields) + unshown
        return 0

    def _write(self, tokens: Counter[str], day: Counter[str]) -> None:
        pipe = self.client.pipeline(transaction=False)
        tpm = self.keys.tpm(minute_now())
        for tenant, n in tokens.items():
            pipe.hincrby(tpm, tenant, n)
        if tokens:
            pipe.expire(tpm, TPM_TTL_S)
        usage = self.keys.usage(day_of(time.time()))
        for name, n in day.items():
            pipe.hincrby(usage, name, n)
        if day:
            pipe.expire(usage, USAGE_TTL_S)
        try:
            errors = [r for r in pipe.execute(raise_on_error=False) if isinstance(r, Exception)]
        except redis.RedisError as exc:
            errors = [exc]
        if errors and str(errors[0]) != self._failing:
            self.log.warning("could not count usage", error=str(errors[0])[:200])
        self._failing = str(errors[0]) if errors else ""
