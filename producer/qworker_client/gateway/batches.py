"""OpenAI's Batch API on qworker's batch runner: a batch's input file is turned into a runner
file, run by `BatchRun` in a thread of this gateway (bounded in flight, resumable: a gateway that
restarts goes on with its unfinished batches), and its results turned into OpenAI's output and
error files. Records, work files and results live in the files directory (`<id>.batch.json`,
`<id>/`); one gateway per directory."""

from __future__ import annotations

import json
import os
import threading
import time
import uuid
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import redis

from qworker_client.batch import BatchConfig, BatchRun, iter_raw_lines, read_jsonl_repairing
from qworker_client.connect import ClientOptions, sync_client
from qworker_client.gateway.batch_lines import (
    ENDPOINTS,
    error_line,
    invalid_line,
    output_line,
    runner_line,
)
from qworker_client.gateway.errors import APIError, bad_request
from qworker_client.gateway.files import FileStore
from qworker_client.scripts import CANCEL_SCRIPT, cancel_call

UNFINISHED = ("validating", "in_progress", "finalizing", "cancelling")
WINDOW_S = 24 * 3600


class _CancellableRun(BatchRun):
    """A `BatchRun` that stops submitting and cancels what it has out once `cancelled` is set."""

    def __init__(self, client: redis.Redis, config: BatchConfig, cancelled: threading.Event,
                 cancel_ttl_s: int) -> None:
        super().__init__(client, config)
        self.cancelled = cancelled
        self.cancel_ttl_s = cancel_ttl_s
        self._cancel = client.register_script(CANCEL_SCRIPT)
        self._flagged: set[str] = set()

    def _fill(self, pending: Any, errors: Any) -> None:
        if not self.cancelled.is_set():
            super()._fill(pending, errors)

    def _collect(self, output: Any, errors: Any) -> None:
        if self.cancelled.is_set():
            for job_id in set(self.tracked) - self._flagged:
                keys, args = cancel_call(self.keys, job_id, self.cancel_ttl_s)
                self._cancel(keys=keys, args=args)
                self._flagged.add(job_id)
        super()._collect(output, errors)


