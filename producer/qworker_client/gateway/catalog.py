"""The models the fleet serves: what the live workers' keys (`<prefix>:worker:<name>`) name
(`served_model_name`, else `model`), looked up at most once per `cache_s`, and the models the
gateway was told are served even while none of their workers is live (`--model`: a fleet that
scales to zero, whose first request is queued for the worker it makes start)."""

from __future__ import annotations

import asyncio
import json
import time
from collections.abc import Iterable
from typing import Any

import redis
import redis.asyncio

from qworker_client.found_keys import SCAN_COUNT, values_of_async
from qworker_client.gateway.errors import APIError
from qworker_client.protocol import Keys
from qworker_client.stats import live_models as live_models  # the batch runner's (no cache)
from qworker_client.stats import served_model


class Catalog:
    def __init__(self, client: redis.asyncio.Redis, keys: Keys, cache_s: float,
                 declared: tuple[str, ...] = ()) -> None:
        self.client = client
        self.keys = keys
        self.cache_s = cache_s
        self._declared = dict.fromkeys(declared, int(time.time()))  # model -> when declared
        self._models: dict[str, int] = {}  # model -> earliest start (unix s) of its workers
        self._workers = 0
        self._at = -float("inf")
        self._lookup: asyncio.Future[None] | None = None

    async def models(self) -> dict[str, int]:
        """The models served; requests that find the cache stale together share one lookup
        (each making its own was a SCAN and an MGET per request under a burst)."""
        if time.monotonic() - self._at > self.cache_s:
            if self._lookup is None or self._lookup.done():
                self._lookup = asyncio.ensure_future(self._refresh())
            await asyncio.shield(self._lookup)
        return self._models

    async def check(self, model: str) -> None:
        """503 when no worker is live, 404 when none serves `model` (a declared model passes)."""
        models = await self.models()
        if model in models:
            return
        if not self._workers:
            raise APIError(503, "no live worker: nothing can run this request now",
                           type="server_error", code="no_live_worker")
        raise model_not_found(model, models)

    async def _refresh(self) -> None:
        names = [n async for n in self.client.scan_iter(match=self.keys.worker_pattern,
                                                       count=SCAN_COUNT)]
        values = await values_of_async(self.client, names)
        infos = [_info(v) for v in values if v is not None]
        models = dict(self._declared)
        for info in infos:
            model = served_model(info)
            started = info.get("started_ms", 0)
            if model is not None:
                started_s = int(started) // 1000 if isinstance(started, int) else 0
                models[model] = min(models.get(model, started_s), started_s)
        self._models, self._workers, self._at = models, len(infos), time.monotonic()


def model_not_found(model: str, served: Iterable[str]) -> APIError:
    return APIError(404, f"the model `{model}` does not exist (served: "
                    f"{', '.join(sorted(served))})", param="model", code="model_not_found")


def _info(raw: str | bytes) -> dict[str, Any]:
    try:
        data = json.loads(raw)
    except ValueError:
        return {}
    return data if isinstance(data, dict) else {}


def model_list(models: dict[str, int]) -> dict[str, Any]:
    return {"object": "list", "data": [model_card(m, c) for m, c in sorted(models.items())]}


def model_card(model: str, created: int) -> dict[str, Any]:
    return {"id": model, "object": "model", "created": created, "owned_by": "qworker"}
