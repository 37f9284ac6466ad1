"""`qworker tail JOB_ID`: follow a job's output stream from its first event (or `--from-id`)."""

from __future__ import annotations

import argparse

from qworker_client.cli import (
    EXIT_USAGE,
    add_connection_args,
    connect,
    follow,
    report_error,
    reports_redis_errors,
)
from qworker_client.result import START_ID


def register(subparsers: argparse._SubParsersAction) -> None:
    parser = subparsers.add_parser(
        "tail", help="follow a job's output",
        description="Print a job's text as it is generated (or its events with --json) until "
                    "its done or error event.",
    )
    parser.add_argument("job_id")
    parser.add_argument("--json", action="store_true", help="one event per line, as JSON")
    parser.add_argument("--from-id", default=START_ID,
                        help="start after this entry id of <prefix>:out:<id> (default: the start)")
    parser.add_argument("--timeout", type=float, default=None, help="seconds to wait for the end")
    parser.add_argument("--logprobs", action="store_true",
                        help="a line per token: index, id, logprob, text, top alternatives")
    add_connection_args(parser)
    parser.set_defaults(func=run)


@reports_redis_errors
def run(args: argparse.Namespace) -> int:
    with connect(args) as producer:
        try:
            job = producer.job(args.job_id, after=args.from_id)
        except ValueError as exc:
            report_error(str(exc))
            return EXIT_USAGE
        return follow(job, stream=True, as_json=args.json, timeout=args.timeout,
                      cancel_on_interrupt=False, logprobs=args.logprobs and not args.json)
