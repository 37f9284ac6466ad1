"""Prometheus metrics of one worker (own registry, so several workers can share a process).

Engine gauges come from `engine.stats()` (a plain dict of ints, see `ENGINE_STATS`), which the
engine core gives both engines; the service never imports torch.
"""

from __future__ import annotations

import time
from collections.abc import Container, Iterable
from dataclasses import dataclass, field
from http.server import ThreadingHTTPServer
from typing import Protocol

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram

from qworker.engine.request import StepOutput
from qworker.service import health as health_http
from qworker.service.health import DEFAULT_STALL_S, Health

_LATENCY_BUCKETS = (0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30, 60, 300)
_ITL_BUCKETS = (0.001, 0.0025, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.15, 0.25, 0.5, 1, 2.5)
_BATCH_BUCKETS = (1, 2, 4, 8, 16, 32, 64, 128, 256, 512)
_TOKEN_BUCKETS = (1, 8, 32, 64, 128, 256, 512, 1024, 2048, 4096, 8192)

# Keys of `engine.stats()`; each optional.
ENGINE_STATS = ("running", "waiting", "blocks_free", "blocks_total", "batch_seqs", "batch_tokens",
                "prefix_cache_queries", "prefix_cache_hits", "blocks_cached", "spec_drafted",
                "spec_accepted", "threads")
# of those, running totals (the engine's counters since it started): exported as counters
_ENGINE_TOTALS = ("prefix_cache_queries", "prefix_cache_hits", "spec_drafted", "spec_accepted")


class HasStats(Protocol):
    def stats(self) -> dict[str, int]: ...


def engine_stats(engine: HasStats) -> dict[str, int]:
    """The engine's gauges that the metrics know, from `engine.stats()`."""
    return {k: int(v) for k, v in engine.stats().items() if k in ENGINE_STATS}


