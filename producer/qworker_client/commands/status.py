"""`qworker status JOB_ID`: queued, running, done, error or unknown (docs/protocol.md, "Asking a
job's status"); with the result when the job has ended, and `held: quota` for a queued job its
tenant's quota holds. Exits 0, or 1 for a job Redis does not know (never submitted, or its output
has expired)."""

from __future__ import annotations

import argparse

from qworker_client.cli import (
    EXIT_JOB_ERROR,
    EXIT_USAGE,
    add_connection_args,
    add_job_model_arg,
    connect,
    job_model,
    print_json,
    report_error,
    reports_redis_errors,
)
from qworker_client.jobs import held_detail
from qworker_client.status import JobStatus


def register(subparsers: argparse._SubParsersAction) -> None:
    parser = subparsers.add_parser(
        "status", help="a job's status", description="Print a job's status (and its result).",
    )
    parser.add_argument("job_id")
    parser.add_argument("--json", action="store_true", help="the status object, as JSON")
    add_job_model_arg(parser)
    add_connection_args(parser)
    parser.set_defaults(func=run)


@reports_redis_errors
def run(args: argparse.Namespace) -> int:
    with connect(args) as producer:
        args.model = job_model(producer, args.model, args.job_id)
        try:
            found = (JobStatus(args.job_id, "unknown") if producer.cluster and args.model is None
                     else producer.status(args.job_id, args.model))  # in no model's slot
        except ValueError as exc:
            report_error(str(exc))
            return EXIT_USAGE
        detail = (held_detail(producer.redis, producer.keys_for(args.model), args.job_id)
                  if found.status == "queued" else "")
    if args.json:
        print_json({**found.to_dict(), **({"detail": detail} if detail else {})})
    elif found.result is not None:
        print(f"done ({found.result.finish_reason})")
    elif found.error is not None:
        print(f"error: {found.error.code}: {found.error.message}")
    else:
        print(f"{found.status} ({detail})" if detail else found.status)
    return EXIT_JOB_ERROR if found.status == "unknown" else 0
