"""`qworker batch run | submit-rq`: run a JSONL batch file here, or as one RQ job."""

from __future__ import annotations

import argparse
from pathlib import Path

from qworker_client.batch import DEFAULT_MAX_IN_FLIGHT, BatchInputError, make_progress, run_batch
from qworker_client.cli import (
    EXIT_INTERRUPTED,
    EXIT_JOB_ERROR,
    EXIT_USAGE,
    add_connection_args,
    print_json,
    reachable_url,
    report_error,
    reports_redis_errors,
)

DEFAULT_RQ_JOB_TIMEOUT_S = 24 * 3600
DEFAULT_RQ_RESULT_TTL_S = 7 * 24 * 3600


def register(subparsers: argparse._SubParsersAction) -> None:
    parser = subparsers.add_parser(
        "batch", help="run a JSONL batch file",
        description="Each input line: {\"custom_id\": ..., \"prompt\" | \"messages\" | "
                    "\"prompt_token_ids\": ..., <sampling params>}. Each output line: "
                    "{\"custom_id\", \"text\", \"finish_reason\", \"usage\"}.",
    )
    commands = parser.add_subparsers(dest="batch_command", required=True)
    _register_run(commands)
    _register_submit_rq(commands)


def _add_files(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("input", type=Path, help="JSONL input, one job per line")
    parser.add_argument("output", type=Path, help="JSONL results (appended; rerun to resume)")
    parser.add_argument("--errors", type=Path, default=None,
                        help="JSONL of failed lines (default: <output stem>.errors.jsonl)")
    parser.add_argument("--max-in-flight", type=_positive, default=DEFAULT_MAX_IN_FLIGHT,
                        help=f"jobs submitted and not finished (default {DEFAULT_MAX_IN_FLIGHT})")
    parser.add_argument("--batch-id", default=None,
                        help="identity of the batch for resuming (default: from the output "
                             "file's real path)")


def _register_run(commands: argparse._SubParsersAction) -> None:
    parser = commands.add_parser(
        "run", help="run a batch file here, with a progress bar",
        description="Submit every line with bounded in-flight jobs and write results as they "
                    "finish. Run the same command again after an interruption to resume.")
    _add_files(parser)
    parser.add_argument("--no-progress", action="store_true", help="no progress bar")
    add_connection_args(parser)
    parser.set_defaults(func=run)


def _register_submit_rq(commands: argparse._SubParsersAction) -> None:
    parser = commands.add_parser(
        "submit-rq", help="enqueue the batch as one RQ job (JSON serializer)",
        description="Enqueue `qworker_client.rq.run_batch` on an RQ queue; an RQ worker started "
                    "with `--serializer rq.serializers.JSONSerializer` runs it. Paths are made "
                    "absolute and must be readable (input) and writable (output) by that worker.")
    _add_files(parser)
    parser.add_argument("--queue", required=True, help="RQ queue name")
    parser.add_argument("--job-timeout", type=int, default=DEFAULT_RQ_JOB_TIMEOUT_S,
                        help="RQ job timeout in seconds (-1: none)")
    parser.add_argument("--result-ttl", type=int, default=DEFAULT_RQ_RESULT_TTL_S,
                        help="seconds RQ keeps the job's result (the batch summary)")
    add_connection_args(parser)
    parser.set_defaults(func=submit_rq)


def _positive(text: str) -> int:
    value = int(text)
    if value < 1:
        raise argparse.ArgumentTypeError("must be >= 1")
    return value


@reports_redis_errors
def run(args: argparse.Namespace) -> int:
    try:
        summary = run_batch(
            args.input, args.output, args.errors, redis_url=reachable_url(args), prefix=args.prefix,
            max_in_flight=args.max_in_flight, batch_id=args.batch_id,
            progress=make_progress(not args.no_progress))
    except BatchInputError as exc:
        report_error(f"batch refused: {exc}")
        return EXIT_USAGE
    except KeyboardInterrupt:
        report_error("interrupted; run the same command again to resume")
        return EXIT_INTERRUPTED
    print_json(summary.to_dict())
    return 0 if summary.ok else EXIT_JOB_ERROR


@reports_redis_errors
def submit_rq(args: argparse.Namespace) -> int:
    from qworker_client.rq import enqueue_batch

    job_id = enqueue_batch(
        reachable_url(args), args.queue, args.input.resolve(),
        args.output.resolve(), args.errors.resolve() if args.errors else None,
        max_in_flight=args.max_in_flight, prefix=args.prefix, batch_id=args.batch_id,
        job_timeout=args.job_timeout, result_ttl=args.result_ttl)
    print_json({"rq_job_id": job_id, "queue": args.queue})
    return 0
