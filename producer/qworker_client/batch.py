"""Batch files: JSONL of jobs in, JSONL of results out; bounded in flight, resumable.

Each input line is `{"custom_id": "...", "prompt" | "messages" | "prompt_token_ids": ...,
<sampling params>}`; each output line `{"custom_id", "text", "finish_reason", "usage"}`; a line
that cannot run (bad JSON, no prompt, bad params, or a job that ended with an `error` event) goes
to the error file with its line number.

Resuming: a line whose `custom_id` is already in the output or error file is skipped. A line's
job id is derived from the batch id (by default the output file's real path), its `custom_id` and
its content, and each submit is recorded in `<prefix>:batch:<batch id>` (a hash: job id -> entry
id) in the same Lua script that XADDs it. So a rerun after a crash re-attaches to jobs submitted
before it (reads their output stream from the start) instead of submitting them again; only a job
whose result is gone (queue entry done and output stream expired) is submitted once more.
"""

from __future__ import annotations

import hashlib
import json
import os
import sys
import time
from collections.abc import Callable, Iterator, Sequence
from dataclasses import asdict, dataclass, field
from pathlib import Path
from types import TracebackType
from typing import Any, Protocol, TypeVar

import redis

from qworker_client.connect import READ_COUNT, ClientOptions, redis_url_from_env, sync_client
from qworker_client.fields import job_fields
from qworker_client.protocol import (
    DEFAULT_PREFIX,
    INVALID_REQUEST,
    DoneEvent,
    ErrorEvent,
    Keys,
    parse_event,
)
from qworker_client.result import START_ID
from qworker_client.retry import TRANSIENT_ERRORS, Backoff

CUSTOM_ID = "custom_id"
DEFAULT_MAX_IN_FLIGHT = 256
MARKER_TTL_S = 7 * 24 * 3600  # how long a rerun can still re-attach to an unfinished batch
SUBMIT_CHUNK = 128  # jobs per submit script call
READ_BLOCK_MS = 1_000
INVALID_LINE = "invalid_line"  # error code of a line that is not a JSON object with a custom_id
BAD_EVENT = "bad_event"  # error code of an output stream entry that breaks the protocol

T = TypeVar("T")

# KEYS: jobs, marker hash, requeue, then the output stream of each job.
# ARGV: marker ttl, then per job: job id, 2n, field, value, ...
# A job already in the marker is left alone while it is alive: output stream present, entry still
# in the jobs stream, or an entry for it in the requeue stream. Otherwise it is XADDed and marked.
# The requeue stream is read at most once per call, and only when a marked job has neither.
# Returns per job 1 (submitted now) or 0 (re-attached).
SUBMIT_SCRIPT = """
local jobs, marker, requeue = KEYS[1], KEYS[2], KEYS[3]
local requeued = nil
local function in_requeue(id)
  if requeued == nil then
    requeued = {}
    for _, entry in ipairs(redis.call('XRANGE', requeue, '-', '+')) do
      local f = entry[2]
      for j = 1, #f, 2 do
        if f[j] == 'id' then requeued[f[j + 1]] = true end
      end
    end
  end
  return requeued[id] == true
end
local function alive(id, out)
  local entry = redis.call('HGET', marker, id)
  if not entry then return false end
  if redis.call('EXISTS', out) == 1 then return true end
  if #redis.call('XRANGE', jobs, entry, entry) > 0 then return true end
  return in_requeue(id)
end
local result, pos = {}, 2
for k = 4, #KEYS do
  local id, n = ARGV[pos], tonumber(ARGV[pos + 1])
  if alive(id, KEYS[k]) then
    result[#result + 1] = 0
  else
    local entry = redis.call('XADD', jobs, '*', unpack(ARGV, pos + 2, pos + 1 + n))
    redis.call('HSET', marker, id, entry)
    result[#result + 1] = 1
  end
  pos = pos + 2 + n
end
redis.call('EXPIRE', marker, tonumber(ARGV[1]))
return result
"""


class BatchInputError(ValueError):
    """The input as a whole is refused (unreadable, duplicate `custom_id`s); nothing was sent."""


# ----------------------------------------------------------------------------- lines


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


