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

The modules: `lines` (a line -> a job), `files` (input, output and error files), `progress`,
`submit` (the idempotent submit script) and `run` (the run itself, `run_batch`).
"""

from __future__ import annotations

from qworker_client.batch.files import (
    BatchInputError,
    Finished,
    InputPlan,
    JsonlAppender,
    default_errors_path,
    error_record,
    plan_input,
    read_finished,
    read_jsonl_repairing,
    result_record,
)
from qworker_client.batch.lines import (
    CUSTOM_ID,
    INVALID_LINE,
    BadLine,
    BatchLine,
    batch_job_id,
    default_batch_id,
    iter_raw_lines,
    parse_line,
    peek_custom_id,
)
from qworker_client.batch.progress import (
    NoProgress,
    Progress,
    TqdmProgress,
    make_progress,
)
from qworker_client.batch.run import (
    DEFAULT_MAX_IN_FLIGHT,
    READ_BLOCK_MS,
    SUBMIT_CHUNK,
    BatchConfig,
    BatchRun,
    BatchSummary,
    run_batch,
)
from qworker_client.batch.submit import (
    MARKER_TTL_S,
    SUBMIT_SCRIPT,
    Submitter,
    marker_key,
)
from qworker_client.multiplex import BAD_EVENT, xread_by_stream
from qworker_client.retry import with_retry

__all__ = [
    "BAD_EVENT",
    "BadLine",
    "BatchConfig",
    "BatchInputError",
    "BatchLine",
    "BatchRun",
    "BatchSummary",
    "CUSTOM_ID",
    "DEFAULT_MAX_IN_FLIGHT",
    "Finished",
    "INVALID_LINE",
    "InputPlan",
    "JsonlAppender",
    "MARKER_TTL_S",
    "NoProgress",
    "Progress",
    "READ_BLOCK_MS",
    "SUBMIT_CHUNK",
    "SUBMIT_SCRIPT",
    "Submitter",
    "TqdmProgress",
    "batch_job_id",
    "default_batch_id",
    "default_errors_path",
    "error_record",
    "iter_raw_lines",
    "make_progress",
    "marker_key",
    "parse_line",
    "peek_custom_id",
    "plan_input",
    "read_finished",
    "read_jsonl_repairing",
    "result_record",
    "run_batch",
    "with_retry",
    "xread_by_stream",
]
