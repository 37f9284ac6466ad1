"""The `qworker` command (`qworker_client.cli:main`, also `python -m qworker_client`) and the
pieces its client commands share. The worker's commands join it where `qworker-llm` is installed
(see `commands/worker.py`)."""

from __future__ import annotations

import argparse
import functools
import importlib
import json
import os
import sys
from collections.abc import Callable, Sequence
from typing import Any, TextIO

import redis

from qworker_client.client import Job, Producer
from qworker_client.connect import (
    ClientOptions,
    RedisUnreachable,
    RedisURLError,
    check_reachable,
    checked_url,
    redis_url_from_env,
)
from qworker_client.found_keys import model_stream_keys
from qworker_client.job_slots import job_view
from qworker_client.protocol import (
    DEFAULT_PREFIX,
    DoneEvent,
    ErrorEvent,
    ModelNeededError,
    PromptLogprobsEvent,
    TokenEvent,
)
from qworker_client.result import JobError, JobTimeoutError, Result, result_fields
from qworker_client.version import add_version_flag

CLIENT_COMMANDS = (
    "qworker_client.commands.submit",
    "qworker_client.commands.tail",
    "qworker_client.commands.stats",
    "qworker_client.commands.batch",
    "qworker_client.commands.status",
    "qworker_client.commands.cancel",
    "qworker_client.commands.usage",
    "qworker_client.commands.jobs",
    "qworker_client.commands.dead",
    "qworker_client.commands.gateway",
    "qworker_client.commands.dashboard",
)
EXIT_JOB_ERROR = 1
EXIT_USAGE = 2
EXIT_REDIS = 3
EXIT_TIMEOUT = 124  # as timeout(1)
EXIT_BROKEN_PIPE = 141  # as a shell reports a command killed by SIGPIPE
EXIT_INTERRUPTED = 130


def add_connection_args(parser: argparse.ArgumentParser) -> None:
    parser.add_argument(
        "--redis-url", default=None,
        help="redis://, rediss://, redis+sentinel://host:port[,...]/service_name or "
             "redis+cluster://host:port[,...] URL, may carry user:password "
             "(default: $REDIS_URL, $QWORKER_REDIS_URL, else redis://localhost:6379/0)",
    )
    parser.add_argument("--prefix", default=DEFAULT_PREFIX, help="key prefix (default: qw)")


def add_job_model_arg(parser: argparse.ArgumentParser,
                      help: str = "on a Redis Cluster: the job's model (its keys live in that "
                                  "model's hash slot; by default the model whose slot holds "
                                  "the job); elsewhere not needed") -> None:
    parser.add_argument("--model", default=None, help=help)


def job_model(producer: Producer, model: str | None, job_id: str) -> str | None:
    """`model`, else on a Cluster the model whose slot holds job `job_id` (None: none does)."""
    if model is not None or not producer.cluster:
        return model
    streams = model_stream_keys(producer.redis, producer.keys)
    return job_view(producer.redis, producer.keys, job_id, streams).slot


def connect(args: argparse.Namespace) -> Producer:
    """A producer on the command's Redis (`reachable_url`)."""
    return Producer(reachable_url(args), args.prefix, options=ClientOptions())


def reachable_url(args: argparse.Namespace) -> str:
    """The command's Redis URL, once it parses (else `RedisURLError`) and one PING answered
    within the connect timeout (else `RedisUnreachable`): a command never sits silent in a
    blocking read or a reconnect loop against a Redis that is not there."""
    url = checked_url(args.redis_url or redis_url_from_env())
    check_reachable(url, ClientOptions())
    return url


def print_json(data: Any, out: TextIO | None = None) -> None:
    stream = out or sys.stdout
    stream.write(json.dumps(data, ensure_ascii=False) + "\n")
    stream.flush()


def print_event(event: TokenEvent | DoneEvent | ErrorEvent | PromptLogprobsEvent, as_json: bool,
                logprobs: bool = False) -> None:
    """One event as a JSON line, or (text mode) a token's text as it comes; with `logprobs`, a
    line per token: index, id, logprob, its text, then the top alternatives as id:logprob."""
    if as_json:
        print_json(event.model_dump(exclude_none=True))
    elif logprobs and isinstance(event, TokenEvent):
        top = " ".join(f"{t.token_id}:{t.logprob:.4f}" for t in event.top_logprobs or ())
        logprob = "" if event.logprob is None else f"{event.logprob:.4f}"
        print(f"{event.i}\t{event.token_id}\t{logprob}\t{event.token or event.text!r}\t{top}")
    elif isinstance(event, TokenEvent) and event.text:
        sys.stdout.write(event.text)
        sys.stdout.flush()


