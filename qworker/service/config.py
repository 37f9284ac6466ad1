"""Settings of the Redis service around the engine: the `qworker serve` flags but the engine's
(`qworker/commands/config_flags.py` makes the flags from these fields)."""

from __future__ import annotations

import os
import socket
from dataclasses import dataclass, field

from qworker_client.cluster_url import is_cluster_url
from qworker_client.protocol import (
    DEFAULT_GROUP,
    DEFAULT_PREFIX,
    MODEL_PATTERN,
    Job,
    Keys,
    is_valid_model,
)


def default_worker_name() -> str:
    return f"{socket.gethostname()}-{os.getpid()}"


def _flag(help: str, **more: object) -> dict[str, object]:
    """Field metadata read by `qworker.commands.config_flags`: the flag's help, and `flag`, its
    name where it is not the field's (None: no flag)."""
    return {"help": help, **more}


@dataclass(frozen=True)
class ServiceConfig:
    """The service's settings; each field with a flag is a `qworker serve` flag and variable."""

    redis_url: str = field(default="redis://127.0.0.1:6379/0", metadata=_flag(
        "redis://[user:password@]host:port/db, rediss:// for TLS, "
        "redis+sentinel://host:port[,host:port...]/service_name[/db] for Sentinel"))
    prefix: str = field(default=DEFAULT_PREFIX, metadata=_flag(
        "key prefix; nothing is written outside it"))
    group: str = field(default=DEFAULT_GROUP, metadata=_flag("consumer group"))
    name: str = field(default_factory=default_worker_name, metadata=_flag(
        "consumer name (default: host-pid)"))
    # shown in the worker's liveness key: the engine's model, given by the engine's flag
    model: str = field(default="", metadata=_flag("the engine's model", flag=None))
    served_model_name: str = field(default="", metadata=_flag(
        "the model's name for clients: the worker takes the jobs for it (<prefix>:jobs:{name}) "
        "and those without a model; in the liveness key, the OpenAI gateway's model id "
        "(default: --model)"))
    fair_share: bool = field(default=True, metadata=_flag(
        "serve the tenants of each band in proportion to their weights, decided in Redis "
        "(docs/protocol.md, \"Tenants and fair share\"); off: each band first come, first "
        "served"))
    fair_preemption: bool = field(default=True, metadata=_flag(
        "with fair share: a worker with no room preempts the newest job of the tenant running the "
        "most over its weight for a job of a tenant below it (requeued and recomputed; "
        "docs/protocol.md, \"Fair preemption\"); off: a tenant that comes waits for a free slot"))
    claim_idle_ms: int = field(default=30_000, metadata=_flag(
        "reclaim entries idle this long (their worker died or stalled); a thread re-claims a "
        "live worker's entries every claim-idle/4 s (at most 10 s), whatever its steps"))
    max_crashes: int = field(default=3, metadata=_flag(
        "a job whose worker died (or stalled) this often while it ran alone is dead-lettered "
        "as a poison job; the jobs beside it are not charged"))
    max_deliveries: int = field(default=5, metadata=_flag(
        "last resort: an entry delivered more often is dead-lettered as a poison job (not "
        "counting deliveries after a worker died while it ran another job alone)"))
    drain_timeout: float = field(default=30.0, metadata=_flag(
        "seconds to finish running jobs after SIGTERM before requeueing them"))
    result_ttl: int = field(default=3_600, metadata=_flag(
        "seconds an output stream lives after its last event, for a job that sets no "
        "result_ttl_s"))
    max_result_ttl: int = field(default=86_400, metadata=_flag(
        "the longest a job's own result_ttl_s keeps its output (longer ones are cut to it)"))
    delayed_poll_ms: int = field(default=250, metadata=_flag(
        "how often a worker looks for delayed jobs whose time has come (sooner when it knows the "
        "next one's time)"))
    metrics_port: int = field(default=0, metadata=_flag(
        "port of /metrics (Prometheus), /healthz and /livez (0: off)"))
    metrics_host: str = field(default="127.0.0.1", metadata=_flag(
        "interface of the metrics port (0.0.0.0: all, as a container or pod needs)"))
    block_ms: int = field(default=1_000, metadata=_flag("XREADGROUP BLOCK while idle", flag=None))
    backoff_min_s: float = field(default=0.05, metadata=_flag(
        "first wait after a Redis error", flag=None))
    backoff_max_s: float = field(default=2.0, metadata=_flag(
        "longest wait between retries of Redis", flag=None))
    dead_maxlen: int = field(default=10_000, metadata=_flag(
        "the dead-letter stream is trimmed to about this many entries"))
    recent_maxlen: int = field(default=1_000, metadata=_flag(
        "the recent-jobs stream (`qworker jobs`) is trimmed to about this many entries"))
    stream_interval_ms: int = field(default=0, metadata=_flag(
        "send the tokens of the steps within this many ms to Redis in one round trip (each token "
        "still its own entry; a job's first token and its end go at once): fewer Redis commands "
        "and less worker CPU per token, up to this much later per token (0: every step)"))
    affinity_ms: int = field(default=50, metadata=_flag(
        "a job that names a session is offered first to the live worker that ran the session's "
        "last job (its prefix cache holds it) for up to this many ms, then any worker takes it "
        "(0: off, whoever reads first takes every job)"))
    kv_events: bool = field(default=False, metadata=_flag(
        "publish KV events (blocks cached and evicted, vLLM's schema) on <prefix>:kv_events, so "
        "that a router outside can route on this worker's prefix cache (docs/protocol.md)"))
    kv_events_maxlen: int = field(default=10_000, metadata=_flag(
        "the KV events stream is trimmed to about this many entries (all workers together)"))
    # no finished loop turn for this long: the loop is stuck, so the heartbeat stops and peers
    # reclaim the jobs
    stall_timeout_s: float = field(default=60.0, metadata=_flag(
        "seconds without a finished loop turn before /healthz and /livez fail and the heartbeat "
        "stops (so peers reclaim the jobs); must exceed the longest step", flag="--stall-timeout"))

    def __post_init__(self) -> None:
        if self.claim_idle_ms < 100:
            raise ValueError("claim_idle_ms must be >= 100")
        if self.max_deliveries < 1 or self.max_crashes < 1:
            raise ValueError("max_deliveries and max_crashes must be >= 1")
        if self.drain_timeout < 0 or self.result_ttl < 1 or self.block_ms < 1:
            raise ValueError("drain_timeout must be >= 0, result_ttl and block_ms >= 1")
        if self.max_result_ttl < 1 or self.delayed_poll_ms < 1:
            raise ValueError("max_result_ttl and delayed_poll_ms must be >= 1")
        if self.dead_maxlen < 1 or self.recent_maxlen < 1 or self.stall_timeout_s <= 0:
            raise ValueError("dead_maxlen and recent_maxlen must be >= 1, stall_timeout_s > 0")
        if self.stream_interval_ms < 0 or self.affinity_ms < 0:
            raise ValueError("stream_interval_ms and affinity_ms must be >= 0")
        if self.kv_events_maxlen < 1:
            raise ValueError("kv_events_maxlen must be >= 1")
        if self.served_model is not None and not is_valid_model(self.served_model):
            raise ValueError(f"the served model name {self.served_model!r} cannot name a job "
                             f"stream (want {MODEL_PATTERN}): give --served-model-name")
        if self.cluster and self.served_model is None:
            raise ValueError("on a Redis Cluster a worker serves a named model (its keys live in "
                             "that model's hash slot): give --model or --served-model-name")

    def result_ttl_of(self, job: Job | None) -> int:
        """How long a job's output lives after its last event: its own result_ttl_s, within
        max_result_ttl; else result_ttl."""
        if job is None or job.result_ttl_s is None:
            return self.result_ttl
        return min(job.result_ttl_s, self.max_result_ttl)

    @property
    def cluster(self) -> bool:
        """Whether Redis is a Cluster (`redis+cluster://`): every key in the served model's slot."""
        return is_cluster_url(self.redis_url)

    @property
    def keys(self) -> Keys:
        """The keys this worker uses: on a Cluster, those of its model's hash slot."""
        keys = Keys(self.prefix)
        return keys.in_slot(self.served_model) if self.cluster else keys

    @property
    def served_model(self) -> str | None:
        """The model whose jobs this worker takes (None: only model-less jobs)."""
        return self.served_model_name or self.model or None

    @property
    def heartbeat_s(self) -> float:
        """How often in-flight entries are re-claimed (by a thread, whatever the loop does):
        well within `claim_idle_ms`, so three beats in a row may fail before a peer reclaims."""
        return min(self.claim_idle_ms / 4000, 10.0)

    @property
    def reclaim_s(self) -> float:
        return max(self.claim_idle_ms / 2000, 0.1)

    @property
    def consumer_idle_ms(self) -> int:
        """A consumer that owns nothing, idle this long and without a live worker key, is removed
        from the group."""
        return 10 * self.claim_idle_ms

    @property
    def liveness_ttl_ms(self) -> int:
        return int(max(3 * self.heartbeat_s * 1000, 2 * self.block_ms, 1000))

    @property
    def affinity_live_ms(self) -> int:
        """A worker that read with room this recently is offered its sessions' jobs: longer than
        an idle worker's blocking wait, so an idle one is offered them too."""
        return 2 * self.block_ms + 1000

    @property
    def owner_ttl_s(self) -> int:
        """Lifetime of a job's owner hash, renewed by the heartbeat while the job runs."""
        return max(self.result_ttl, 10 * self.claim_idle_ms // 1000, 60)

    @property
    def socket_timeout_s(self) -> float:
        """Longer than any BLOCK we issue, so a blocking read never times out client-side."""
        return self.block_ms / 1000 + 5.0