@dataclass
class Metrics:
    registry: CollectorRegistry = field(default_factory=CollectorRegistry)
    stall_s: float = DEFAULT_STALL_S  # /healthz fails when the loop is stuck this long
    host: str = "127.0.0.1"  # interface of the endpoint (serve --metrics-host)

    def __post_init__(self) -> None:
        self.health = Health(self.stall_s)
        self._server: ThreadingHTTPServer | None = None
        self._last_token: dict[str, float] = {}  # job id -> when its last token came out
        self._totals: dict[str, int] = {}  # the engine's counters, as last exported
        self._jobs()
        self._engine()
        self._latency()

    def _jobs(self) -> None:
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
        self.reclaimed = Counter("qworker_reclaimed", "Entries taken over from dead or stalled "
                                 "workers (XCLAIM of idle entries)",
                                 registry=r)
        self.fenced = Counter("qworker_jobs_fenced", "Jobs dropped because another worker owns "
                              "them (fenced out)", registry=r)
        self.resumed_tokens = Counter("qworker_resumed_tokens", "Already streamed tokens read "
                                      "back (and recomputed) to resume a job", registry=r)
        self.tokens = Counter("qworker_generated_tokens", "Tokens published", registry=r)
        self.prompt_tokens = Counter("qworker_prompt_tokens", "Prompt tokens of jobs started "
                                     "(a resumed job's counted again)", registry=r)
        self.internal_errors = Counter("qworker_internal_errors", "Valid jobs an engine failure "
                                       "ended (code internal): a bug, worth an alert", registry=r)
        self.redis_errors = Counter("qworker_redis_errors", "Failed Redis round trips",
                                    registry=r)
        self.redis_job_errors = Counter("qworker_redis_job_errors", "Jobs failed because Redis "
                                        "refused their keys (wrong type, ACL)", registry=r)
        self.consumers_removed = Counter("qworker_consumers_removed", "Dead consumers that owned "
                                         "nothing, removed from the group", registry=r)
        self.running = Gauge("qworker_jobs_in_flight", "Jobs this worker holds", registry=r)
        self.free_slots = Gauge("qworker_free_slots", "More jobs the engine would admit now",
                                registry=r)

    def _engine(self) -> None:
        r = self.registry
        self.requests_running = Gauge("qworker_requests_running", "Sequences in the engine's "
                                      "running batch", registry=r)
        self.requests_waiting = Gauge("qworker_requests_waiting", "Sequences waiting in the "
                                      "engine for admission", registry=r)
        self.kv_blocks_free = Gauge("qworker_kv_blocks_free", "Free KV cache blocks", registry=r)
        self.kv_blocks_used = Gauge("qworker_kv_blocks_used", "KV cache blocks held by "
                                    "sequences", registry=r)
        self.kv_blocks_cached = Gauge("qworker_kv_blocks_cached", "KV cache blocks the prefix "
                                      "cache knows (held or free)", registry=r)
        self.engine_totals = {
            "prefix_cache_queries": Counter("qworker_prefix_cache_queries", "Prompt tokens of "
                                            "sequences admitted with prefix caching", registry=r),
            "prefix_cache_hits": Counter("qworker_prefix_cache_hits", "Of those, tokens found in "
                                         "the prefix cache (not computed)", registry=r),
            "spec_drafted": Counter("qworker_spec_draft_tokens", "Speculative draft tokens "
                                    "verified", registry=r),
            "spec_accepted": Counter("qworker_spec_accepted_tokens", "Of those, accepted (each "
                                     "one a token without a step of its own)", registry=r)}
        self.spec_acceptance = Gauge("qworker_spec_acceptance_rate", "Accepted share of the "
                                     "draft tokens verified since start", registry=r)
        self.engine_threads = Gauge("qworker_engine_threads", "Threads the engine's steps run "
                                    "on (fewer while other processes take its cores)",
                                    registry=r)
        self.batch_size = Histogram("qworker_batch_size", "Sequences per engine step",
                                    registry=r, buckets=_BATCH_BUCKETS)
        self.batch_tokens = Histogram("qworker_batch_tokens", "Tokens computed per engine step "
                                      "(prefill chunks + decodes)", registry=r,
                                      buckets=_TOKEN_BUCKETS)
        self.step_seconds = Histogram("qworker_step_seconds", "Engine step time", registry=r,
                                      buckets=_LATENCY_BUCKETS)
        self.kernels = Gauge("qworker_kernel", "1 for the kernel each op runs (linear shapes: "
                             "kernel@rows per token bucket), as measured at start",
                             ["op", "kernel"], registry=r)
        self.weight_bytes = Gauge("qworker_weight_bytes", "Bytes of the model's weights as held "
                                  "in memory (quantized blocks, packs), after start", registry=r)
        self.native_kernels = Gauge("qworker_native_kernels_loaded", "1 when the native CPU "
                                    "kernels are loaded; 0: every op runs the slow torch path",
                                    ["level"], registry=r)

    def _latency(self) -> None:
        r = self.registry
        self.queue_seconds = Histogram("qworker_queue_seconds", "Queued until first taken",
                                       registry=r, buckets=_LATENCY_BUCKETS)
        self.ttft_seconds = Histogram("qworker_ttft_seconds", "Queued until first token",
                                      registry=r, buckets=_LATENCY_BUCKETS)
        self.inter_token_seconds = Histogram("qworker_inter_token_seconds", "Time between two "
                                             "tokens of a job", registry=r, buckets=_ITL_BUCKETS)
        self.total_seconds = Histogram("qworker_job_seconds", "Queued until done", registry=r,
                                       buckets=_LATENCY_BUCKETS)

    # ------------------------------------------------------------------ hooks of the loop

    def tick(self, engine: HasStats) -> None:
        """Once per loop iteration: the loop is alive; refresh the engine's gauges."""
        self.health.tick()
        self._set_gauges(engine_stats(engine))

    def _set_gauges(self, stats: dict[str, int]) -> None:
        if "running" in stats:
            self.requests_running.set(stats["running"])
        if "waiting" in stats:
            self.requests_waiting.set(stats["waiting"])
        if "blocks_free" in stats and "blocks_total" in stats:
            self.kv_blocks_free.set(stats["blocks_free"])
            self.kv_blocks_used.set(stats["blocks_total"] - stats["blocks_free"])
        if "blocks_cached" in stats:
            self.kv_blocks_cached.set(stats["blocks_cached"])
        for name in _ENGINE_TOTALS:
            if name in stats:
                self.engine_totals[name].inc(max(0, stats[name] - self._totals.get(name, 0)))
                self._totals[name] = stats[name]
        if stats.get("spec_drafted"):
            self.spec_acceptance.set(stats.get("spec_accepted", 0) / stats["spec_drafted"])
        if "threads" in stats:
            self.engine_threads.set(stats["threads"])

    def observe_step(self, engine: HasStats, outputs: Iterable[StepOutput], seconds: float,
                     active: Container[str]) -> None:
        """After an engine step: its time, batch size and each job's inter-token latency."""
        self.step_seconds.observe(seconds)
        now = time.monotonic()
        outputs = list(outputs)
        stats = engine_stats(engine)
        self._set_gauges(stats)
        with_tokens = [out for out in outputs if out.new_token_ids]
        seqs = stats.get("batch_seqs", len(with_tokens))
        if seqs:
            self.batch_size.observe(seqs)
        if stats.get("batch_tokens"):
            self.batch_tokens.observe(stats["batch_tokens"])
        for out in with_tokens:
            last = self._last_token.get(out.request_id)
            if last is not None:
                gap = (now - last) / len(out.new_token_ids)
                for _ in out.new_token_ids:
                    self.inter_token_seconds.observe(gap)
            self._last_token[out.request_id] = now
        for out in outputs:
            if out.finished or out.preempted:
                self._last_token.pop(out.request_id, None)
        for job_id in [j for j in self._last_token if j not in active]:
            del self._last_token[job_id]  # cancelled, requeued at shutdown, fenced out

    def set_kernels(self, report: dict[str, str]) -> None:
        for op, kernel in report.items():
            if op == "weight_bytes":
                self.weight_bytes.set(float(kernel))
            else:
                self.kernels.labels(op, kernel).set(1)
        native = report.get("native", "")
        self.native_kernels.labels(native).set(0 if native.startswith("missing") else 1)

    def redis_succeeded(self) -> None:
        self.health.redis_succeeded()

    def redis_failed(self, exc: BaseException) -> None:
        self.redis_errors.inc()
        self.health.redis_failed(f"{type(exc).__name__}: {exc}")

    # ------------------------------------------------------------------ endpoint

    def serve(self, port: int) -> None:
        """/metrics, /healthz and /livez on `port` (0: none) of `host`."""
        if port and self._server is None:
            self._server = health_http.serve(port, self.registry, self.health, self.host)

    def close(self) -> None:
        if self._server is not None:
            self._server.shutdown()
            self._server.server_close()
            self._server = None