def table(rows: Sequence[Sequence[str]]) -> str:
    """Rows (the first a header) as left-aligned columns."""
    widths = [max(len(row[i]) for row in rows) for i in range(len(rows[0]))]
    return "\n".join("  ".join(cell.ljust(w) for cell, w in zip(row, widths, strict=True)).rstrip()
                     for row in rows)


def report_error(message: str) -> None:
    sys.stderr.write(f"qworker: {message}\n")
    sys.stderr.flush()


def reports_redis_errors(run: Callable[[argparse.Namespace], int]) -> Callable[..., int]:
    """A command's `run` that prints a Redis failure as one line (exit 3; a Redis URL that does
    not parse: exit 2), not a traceback."""

    @functools.wraps(run)
    def wrapper(args: argparse.Namespace) -> int:
        try:
            return run(args)
        except (RedisURLError, ModelNeededError) as exc:
            report_error(str(exc))
            return EXIT_USAGE
        except RedisUnreachable as exc:
            report_error(str(exc))
            return EXIT_REDIS
        except redis.RedisError as exc:
            report_error(f"redis: {type(exc).__name__}: {exc}")
            return EXIT_REDIS

    return wrapper


def follow(
    job: Job, *, stream: bool, as_json: bool, timeout: float | None, cancel_on_interrupt: bool,
    logprobs: bool = False,
) -> int:
    """Print a job's output: its text (live when `stream`), or JSON (the result, or one event per
    line when `stream`; a prompt_logprobs event before the first token). The exit status says how
    the job ended."""
    try:
        if stream:
            shown_prompt = False
            for event in job.stream(timeout):
                if as_json and not shown_prompt and job.state.prompt_logprobs is not None:
                    print_event(PromptLogprobsEvent(prompt_logprobs=job.state.prompt_logprobs),
                                as_json)
                    shown_prompt = True
                print_event(event, as_json, logprobs)
            if not as_json and not logprobs:
                print()
        else:
            print_result(job.result(timeout), as_json)
        return 0
    except JobError as exc:
        if as_json:
            print_json({"type": "error", "code": exc.code, "message": exc.message})
        report_error(str(exc))
        return EXIT_JOB_ERROR
    except JobTimeoutError as exc:
        report_error(str(exc))
        return EXIT_TIMEOUT
    except KeyboardInterrupt:
        if cancel_on_interrupt:
            job.cancel()
            report_error(f"job {job.id}: cancelled")
        return EXIT_INTERRUPTED


def print_result(result: Result, as_json: bool) -> None:
    if as_json:
        data = result_fields(result)
        for name in ("logprobs", "prompt_logprobs"):  # absent when not asked
            if data[name] is None:
                del data[name]
        print_json({"id": data.pop("job_id"), **data})
    else:
        print(result.text)


def build_parser() -> argparse.ArgumentParser:
    from qworker_client.commands.worker import register_worker_commands  # it imports this module

    parser = argparse.ArgumentParser(
        prog="qworker", description="Queue-driven LLM inference: client and worker commands."
    )
    add_version_flag(parser)
    subparsers = parser.add_subparsers(dest="command", required=True)
    for name in CLIENT_COMMANDS:
        importlib.import_module(name).register(subparsers)
    register_worker_commands(subparsers)
    return parser


def main(argv: list[str] | None = None) -> int:
    parser = build_parser()
    args, unknown = parser.parse_known_args(argv)
    if unknown and not getattr(args, "takes_any_arguments", False):
        parser.error(f"unrecognized arguments: {' '.join(unknown)}")
    try:
        return int(args.func(args) or 0)
    except BrokenPipeError:  # `qworker tail --json ID | head`: the reader has gone, quietly
        return closed_stdout()


def closed_stdout() -> int:
    """Exit as a command whose stdout was closed by its reader does (SIGPIPE's 128 + 13); stdout
    is pointed at /dev/null first, so flushing it at exit raises nothing more."""
    devnull = os.open(os.devnull, os.O_WRONLY)
    os.dup2(devnull, sys.stdout.fileno())
    os.close(devnull)
    return EXIT_BROKEN_PIPE
