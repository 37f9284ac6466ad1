"""The asyncio twin of `qworker_client.client`: the same API over `redis.asyncio`, with `async`."""

from __future__ import annotations

import asyncio
import time
from collections.abc import AsyncIterator, Iterable, Mapping
from types import TracebackType
from typing import Any

import redis.asyncio

from qworker_client.connect import (
    READ_COUNT,
    ClientOptions,
    async_client,
    is_cluster_client,
    redis_url_from_env,
    slot_keys,
)
from qworker_client.fields import JobInput, job_fields
from qworker_client.protocol import (
    DEFAULT_GROUP,
    DEFAULT_PREFIX,
    ID_PATTERN,
    DoneEvent,
    ErrorEvent,
    Keys,
    TokenEvent,
    is_valid_id,
)
from qworker_client.result import START_ID, JobTimeoutError, OutputState, Result, stream_entries
from qworker_client.retry import TRANSIENT_ERRORS, Backoff, capped
from qworker_client.scripts import (
    CANCEL_SCRIPT,
    SUBMIT_SCRIPT,
    Submitted,
    by_stream,
    cancel_call,
    submit_call,
    submitted,
)
from qworker_client.stats import Stats, collect_stats_async
from qworker_client.status import JobStatus, job_status_async


class AsyncProducer:
    """`Producer` for asyncio code: every Redis call is awaited."""

    def __init__(
        self,
        redis_url: str | None = None,
        prefix: str = DEFAULT_PREFIX,
        *,
        options: ClientOptions | None = None,
        client: redis.asyncio.Redis | None = None,
    ) -> None:
        self.options = options or ClientOptions()
        self.keys = Keys(prefix)
        self.redis = client or async_client(redis_url or redis_url_from_env(), self.options)
        self._submit = self.redis.register_script(SUBMIT_SCRIPT)
        self._cancel = self.redis.register_script(CANCEL_SCRIPT)
        self.cluster = is_cluster_client(self.redis)  # a job's keys then live in its model's slot

    def keys_for(self, model: str | None) -> Keys:
        """The keys of a job of `model` (on a Cluster, a ValueError for a model-less job)."""
        return slot_keys(self.keys, self.cluster, model)

    async def submit(
        self,
        prompt: str | None = None,
        *,
        messages: list[Mapping[str, Any]] | None = None,
        prompt_token_ids: list[int] | None = None,
        **params: Any,
    ) -> AsyncJob:
        """See `Producer.submit`."""
        spec = dict(params, prompt=prompt, messages=messages, prompt_token_ids=prompt_token_ids)
        return (await self.submit_many([spec]))[0]

    async def submit_many(self, jobs: Iterable[JobInput]) -> list[AsyncJob]:
        """See `Producer.submit_many`: each id is queued once, retried after a dropped
        connection."""
        return await self.submit_prepared([job_fields(job) for job in jobs])

    async def submit_prepared(self, prepared: list[tuple[str, dict[str, str]]]
                              ) -> list[AsyncJob]:
        """`submit_many` of jobs already made wire fields (`job_fields`'s (id, fields))."""
        handles: dict[int, AsyncJob] = {}
        streams = by_stream(self.keys, prepared)
        for stream in streams:  # a model-less job on a Cluster: refused before anything is sent
            self.keys_for(self.keys.stream_model(stream))
        for stream, positions in streams.items():
            model = self.keys.stream_model(stream)
            group = [prepared[k] for k in positions]
            for k, s in zip(positions, await self._queue(stream, group), strict=True):
                handles[k] = AsyncJob(self, prepared[k][0], s.entry_id, new=s.new, model=model)
        return [handles[k] for k in range(len(prepared))]

    async def _queue(self, stream: str, jobs: list[tuple[str, dict[str, str]]]
                     ) -> list[Submitted]:
        keys, args = submit_call(self.keys_for(self.keys.stream_model(stream)), jobs,
                                 self.options.result_ttl_s, stream)
        backoff = Backoff(give_up_s=self.options.reconnect_give_up_s)
        while True:
            try:
                return submitted(await self._submit(keys=keys, args=args))
            except TRANSIENT_ERRORS as exc:
                await asyncio.sleep(backoff.failed(exc))

    def job(self, job_id: str, after: str = START_ID, model: str | None = None) -> AsyncJob:
        """A handle on an existing job, reading its output after entry `after` (default: all);
        on a Cluster, `model` names the job's model (its keys live in that model's slot)."""
        if not is_valid_id(job_id):
            raise ValueError(f"invalid job id {job_id!r} (want {ID_PATTERN})")
        job = AsyncJob(self, job_id, model=model)
        job.state.last_id = after
        return job

    async def cancel(self, job_id: str, ttl_s: int | None = None,
                     model: str | None = None) -> bool:
        """See `Producer.cancel`."""
        keys, args = cancel_call(self.keys_for(model), job_id, self.options.cancel_ttl(ttl_s))
        return bool(await self._cancel(keys=keys, args=args))

    async def stats(self, group: str = DEFAULT_GROUP) -> Stats:
        return await collect_stats_async(self.redis, self.keys, group, self.cluster)

    async def status(self, job_id: str, model: str | None = None) -> JobStatus:
        """Queued, running, done (with its result), error, or unknown (docs/protocol.md,
        "Asking a job's status")."""
        if not is_valid_id(job_id):
            raise ValueError(f"invalid job id {job_id!r} (want {ID_PATTERN})")
        return await job_status_async(self.redis, self.keys_for(model), job_id)

    async def close(self) -> None:
        await self.redis.aclose()

    async def __aenter__(self) -> AsyncProducer:
        return self

    async def __aexit__(
        self, exc_type: type[BaseException] | None, exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        await self.close()


class AsyncJob:
    """See `qworker_client.client.Job`."""

    def __init__(self, producer: AsyncProducer, job_id: str, entry_id: str | None = None,
                 new: bool = True, model: str | None = None) -> None:
        self.producer = producer
        self.id = job_id
        self.model = model  # its keys' slot on a Cluster
        self.keys = producer.keys_for(model)
        self.entry_id = entry_id
        self.new = new
        self.state = OutputState(job_id)

    def __repr__(self) -> str:
        return f"AsyncJob(id={self.id!r}, last_id={self.state.last_id!r})"

    @property
    def last_id(self) -> str:
        return self.state.last_id

    async def stream(self, timeout: float | None = None) -> AsyncIterator[TokenEvent | DoneEvent]:
        """See `Job.stream`."""
        if self.state.error is not None:
            raise self.state.job_error()
        deadline = None if timeout is None else time.monotonic() + timeout
        while not self.state.finished:
            for entry_id, fields in await self._read(deadline, timeout):
                event = self.state.apply(entry_id, fields)
                if event is None:
                    continue  # an index seen before (the stream rolled back), or past the end
                if isinstance(event, ErrorEvent):
                    raise self.state.job_error()
                yield event
                if isinstance(event, DoneEvent):
                    return

    async def text_stream(self, timeout: float | None = None) -> AsyncIterator[str]:
        async for event in self.stream(timeout):
            if isinstance(event, TokenEvent) and event.text:
                yield event.text

    async def result(self, timeout: float | None = None) -> Result:
        async for _ in self.stream(timeout):
            pass
        return self.state.result()

    async def cancel(self, ttl_s: int | None = None) -> bool:
        return await self.producer.cancel(self.id, ttl_s, self.model)

    async def _read(self, deadline: float | None, timeout: float | None) -> list[tuple[str, Any]]:
        options = self.producer.options
        backoff = Backoff(give_up_s=options.reconnect_give_up_s)
        key = self.keys.out(self.id)
        while True:
            block = options.block_for(deadline)
            if block is None:
                raise JobTimeoutError(f"job {self.id}: not finished within {timeout} s")
            try:
                reply = await self.producer.redis.xread(
                    {key: self.state.last_id}, count=READ_COUNT, block=block
                )
                return stream_entries(reply)
            except TRANSIENT_ERRORS as exc:
                await asyncio.sleep(capped(backoff.failed(exc), deadline))
