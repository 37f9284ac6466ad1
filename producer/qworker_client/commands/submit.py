"""`qworker submit`: send one job and print its output (live with `--stream`)."""

from __future__ import annotations

import argparse
import json
import sys
from typing import Any

from qworker_client.cli import (
    EXIT_REDIS,
    EXIT_USAGE,
    add_connection_args,
    connect,
    follow,
    print_json,
    report_error,
    reports_redis_errors,
)
from qworker_client.fields import job_fields
from qworker_client.stats import serving, visible_workers, why_not_served

# (flag, wire field, type) of the optional job fields taken as plain values.
_PARAM_FLAGS: tuple[tuple[str, str, type], ...] = (
    ("--max-tokens", "max_tokens", int),
    ("--temperature", "temperature", float),
    ("--top-p", "top_p", float),
    ("--top-k", "top_k", int),
    ("--min-p", "min_p", float),
    ("--seed", "seed", int),
    ("--min-tokens", "min_tokens", int),
    ("--repetition-penalty", "repetition_penalty", float),
    ("--presence-penalty", "presence_penalty", float),
    ("--frequency-penalty", "frequency_penalty", float),
    ("--priority", "priority", int),
    ("--deadline-ms", "deadline_ms", int),  # the start deadlines, the delays, the limits: _HELP
    ("--start-within-ms", "start_within_ms", int),
    ("--delay-ms", "delay_ms", int),
    ("--not-before-ms", "not_before_ms", int),
    ("--timeout-ms", "timeout_ms", int),
    ("--result-ttl-s", "result_ttl_s", int),
    ("--logprobs", "logprobs", int),  # 0..20: each token's logprob and its top k
    ("--prompt-logprobs", "prompt_logprobs", int),  # 0..20: the prompt tokens' logprobs
    ("--model", "model", str),  # to <prefix>:jobs:{<model>}, for the workers serving it
    ("--cache-salt", "cache_salt", str),  # only jobs of the same salt share cached prefixes
    ("--tenant", "tenant", str),  # whose share of the fleet it runs in (default: default)
    ("--session", "session", str),  # offered first to the worker that ran its last job
)


_HELP = {
    "deadline_ms": "absolute start deadline, unix time in ms: a job not started by then ends "
                   "with error expired (a relative one: --start-within-ms)",
    "start_within_ms": "relative start deadline: a job not started within this many ms of its "
                       "queueing (a delayed one: of its time) ends with error expired",
    "delay_ms": "run it no sooner than this many ms from now (a delayed job)",
    "not_before_ms": "run it no sooner than this unix time in ms (a delayed job)",
    "timeout_ms": "run-time limit in ms, from its start: past it the job ends with "
                  "finish_reason timeout and its text so far",
    "result_ttl_s": "seconds its output lives after its end (at most the workers' "
                    "--max-result-ttl; default their --result-ttl)",
}


def register(subparsers: argparse._SubParsersAction) -> None:
    parser = subparsers.add_parser(
        "submit", help="submit a job and print its output",
        description="Submit one job to <prefix>:jobs and print its text (or events with --json).",
    )
    parser.add_argument("prompt", nargs="?", help="prompt text ('-' reads stdin)")
    add_prompt_args(parser)
    add_param_args(parser)
    parser.add_argument("--stream", action="store_true", help="print text as it is generated")
    parser.add_argument("--json", action="store_true",
                        help="machine output: the result object, or one event per line (--stream)")
    parser.add_argument("--no-wait", action="store_true",
                        help="queue it, print the job id and exit (even with no live worker)")
    parser.add_argument("--wait", action="store_true",
                        help="queue it and wait even when no live worker serves its model "
                             "(default: say so and queue nothing)")
    parser.add_argument("--timeout", type=float, default=None, help="seconds to wait for the end")
    add_connection_args(parser)
    parser.set_defaults(func=run)


def add_prompt_args(parser: argparse.ArgumentParser) -> None:
    kind = parser.add_mutually_exclusive_group()
    kind.add_argument("--chat", action="store_true",
                      help="send the prompt as a user message, the chat template applies (the "
                           "default, unless the live workers of its model have no template)")
    kind.add_argument("--raw", action="store_true",
                      help="send the prompt as is: a plain completion, no chat template")
    parser.add_argument("--system", default=None, help="system message (implies --chat)")
    parser.add_argument("--messages-json", default=None,
                        help='chat messages as JSON: [{"role": "user", "content": "..."}]')
    parser.add_argument("--prompt-token-ids", default=None, help="prompt as a JSON list of ids")


def add_param_args(parser: argparse.ArgumentParser) -> None:
    for flag, field, kind in _PARAM_FLAGS:
        parser.add_argument(flag, dest=field, type=kind, default=None, help=_HELP.get(field))
    parser.add_argument("--stop", action="append", default=None, help="stop string (repeatable)")
    parser.add_argument("--stop-token-ids", default=None, help="JSON list of token ids")
    parser.add_argument("--ignore-eos", action="store_true", default=None)
    parser.add_argument("--logprobs-text", action="store_true", default=None,
                        help="logprob entries carry their token's text")
    parser.add_argument("--no-speculate", dest="speculate", action="store_false", default=None,
                        help="never decode it speculatively (the same tokens either way)")
    parser.add_argument("--id", dest="job_id", default=None, help="job id (default: random)")
    structured = parser.add_mutually_exclusive_group()  # structured_outputs: one constraint
    structured.add_argument("--json-schema", default=None, metavar="FILE",
                            help="output JSON valid against the JSON Schema in FILE ('-': stdin)")
    structured.add_argument("--json-object", action="store_true", default=None,
                            help="output any JSON object")
    structured.add_argument("--regex", default=None, help="output matching this regex")
    structured.add_argument("--choice", action="append", default=None,
                            help="output exactly one of these strings (repeatable)")
    structured.add_argument("--grammar", default=None, metavar="FILE",
                            help="output of the Lark (or GBNF) grammar in FILE")


