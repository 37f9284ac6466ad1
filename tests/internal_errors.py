"""An `internal` error on a valid job fails the test that saw it. Every worker a test runs is
watched for its `job failed` line with code `internal`: one in this process through a structlog
processor, one started by `spawn_worker` through its log file. A test that provokes such errors
on purpose says so: `@pytest.mark.internal_errors_expected` (conftest.py does the rest)."""

from __future__ import annotations

import json
import os
import tempfile
from collections.abc import MutableMapping
from pathlib import Path
from typing import Any

import structlog

MARKER = "internal_errors_expected"
_seen: list[str] = []  # reasons logged in this process since the test began
_logs: list[tuple[Path, bool]] = []  # worker log files of the test, and whether ours to delete


def is_internal_failure(event: MutableMapping[str, Any]) -> bool:
    return event.get("event") == "job failed" and event.get("code") == "internal"


def _watch(_logger: object, _method: str,
           event: MutableMapping[str, Any]) -> MutableMapping[str, Any]:
    if is_internal_failure(event):
        _seen.append(f"{event.get('job_id')}: {event.get('reason')}")
    return event


def start() -> None:
    """Watches from now: the processor goes first in structlog's chain (in place, so loggers
    already bound to it see it; again where a test configured structlog anew)."""
    _seen.clear()
    _logs.clear()
    processors = structlog.get_config()["processors"]
    if _watch not in processors:
        processors.insert(0, _watch)


def worker_log(given: Path | None) -> Path:
    """Where a worker process started for this test logs: `given`, else a file of ours."""
    if given is not None:
        _logs.append((given, False))
        return given
    fd, name = tempfile.mkstemp(prefix="qworker-worker-", suffix=".log")
    os.close(fd)
    _logs.append((Path(name), True))
    return Path(name)


def seen() -> list[str]:
    """The internal failures the test's workers logged (its log files then deleted if ours)."""
    found = list(_seen)
    for path, ours in _logs:
        found += [f"{line.get('job_id')}: {line.get('reason')}" for line in _json_lines(path)
                  if is_internal_failure(line)]
        if ours:
            path.unlink(missing_ok=True)
    _logs.clear()
    return found


def _json_lines(path: Path) -> list[dict[str, Any]]:
    try:
        text = path.read_text(errors="replace")
    except OSError:
        return []
    lines = []
    for line in text.splitlines():
        if line.startswith("{"):
            try:
                lines.append(json.loads(line))
            except ValueError:
                continue
    return lines