def _load_object(raw: bytes) -> dict[str, Any]:
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
        obj = _load_object(raw)
        custom_id = _custom_id(obj)
    except ValueError as exc:
        return BadLine(line_no, None, INVALID_LINE, str(exc))
    body = {k: v for k, v in obj.items() if k != CUSTOM_ID}
    if "id" in body:
        return BadLine(line_no, custom_id, INVALID_REQUEST,
                       "field 'id' is not allowed: the job id is derived from custom_id")
    job_id = batch_job_id(batch_id, custom_id, body)
    try:
        _, fields = job_fields({**body, "id": job_id})
    except (ValueError, TypeError) as exc:
        return BadLine(line_no, custom_id, INVALID_REQUEST, str(exc))
    return BatchLine(line_no, custom_id, job_id, fields)


def peek_custom_id(raw: bytes) -> str | None:
    try:
        return _custom_id(_load_object(raw))
    except ValueError:
        return None


# ----------------------------------------------------------------------------- files


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
            records.append(_load_object(raw))
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


# ----------------------------------------------------------------------------- progress


class Progress(Protocol):
    def start(self, total: int, initial: int) -> None: ...
    def finished(self, ok: bool) -> None: ...
    def tokens(self, count: int) -> None: ...
    def close(self) -> None: ...


class NoProgress:
    def start(self, total: int, initial: int) -> None:
        pass

    def finished(self, ok: bool) -> None:
        pass

    def tokens(self, count: int) -> None:
        pass

    def close(self) -> None:
        pass


class TqdmProgress:
    """A tqdm bar on stderr: lines done / total, ETA, and failed lines and tokens/s as postfix."""

    REFRESH_S = 0.5

    def __init__(self) -> None:
        self.bar: Any = None
        self.failed = 0
        self.token_count = 0
        self._t0 = time.monotonic()
        self._shown = 0.0

    def start(self, total: int, initial: int) -> None:
        from tqdm import tqdm

        self.bar = tqdm(total=total, initial=initial, unit="line", file=sys.stderr,
                        dynamic_ncols=True, smoothing=0.05)
        self._t0 = time.monotonic()

    def finished(self, ok: bool) -> None:
        self.failed += not ok
        self.bar.update(1)
        self._postfix()

    def tokens(self, count: int) -> None:
        self.token_count += count
        self._postfix()

    def _postfix(self, force: bool = False) -> None:
        now = time.monotonic()
        if not force and now - self._shown < self.REFRESH_S:
            return
        self._shown = now
        rate = self.token_count / max(now - self._t0, 1e-9)
        self.bar.set_postfix(failed=self.failed, tok_s=f"{rate:.0f}", refresh=False)

    def close(self) -> None:
        if self.bar is not None:
            self._postfix(force=True)
            self.bar.close()


def make_progress(enabled: bool) -> Progress:
    """tqdm on stderr when asked for, stderr is a terminal and tqdm is installed."""
    if not enabled or not sys.stderr.isatty():
        return NoProgress()
    try:
        import tqdm  # noqa: F401
    except ImportError:
        return NoProgress()
    return TqdmProgress()


# ----------------------------------------------------------------------------- redis


def with_retry(call: Callable[[], T], give_up_s: float) -> T:
    """Run an idempotent Redis call, retrying dropped connections with backoff."""
    backoff = Backoff(give_up_s=give_up_s)
    while True:
        try:
            return call()
        except TRANSIENT_ERRORS as exc:
            time.sleep(backoff.failed(exc))


def marker_key(keys: Keys, batch_id: str) -> str:
    return f"{keys.prefix}:batch:{batch_id}"


class Submitter:
    """XADDs jobs not yet submitted by this batch (idempotent: a retry or a rerun re-attaches)."""

    def __init__(self, client: redis.Redis, keys: Keys, batch_id: str,
                 ttl_s: int = MARKER_TTL_S) -> None:
        self.client = client
        self.keys = keys
        self.marker = marker_key(keys, batch_id)
        self.ttl_s = ttl_s
        self.script = client.register_script(SUBMIT_SCRIPT)

    def submit(self, lines: Sequence[BatchLine]) -> list[bool]:
        """Per line: True when submitted now, False when an earlier run's job was found."""
        keys = [self.keys.jobs, self.marker, self.keys.requeue]
        keys += [self.keys.out(line.job_id) for line in lines]
        args: list[str | int] = [self.ttl_s]
        for line in lines:
            flat = [item for pair in line.fields.items() for item in pair]
            args += [line.job_id, len(flat), *flat]
        return [bool(flag) for flag in self.script(keys=keys, args=args, client=self.client)]


