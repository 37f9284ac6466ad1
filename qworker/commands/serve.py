"""`qworker serve`: run one worker (one engine) on the job streams of a Redis.

Every flag can also come from an environment variable `QWORKER_<FLAG>` (dashes as underscores,
upper case), e.g. `QWORKER_REDIS_URL`, `QWORKER_MAX_NUM_SEQS`; a flag on the command line wins.
The flags are the fields of ServiceConfig and EngineConfig (their defaults and help too).
"""

from __future__ import annotations

import argparse
import signal
import sys
from typing import Any

from qworker.commands.config_flags import Flag, add_config_flags, add_flag, config_values
from qworker.commands.config_flags import env_name as env_name  # where tests/deploy look
from qworker.engine.config import EngineConfig  # a plain dataclass: no torch
from qworker.service.config import ServiceConfig  # stdlib and the protocol's names: no redis

LOG_LEVELS = ("debug", "info", "warning", "error")
EXIT_INTERRUPTED = 130  # as a shell reports Ctrl-C
# the flags of `serve` that are no config field: how the process logs, and its RQ callback
NOT_CONFIG = (
    Flag("--log-level", "log_level", str, "info", "how much to log", LOG_LEVELS),
    Flag("--on-done-rq-queue", "on_done_rq_queue", str, None,
         "RQ queue to enqueue each finished job's result on"),
    Flag("--on-done-rq-func", "on_done_rq_func", str, None,
         "dotted path of the RQ function given that result"),
)


def register(subparsers: argparse._SubParsersAction) -> None:
    p = subparsers.add_parser("serve", help="run a worker on a Redis job stream",
                              description=__doc__,
                              formatter_class=argparse.RawDescriptionHelpFormatter)
    add_flags(p)
    p.set_defaults(func=run)


def add_flags(p: argparse.ArgumentParser, redis_required: bool = True,
              default_model: str | None = None) -> None:
    """The worker's flags: ServiceConfig's, EngineConfig's and NOT_CONFIG (`qworker up` takes
    them too, with a Redis of its own and a default model)."""
    redis_url = {"required": True, "default": None} if redis_required else {"default": None}
    model = ({"required": True, "default": None} if default_model is None
             else {"default": default_model})
    add_config_flags(p, ServiceConfig, redis_url=redis_url)
    add_config_flags(p, EngineConfig, model=model)
    for flag in NOT_CONFIG:
        add_flag(p, flag)


def engine_for(config: EngineConfig, log: Any = None) -> Any:
    """The simulated engine for a `sim` model, else the real one (torch: imported only then),
    its loading shown on stderr (load_progress.py) through `log` (None: the default logger)."""
    from qworker.commands.load_progress import LoadProgress
    from qworker.engine.simulated import SimulatedEngine, is_simulated
    from qworker.service.logs import get_logger

    if is_simulated(config.model):
        return SimulatedEngine.from_config(config)
    from qworker.engine.engine import Engine  # torch: only for a real model

    progress = LoadProgress(log or get_logger(), config.model)
    engine = None
    try:
        engine = Engine.from_config(config, progress.stage)
    finally:
        progress.close(loaded=engine is not None)
    return engine


def engine_config(args: argparse.Namespace) -> EngineConfig:
    """A worker's: it requeues what the engine preempts, so the job streams roll back."""
    return EngineConfig(**config_values(args, EngineConfig), requeue_preempted=True)


def build_engine(args: argparse.Namespace, log: Any = None) -> Any:
    return engine_for(engine_config(args), log)


def service_config(args: argparse.Namespace) -> ServiceConfig:
    values = config_values(args, ServiceConfig)
    if not values.get("name"):  # none, or empty: host-pid
        values.pop("name", None)
    return ServiceConfig(**values, model=args.model)


def checked_inputs(args: argparse.Namespace) -> ServiceConfig:
    """The worker's settings, once the Redis URL parses and the model is a path or a known
    name: what is wrong with them is said before seconds go into loading the model
    (`RedisURLError`, a ValueError; `ModelInputError`)."""
    from qworker.engine.simulated import is_simulated
    from qworker.model.loading.hub import local_path
    from qworker_client.connect import checked_url

    config = service_config(args)
    checked_url(config.redis_url)
    if not is_simulated(args.model):
        local_path(args.model)  # an unknown name raises; a known one is fetched when loaded
    return config


def run(args: argparse.Namespace) -> int:
    from qworker.model.errors import ModelInputError, one_line
    from qworker.service.logs import configure_logging, get_logger
    from qworker.service.metrics import Metrics
    from qworker.service.on_done import OnDone
    from qworker.service.worker import Worker

    configure_logging(args.log_level)
    try:
        config = checked_inputs(args)
    except ModelInputError as exc:
        get_logger().error("model_not_loaded", model=args.model, error=one_line(exc))
        return 2
    except ValueError as exc:  # a Redis URL that does not parse, a served name that cannot be
        get_logger().error("bad_settings", error=one_line(exc))
        return 2
    log = get_logger(worker=config.name)
    try:
        on_done = OnDone.from_flags(args.on_done_rq_queue, args.on_done_rq_func, args.prefix)
    except (ValueError, ImportError) as exc:
        log.error("bad --on-done-rq-* flags", error=str(exc))
        return 2
    try:
        log.info("loading engine", model=args.model, device=args.device)
        engine = build_engine(args, log)
    except ModelInputError as exc:  # a bad model: one line, no traceback (qworker/model/errors.py)
        log.error("model_not_loaded", model=args.model, error=one_line(exc))
        return 2
    except KeyboardInterrupt:  # Ctrl-C while loading: nothing taken yet, nothing to drain
        log.warning("interrupted while loading the model")
        return EXIT_INTERRUPTED
    worker = Worker(engine, config, on_done=on_done,
                    metrics=Metrics(stall_s=config.stall_timeout_s, host=config.metrics_host))

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