def job_spec(args: argparse.Namespace) -> dict[str, Any]:
    """The job's fields from the parsed flags; None fields are left to the worker's default."""
    spec: dict[str, Any] = {field: getattr(args, field) for _, field, _ in _PARAM_FLAGS}
    spec.update(
        id=args.job_id, stop=args.stop, ignore_eos=args.ignore_eos,
        logprobs_text=args.logprobs_text, speculate=args.speculate,
        stop_token_ids=_json_arg("--stop-token-ids", args.stop_token_ids),
    )
    spec.update(_prompt_fields(args))
    spec["structured_outputs"] = _structured_outputs(args)
    return spec


def _structured_outputs(args: argparse.Namespace) -> dict[str, Any] | None:
    if args.json_schema is not None:
        return {"json": _json_arg("--json-schema", _read_file("--json-schema", args.json_schema))}
    if args.grammar is not None:
        return {"grammar": _read_file("--grammar", args.grammar)}
    if args.json_object:
        return {"json_object": True}
    if args.regex is not None:
        return {"regex": args.regex}
    if args.choice is not None:
        return {"choice": args.choice}
    return None


def _read_file(flag: str, path: str) -> str:
    if path == "-":
        return sys.stdin.read()
    try:
        with open(path, encoding="utf-8") as f:
            return f.read()
    except OSError as exc:
        raise ValueError(f"{flag}: cannot read {path}: {exc.strerror}") from None


def _prompt_fields(args: argparse.Namespace) -> dict[str, Any]:
    prompt = sys.stdin.read() if args.prompt == "-" else args.prompt
    if args.messages_json is not None:
        return {"messages": _json_arg("--messages-json", args.messages_json), "prompt": prompt}
    if args.prompt_token_ids is not None:
        return {"prompt_token_ids": _json_arg("--prompt-token-ids", args.prompt_token_ids),
                "prompt": prompt}
    if prompt is None and args.system is None:
        return {"prompt": None}  # the job's own check says what is missing
    if not args.raw or args.system is not None:  # a system message is a chat
        system = [{"role": "system", "content": args.system}] if args.system is not None else []
        user = [{"role": "user", "content": prompt}] if prompt is not None else []
        return {"messages": system + user}
    return {"prompt": prompt}


def _json_arg(flag: str, raw: str | None) -> Any:
    if raw is None:
        return None
    try:
        return json.loads(raw)
    except ValueError as exc:
        raise ValueError(f"{flag}: invalid JSON ({exc})") from None


@reports_redis_errors
def run(args: argparse.Namespace) -> int:
    try:
        spec = job_spec(args)
    except ValueError as exc:
        report_error(str(exc))
        return EXIT_USAGE
    try:
        job_fields(spec)  # a job no worker would take is refused before Redis is asked
    except (ValueError, TypeError) as exc:
        report_error(f"invalid job: {exc}")
        return EXIT_USAGE
    with connect(args) as producer:
        try:
            producer.keys_for(spec.get("model"))  # a Cluster: the job must name its model
        except ValueError as exc:
            report_error(str(exc))
            return EXIT_USAGE
        workers = visible_workers(producer.redis, producer.keys)  # None: this user may not look
        if workers is not None and _sent_plain(args, workers, spec.get("model")):
            spec.update(_raw_prompt(spec))
        why_not = None if workers is None else why_not_served(workers, spec.get("model"))
        if why_not is not None and not (args.wait or args.no_wait):
            report_error(f"{why_not}: nothing queued (a worker is live once `qworker serve` "
                         "says ready; --wait queues it and waits for one)")
            return EXIT_REDIS
        job = producer.submit(**spec)
        if why_not is not None:
            report_error(f"{why_not}: job {job.id} is queued"
                         + ("" if args.no_wait else "; waiting for a worker"))
        if args.no_wait:
            if args.json:
                print_json({"id": job.id})
            else:
                print(job.id)
            return 0
        logprobs = args.logprobs is not None and not args.json  # a line per token
        return follow(job, stream=args.stream or logprobs, as_json=args.json,
                      timeout=args.timeout, cancel_on_interrupt=True, logprobs=logprobs)


def _sent_plain(args: argparse.Namespace, workers: list[dict[str, Any]],
                  model: str | None) -> bool:
    """Whether a prompt given plainly (no --chat, --raw, --system) goes as is: every live worker
    that would run it says its model has no chat template (`chat` false in its key)."""
    said = (args.chat, args.raw, args.system, args.messages_json, args.prompt_token_ids)
    if any(flag not in (None, False) for flag in said):
        return False
    ours = serving(workers, model)
    return bool(ours) and all(w.get("chat") is False for w in ours)


def _raw_prompt(spec: dict[str, Any]) -> dict[str, Any]:
    """The plain prompt's job fields, from the user message it was first made into."""
    (user,) = spec["messages"]
    return {"prompt": user["content"], "messages": None}