StreamBatch = tuple[str, list[tuple[str, dict[str, str]]]]


def xread_by_stream(reply: object) -> list[StreamBatch]:
    """An XREAD reply as (key, entries) pairs: RESP2 `[[key, entries]]` or RESP3
    `{key: [entries]}`."""
    if not reply:
        return []
    if isinstance(reply, dict):
        return [(key, entries) for key, value in reply.items() for entries in value]
    return [(key, entries) for key, entries in reply]  # type: ignore[attr-defined]


# ----------------------------------------------------------------------------- the run


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


@dataclass
class Tracked:
    line: BatchLine
    last_id: str = START_ID
    next_index: int = 0  # token indices below it were counted (a rolled-back stream repeats them)


class BatchRun:
    """One run over a batch file; `run()` returns when every line has a result or an error."""

    def __init__(self, client: redis.Redis, config: BatchConfig,
                 progress: Progress | None = None) -> None:
        self.client = client
        self.config = config
        self.keys = Keys(config.prefix)
        self.progress = progress or NoProgress()
        self.summary = BatchSummary()
        self.tracked: dict[str, Tracked] = {}
        self.submitter = Submitter(client, self.keys, config.identity, config.marker_ttl_s)
        self._out_prefix = self.keys.out("")

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
            self.tracked[line.job_id] = Tracked(line)
            self.summary.submitted += new
            self.summary.attached += not new

    def _collect(self, output: JsonlAppender, errors: JsonlAppender) -> None:
        """One XREAD over every in-flight job's output stream; write what finished."""
        streams = {self.keys.out(job_id): t.last_id for job_id, t in self.tracked.items()}
        reply = with_retry(
            lambda: self.client.xread(streams, count=READ_COUNT, block=self.config.block_ms),
            self.config.reconnect_give_up_s)
        for key, entries in xread_by_stream(reply):
            tracked = self.tracked[key.removeprefix(self._out_prefix)]
            self._take(tracked, entries, output, errors)

    def _take(self, tracked: Tracked, entries: list[tuple[str, dict[str, str]]],
              output: JsonlAppender, errors: JsonlAppender) -> None:
        tokens = 0
        for entry_id, fields in entries:
            tracked.last_id = entry_id
            if fields.get("type") == "token":
                index = _token_index(fields)
                if index is None or index >= tracked.next_index:
                    tracked.next_index = tracked.next_index if index is None else index + 1
                    tokens += 1
                continue
            self._end(tracked, fields, output, errors)
            break
        self.summary.tokens += tokens
        self.progress.tokens(tokens)

    def _end(self, tracked: Tracked, fields: dict[str, str], output: JsonlAppender,
             errors: JsonlAppender) -> None:
        line = tracked.line
        del self.tracked[line.job_id]
        try:
            event = parse_event(fields)
        except ValueError as exc:
            event = ErrorEvent(code=BAD_EVENT, message=f"unreadable output event: {exc}")
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


def _token_index(fields: dict[str, str]) -> int | None:
    """A token event's `i` (None when unreadable: only the token tally uses it)."""
    try:
        return int(fields.get("i", ""))
    except ValueError:
        return None


def result_record(custom_id: str, done: DoneEvent) -> dict[str, Any]:
    return {
        CUSTOM_ID: custom_id,
        "text": done.text,
        "finish_reason": done.finish_reason,
        "usage": {"prompt_tokens": done.prompt_tokens,
                  "completion_tokens": done.completion_tokens},
    }


def error_record(line_no: int, custom_id: str | None, code: str, message: str) -> dict[str, Any]:
    return {"line": line_no, CUSTOM_ID: custom_id, "error": {"code": code, "message": message}}


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
