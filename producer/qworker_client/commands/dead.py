"""`qworker dead list | show | retry | purge`: the dead letters (docs/protocol.md, "Dead
letters")."""

from __future__ import annotations

import argparse

from qworker_client import dead
from qworker_client.cli import (
    EXIT_JOB_ERROR,
    EXIT_USAGE,
    add_connection_args,
    add_job_model_arg,
    connect,
    print_json,
    report_error,
    reports_redis_errors,
    table,
)
from qworker_client.jobs import age, server_ms

MAX_LIST = 1_000
MAX_PURGE = 10_000


def register(subparsers: argparse._SubParsersAction) -> None:
    parser = subparsers.add_parser(
        "dead", help="list, show, retry or purge dead letters",
        description="The jobs that could not be run, in <prefix>:dead (code, reason, a bounded "
                    "copy of the job). A dead letter is named by its entry id there, or by its "
                    "job id (the newest of that job).")
    verbs = parser.add_subparsers(dest="verb", required=True)
    listing = verbs.add_parser("list", help="the newest dead letters")
    listing.add_argument("--limit", type=int, default=20,
                         help=f"at most this many (default 20, at most {MAX_LIST})")
    listing.add_argument("--code", default=None, help="only those of this error code")
    listing.add_argument("--json", action="store_true", help="one JSON object per dead letter")
    listing.set_defaults(func=run_list)
    show = verbs.add_parser("show", help="one dead letter, every field")
    show.add_argument("ref", metavar="ENTRY_OR_JOB_ID")
    show.add_argument("--json", action="store_true", help="one JSON object")
    show.set_defaults(func=run_show)
    retry = verbs.add_parser(
        "retry", help="queue jobs again, under their ids",
        description="Queue each job again under its id, afresh (new delivery and crash counts, "
                    "its old output deleted), on its model's stream of its priority's band; the "
                    "dead letter goes. Refused for a job whose copy was cut, that is not valid, "
                    "or whose id is queued or running again.")
    retry.add_argument("refs", nargs="+", metavar="ENTRY_OR_JOB_ID")
    retry.set_defaults(func=run_retry)
    purge = verbs.add_parser(
        "purge", help="delete the oldest dead letters",
        description="Delete the oldest dead letters (at most --limit), of --code and older than "
                    "--older-than when given. Without --yes only says what it would delete.")
    purge.add_argument("--limit", type=int, default=1_000,
                       help=f"at most this many (default 1000, at most {MAX_PURGE})")
    purge.add_argument("--code", default=None, help="only those of this error code")
    purge.add_argument("--older-than", type=float, default=None, metavar="SECONDS",
                       help="only those dead-lettered at least this long ago")
    purge.add_argument("--yes", action="store_true", help="delete them")
    purge.set_defaults(func=run_purge)
    for sub in (listing, show, retry, purge):
        add_job_model_arg(sub, "the dead letters of this model (on a Redis Cluster, where "
                               "each model has its own; elsewhere not needed)")
        add_connection_args(sub)


@reports_redis_errors
def run_list(args: argparse.Namespace) -> int:
    with connect(args) as producer:
        letters = dead.newest(producer.redis, producer.keys_for(args.model),
                              _bounded(args.limit, MAX_LIST), args.code)
        now = server_ms(producer.redis)
    if args.json:
        for letter in letters:
            print_json(letter.to_dict())
    elif letters:
        rows = [("ENTRY", "JOB", "CODE", "SOURCE", "AGE", "REASON")]
        rows += [(d.entry_id, d.job_id, d.code, d.source, age(now - d.dead_ms), d.reason[:60])
                 for d in letters]
        print(table(rows))
    return 0


@reports_redis_errors
def run_show(args: argparse.Namespace) -> int:
    with connect(args) as producer:
        letter = dead.find(producer.redis, producer.keys_for(args.model), args.ref)
    if letter is None:
        report_error(f"no dead letter {args.ref!r}")
        return EXIT_JOB_ERROR
    if args.json:
        print_json(letter.to_dict())
    else:
        print(f"entry: {letter.entry_id}")
        for name, value in letter.fields.items():
            print(f"{name}: {value}")
    return 0


@reports_redis_errors
def run_retry(args: argparse.Namespace) -> int:
    code = 0
    with connect(args) as producer:
        for ref in args.refs:
            letter = dead.find(producer.redis, producer.keys_for(args.model), ref)
            if letter is None:
                report_error(f"no dead letter {ref!r}")
                code = EXIT_JOB_ERROR
                continue
            try:
                done = dead.retry(producer.redis, producer.keys_for(args.model), letter,
                                  producer.options.result_ttl_s)
            except ValueError as exc:
                report_error(str(exc).splitlines()[0])
                code = EXIT_JOB_ERROR
                continue
            print(f"{done.job_id}: queued again on {done.stream} ({done.entry_id})")
    return code


@reports_redis_errors
def run_purge(args: argparse.Namespace) -> int:
    with connect(args) as producer:
        now = server_ms(producer.redis)
        before = None if args.older_than is None else now - int(args.older_than * 1000)
        chosen = dead.purge(producer.redis, producer.keys_for(args.model),
                            _bounded(args.limit, MAX_PURGE), args.code, before,
                            dry_run=not args.yes)
    if not args.yes:
        report_error(f"would purge {len(chosen)} dead letter(s); run again with --yes to delete "
                     "them")
        return EXIT_USAGE
    print(f"purged {len(chosen)} dead letter(s)")
    return 0


def _bounded(value: int, most: int) -> int:
    return max(1, min(value, most))
