"""What a worker says of itself: its liveness key's value, at start which kernels it runs, and
once it takes jobs its ready line."""

from __future__ import annotations

import functools
import os
import socket
from importlib import metadata
from typing import Any

from qworker.service.config import ServiceConfig
from qworker.service.metrics import Metrics
from qworker_client.connect import masked
from qworker_client.protocol import WorkerInfo


def worker_info(config: ServiceConfig, started_ms: int, running: int, free_slots: int,
                draining: bool, kernels: dict[str, str], chat: bool,
                engine: dict[str, int] | None = None) -> WorkerInfo:
    """`engine`: its `engine_stats` (the KV cache's blocks), when known."""
    blocks = (engine or {}).get("blocks_total", 0)
    kv_used = (blocks - (engine or {}).get("blocks_free", blocks)) / blocks if blocks else None
    return WorkerInfo(name=config.name, host=socket.gethostname(), pid=os.getpid(),
                      model=config.model, group=config.group,
                      served_model_name=config.served_model or "", started_ms=started_ms,
                      running=running, free_slots=free_slots, draining=draining,
                      native=kernels.get("native", ""), chat=chat, version=_version(),
                      kv_used=kv_used, liveness_ms=config.liveness_ttl_ms)


@functools.cache
def _version() -> str:
    try:
        return metadata.version("qworker-llm")
    except metadata.PackageNotFoundError:
        return ""


def report_kernels(report: dict[str, str], metrics: Metrics, log: Any) -> None:
    """Which kernels run (in the log and /metrics); loudly when the native CPU kernels are
    missing, since then every op takes the slow torch path."""
    metrics.set_kernels(report)
    if report.get("native", "").startswith("missing"):
        log.error("native CPU kernels missing: every op runs the slow torch path",
                  reason=report["native"], fix="reinstall with `make install` or the wheel "
                  "(they carry the build), or give the worker a C++ compiler")
    else:
        log.info("kernels", **report)


def say_ready(log: Any, config: ServiceConfig, streams: tuple[str, ...],
              kernels: dict[str, str], sampling_defaults: dict[str, float | int]) -> None:
    """The one line that says the worker takes jobs, and from where (its password masked)."""
    log.info("ready", redis=masked(config.redis_url), streams=len(streams),
             reads=" ".join(streams), model=config.model,
             served_model_name=config.served_model or "", kernels=kernels.get("native", ""),
             sampling_defaults=sampling_defaults, worker=config.name)
