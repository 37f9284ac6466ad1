"""`qworker usage [--tenant T] [--since D]`: each tenant's jobs, tokens and errors per model and
UTC day (docs/protocol.md, "Quotas and usage")."""

from __future__ import annotations

import argparse
import datetime as dt

from qworker_client.cli import (
    EXIT_USAGE,
    add_connection_args,
    connect,
    print_json,
    report_error,
    reports_redis_errors,
    table,
)
from qworker_client.usage import COUNTERS, days_since, parse_day, usage


def register(subparsers: argparse._SubParsersAction) -> None:
    parser = subparsers.add_parser(
        "usage", help="each tenant's usage per model and day",
        description="Jobs, prompt and completion tokens and errors of each tenant, per model and "
                    "UTC day, as the workers counted them (kept 90 days).")
    parser.add_argument("--tenant", default=None, help="only this tenant")
    parser.add_argument("--since", default=None, metavar="YYYY-MM-DD",
                        help="from this UTC day on (default: today)")
    parser.add_argument("--json", action="store_true", help="one JSON object per row")
    add_connection_args(parser)
    parser.set_defaults(func=run)


@reports_redis_errors
def run(args: argparse.Namespace) -> int:
    today = dt.datetime.now(dt.timezone.utc).date()
    try:
        since = parse_day(args.since) if args.since else today
    except ValueError as exc:
        report_error(str(exc))
        return EXIT_USAGE
    with connect(args) as producer:
        rows = usage(producer.redis, producer.keys, days_since(since, today), args.tenant)
    if args.json:
        for row in rows:
            print_json(row.to_dict())
    elif rows:
        print(table([("DAY", "TENANT", "MODEL", *(c.upper() for c in COUNTERS))] + [
            (r.day, r.tenant, r.model, *(str(getattr(r, c)) for c in COUNTERS)) for r in rows]))
    return 0
