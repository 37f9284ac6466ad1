"""`qworker cancel JOB_ID...`: flag jobs for cancelling (docs/protocol.md, "Cancelling"): a running
job stops within one engine step and ends `cancelled` with its text so far; a queued one ends so
without running. Exits 1 when a job had already ended."""

from __future__ import annotations

import argparse

from qworker_client.cli import (
    EXIT_JOB_ERROR,
    EXIT_USAGE,
    add_connection_args,
    add_job_model_arg,
    connect,
    job_model,
    report_error,
    reports_redis_errors,
)
from qworker_client.protocol import ID_PATTERN, is_valid_id


def register(subparsers: argparse._SubParsersAction) -> None:
    parser = subparsers.add_parser(
        "cancel", help="cancel jobs",
        description="Cancel queued or running jobs: each ends with finish_reason cancelled. A "
                    "job that has already ended is left alone (exit 1).")
    parser.add_argument("job_ids", nargs="+", metavar="JOB_ID")
    add_job_model_arg(parser)
    add_connection_args(parser)
    parser.set_defaults(func=run)


@reports_redis_errors
def run(args: argparse.Namespace) -> int:
    bad = [job_id for job_id in args.job_ids if not is_valid_id(job_id)]
    if bad:
        report_error(f"invalid job id {bad[0]!r} (want {ID_PATTERN})")
        return EXIT_USAGE
    code = 0
    with connect(args) as producer:
        for job_id in args.job_ids:
            model = job_model(producer, args.model, job_id)
            if producer.cluster and model is None:
                report_error(f"{job_id}: in no model's slot (give --model to flag a job not "
                             "yet submitted)")
                code = EXIT_JOB_ERROR
            elif producer.cancel(job_id, model=model):
                print(f"{job_id}: cancelling")
            else:
                report_error(f"{job_id}: has already ended, left alone")
                code = EXIT_JOB_ERROR
    return code
