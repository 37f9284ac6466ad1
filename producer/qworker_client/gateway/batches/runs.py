"""OpenAI's Batch API on qworker's batch runner: a batch's input file is turned into a runner
file, run by `BatchRun` in a thread of this gateway (bounded in flight, resumable: a gateway that
restarts goes on with its unfinished batches), and its results turned into OpenAI's output and
error files. Records, work files and results live in the files directory (`<id>.batch.json`,
`<id>/`); one gateway per directory.

A batch is its creator's (`owners`): its input file must be theirs, its output and error files
are theirs, and no other key sees or cancels it. Each line stands alone: one that cannot be read
or translated, whatever is wrong with it, or that names a model no live worker serves, fails in
the error file and the rest run. The completion window is kept: at its end the run stops
submitting, cancels the jobs it has out and stops waiting for them; the batch is `expired`, with
the results it has and each unfinished line in the error file (`batch_expired`, or
`model_not_found` when no live worker serves its model by then)."""

from __future__ import annotations

import json
import os
import re
import threading
import time
import uuid
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import redis

from qworker_client.batch import BatchConfig, BatchRun, iter_raw_lines, read_jsonl_repairing
from qworker_client.connect import ClientOptions, sync_client
from qworker_client.gateway.batches.files import OWNER, FileStore
from qworker_client.gateway.batches.lines import (
    ENDPOINTS,
    error_line,
    invalid_line,
    line_custom_id,
    output_line,
    runner_line,
)
from qworker_client.gateway.catalog import live_models, model_not_found
from qworker_client.gateway.errors import APIError, bad_request
from qworker_client.gateway.owners import Owner, may_see
from qworker_client.protocol import Keys
from qworker_client.scripts import CANCEL_SCRIPT, cancel_call

UNFINISHED = ("validating", "in_progress", "finalizing", "cancelling")
BATCH_ID_RE = re.compile(r"batch_[0-9a-f]{32}")
MAX_WINDOW_S = 24 * 3600
_WINDOW_RE = re.compile(r"([1-9][0-9]{0,5})([hms])")
_UNIT_S = {"h": 3600, "m": 60, "s": 1}
BATCH_EXPIRED = "batch_expired"  # OpenAI's code of a line the window cut off


def window_s(value: Any) -> int:
    """The completion window in seconds: OpenAI's `24h`, or any shorter `<n>h`, `<n>m`, `<n>s`."""
    match = _WINDOW_RE.fullmatch(value) if isinstance(value, str) else None
    seconds = int(match[1]) * _UNIT_S[match[2]] if match else 0
    if not 0 < seconds <= MAX_WINDOW_S:
        raise bad_request("`completion_window` must be `24h` or shorter (`<n>h`, `<n>m` or "
                          "`<n>s`)", param="completion_window")
    return seconds


class _WindowedRun(BatchRun):
    """A `BatchRun` that stops submitting once `cancelled` is set or its window has passed,
    cancels the jobs it has out then, and once the window has passed stops waiting for them."""

    def __init__(self, client: redis.Redis, config: BatchConfig, cancelled: threading.Event,
                 cancel_ttl_s: int, expires_at: float) -> None:
        super().__init__(client, config)
        self.cancelled = cancelled
        self.cancel_ttl_s = cancel_ttl_s
        self.expires_at = expires_at
        self.expired = False
        self._cancel = client.register_script(CANCEL_SCRIPT)
        self._flagged: set[str] = set()

    def _fill(self, pending: Any, errors: Any) -> None:
        if not self._past_window() and not self.cancelled.is_set():
            super()._fill(pending, errors)

    def _collect(self, output: Any, errors: Any) -> None:
        expired = self._past_window()  # a cancelled batch too: its jobs may never be taken
        if expired or self.cancelled.is_set():
            self._cancel_out()
        if expired:
            self.tracked.clear()  # the run ends; `Batches` writes these lines as unfinished
            return
        super()._collect(output, errors)

    def _past_window(self) -> bool:
        self.expired = self.expired or time.time() >= self.expires_at
        return self.expired

    def _cancel_out(self) -> None:
        for job_id in set(self.tracked) - self._flagged:
            keys, args = cancel_call(self.keys, job_id, self.cancel_ttl_s)
            self._cancel(keys=keys, args=args)
            self._flagged.add(job_id)


@dataclass
class _Lines:
    """A batch's input as the runner takes it."""

    models: dict[str, str]  # the model of each line handed to the runner, by custom_id
    invalid: list[dict[str, Any]]  # the error-file lines of those that cannot run

    @property
    def total(self) -> int:
        return len(self.models) + len(self.invalid)


