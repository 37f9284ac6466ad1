"""`qworker gateway`: the OpenAI-compatible HTTP API over the queue (extra `[gateway]`).

Every flag can also come from `QWORKER_<FLAG>` (dashes as underscores, upper case), e.g.
`QWORKER_PORT`, `QWORKER_MAX_QUEUED`; `QWORKER_API_KEY` may hold several keys, comma-separated.
A flag on the command line wins; a variable that does not parse (Kubernetes' `QWORKER_PORT=
tcp://10.0.0.5:8000`, for a Service named `qworker`) is ignored with one warning line."""

from __future__ import annotations

import argparse
import os

from qworker_client.cli import EXIT_USAGE, add_connection_args, report_error
from qworker_client.connect import DEFAULT_RESULT_TTL_S, redis_url_from_env
from qworker_client.env import env_text, lenient
from qworker_client.gateway.config import GatewayConfig  # needs no extra
from qworker_client.protocol import DEFAULT_PREFIX

INSTALL_HINT = "pip install 'qworker-client[gateway]'"


def _env(name: str, default: str | None = None) -> str | None:
    return os.environ.get(f"QWORKER_{name}", default)


def _env_default(name: str, default: object) -> object:
    """QWORKER_<name> as the default text of a flag (parsed leniently), else `default`."""
    text = env_text(f"QWORKER_{name}")
    return default if text is None else text


def _bound(text: str) -> int | None:
    """A bound: a number, or `none` for no bound."""
    return None if text.strip().lower() == "none" else int(text)


def _setting(parser: argparse.ArgumentParser, flag: str, field: str, kind: type, metavar: str,
             help: str) -> None:
    """A flag for a GatewayConfig field: its default the field's, or its QWORKER_ variable."""
    default = getattr(GatewayConfig, field)
    parser.add_argument(flag, dest=field, type=lenient(kind, default), metavar=metavar,
                        default=_env_default(flag.lstrip("-").replace("-", "_").upper(), default),
                        help=f"{help} (default: {default})")


def register(subparsers: argparse._SubParsersAction) -> None:
    parser = subparsers.add_parser(
        "gateway", help="serve an OpenAI-compatible HTTP API over the queue",
        description="OpenAI-compatible HTTP API (chat and text completions, models, job status "
                    "and resumable streams) in front of the queue: needs " + INSTALL_HINT,
    )
    add_connection_args(parser)
    parser.set_defaults(prefix=_env("PREFIX", DEFAULT_PREFIX))
    parser.add_argument("--host", default=_env("HOST", "127.0.0.1"))
    parser.add_argument("--port", type=lenient(int, GatewayConfig.port),
                        default=_env_default("PORT", GatewayConfig.port))
    parser.add_argument("--model", action="append", default=None, dest="models",
                        help="a model served even while none of its workers is live (a fleet "
                             "scaled to zero): its requests are queued for the worker that "
                             "starts (repeatable; env QWORKER_MODEL, comma-separated; the live "
                             "workers' models are served anyway)")
    parser.add_argument("--max-queued", metavar="N",
                        type=lenient(_bound, GatewayConfig.max_queued, "a number or `none`"),
                        default=_env_default("MAX_QUEUED", GatewayConfig.max_queued),
                        help="refuse a request (429) that would make more jobs than this "
                             "unfinished for its model; `none`: no bound (default: "
                             f"{GatewayConfig.max_queued})")
    _setting(parser, "--max-prompts", "max_prompts", int, "N",
             "most prompts one completions request may hold (400 past it)")
    _setting(parser, "--max-jobs", "max_jobs", int, "N",
             "most jobs one request may queue, its prompts times `n` (400 past it)")
    _setting(parser, "--max-body-bytes", "max_body_bytes", int, "BYTES",
             "largest request body, file uploads aside (413 past it)")
    _setting(parser, "--max-header-bytes", "max_header_bytes", int, "BYTES",
             "largest request line and headers (431 past it)")
    _setting(parser, "--header-timeout", "header_timeout_s", float, "S",
             "seconds a connection has to send a request's line and headers")
    _setting(parser, "--keep-alive", "keep_alive_s", int, "S",
             "seconds an idle kept-alive connection is kept")
    parser.add_argument("--max-connections", type=lenient(int, None), metavar="N",
                        default=_env_default("MAX_CONNECTIONS", None),
                        help="connections at once; past it the one idle longest is closed "
                             "(default: the open-file limit less what Redis and files need)")
    parser.add_argument("--api-key", action="append", default=None,
                        help="require `Authorization: Bearer KEY` (repeatable); it opens "
                             "the dashboard (/dashboard) read-only")
    parser.add_argument("--admin-key", action="append", default=None,
                        help="a key that opens the dashboard as admin: retry, cancel, purge "
                             "(repeatable; env QWORKER_ADMIN_KEY, comma-separated)")
    parser.add_argument("--keys-file", default=_env("KEYS_FILE"), metavar="PATH",
                        help="API keys of tenants, JSON (docs/gateway.md, \"Tenants\"); reread "
                             "when it changes or on SIGHUP")
    parser.add_argument("--result-ttl", type=lenient(int, DEFAULT_RESULT_TTL_S),
                        default=_env_default("RESULT_TTL", DEFAULT_RESULT_TTL_S),
                        help="the workers' --result-ttl, in seconds (default: 3600)")
    parser.add_argument("--files-dir", default=_env("FILES_DIR"),
                        help="directory of the Files and Batch APIs (default: none, no batches)")
    default_interval = GatewayConfig.stream_interval_ms
    parser.add_argument("--stream-interval", type=lenient(float, default_interval),
                        default=_env_default("STREAM_INTERVAL", default_interval),
                        help="milliseconds: read the output streams at most once per interval "
                             "and send a choice's tokens of one read as one chunk (0: each token "
                             f"its own chunk; default: {default_interval:g})")
    parser.add_argument("--log-level", default=_env("LOG_LEVEL", "info"))
    parser.set_defaults(func=run)


