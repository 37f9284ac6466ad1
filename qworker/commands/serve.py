"""`qworker serve`: run one worker (one engine) on the job streams of a Redis.

Every flag can also come from an environment variable `QWORKER_<FLAG>` (dashes as underscores,
upper case), e.g. `QWORKER_REDIS_URL`, `QWORKER_MAX_NUM_SEQS`; a flag on the command line wins.
"""

from __future__ import annotations

import argparse
import os
import signal
import sys
from collections.abc import Callable
from typing import Any

from qworker.engine.config import EngineConfig  # a plain dataclass: no torch

SIM_HELP = ("model name, HF folder or .gguf file; `sim` or `sim:step_ms=5,max_model_len=4096,"
            "eos_every=0,token_us=0` selects the built-in simulated engine (no torch: a byte "
            "tokenizer and a deterministic fake model with the real scheduling, for tests and "
            "scale-out benchmarks)")


def env_name(flag: str) -> str:
    return "QWORKER_" + flag.lstrip("-").replace("-", "_").upper()


def _flag(parser: argparse.ArgumentParser, flag: str, type: Callable[[str], Any] = str,
          default: Any = None, required: bool = False, help: str = "", **kw: Any) -> None:
    env = env_name(flag)
    value = os.environ.get(env)
    if value is not None:
        default, required = value, False  # argparse applies `type` to string defaults
    shown = f"{help} (env {env}" + (f"; default {default})" if default is not None else ")")
    parser.add_argument(flag, type=type, default=default, required=required, help=shown, **kw)


def register(subparsers: argparse._SubParsersAction) -> None:
    p = subparsers.add_parser("serve", help="run a worker on a Redis job stream",
                              description=__doc__,
                              formatter_class=argparse.RawDescriptionHelpFormatter)
    add_flags(p)
    p.set_defaults(func=run)


def add_flags(p: argparse.ArgumentParser, redis_required: bool = True,
              default_model: str | None = None) -> None:
    """The worker's flags (`qworker up` takes them too, with a Redis of its own)."""
    _flag(p, "--redis-url", required=redis_required,
          help="redis://[user:password@]host:port/db, rediss:// for TLS")
    _flag(p, "--model", required=default_model is None, default=default_model, help=SIM_HELP)
    _flag(p, "--prefix", default="qw", help="key prefix; nothing is written outside it")
    _flag(p, "--group", default="workers", help="consumer group")
    _flag(p, "--name", help="consumer name (default: host-pid)")
    _flag(p, "--device", default="cpu", choices=["cpu", "cuda"], help="engine device")
    _flag(p, "--dtype", default="auto", help="auto | float32 | bfloat16 | float16")
    _flag(p, "--max-num-seqs", type=int, default=EngineConfig.max_num_seqs,
          help="most sequences in a batch")
    _flag(p, "--num-blocks", type=int, help="KV cache blocks (default: from --kv-cache-gb)")
    _flag(p, "--kv-cache-gb", type=float, default=EngineConfig.kv_cache_gb, help="KV cache size")
    _flag(p, "--block-size", type=int, default=EngineConfig.block_size,
          help="tokens per KV block")
    _flag(p, "--max-batched-tokens", type=int, default=EngineConfig.max_batched_tokens,
          help="prefill tokens per step")
    _flag(p, "--prefill-chunk", type=int, default=EngineConfig.prefill_chunk,
          help="prefill tokens per sequence per step")
    _flag(p, "--max-model-len", type=int, help="context limit (default: the model's)")
    _flag(p, "--decode-stretch", type=float,
          help="pace prefill so a step with decodes takes about this many times a decode-only "
               "step (even inter-token latency while long prompts arrive; default: off)")
    _flag(p, "--claim-idle-ms", type=int, default=30_000,
          help="reclaim entries idle this long (their worker died or stalled); a thread re-claims "
               "a live worker's entries every claim-idle/4 s (at most 10 s), whatever its steps")
    _flag(p, "--max-deliveries", type=int, default=5,
          help="an entry delivered more often is dead-lettered as a poison job")
    _flag(p, "--drain-timeout", type=float, default=30.0,
          help="seconds to finish running jobs after SIGTERM before requeueing them")
    _flag(p, "--result-ttl", type=int, default=3600,
          help="seconds an output stream lives after its last event")
    _flag(p, "--metrics-port", type=int, default=0,
          help="port of /metrics (Prometheus), /healthz and /livez (0: off)")
    _flag(p, "--metrics-host", default="127.0.0.1",
          help="interface of the metrics port (0.0.0.0: all, as a container or pod needs)")
    _flag(p, "--stall-timeout", type=float, default=60.0,
          help="seconds without a finished loop turn before /healthz and /livez fail and the "
               "heartbeat stops (so peers reclaim the jobs); must exceed the longest step")
    _flag(p, "--dead-maxlen", type=int, default=10_000,
          help="the dead-letter stream is trimmed to about this many entries")
    _flag(p, "--on-done-rq-queue", help="RQ queue to enqueue each finished job's result on")
    _flag(p, "--on-done-rq-func", help="dotted path of the RQ function given that result")
    _flag(p, "--log-level", default="info", help="debug | info | warning | error")


