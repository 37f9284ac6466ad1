"""What every route shares: the Redis client, the producer, the gate, the catalog, the metrics."""

from __future__ import annotations

import re
import time
from collections.abc import Sequence
from pathlib import Path
from typing import cast

from redis.typing import EncodableT, FieldT

from qworker_client.aio import AsyncProducer
from qworker_client.batch.run import NOT_ON_CLUSTER
from qworker_client.connect import ClientOptions
from qworker_client.fields import job_fields
from qworker_client.gateway.backpressure import Gate
from qworker_client.gateway.batches.files import FileStore
from qworker_client.gateway.batches.runs import Batches
from qworker_client.gateway.catalog import Catalog
from qworker_client.gateway.chat.shaping import Shape
from qworker_client.gateway.chat.translate import GatewayRequest
from qworker_client.gateway.config import GatewayConfig
from qworker_client.gateway.connection import (
    MAX_CONNECTIONS,
    WAIT_S,
    connection_options,
    gateway_client,
)
from qworker_client.gateway.errors import APIError, bad_request
from qworker_client.gateway.metrics import Metrics
from qworker_client.gateway.owners import Owner
from qworker_client.gateway.round_trip import Command, round_trip
from qworker_client.gateway.slots import Slots, SlotView
from qworker_client.gateway.streams.hub import Hub
from qworker_client.gateway.streams.meta import JobMeta, meta_key
from qworker_client.gateway.streams.vanished import Queued
from qworker_client.gateway.tenants import KeysFile, Tenant, refusal
from qworker_client.protocol import QUOTAS_FIELD, JobValidationError, Keys
from qworker_client.scripts import SUBMIT_SCRIPT, by_stream, submit_call, submitted

_PARAM_RE = re.compile(r"^([a-z_]+)\b")
Replies = Sequence[Sequence[int | bytes | str]]  # the submit script's