def _listed(flags: list[str] | None, name: str) -> tuple[str, ...]:
    """A repeatable flag's values, else its QWORKER_<name> variable's, comma-separated."""
    if flags:
        return tuple(flags)
    return tuple(k.strip() for k in (_env(name) or "").split(",") if k.strip())


def api_keys(flags: list[str] | None) -> tuple[str, ...]:
    return _listed(flags, "API_KEY")


def run(args: argparse.Namespace) -> int:
    try:
        from qworker_client.gateway.app import create_app
        from qworker_client.gateway.gc_tuning import tune_gc
        from qworker_client.gateway.server import AnnouncingServer, uvicorn_config
        from qworker_client.gateway.tenants import KeysFileError
    except ModuleNotFoundError as exc:
        report_error(f"`gateway` needs its extra ({exc.name} is missing): {INSTALL_HINT}")
        return EXIT_USAGE
    config = GatewayConfig(
        redis_url=args.redis_url or redis_url_from_env(), prefix=args.prefix, host=args.host,
        port=args.port, max_queued=args.max_queued, api_keys=api_keys(args.api_key),
        keys_file=args.keys_file,
        admin_keys=_listed(args.admin_key, "ADMIN_KEY"),
        result_ttl_s=args.result_ttl, files_dir=args.files_dir,
        stream_interval_ms=args.stream_interval, max_prompts=args.max_prompts,
        max_jobs=args.max_jobs, max_body_bytes=args.max_body_bytes,
        max_header_bytes=args.max_header_bytes, header_timeout_s=args.header_timeout_s,
        keep_alive_s=args.keep_alive_s, max_connections=args.max_connections,
        models=_listed(args.models, "MODEL"),
    )
    try:
        app = create_app(config)
    except (KeysFileError, ValueError) as exc:  # ValueError: what the settings cannot do
        report_error(str(exc))
        return EXIT_USAGE
    if app.state.gateway.keys_file is not None:
        app.state.gateway.keys_file.listen_for_hangup()
    tune_gc()  # what the imports and the app made is frozen
    try:
        AnnouncingServer(uvicorn_config(app, config, args.log_level)).run()
    except KeyboardInterrupt:  # uvicorn has shut down gracefully, then raises Ctrl-C again
        return 130
    return 0
