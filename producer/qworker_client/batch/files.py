"""A batch's files: the input read once up front (refused as a whole, or counted), the output
and error files appended to, and what earlier runs already wrote to them."""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from qworker_client.batch.lines import CUSTOM_ID, iter_raw_lines, load_object, peek_custom_id
from qworker_client.protocol import DoneEvent


class BatchInputError(ValueError):
    """The input as a whole is refused (unreadable, duplicate `custom_id`s); nothing was sent."""


@dataclass
class Finished:
    """What earlier runs already wrote: those lines are not run again."""

    custom_ids: set[str] = field(default_factory=set)
    error_lines: set[int] = field(default_factory=set)  # bad lines that had no custom_id

    def has(self, line_no: int, custom_id: str | None) -> bool:
        if custom_id is None:
            return line_no in self.error_lines
        return custom_id in self.custom_ids


def read_jsonl_repairing(path: Path) -> list[dict[str, Any]]:
    """The records of an append-only JSONL file we wrote. An unterminated last line (a crash in
    the middle of a write) is cut off, so appending goes on from a clean line end."""
    if not path.exists():
        return []
    data = path.read_bytes()
    end = data.rfind(b"\n") + 1
    if end < len(data):
        with open(path, "r+b") as file:
            file.truncate(end)
    records = []
    for raw in data[:end].splitlines():
        try:
            records.append(load_object(raw))
        except ValueError:
            continue  # not ours (hand-edited): ignored, its line is run again
    return records


def read_finished(output: Path, errors: Path) -> Finished:
    finished = Finished()
    for record in read_jsonl_repairing(output):
        if isinstance(record.get(CUSTOM_ID), str):
            finished.custom_ids.add(record[CUSTOM_ID])
    for record in read_jsonl_repairing(errors):
        custom_id = record.get(CUSTOM_ID)
        if isinstance(custom_id, str):
            finished.custom_ids.add(custom_id)
        elif isinstance(record.get("line"), int):
            finished.error_lines.add(record["line"])
    return finished


@dataclass
class InputPlan:
    total: int  # non-blank lines
    skipped: int  # already finished by an earlier run


def plan_input(path: Path, finished: Finished) -> InputPlan:
    """Read the input once: refuse duplicate custom_ids, count what is left to do."""
    if not path.is_file():
        raise BatchInputError(f"input {path}: no such file")
    first_seen: dict[str, int] = {}
    duplicates: list[str] = []
    plan = InputPlan(0, 0)
    for line_no, raw in iter_raw_lines(path):
        plan.total += 1
        custom_id = peek_custom_id(raw)
        if finished.has(line_no, custom_id):
            plan.skipped += 1
        if custom_id is None:
            continue
        if custom_id in first_seen:
            duplicates.append(f"{custom_id!r} (lines {first_seen[custom_id]} and {line_no})")
        else:
            first_seen[custom_id] = line_no
    if duplicates:
        more = f" and {len(duplicates) - 5} more" if len(duplicates) > 5 else ""
        raise BatchInputError(f"duplicate custom_id: {', '.join(duplicates[:5])}{more}")
    return plan


class JsonlAppender:
    """Append-only JSONL, one flushed line per record; the file is opened on the first record
    (unless `create`), so an error file only exists when there were errors."""

    def __init__(self, path: Path, create: bool = False) -> None:
        self.path = path
        self._file = open(path, "a", encoding="utf-8") if create else None  # noqa: SIM115

    def write(self, record: dict[str, Any]) -> None:
        if self._file is None:
            self._file = open(self.path, "a", encoding="utf-8")  # noqa: SIM115
        self._file.write(json.dumps(record, ensure_ascii=False) + "\n")
        self._file.flush()

    def close(self) -> None:
        if self._file is not None:
            self._file.close()


def default_errors_path(output: Path) -> Path:
    """`out.jsonl` -> `out.errors.jsonl`."""
    return output.with_name(output.stem + ".errors" + (output.suffix or ".jsonl"))


def result_record(custom_id: str, done: DoneEvent) -> dict[str, Any]:
    """An output line; `tool_calls` and `reasoning` where the job had them."""
    record: dict[str, Any] = {
        CUSTOM_ID: custom_id,
        "text": done.text,
        "finish_reason": done.finish_reason,
        "usage": {"prompt_tokens": done.prompt_tokens,
                  "completion_tokens": done.completion_tokens},
    }
    if done.tool_calls is not None:
        record["tool_calls"] = [c.model_dump() for c in done.tool_calls]
    if done.reasoning is not None:
        record["reasoning"] = done.reasoning
    return record


def error_record(line_no: int, custom_id: str | None, code: str, message: str) -> dict[str, Any]:
    return {"line": line_no, CUSTOM_ID: custom_id, "error": {"code": code, "message": message}}
