"""A batch file's lines: each one a job to submit (`BatchLine`) or a line that cannot run
(`BadLine`), and the job id it is given."""

from __future__ import annotations

import hashlib
import json
import os
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from qworker_client.fields import job_fields
from qworker_client.protocol import INVALID_REQUEST

CUSTOM_ID = "custom_id"
INVALID_LINE = "invalid_line"  # error code of a line that is not a JSON object with a custom_id


@dataclass(frozen=True)
class BatchLine:
    """A valid input line, ready to submit."""

    line_no: int
    custom_id: str
    job_id: str
    fields: dict[str, str]


@dataclass(frozen=True)
class BadLine:
    line_no: int
    custom_id: str | None
    code: str
    message: str


def default_batch_id(output: Path) -> str:
    """The identity of a batch: its output file, wherever it is run from."""
    return hashlib.sha256(os.path.realpath(output).encode()).hexdigest()[:16]


def batch_job_id(batch_id: str, custom_id: str, body: dict[str, Any]) -> str:
    """Same batch, custom_id and content: same job id, so a rerun finds the job again."""
    key = json.dumps([batch_id, custom_id, body], sort_keys=True, ensure_ascii=False)
    return "batch-" + hashlib.sha256(key.encode()).hexdigest()[:24]


def iter_raw_lines(path: Path) -> Iterator[tuple[int, bytes]]:
    """(1-based line number, bytes) of every non-blank line."""
    with open(path, "rb") as file:
        for line_no, raw in enumerate(file, start=1):
            if raw.strip():
                yield line_no, raw


def load_object(raw: bytes) -> dict[str, Any]:
    try:
        obj = json.loads(raw.decode("utf-8"))
    except (UnicodeDecodeError, ValueError, RecursionError) as exc:
        raise ValueError(f"not a JSON line: {exc}") from None
    if not isinstance(obj, dict):
        raise ValueError(f"not a JSON object but a {type(obj).__name__}")
    return obj


def _custom_id(obj: dict[str, Any]) -> str:
    value = obj.get(CUSTOM_ID)
    if not isinstance(value, str) or not value:
        raise ValueError(f"{CUSTOM_ID} must be a non-empty string")
    return value


def parse_line(line_no: int, raw: bytes, batch_id: str) -> BatchLine | BadLine:
    try:
        obj = load_object(raw)
        custom_id = _custom_id(obj)
    except ValueError as exc:
        return BadLine(line_no, None, INVALID_LINE, str(exc))
    body = {k: v for k, v in obj.items() if k != CUSTOM_ID}
    if "id" in body:
        return BadLine(line_no, custom_id, INVALID_REQUEST,
                       "field 'id' is not allowed: the job id is derived from custom_id")
    try:  # whatever is wrong with a line (its types, its depth) fails that line alone
        job_id = batch_job_id(batch_id, custom_id, body)
        _, fields = job_fields({**body, "id": job_id})
    except (ValueError, TypeError, RecursionError) as exc:
        return BadLine(line_no, custom_id, INVALID_REQUEST, str(exc))
    return BatchLine(line_no, custom_id, job_id, fields)


def peek_custom_id(raw: bytes) -> str | None:
    try:
        return _custom_id(load_object(raw))
    except ValueError:
        return None
