"""Where `benchmarks.scale_out` runs its fleet: one throwaway redis-server, or a Redis Cluster of
its own with N masters, each serving one model's slot (a model's keys live in the slot of
`{<model>}`, so N models spread a fleet's traffic over N masters).

Each worker serves one of `models` in turn; a job goes to the model of the worker its index
names, so every model gets its workers' share of the jobs.
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass

import redis

from benchmarks.local_redis import local_redis
from qworker_client.local_cluster import local_cluster
from qworker_client.protocol import Keys


@dataclass
class RedisTarget:
    url: str
    nodes: list[redis.Redis]  # a plain client of each master (one: a single Redis)
    models: list[str | None]  # [None]: model-less jobs on one Redis; else one model a master

    @property
    def cluster(self) -> bool:
        return self.models != [None]

    def model_of(self, index: int) -> str | None:
        """The model of worker `index` (and of the jobs dealt to it)."""
        return self.models[index % len(self.models)]

    def keys_of(self, model: str | None) -> Keys:
        return Keys().in_slot(model) if self.cluster else Keys()

    def flush(self) -> None:
        for node in self.nodes:
            node.flushall()

    def close(self) -> None:
        for node in self.nodes:
            node.close()


@contextmanager
def redis_target(masters: int) -> Iterator[RedisTarget]:
    """One Redis (`masters` 0) or a cluster of `masters` masters without replicas."""
    if masters == 0:
        with local_redis() as url:
            target = RedisTarget(url, [redis.Redis.from_url(url, socket_timeout=30)], [None])
            try:
                yield target
            finally:
                target.close()
        return
    with local_cluster(masters=masters) as cluster:
        models: list[str | None] = list(cluster.models_on_each_master("sim"))
        nodes = [redis.Redis(port=node.port, socket_timeout=30) for node in cluster.masters_now()]
        target = RedisTarget(cluster.url, nodes, models)
        try:
            yield target
        finally:
            target.close()
