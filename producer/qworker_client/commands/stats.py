"""`qworker stats`: queue depth, group lag and pending, dead letters and live workers."""

from __future__ import annotations

import argparse

from qworker_client.cli import (
    add_connection_args,
    connect,
    print_json,
    reports_redis_errors,
    table,
)
from qworker_client.protocol import DEFAULT_GROUP
from qworker_client.stats import Stats, StreamStats


def register(subparsers: argparse._SubParsersAction) -> None:
    parser = subparsers.add_parser(
        "stats", help="queue depth, lag, pending, dead letters, live workers",
        description="Read the queue's state from Redis (no worker needed).",
    )
    parser.add_argument("--group", default=DEFAULT_GROUP, help="consumer group (default: workers)")
    parser.add_argument("--json", action="store_true", help="one JSON object")
    add_connection_args(parser)
    parser.set_defaults(func=run)


@reports_redis_errors
def run(args: argparse.Namespace) -> int:
    with connect(args) as producer:
        stats = producer.stats(args.group)
    if args.json:
        print_json(stats.to_dict())
    else:
        print(render(stats))
    return 0


def render(stats: Stats) -> str:
    rows: list[tuple[str, ...]] = [
        ("stream", "length", "lag", "pending", "consumers", "last delivered")]
    rows += [_stream_row(s) for s in stats.streams]
    lines = [table(rows)]
    lines.append(f"dead letters: {stats.dead_letters}")
    lines.append(f"live workers: {stats.live_workers}")
    lines += [f"  {_worker_line(w)}" for w in stats.workers]
    return "\n".join(lines)


def _stream_row(s: StreamStats) -> tuple[str, ...]:
    lag = str(s.waiting)  # where Redis reports none: length - pending
    if not s.group_exists:
        return (s.key, str(s.length), lag, "-", "no group", "-")
    return (s.key, str(s.length), lag, str(s.pending), str(s.consumers),
            s.last_delivered_id or "-")


def _worker_line(worker: dict) -> str:
    details = [f"{k}={worker[k]}" for k in ("host", "pid", "model", "running", "free_slots")
               if k in worker]
    if worker.get("served_model_name") not in (None, "", worker.get("model")):
        details.append(f"serves={worker['served_model_name']}")
    if worker.get("draining"):
        details.append("draining")
    if worker.get("native"):
        details.append(f"kernels={worker['native']}")
    return " ".join([str(worker["name"]), *details])