@dataclass
class Batches:
    files: FileStore
    redis_url: str
    prefix: str
    result_ttl_s: int = 3600  # the workers' --result-ttl: the longest cancel flag
    max_in_flight: int = 256
    _cancels: dict[str, threading.Event] = field(default_factory=dict)
    _lock: threading.Lock = field(default_factory=threading.Lock)

    def create(self, body: Any, owner: Owner) -> dict[str, Any]:
        if not isinstance(body, dict):
            raise bad_request("the request body must be a JSON object")
        endpoint = body.get("endpoint")
        if endpoint not in ENDPOINTS:
            raise bad_request(f"`endpoint` must be one of {', '.join(ENDPOINTS)}",
                              param="endpoint")
        input_id = body.get("input_file_id")
        if not isinstance(input_id, str):
            raise bad_request("`input_file_id` is required", param="input_file_id")
        self.files.get(input_id, owner)
        window = body.get("completion_window", "24h")
        now = int(time.time())
        record = {"id": f"batch_{uuid.uuid4().hex}", "object": "batch", "endpoint": endpoint,
                  "errors": None, "input_file_id": input_id, "completion_window": window,
                  "status": "validating", "output_file_id": None, "error_file_id": None,
                  "created_at": now, "in_progress_at": None,
                  "expires_at": now + window_s(window),
                  "finalizing_at": None, "completed_at": None, "failed_at": None,
                  "expired_at": None, "cancelling_at": None, "cancelled_at": None,
                  "request_counts": {"total": 0, "completed": 0, "failed": 0},
                  "metadata": body.get("metadata")}
        self._save({**record, OWNER: owner})
        self.start(record["id"])
        return record

    def get(self, batch_id: str, viewer: Owner) -> dict[str, Any]:
        """The batch's OpenAI object; 404 when there is none of that id `viewer` may see."""
        record = self._record(batch_id)
        if not may_see(record.pop(OWNER, None), viewer):
            raise _not_found(batch_id)
        return record

    def cancel(self, batch_id: str, viewer: Owner) -> dict[str, Any]:
        self.get(batch_id, viewer)
        with self._lock:
            record = self._record(batch_id)
            if record["status"] in ("validating", "in_progress"):
                record.update(status="cancelling", cancelling_at=int(time.time()))
                self._save(record)
                self._cancels.setdefault(batch_id, threading.Event()).set()
        return self.get(batch_id, viewer)

    def resume_unfinished(self) -> None:
        """Go on with the batches an earlier run of this gateway left unfinished."""
        for path in sorted(self.files.root.glob("*.batch.json")):
            record = json.loads(path.read_text())
            if record["status"] in UNFINISHED:
                if record["status"] == "cancelling":
                    self._cancels.setdefault(record["id"], threading.Event()).set()
                self.start(record["id"])

    def start(self, batch_id: str) -> None:
        cancelled = self._cancels.setdefault(batch_id, threading.Event())
        threading.Thread(target=self._run, args=(batch_id, cancelled), daemon=True,
                         name=f"batch:{batch_id}").start()

    # ------------------------------------------------------------------ the run

    def _run(self, batch_id: str, cancelled: threading.Event) -> None:
        work = self.files.root / batch_id
        work.mkdir(parents=True, exist_ok=True)
        record = self._record(batch_id)
        keys = Keys(self.prefix)
        try:
            client = sync_client(self.redis_url, ClientOptions(block_ms=1000))
            try:
                lines = self._prepare(record, work, live_models(client, keys))
                self._update(batch_id,
                             status="cancelling" if cancelled.is_set() else "in_progress",
                             in_progress_at=record["in_progress_at"] or int(time.time()),
                             request_counts={"total": lines.total, "completed": 0, "failed": 0})
                config = BatchConfig(input=work / "input.jsonl", output=work / "results.jsonl",
                                     errors=work / "errors.jsonl", prefix=self.prefix,
                                     batch_id=batch_id, max_in_flight=self.max_in_flight)
                run = _WindowedRun(client, config, cancelled, self.result_ttl_s,
                                   record["expires_at"])
                run.run()
                served_at_end = live_models(client, keys) if run.expired else None
            finally:
                client.close()
            self._finish(batch_id, work, lines, cancelled.is_set(), served_at_end)
        except Exception as exc:  # the batch fails, the gateway goes on
            self._update(batch_id, status="failed", failed_at=int(time.time()),
                         errors={"object": "list", "data": [
                             {"code": "internal", "message": f"{type(exc).__name__}: {exc}"}]})

    def _prepare(self, record: dict[str, Any], work: Path, served: set[str]) -> _Lines:
        """The runner's input file, and the lines that cannot run: a line that fails alone, or
        that names a model no live worker serves while some are live (with none live, the
        lines wait for workers to come, within the window)."""
        lines = _Lines({}, [])
        with open(work / "input.jsonl", "w", encoding="utf-8") as out:
            source = self.files.data_path(record["input_file_id"])
            for _, raw in iter_raw_lines(source):
                try:
                    custom_id, model, text = runner_line(raw, record["endpoint"])
                    if custom_id in lines.models:
                        raise bad_request("duplicate custom_id", param="custom_id")
                    if served and model not in served:
                        raise model_not_found(model, served)
                except APIError as exc:
                    lines.invalid.append(invalid_line(line_custom_id(raw), exc))
                    continue
                lines.models[custom_id] = model
                out.write(text + "\n")
        return lines

    def _finish(self, batch_id: str, work: Path, lines: _Lines, cancelled: bool,
                served_at_end: set[str] | None) -> None:
        """The output and error files, and the batch's end: `served_at_end` is None unless the
        window cut the run short (the models served then)."""
        self._update(batch_id, status="finalizing", finalizing_at=int(time.time()))
        record = self._record(batch_id)
        kind = ENDPOINTS[record["endpoint"]]
        results = [output_line(r, kind, lines.models[r["custom_id"]], record["created_at"])
                   for r in read_jsonl_repairing(work / "results.jsonl")]
        failed = read_jsonl_repairing(work / "errors.jsonl")
        errors = lines.invalid + [error_line(e.get("custom_id"), e["error"]["code"],
                                             e["error"]["message"]) for e in failed]
        if served_at_end is not None:
            answered = {r["custom_id"] for r in results} | {e.get("custom_id") for e in failed}
            errors += [_unfinished(custom_id, model, served_at_end)
                       for custom_id, model in lines.models.items() if custom_id not in answered]
        owner = record.get(OWNER)
        output = self._file(f"{batch_id}_output", results, owner)
        error_file = self._file(f"{batch_id}_errors", errors, owner) if errors else None
        status = ("cancelled" if cancelled else "expired" if served_at_end is not None
                  else "completed")
        self._update(batch_id, status=status, output_file_id=output, error_file_id=error_file,
                     request_counts={"total": lines.total, "completed": len(results),
                                     "failed": len(errors)},
                     **{f"{status}_at": int(time.time())})

    def _file(self, name: str, lines: list[dict[str, Any]], owner: Owner) -> str:
        content = "".join(json.dumps(line, ensure_ascii=False) + "\n" for line in lines)
        file_id = f"file-{name}"
        self.files.write(file_id, content.encode(), f"{name}.jsonl", "batch_output", owner)
        return file_id

    # ------------------------------------------------------------------ records

    def _update(self, batch_id: str, **changes: Any) -> None:
        with self._lock:
            record = self._record(batch_id)
            if record["status"] == "cancelling" and changes.get("status") == "in_progress":
                changes["status"] = "cancelling"
            record.update(changes)
            self._save(record)

    def _record(self, batch_id: str) -> dict[str, Any]:
        """The stored record, owner included."""
        path = self._record_path(batch_id)
        if BATCH_ID_RE.fullmatch(batch_id) is None or not path.is_file():
            raise _not_found(batch_id)
        record: dict[str, Any] = json.loads(path.read_text())
        return record

    def _save(self, record: dict[str, Any]) -> None:
        self.files.root.mkdir(parents=True, exist_ok=True)
        path = self._record_path(record["id"])
        tmp = path.with_suffix(".tmp")
        tmp.write_text(json.dumps(record))
        os.replace(tmp, path)

    def _record_path(self, batch_id: str) -> Path:
        return self.files.root / f"{batch_id}.batch.json"


def _unfinished(custom_id: str, model: str, served: set[str]) -> dict[str, Any]:
    """The error-file line of a line the window cut off."""
    if model not in served:
        return invalid_line(custom_id, model_not_found(model, served))
    return invalid_line(custom_id, APIError(
        408, "This request could not be executed before the completion window expired.",
        code=BATCH_EXPIRED))


def _not_found(batch_id: str) -> APIError:
    return APIError(404, f"no batch {batch_id[:100]}", param="batch_id", code="batch_not_found")
