"""Prometheus metrics of one worker (own registry, so several workers can share a process)."""

from __future__ import annotations

from dataclasses import dataclass, field

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, start_http_server

_LATENCY_BUCKETS = (0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30, 60, 300)


@dataclass
class Metrics:
    registry: CollectorRegistry = field(default_factory=CollectorRegistry)

    def __post_init__(self) -> None:
        r = self.registry
        self.jobs_started = Counter("qworker_jobs_started", "Jobs taken and started (incl. "
                                    "resumed)", ["source"], registry=r)
        self.jobs_finished = Counter("qworker_jobs_finished", "Jobs done", ["finish_reason"],
                                     registry=r)
        self.jobs_failed = Counter("qworker_jobs_failed", "Jobs ended with an error event",
                                   ["code"], registry=r)
        self.dead_letters = Counter("qworker_dead_letters", "Entries written to the dead stream",
                                    ["code"], registry=r)
        self.requeues = Counter("qworker_requeues", "Jobs requeued", ["reason"], registry=r)
        self.preemptions = Counter("qworker_preemptions", "Preempted sequences", registry=r)
        self.reclaimed = Counter("qworker_reclaimed", "Entries taken over by XAUTOCLAIM",
                                 registry=r)
        self.lost = Counter("qworker_jobs_lost", "Jobs dropped because another worker owns them",
                            registry=r)
        self.resumed_tokens = Counter("qworker_resumed_tokens", "Already streamed tokens read "
                                      "back (and recomputed) to resume a job", registry=r)
        self.tokens = Counter("qworker_generated_tokens", "Tokens published", registry=r)
        self.redis_errors = Counter("qworker_redis_errors", "Failed Redis round trips",
                                    registry=r)
        self.running = Gauge("qworker_jobs_in_flight", "Jobs this worker holds", registry=r)
        self.free_slots = Gauge("qworker_free_slots", "More jobs the engine would admit now",
                                registry=r)
        self.step_seconds = Histogram("qworker_step_seconds", "Engine step time", registry=r,
                                      buckets=_LATENCY_BUCKETS)
        self.queue_seconds = Histogram("qworker_queue_seconds", "Queued until first taken",
                                       registry=r, buckets=_LATENCY_BUCKETS)
        self.ttft_seconds = Histogram("qworker_ttft_seconds", "Queued until first token",
                                      registry=r, buckets=_LATENCY_BUCKETS)
        self.total_seconds = Histogram("qworker_job_seconds", "Queued until done", registry=r,
                                       buckets=_LATENCY_BUCKETS)

    def serve(self, port: int) -> None:
        if port:
            start_http_server(port, registry=self.registry)
