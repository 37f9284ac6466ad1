"""`qworker tail JOB_ID`: follow a job's output stream from its first event (or `--from-id`). A job
Redis does not know exits 1 at once; a queued one with no live worker says so (exit 3); with
`--wait` either is followed all the same."""

from __future__ import annotations

import argparse

from qworker_client.cli import (
    EXIT_JOB_ERROR,
    EXIT_REDIS,
    EXIT_USAGE,
    add_connection_args,
    add_job_model_arg,
    connect,
    follow,
    job_model,
    report_error,
    reports_redis_errors,
)
from qworker_client.result import START_ID
from qworker_client.stats import visible_workers


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
    parser.add_argument("--wait", action="store_true",
                        help="follow the job even when Redis does not know it yet (exit 1 "
                             "otherwise) or no worker is live (exit 3 otherwise)")
    add_job_model_arg(parser)
    add_connection_args(parser)
    parser.set_defaults(func=run)


@reports_redis_errors
def run(args: argparse.Namespace) -> int:
    with connect(args) as producer:
        args.model = job_model(producer, args.model, args.job_id)
        if producer.cluster and args.model is None and not args.wait:
            report_error(f"job {args.job_id} is unknown: in no model's slot (--model and --wait "
                         "to follow a job not yet submitted)")
            return EXIT_JOB_ERROR
        try:
            job = producer.job(args.job_id, after=args.from_id, model=args.model)
        except ValueError as exc:
            report_error(str(exc))
            return EXIT_USAGE
        status = producer.status(args.job_id, args.model).status
        if status == "unknown" and not args.wait:
            report_error(f"job {args.job_id} is unknown: never submitted, expired, or written "
                         "with a plain XADD and not started yet (--wait to follow it anyway)")
            return EXIT_JOB_ERROR
        if status == "queued" and visible_workers(producer.redis, producer.keys) == []:
            if not args.wait:
                report_error(f"job {args.job_id} is queued and no worker is live (start one "
                             "with `qworker serve`, or --wait to wait for one)")
                return EXIT_REDIS
            report_error(f"job {args.job_id} is queued and no worker is live; waiting for one")
        return follow(job, stream=True, as_json=args.json, timeout=args.timeout,
                      cancel_on_interrupt=False, logprobs=args.logprobs and not args.json)
