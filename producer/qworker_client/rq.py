"""qworker from RQ: functions an RQ worker runs by import path, with RQ's JSON serializer.

    from redis import Redis
    from rq import Queue
    from rq.serializers import JSONSerializer

    queue = Queue("llm", connection=Redis(), serializer=JSONSerializer)
    job = queue.enqueue("qworker_client.rq.generate", kwargs={"prompt": "Hi", "max_tokens": 32})

and an RQ worker started with `--serializer rq.serializers.JSONSerializer`. Arguments and results
are plain JSON values: never pickle. `generate` submits to qworker, waits and returns the result
as a dict; `run_batch` runs a whole batch file (see `qworker_client.batch`) and returns its summary.

Which Redis qworker is on: the `redis_url` argument, else `$QWORKER_REDIS_URL`, else the RQ
worker's own connection, else `$REDIS_URL`. Pass no password in job arguments: RQ stores them.
"""

from __future__ import annotations

import os
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import redis
import redis.sentinel
from rq import Queue, get_current_job
from rq.serializers import JSONSerializer

from qworker_client import batch
from qworker_client.client import Producer
from qworker_client.connect import ClientOptions, redis_url_from_env, sync_client
from qworker_client.protocol import DEFAULT_PREFIX
from qworker_client.redis_clients import sync_redis
from qworker_client.result import Result, result_fields
from qworker_client.sentinel_pools import SentinelPool

SERIALIZER = JSONSerializer
GENERATE = "qworker_client.rq.generate"
RUN_BATCH = "qworker_client.rq.run_batch"


def generate(
    prompt: str | None = None,
    *,
    messages: list[Mapping[str, Any]] | None = None,
    prompt_token_ids: list[int] | None = None,
    timeout: float | None = None,
    redis_url: str | None = None,
    prefix: str = DEFAULT_PREFIX,
    **params: Any,
) -> dict[str, Any]:
    """Submit one job, wait for it (at most `timeout` s), return `{id, text, finish_reason,
    usage, timings}`. A job that fails raises `qworker_client.JobError`, so RQ marks it failed."""
    with Producer(prefix=prefix, client=qworker_client(redis_url)) as producer:
        job = producer.submit(prompt, messages=messages, prompt_token_ids=prompt_token_ids,
                              **params)
        return result_dict(job.result(timeout))


def run_batch(
    input_path: str,
    output_path: str,
    errors_path: str | None = None,
    *,
    max_in_flight: int = batch.DEFAULT_MAX_IN_FLIGHT,
    prefix: str = DEFAULT_PREFIX,
    batch_id: str | None = None,
    redis_url: str | None = None,
) -> dict[str, Any]:
    """Run a batch file on the RQ worker's machine; its summary is the RQ job's result."""
    client = qworker_client(redis_url)
    try:
        summary = batch.run_batch(input_path, output_path, errors_path, client=client,
                                  prefix=prefix, max_in_flight=max_in_flight, batch_id=batch_id)
    finally:
        client.close()
    return summary.to_dict()


def result_dict(result: Result) -> dict[str, Any]:
    data = result_fields(result)
    return {"id": data.pop("job_id"), **data}


def json_queue(name: str, connection: redis.Redis) -> Queue:
    """An RQ queue that serializes with JSON (the connection must not decode responses)."""
    return Queue(name, connection=connection, serializer=SERIALIZER)


def enqueue_batch(
    redis_url: str, queue: str, input_path: Path, output_path: Path,
    errors_path: Path | None = None, *, max_in_flight: int = batch.DEFAULT_MAX_IN_FLIGHT,
    prefix: str = DEFAULT_PREFIX, batch_id: str | None = None, job_timeout: int = -1,
    result_ttl: int = 7 * 24 * 3600,
) -> str:
    """Enqueue `run_batch` as one RQ job; its id."""
    kwargs: dict[str, Any] = {
        "input_path": str(input_path), "output_path": str(output_path),
        "errors_path": str(errors_path) if errors_path is not None else None,
        "max_in_flight": max_in_flight, "prefix": prefix, "batch_id": batch_id,
    }
    with sync_redis(redis_url) as connection:
        job = json_queue(queue, connection).enqueue(
            RUN_BATCH, kwargs=kwargs, job_timeout=job_timeout, result_ttl=result_ttl,
            description=f"qworker batch {input_path} -> {output_path}")
    return str(job.id)


def qworker_client(redis_url: str | None = None) -> redis.Redis:
    """A decoding client for qworker's Redis (see the module doc for which one)."""
    options = ClientOptions()
    url = redis_url or os.environ.get("QWORKER_REDIS_URL")
    if url:
        return sync_client(url, options)
    current = get_current_job()
    if current is not None:
        return _decoding_twin(current.connection, options)
    return sync_client(redis_url_from_env(), options)


def _decoding_twin(connection: redis.Redis, options: ClientOptions) -> redis.Redis:
    """A client to the same server as the RQ worker's (which must not decode responses)."""
    pool = connection.connection_pool
    if isinstance(pool, redis.sentinel.SentinelConnectionPool):  # the master Sentinel names
        kwargs = {k: v for k, v in pool.connection_kwargs.items() if k != "connection_pool"}
        twin: redis.Redis = pool.sentinel_manager.master_for(
            pool.service_name, connection_pool_class=SentinelPool,
            **{**kwargs, **options.kwargs()})
        return twin
    kwargs = {**pool.connection_kwargs, **options.kwargs()}
    return redis.Redis(connection_pool=redis.ConnectionPool(
        connection_class=pool.connection_class, **kwargs))
