"""`qworker dashboard`: the web dashboard alone, for a fleet without a gateway (extra
`[gateway]`); the gateway serves the same at `/dashboard` (docs/dashboard.md)."""

from __future__ import annotations

import argparse
import os

from qworker_client.cli import (
    EXIT_USAGE,
    add_connection_args,
    reachable_url,
    report_error,
    reports_redis_errors,
)
from qworker_client.commands.gateway import INSTALL_HINT
from qworker_client.connect import DEFAULT_RESULT_TTL_S, masked

READY = "qworker dashboard: ready at http://{host}:{port}/ (Redis {redis})"


def register(subparsers: argparse._SubParsersAction) -> None:
    parser = subparsers.add_parser(
        "dashboard", help="serve the web dashboard (queues, workers, jobs, dead letters)",
        description="A web dashboard of the fleet from Redis alone: queues, workers, jobs and "
                    "their live streams, dead letters (retry, purge). With no key it is open "
                    "and every visitor is admin: keep it on localhost then. Needs "
                    + INSTALL_HINT)
    add_connection_args(parser)
    parser.add_argument("--host", default="127.0.0.1")
    parser.add_argument("--port", type=int, default=8080)
    parser.add_argument("--api-key", action="append", default=None,
                        help="a key that opens it read-only (repeatable; env QWORKER_API_KEY, "
                             "comma-separated)")
    parser.add_argument("--admin-key", action="append", default=None,
                        help="a key that opens it as admin: retry, cancel, purge (repeatable; "
                             "env QWORKER_ADMIN_KEY, comma-separated)")
    parser.add_argument("--result-ttl", type=int, default=DEFAULT_RESULT_TTL_S,
                        help="the workers' --result-ttl, in seconds (default: 3600)")
    parser.add_argument("--log-level", default="warning")
    parser.set_defaults(func=run)


def _listed(flags: list[str] | None, name: str) -> tuple[str, ...]:
    if flags:
        return tuple(flags)
    return tuple(k.strip() for k in os.environ.get(f"QWORKER_{name}", "").split(",")
                 if k.strip())


@reports_redis_errors
def run(args: argparse.Namespace) -> int:
    try:
        import uvicorn

        from qworker_client.dashboard.app import create_dashboard
    except ModuleNotFoundError as exc:
        report_error(f"`dashboard` needs its extra ({exc.name} is missing): {INSTALL_HINT}")
        return EXIT_USAGE
    url = reachable_url(args)
    app = create_dashboard(url, args.prefix, _listed(args.api_key, "API_KEY"),
                           _listed(args.admin_key, "ADMIN_KEY"), args.result_ttl)
    print(READY.format(host=args.host, port=args.port, redis=masked(url)), flush=True)
    try:
        uvicorn.run(app, host=args.host, port=args.port, log_level=args.log_level)
    except KeyboardInterrupt:
        return 130
    return 0
