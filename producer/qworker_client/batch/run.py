"""One run over a batch file: submit lines until `max_in_flight` jobs are out, read their output
streams together, write each result or error as it ends, until every line has one."""

from __future__ import annotations

import time
from collections.abc import Iterator
from dataclasses import asdict, dataclass
from pathlib import Path
from types import TracebackType
from typing import Any

import redis

from qworker_client.batch.files import (
    BatchInputError,
    Finished,
    JsonlAppender,
    default_errors_path,
    error_record,
    plan_input,
    read_finished,
    result_record,
)
from qworker_client.batch.lines import (
    BadLine,
    BatchLine,
    default_batch_id,
    iter_raw_lines,
    parse_line,
    peek_custom_id,
)
from qworker_client.batch.progress import NoProgress, Progress
from qworker_client.batch.submit import MARKER_TTL_S, Submitter
from qworker_client.connect import (
    READ_COUNT,
    ClientOptions,
    is_cluster_client,
    redis_url_from_env,
    sync_client,
)
from qworker_client.multiplex import Multiplexer
from qworker_client.protocol import DEFAULT_PREFIX, DoneEvent, ErrorEvent, Keys, TokenEvent
from qworker_client.result import OutputEvent
from qworker_client.retry import with_retry

DEFAULT_MAX_IN_FLIGHT = 256
SUBMIT_CHUNK = 128  # jobs per submit script call
READ_BLOCK_MS = 1_000


@dataclass(frozen=True)
class BatchConfig:
    input: Path
    output: Path
    errors: Path | None = None  # default: `<output stem>.errors.jsonl`
    max_in_flight: int = DEFAULT_MAX_IN_FLIGHT
    prefix: str = DEFAULT_PREFIX
    batch_id: str | None = None  # default: from the output file's real path
    marker_ttl_s: int = MARKER_TTL_S
    block_ms: int = READ_BLOCK_MS
    reconnect_give_up_s: float = 60.0

    def __post_init__(self) -> None:
        if self.max_in_flight < 1:
            raise ValueError("max_in_flight must be >= 1")

    @property
    def errors_path(self) -> Path:
        return self.errors or default_errors_path(self.output)

    @property
    def identity(self) -> str:
        return self.batch_id or default_batch_id(self.output)


@dataclass
class BatchSummary:
    lines: int = 0  # non-blank input lines
    skipped: int = 0  # finished by an earlier run
    succeeded: int = 0
    failed: int = 0  # jobs that ended with an error event
    invalid: int = 0  # lines that could not be submitted
    submitted: int = 0
    attached: int = 0  # jobs of an earlier run read back instead of submitted again
    tokens: int = 0  # generated tokens seen in this run
    elapsed_s: float = 0.0

    @property
    def ok(self) -> bool:
        return self.failed == 0 and self.invalid == 0

    def to_dict(self) -> dict[str, Any]:
        return {**asdict(self), "ok": self.ok}


# its output reader follows many jobs in one XREAD, which a Cluster serves for keys of one slot
NOT_ON_CLUSTER = "batches do not run on a Redis Cluster yet (docs/operating.md, \"Redis Cluster\")"