class Gateway:
    def __init__(self, config: GatewayConfig) -> None:
        self.config = config
        self.keys = Keys(config.prefix)
        options = ClientOptions(result_ttl_s=config.result_ttl_s)
        self.producer = AsyncProducer(config.redis_url, config.prefix, options=options,
                                      client=gateway_client(config.redis_url, options))
        self.redis = self.producer.redis
        self.slots = Slots(self.redis, self.keys, config.redis_url,
                           {**options.kwargs(), **connection_options()}, MAX_CONNECTIONS, WAIT_S,
                           config.stream_interval_ms / 1000)
        self.gate = Gate(self.redis, self.keys, config.max_queued, config.retry_after_s)
        self.catalog = Catalog(self.redis, self.keys, config.models_cache_s, config.models)
        self.metrics = Metrics()
        self._submit_sha = self.redis.register_script(SUBMIT_SCRIPT).sha
        self.keys_file = None if config.keys_file is None else KeysFile(config.keys_file)
        self._published: dict[str, int] = {}  # tenants key -> the keys file's version there
        if config.files_dir is not None and self.slots.cluster is not None:
            raise ValueError(f"--files-dir: {NOT_ON_CLUSTER}")
        self.batches = None if config.files_dir is None else Batches(
            FileStore(Path(config.files_dir)), config.redis_url, config.prefix,
            result_ttl_s=config.result_ttl_s)

    def hub_of(self, model: str | None) -> Hub:
        return self.slots.of(model).hub

    async def publish_tenants(self, model: str | None = None) -> None:
        """The keys file's tenants (weight, quotas) into `<prefix>:tenants` (on a Cluster, that
        of `model`'s slot), where the workers' fair share reads them; again whenever the file
        changed. On a Cluster, a model's slot gets them with the first request of that model."""
        if self.keys_file is None or (model is None and self.slots.cluster is not None):
            return
        view = self.slots.of(model)
        key = view.keys.tenants
        if self._published.get(key) == self.keys_file.version:
            return
        version = self.keys_file.version
        tenants = self.keys_file.tenants
        pipe = view.redis.pipeline(transaction=True)
        pipe.delete(key)
        published: dict[FieldT, EncodableT] = {n: t.published() for n, t in tenants.items()}
        if any(t.tokens_per_minute or t.concurrent_jobs for t in tenants.values()):
            published[QUOTAS_FIELD] = "1"  # the workers' fair read then looks at quotas
        if published:
            pipe.hset(key, mapping=published)
        await pipe.execute()
        self._published[key] = version

    async def admit_tenant(self, tenant: Tenant | None, model: str,
                           priorities: list[int]) -> Tenant | None:
        """The caller's tenant (None: no keys file names it), once its keys file allows the model
        and bands (403) and its quotas have room (429); the tenants published for the workers."""
        if tenant is not None:
            if (why := refusal(tenant, model, priorities)) is not None:
                raise APIError(403, why, type="permission_error", code="tenant_not_allowed")
            await self.check_quota(tenant, model)
        await self.publish_tenants(model)
        return tenant

    async def check_quota(self, tenant: Tenant, model: str | None = None) -> None:
        """429 with `Retry-After` while the tenant is at a quota, as counted in Redis by every
        worker's fair read: its tokens of this minute (retry when the minute ends), or its jobs
        running (retry in a second). On a Cluster the counts are each model's."""
        now = time.time()
        view = self.slots.of(model)
        if tenant.tokens_per_minute is not None:
            used = await view.redis.hget(view.keys.tpm(int(now) // 60), tenant.name)
            if used is not None and int(used) >= tenant.tokens_per_minute:
                raise self._at_quota(tenant, f"its {tenant.tokens_per_minute} tokens of this "
                                     "minute", "tokens_per_minute", 60 - int(now) % 60)
        if tenant.concurrent_jobs is not None:
            running = await view.redis.zlexcount(view.keys.running, f"[{tenant.name}\0",
                                                 f"({tenant.name}\1")
            if int(running) >= tenant.concurrent_jobs:
                raise self._at_quota(tenant, f"its {tenant.concurrent_jobs} concurrent jobs",
                                     "concurrent_jobs", 1)

    @staticmethod
    def _at_quota(tenant: Tenant, what: str, code: str, retry_s: int) -> APIError:
        return APIError(429, f"tenant {tenant.name!r} has used {what}", type="rate_limit_error",
                        code=code, headers={"retry-after": str(max(1, retry_s))})

    async def submit(self, request: GatewayRequest, shape: Shape, owner: Owner,
                     records: dict[str, str] | None = None, tenant: Tenant | None = None
                     ) -> dict[str, Queued]:
        """Validate every job (400 on what a worker would refuse), remember how to shape their
        streams and whose they are (and set `records`, key -> value, beside: a response's),
        then queue them all at once (as the keys file's `tenant`'s jobs, when the key has one).
        Returns where each job was queued (for the hub to tell one
        that vanished)."""
        try:
            prepared = [job_fields(choice.spec) for choice in request.choices]
            if tenant is not None:
                for _, fields in prepared:
                    fields["tenant"] = tenant.name
        except JobValidationError as exc:
            match = _PARAM_RE.match(exc.message)
            raise bad_request(exc.message, param=match.group(1) if match else None) from None
        except TypeError as exc:
            raise bad_request(str(exc)) from None
        metas = {meta_key(self.keys.prefix, c.job_id):
                 JobMeta(shape, c.index, request.include_usage, owner).to_json()
                 for c in request.choices}
        metas.update(records or {})
        groups = by_stream(self.keys, prepared)
        view = self.slots.of(request.model)
        if self.slots.cluster is not None:  # the records' keys are in other slots
            await self._set_records(metas)
            metas = {}
        entries = await self._queue_at_once(view, metas, prepared, groups)
        if entries is None:
            await self._set_records(metas)
            jobs = await self.producer.submit_prepared(prepared)  # loads the script, retries
            entries = [job.entry_id for job in jobs]
        stream_of = {k: stream for stream, positions in groups.items() for k in positions}
        return {job_id: Queued(stream_of[k], entry)
                for k, ((job_id, _), entry) in enumerate(zip(prepared, entries, strict=True))
                if entry}

    async def _set_records(self, records: dict[str, str]) -> None:
        pipe = self.redis.pipeline(transaction=False)
        for key, value in records.items():
            pipe.set(key, value, ex=self.config.result_ttl_s)
        await pipe.execute()

    async def _queue_at_once(self, view: SlotView, metas: dict[str, str],
                             prepared: list[tuple[str, dict[str, str]]],
                             groups: dict[str, list[int]]) -> list[str | None] | None:
        """The metas set and the jobs queued in one round trip (EVALSHA beside the SETs): each
        job's entry id, in order; None when that did not do it all (the server lost the script,
        a dropped connection): both steps can simply be done again, the submit script queues an
        id once."""
        ttl = self.config.result_ttl_s
        commands: list[Command] = [("SET", key, value, "EX", ttl) for key, value in metas.items()]
        for stream, positions in groups.items():
            keys, args = submit_call(view.keys, [prepared[k] for k in positions], ttl, stream)
            commands.append(("EVALSHA", self._submit_sha, len(keys), *keys, *args))
        replies = await round_trip(view.redis.connection_pool, commands)
        if replies is None or any(isinstance(r, Exception) for r in replies):
            return None
        entries: list[str | None] = [None] * len(prepared)
        for positions, reply in zip(groups.values(), replies[len(metas):], strict=True):
            for k, done in zip(positions, submitted(cast(Replies, reply)), strict=True):
                entries[k] = done.entry_id
        return entries

    async def cancel(self, job_ids: list[str], model: str | None = None) -> None:
        """Cancel jobs of `model` (on a Cluster their keys are in its slot)."""
        for job_id in job_ids:
            await self.producer.cancel(job_id, model=model)

    async def close(self) -> None:
        await self.slots.close()
        await self.producer.close()
