"""`qworker jobs`: the jobs running, waiting and delayed, then those that ended lately, with status,
model, tokens and age (docs/protocol.md, "Listing jobs"); bounded by --limit."""

from __future__ import annotations

import argparse

from qworker_client.cli import add_connection_args, connect, print_json, reports_redis_errors, table
from qworker_client.jobs import MAX_LIMIT, ORDER, JobRow, age, list_jobs, server_ms


def register(subparsers: argparse._SubParsersAction) -> None:
    parser = subparsers.add_parser(
        "jobs", help="running, waiting and recently ended jobs",
        description="List the jobs in the queue (running or waiting, oldest first; delayed, "
                    "soonest first) and those that ended lately (done, error, dead-lettered; "
                    "newest first).")
    parser.add_argument("--limit", type=int, default=50,
                        help=f"at most this many jobs (default 50, at most {MAX_LIMIT})")
    parser.add_argument("--status", action="append", choices=ORDER, default=None,
                        help="only jobs of this status (repeatable)")
    parser.add_argument("--json", action="store_true", help="one JSON object per job")
    add_connection_args(parser)
    parser.set_defaults(func=run)


@reports_redis_errors
def run(args: argparse.Namespace) -> int:
    with connect(args) as producer:
        rows = list_jobs(producer.redis, producer.keys, args.limit)
        now = server_ms(producer.redis)
    rows = [row for row in rows if args.status is None or row.status in args.status]
    if args.json:
        for row in rows:
            print_json(row.to_dict())
    elif rows:
        print(render(rows, now))
    return 0


def render(rows: list[JobRow], now_ms: int) -> str:
    lines = [("ID", "STATUS", "TENANT", "MODEL", "TOKENS", "AGE", "DETAIL")]
    lines += [(row.job_id, row.status, row.tenant, row.model or "-",
               "-" if row.tokens is None else str(row.tokens),
               f"in {age(row.since_ms - now_ms)}" if row.status == "delayed"
               else age(now_ms - row.since_ms), row.detail) for row in rows]
    return table(lines)