class BatchRun:
    """One run over a batch file; `run()` returns when every line has a result or an error."""

    def __init__(self, client: redis.Redis, config: BatchConfig,
                 progress: Progress | None = None) -> None:
        if is_cluster_client(client):
            raise BatchInputError(NOT_ON_CLUSTER)
        self.client = client
        self.config = config
        self.keys = Keys(config.prefix)
        self.progress = progress or NoProgress()
        self.summary = BatchSummary()
        self.tracked: dict[str, BatchLine] = {}  # in flight, by job id
        self.submitter = Submitter(client, self.keys, config.identity, config.marker_ttl_s)
        self.reader = Multiplexer(client, self.keys, block_ms=config.block_ms, count=READ_COUNT,
                                  give_up_s=config.reconnect_give_up_s)

    def run(self) -> BatchSummary:
        started = time.monotonic()
        finished = read_finished(self.config.output, self.config.errors_path)
        plan = plan_input(self.config.input, finished)
        self.summary.lines, self.summary.skipped = plan.total, plan.skipped
        output = JsonlAppender(self.config.output, create=True)
        errors = JsonlAppender(self.config.errors_path)
        self.progress.start(plan.total, plan.skipped)
        try:
            pending = self._pending_lines(finished)
            while True:
                self._fill(pending, errors)
                if not self.tracked:
                    break
                self._collect(output, errors)
        finally:
            output.close()
            errors.close()
            self.progress.close()
            self.summary.elapsed_s = round(time.monotonic() - started, 3)
        return self.summary

    def _pending_lines(self, finished: Finished) -> Iterator[BatchLine | BadLine]:
        for line_no, raw in iter_raw_lines(self.config.input):
            if not finished.has(line_no, peek_custom_id(raw)):
                yield parse_line(line_no, raw, self.config.identity)

    def _fill(self, pending: Iterator[BatchLine | BadLine], errors: JsonlAppender) -> None:
        """Submit lines until `max_in_flight` jobs are out (or the input is done)."""
        while len(self.tracked) < self.config.max_in_flight:
            room = min(self.config.max_in_flight - len(self.tracked), SUBMIT_CHUNK)
            chunk: list[BatchLine] = []
            for item in pending:
                if isinstance(item, BadLine):
                    self._write_bad(item, errors)
                    continue
                chunk.append(item)
                if len(chunk) >= room:
                    break
            if not chunk:
                return
            self._submit(chunk)

    def _submit(self, chunk: list[BatchLine]) -> None:
        fresh = with_retry(lambda: self.submitter.submit(chunk), self.config.reconnect_give_up_s)
        for line, new in zip(chunk, fresh, strict=True):
            self.tracked[line.job_id] = line
            self.reader.follow(line.job_id)
            self.summary.submitted += new
            self.summary.attached += not new

    def _collect(self, output: JsonlAppender, errors: JsonlAppender) -> None:
        """One read over every in-flight job's output stream; write what finished."""
        tokens = 0
        for job_id, event in self.reader.read():
            if isinstance(event, TokenEvent):
                tokens += 1
            else:
                self._end(self.tracked.pop(job_id), event, output, errors)
        self.summary.tokens += tokens
        self.progress.tokens(tokens)

    def _end(self, line: BatchLine, event: OutputEvent, output: JsonlAppender,
             errors: JsonlAppender) -> None:
        if isinstance(event, DoneEvent):
            output.write(result_record(line.custom_id, event))
            self.summary.succeeded += 1
            self.progress.finished(True)
        elif isinstance(event, ErrorEvent):
            errors.write(error_record(line.line_no, line.custom_id, event.code, event.message))
            self.summary.failed += 1
            self.progress.finished(False)

    def _write_bad(self, bad: BadLine, errors: JsonlAppender) -> None:
        errors.write(error_record(bad.line_no, bad.custom_id, bad.code, bad.message))
        self.summary.invalid += 1
        self.progress.finished(False)


class _ClientScope:
    """A client of our own (closed on exit) or the caller's (left open)."""

    def __init__(self, client: redis.Redis | None, redis_url: str | None) -> None:
        self.owned = client is None
        self.client = client or sync_client(redis_url or redis_url_from_env(),
                                            ClientOptions(block_ms=READ_BLOCK_MS))

    def __enter__(self) -> redis.Redis:
        return self.client

    def __exit__(self, exc_type: type[BaseException] | None, exc: BaseException | None,
                 tb: TracebackType | None) -> None:
        if self.owned:
            self.client.close()


def run_batch(
    input_path: str | Path,
    output_path: str | Path,
    errors_path: str | Path | None = None,
    *,
    redis_url: str | None = None,
    client: redis.Redis | None = None,
    prefix: str = DEFAULT_PREFIX,
    max_in_flight: int = DEFAULT_MAX_IN_FLIGHT,
    batch_id: str | None = None,
    progress: Progress | None = None,
) -> BatchSummary:
    """Run a batch file to the end (resuming an earlier run of the same output file).

    `client` must decode responses (`decode_responses=True`); by default one is made from
    `redis_url` (else `REDIS_URL` / `QWORKER_REDIS_URL`). Raises `BatchInputError` when the
    input is refused; bad lines and failed jobs are counted in the summary and written to the
    error file.
    """
    config = BatchConfig(
        input=Path(input_path), output=Path(output_path),
        errors=Path(errors_path) if errors_path is not None else None,
        max_in_flight=max_in_flight, prefix=prefix, batch_id=batch_id)
    with _ClientScope(client, redis_url) as redis_client:
        return BatchRun(redis_client, config, progress).run()
