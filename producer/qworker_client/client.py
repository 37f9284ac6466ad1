"""The synchronous producer: submit jobs to `<prefix>:jobs`, follow `<prefix>:out:<id>`."""

from __future__ import annotations

import time
from collections.abc import Iterable, Iterator, Mapping
from types import TracebackType
from typing import Any

import redis

from qworker_client.connect import (
    READ_COUNT,
    ClientOptions,
    is_cluster_client,
    redis_url_from_env,
    slot_keys,
    sync_client,
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
from qworker_client.result import (
    START_ID,
    JobTimeoutError,
    OutputState,
    Result,
    stream_entries,
)
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
from qworker_client.stats import Stats, collect_stats
from qworker_client.status import JobStatus, job_status


class Producer:
    """Submits jobs and follows their output. One Redis connection pool; thread-safe like redis-py.

    `redis_url` may carry AUTH / ACL user (`redis://user:pass@host/0`) and TLS (`rediss://`);
    None reads `REDIS_URL` or `QWORKER_REDIS_URL` from the environment.
    """

    def __init__(
        self,
        redis_url: str | None = None,
        prefix: str = DEFAULT_PREFIX,
        *,
        options: ClientOptions | None = None,
        client: redis.Redis | None = None,
    ) -> None:
        self.options = options or ClientOptions()
        self.keys = Keys(prefix)
        self.redis = client or sync_client(redis_url or redis_url_from_env(), self.options)
        self._submit = self.redis.register_script(SUBMIT_SCRIPT)
        self._cancel = self.redis.register_script(CANCEL_SCRIPT)
        self.cluster = is_cluster_client(self.redis)  # a job's keys then live in its model's slot

    def keys_for(self, model: str | None) -> Keys:
        """The keys of a job of `model` (on a Cluster, a ValueError for a model-less job)."""
        return slot_keys(self.keys, self.cluster, model)

    def submit(
        self,
        prompt: str | None = None,
        *,
        messages: list[Mapping[str, Any]] | None = None,
        prompt_token_ids: list[int] | None = None,
        **params: Any,
    ) -> Job:
        """Validate one job (the protocol's own parser, so errors are the worker's) and XADD it.

        `params` are the optional wire fields (`max_tokens`, `temperature`, `stop`, `id`, ...);
        None means the worker's default. A job with a `model` goes to `<prefix>:jobs:{<model>}`,
        which only the workers serving that model read. Raises `JobValidationError` (a
        ValueError) before anything is sent. A job without `id` gets a uuid4 hex id.

        Submitting is idempotent per id: a job whose id was submitted within `result_ttl_s`, or
        whose output stream exists, is not queued again (`Job.new` is False), so a submit is
        retried after a dropped connection without ever running a job twice.
        """
        spec = dict(params, prompt=prompt, messages=messages, prompt_token_ids=prompt_token_ids)
        return self.submit_many([spec])[0]

    def submit_many(self, jobs: Iterable[JobInput]) -> list[Job]:
        """Validate every job first, then queue them in one script call per stream: the jobs of
        one model (or without one) atomically, in one round trip; never MAXLEN: trimming would
        drop work."""
        prepared = [job_fields(job) for job in jobs]
        handles: dict[int, Job] = {}
        streams = by_stream(self.keys, prepared)
        for stream in streams:  # a model-less job on a Cluster: refused before anything is sent
            self.keys_for(self.keys.stream_model(stream))
        for stream, positions in streams.items():
            model = self.keys.stream_model(stream)
            group = [prepared[k] for k in positions]
            for k, s in zip(positions, self._queue(stream, group), strict=True):
                handles[k] = Job(self, prepared[k][0], s.entry_id, new=s.new, model=model)
        return [handles[k] for k in range(len(prepared))]

    def _queue(self, stream: str, jobs: list[tuple[str, dict[str, str]]]) -> list[Submitted]:
        keys, args = submit_call(self.keys_for(self.keys.stream_model(stream)), jobs,
                                 self.options.result_ttl_s, stream)
        backoff = Backoff(give_up_s=self.options.reconnect_give_up_s)
        while True:
            try:
                return submitted(self._submit(keys=keys, args=args))
            except TRANSIENT_ERRORS as exc:  # safe to repeat: the script queues each id once
                time.sleep(backoff.failed(exc))

    def job(self, job_id: str, after: str = START_ID, model: str | None = None) -> Job:
        """A handle on an existing job, reading its output after entry `after` (default: all);
        on a Cluster, `model` names the job's model (its keys live in that model's slot)."""
        if not is_valid_id(job_id):
            raise ValueError(f"invalid job id {job_id!r} (want {ID_PATTERN})")
        job = Job(self, job_id, model=model)
        job.state.last_id = after
        return job

    def cancel(self, job_id: str, ttl_s: int | None = None,
               model: str | None = None) -> bool:
        """Flag the job for cancelling, for `ttl_s` (at most, and by default, `result_ttl_s`).
        A job that has already ended is left alone: False."""
        keys, args = cancel_call(self.keys_for(model), job_id, self.options.cancel_ttl(ttl_s))
        return bool(self._cancel(keys=keys, args=args))

    def stats(self, group: str = DEFAULT_GROUP) -> Stats:
        return collect_stats(self.redis, self.keys, group, self.cluster)

    def status(self, job_id: str, model: str | None = None) -> JobStatus:
        """Queued, running, done (with its result), error, or unknown (docs/protocol.md,
        "Asking a job's status")."""
        if not is_valid_id(job_id):
            raise ValueError(f"invalid job id {job_id!r} (want {ID_PATTERN})")
        return job_status(self.redis, self.keys_for(model), job_id)

    def close(self) -> None:
        self.redis.close()

    def __enter__(self) -> Producer:
        return self

    def __exit__(
        self, exc_type: type[BaseException] | None, exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        self.close()


class Job:
    """One submitted job. Reading resumes where the last read stopped (`last_id`)."""

    def __init__(self, producer: Producer, job_id: str, entry_id: str | None = None,
                 new: bool = True, model: str | None = None) -> None:
        self.producer = producer
        self.id = job_id
        self.model = model  # its keys' slot on a Cluster
        self.keys = producer.keys_for(model)
        self.entry_id = entry_id  # the `<prefix>:jobs` entry, when this handle submitted it
        self.new = new  # False: the id was already submitted; this handle follows that job
        self.state = OutputState(job_id)

    def __repr__(self) -> str:
        return f"Job(id={self.id!r}, last_id={self.state.last_id!r})"

    @property
    def last_id(self) -> str:
        return self.state.last_id

    def stream(self, timeout: float | None = None) -> Iterator[TokenEvent | DoneEvent]:
        """Yield this job's events live: token events, then the done event.

        Raises `JobError` on an error event and `JobTimeoutError` when `timeout` seconds pass
        first. A dropped connection is retried with backoff from the last entry seen, so no event
        is skipped or repeated; a token index seen before (the stream rolled back and the job ran
        again from there) is skipped, and nothing after the first terminal event is read.
        Stopping early and calling again continues where it left off.
        """
        if self.state.error is not None:
            raise self.state.job_error()
        deadline = None if timeout is None else time.monotonic() + timeout
        while not self.state.finished:
            for entry_id, fields in self._read(deadline, timeout):
                event = self.state.apply(entry_id, fields)
                if event is None:
                    continue  # an index seen before (the stream rolled back), or past the end
                if isinstance(event, ErrorEvent):
                    raise self.state.job_error()
                yield event
                if isinstance(event, DoneEvent):
                    return

    def text_stream(self, timeout: float | None = None) -> Iterator[str]:
        """Only the non-empty text deltas of `stream()`."""
        for event in self.stream(timeout):
            if isinstance(event, TokenEvent) and event.text:
                yield event.text

    def result(self, timeout: float | None = None) -> Result:
        """Wait for the end of the job: its `Result`, or its `JobError` raised."""
        for _ in self.stream(timeout):
            pass
        return self.state.result()

    def cancel(self, ttl_s: int | None = None) -> bool:
        """Ask the workers to stop this job; it ends with `finish_reason` `cancelled`."""
        return self.producer.cancel(self.id, ttl_s, self.model)

    def _read(self, deadline: float | None, timeout: float | None) -> list[tuple[str, Any]]:
        options = self.producer.options
        backoff = Backoff(give_up_s=options.reconnect_give_up_s)
        key = self.keys.out(self.id)
        while True:
            block = options.block_for(deadline)
            if block is None:
                raise JobTimeoutError(f"job {self.id}: not finished within {timeout} s")
            try:
                reply = self.producer.redis.xread(
                    {key: self.state.last_id}, count=READ_COUNT, block=block
                )
                return stream_entries(reply)
            except TRANSIENT_ERRORS as exc:
                time.sleep(capped(backoff.failed(exc), deadline))
