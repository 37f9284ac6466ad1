"""Turn what a caller passes to `submit` into the XADD fields of one job, validated client-side."""

from __future__ import annotations

import uuid
from collections.abc import Mapping
from typing import Any

from qworker_client.protocol import Job, encode_value, parse_job_fields

# Validation runs on the encoded strings, through the same parser a worker runs, so a job that
# passes here is exactly a job the worker accepts.
_PLACEHOLDER_ENTRY_ID = "0-0"

JobInput = Mapping[str, Any] | Job


def new_job_id() -> str:
    return uuid.uuid4().hex


def job_fields(spec: JobInput) -> tuple[str, dict[str, str]]:
    """(job id, wire fields) for one job given as keyword fields or a `protocol.Job`.

    Fields set to None are left out (the worker's default applies). A missing `id` gets a fresh
    uuid4 hex. Raises `qworker_client.protocol.JobValidationError` (a ValueError) on anything the
    worker would reject, and TypeError for a value that has no wire encoding.
    """
    raw = spec.to_fields() if isinstance(spec, Job) else _encode(spec)
    if "id" not in raw:  # not setdefault: a uuid4 (a urandom read) for nothing per given id
        raw["id"] = new_job_id()
    job = parse_job_fields(raw, _PLACEHOLDER_ENTRY_ID)
    assert job.id is not None
    return job.id, raw


def _encode(spec: Mapping[str, Any]) -> dict[str, str]:
    fields: dict[str, str] = {}
    for name, value in spec.items():
        if value is None:
            continue
        try:
            fields[name] = encode_value(value)
        except TypeError:
            raise TypeError(
                f"field {name!r}: cannot send a {type(value).__name__} (use str, int, float, "
                "bool, a list of them, or a dict)"
            ) from None
    return fields