def build_engine(args: argparse.Namespace) -> Any:
    from qworker.engine.simulated import SimulatedEngine, is_simulated

    kv: dict[str, Any] = {"num_blocks": args.num_blocks, "kv_cache_gb": args.kv_cache_gb}
    config = EngineConfig(
        model=args.model, device=args.device, dtype=args.dtype, max_num_seqs=args.max_num_seqs,
        max_batched_tokens=args.max_batched_tokens, prefill_chunk=args.prefill_chunk,
        block_size=args.block_size, max_model_len=args.max_model_len, requeue_preempted=True,
        decode_stretch=args.decode_stretch, **kv)
    if is_simulated(args.model):
        return SimulatedEngine.from_config(config)
    from qworker.engine.engine import Engine  # torch: only for a real model

    return Engine.from_config(config)


def run(args: argparse.Namespace) -> int:
    from qworker.service.config import ServiceConfig, default_worker_name
    from qworker.service.logs import configure_logging, get_logger
    from qworker.service.metrics import Metrics
    from qworker.service.on_done import OnDone
    from qworker.service.worker import Worker

    configure_logging(args.log_level)
    config = ServiceConfig(
        redis_url=args.redis_url, prefix=args.prefix, group=args.group,
        name=args.name or default_worker_name(), model=args.model,
        claim_idle_ms=args.claim_idle_ms, max_deliveries=args.max_deliveries,
        drain_timeout=args.drain_timeout, result_ttl=args.result_ttl,
        metrics_port=args.metrics_port, dead_maxlen=args.dead_maxlen,
        stall_timeout_s=args.stall_timeout)
    log = get_logger(worker=config.name)
    log.info("loading engine", model=args.model, device=args.device)
    try:
        on_done = OnDone.from_flags(args.on_done_rq_queue, args.on_done_rq_func, args.prefix)
    except (ValueError, ImportError) as exc:
        log.error("bad --on-done-rq-* flags", error=str(exc))
        return 2
    worker = Worker(build_engine(args), config, on_done=on_done,
                    metrics=Metrics(stall_s=args.stall_timeout, host=args.metrics_host))

    def on_signal(_signum: int, _frame: object) -> None:
        worker.request_stop()  # nothing more here: logging could deadlock (see request_stop)

    signal.signal(signal.SIGTERM, on_signal)
    signal.signal(signal.SIGINT, on_signal)
    return worker.run()


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="qworker")
    register(parser.add_subparsers(dest="command", required=True))
    args = parser.parse_args(["serve", *(sys.argv[1:] if argv is None else argv)])
    return int(args.func(args) or 0)


if __name__ == "__main__":
    sys.exit(main())