@dataclass
class Batches:
    files: FileStore
    redis_url: str
    prefix: str
    result_ttl_s: int = 3600  # the workers' --result-ttl: the longest cancel flag
    max_in_flight: int = 256
    _cancels: dict[str, threading.Event] = field(default_factory=dict)
    _lock: threading.Lock = field(default_factory=threading.Lock)

    def create(self, body: Any) -> dict[str, Any]:
        if not isinstance(body, dict):
            raise bad_request("the request body must be a JSON object")
        endpoint = body.get("endpoint")
        if endpoint not in ENDPOINTS:
            raise bad_request(f"`endpoint` must be one of {', '.join(ENDPOINTS)}",
                              param="endpoint")
        input_id = body.get("input_file_id")
        if not isinstance(input_id, str):
            raise bad_request("`input_file_id` is required", param="input_file_id")
        self.files.get(input_id)
        now = int(time.time())
        record = {"id": f"batch_{uuid.uuid4().hex}", "object": "batch", "endpoint": endpoint,
                  "errors": None, "input_file_id": input_id,
                  "completion_window": body.get("completion_window", "24h"),
                  "status": "validating", "output_file_id": None, "error_file_id": None,
                  "created_at": now, "in_progress_at": None, "expires_at": now + WINDOW_S,
                  "finalizing_at": None, "completed_at": None, "failed_at": None,
                  "expired_at": None, "cancelling_at": None, "cancelled_at": None,
                  "request_counts": {"total": 0, "completed": 0, "failed": 0},
                  "metadata": body.get("metadata")}
        self._save(record)
        self.start(record["id"])
        return record

    def get(self, batch_id: str) -> dict[str, Any]:
        path = self._record_path(batch_id)
        if "/" in batch_id or not path.is_file():
            raise APIError(404, f"no batch {batch_id}", param="batch_id", code="batch_not_found")
        return json.loads(path.read_text())

    def cancel(self, batch_id: str) -> dict[str, Any]:
        with self._lock:
            record = self.get(batch_id)
            if record["status"] in ("validating", "in_progress"):
                record.update(status="cancelling", cancelling_at=int(time.time()))
                self._save(record)
                self._cancels.setdefault(batch_id, threading.Event()).set()
        return self.get(batch_id)

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
        record = self.get(batch_id)
        try:
            models, invalid = self._prepare(record, work)
            self._update(batch_id, status="cancelling" if cancelled.is_set() else "in_progress",
                         in_progress_at=record["in_progress_at"] or int(time.time()),
                         request_counts={"total": len(models) + len(invalid), "completed": 0,
                                         "failed": 0})
            client = sync_client(self.redis_url, ClientOptions(block_ms=1000))
            try:
                config = BatchConfig(input=work / "input.jsonl", output=work / "results.jsonl",
                                     errors=work / "errors.jsonl", prefix=self.prefix,
                                     batch_id=batch_id, max_in_flight=self.max_in_flight)
                _CancellableRun(client, config, cancelled, self.result_ttl_s).run()
            finally:
                client.close()
            self._finish(batch_id, work, models, invalid, cancelled.is_set())
        except Exception as exc:  # the batch fails, the gateway goes on
            self._update(batch_id, status="failed", failed_at=int(time.time()),
                         errors={"object": "list", "data": [
                             {"code": "internal", "message": f"{type(exc).__name__}: {exc}"}]})

    def _prepare(self, record: dict[str, Any], work: Path
                 ) -> tuple[dict[str, str], list[dict[str, Any]]]:
        """The runner's input file; the model of each custom_id; the lines that cannot run."""
        models: dict[str, str] = {}
        invalid: list[dict[str, Any]] = []
        with open(work / "input.jsonl", "w", encoding="utf-8") as out:
            source = self.files.data_path(record["input_file_id"])
            for _, raw in iter_raw_lines(source):
                try:
                    custom_id, model, line = runner_line(raw, record["endpoint"])
                except APIError as exc:
                    invalid.append(invalid_line(_custom_id(raw), exc))
                    continue
                if custom_id in models:
                    invalid.append(invalid_line(custom_id, bad_request("duplicate custom_id")))
                    continue
                models[custom_id] = model
                out.write(json.dumps(line, ensure_ascii=False) + "\n")
        return models, invalid

    def _finish(self, batch_id: str, work: Path, models: dict[str, str],
                invalid: list[dict[str, Any]], cancelled: bool) -> None:
        self._update(batch_id, status="finalizing", finalizing_at=int(time.time()))
        record = self.get(batch_id)
        kind = ENDPOINTS[record["endpoint"]]
        results = [output_line(r, kind, models[r["custom_id"]], record["created_at"])
                   for r in read_jsonl_repairing(work / "results.jsonl")]
        errors = invalid + [error_line(e.get("custom_id"), e["error"]["code"],
                                       e["error"]["message"])
                            for e in read_jsonl_repairing(work / "errors.jsonl")]
        output = self._file(f"{batch_id}_output", results)
        error_file = self._file(f"{batch_id}_errors", errors) if errors else None
        now = int(time.time())
        self._update(batch_id, status="cancelled" if cancelled else "completed",
                     output_file_id=output, error_file_id=error_file,
                     request_counts={"total": len(models) + len(invalid),
                                     "completed": len(results), "failed": len(errors)},
                     **({"cancelled_at": now} if cancelled else {"completed_at": now}))

    def _file(self, name: str, lines: list[dict[str, Any]]) -> str:
        content = "".join(json.dumps(line, ensure_ascii=False) + "\n" for line in lines)
        file_id = f"file-{name}"
        self.files.write(file_id, content.encode(), f"{name}.jsonl", "batch_output")
        return file_id

    # ------------------------------------------------------------------ records

    def _update(self, batch_id: str, **changes: Any) -> None:
        with self._lock:
            record = self.get(batch_id)
            if record["status"] == "cancelling" and changes.get("status") == "in_progress":
                changes["status"] = "cancelling"
            record.update(changes)
            self._save(record)

    def _save(self, record: dict[str, Any]) -> None:
        self.files.root.mkdir(parents=True, exist_ok=True)
        path = self._record_path(record["id"])
        tmp = path.with_suffix(".tmp")
        tmp.write_text(json.dumps(record))
        os.replace(tmp, path)

    def _record_path(self, batch_id: str) -> Path:
        return self.files.root / f"{batch_id}.batch.json"


def _custom_id(raw: bytes) -> str | None:
    try:
        line = json.loads(raw)
    except ValueError:
        return None
    value = line.get("custom_id") if isinstance(line, dict) else None
    return value if isinstance(value, str) else None

