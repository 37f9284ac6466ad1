"""docs/schema/*.json and docs/protocol.md stay in step with the protocol's pydantic models."""

from __future__ import annotations

import json
import re
import shlex
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from qworker_client.protocol import (
    DEAD_META_FIELDS,
    EXPIRED,
    INTERNAL,
    INVALID_REQUEST,
    PROMPT_TOO_LONG,
    TOO_MANY_DELIVERIES,
    Job,
    JobValidationError,
    Keys,
    json_schemas,
    parse_job_fields,
)
from qworker_client.schema import DEFAULT_DIR, DEFAULT_DOC, drifted, write
from qworker_client.schema_doc import field_table

ROOT = Path(__file__).resolve().parents[1]


@pytest.fixture
def docs_copy(tmp_path: Path) -> tuple[Path, Path]:
    schema_dir = tmp_path / "schema"
    shutil.copytree(DEFAULT_DIR, schema_dir)
    doc = tmp_path / "protocol.md"
    shutil.copy(DEFAULT_DOC, doc)
    return schema_dir, doc


def test_checked_in_files_match_the_models() -> None:
    stale = drifted()
    assert stale == [], f"out of date: {stale}; run `python -m qworker_client.schema`"
    for name, schema in json_schemas().items():
        assert json.loads((DEFAULT_DIR / f"{name}.json").read_text()) == schema


def test_drift_is_detected(docs_copy: tuple[Path, Path]) -> None:
    schema_dir, doc = docs_copy
    assert drifted(schema_dir, doc) == []
    job = json.loads((schema_dir / "job.json").read_text())
    job["properties"]["max_tokens"]["default"] = 16
    (schema_dir / "job.json").write_text(json.dumps(job, indent=2, sort_keys=True) + "\n")
    (schema_dir / "token.json").unlink()
    (schema_dir / "removed.json").write_text("{}\n")
    doc.write_text(doc.read_text().replace("| `max_tokens` | decimal integer | `256`",
                                           "| `max_tokens` | decimal integer | `16`"))
    assert drifted(schema_dir, doc) == [schema_dir / "job.json", schema_dir / "token.json",
                                        schema_dir / "removed.json", doc]
    write(schema_dir, doc)
    (schema_dir / "removed.json").unlink()
    assert drifted(schema_dir, doc) == []


def test_a_doc_without_generated_blocks_counts_as_drifted(docs_copy: tuple[Path, Path]) -> None:
    schema_dir, doc = docs_copy
    doc.write_text("# protocol\n")
    assert drifted(schema_dir, doc) == [doc]


def test_check_command(docs_copy: tuple[Path, Path]) -> None:
    schema_dir, doc = docs_copy

    def check() -> subprocess.CompletedProcess[str]:
        return subprocess.run(
            [sys.executable, "-m", "qworker_client.schema", "--check", "--dir", str(schema_dir),
             "--doc", str(doc)], capture_output=True, text=True, cwd=ROOT, timeout=60)

    assert check().returncode == 0
    doc.write_text(doc.read_text().replace('"maximum": 32768', '"maximum": 99'))
    failed = check()
    assert failed.returncode == 1
    assert f"{doc}: out of date" in failed.stdout


def test_doc_embeds_every_schema_and_table() -> None:
    text = DEFAULT_DOC.read_text()
    for name in ("job", "event", "worker"):
        assert f"<!-- generated:schema:{name} -->\n```json\n" in text
    for name in ("job", "token", "done", "error"):
        assert field_table(json_schemas()[name]) in text
    for field in Job.model_fields:
        assert f"| `{field}` |" in text


def test_doc_names_every_key_dead_letter_field_and_error_code() -> None:
    text = DEFAULT_DOC.read_text()
    keys = Keys("qw")
    for key in (keys.jobs, keys.requeue, keys.dead, keys.out("<id>"), keys.cancel("<id>"),
                keys.submitted("<id>"), keys.worker("<name>"), keys.owner("<id>"),
                keys.kv_events):
        assert f"`{key}`" in text, key
    for field in DEAD_META_FIELDS:
        assert f"| `{field}` |" in text
    for code in (INVALID_REQUEST, PROMPT_TOO_LONG, EXPIRED, TOO_MANY_DELIVERIES, INTERNAL):
        assert f"| `{code}` |" in text


def test_example_session_jobs_are_judged_as_the_doc_says() -> None:
    """Every `XADD qw:jobs` of the example parses as the worker would parse it; the one the
    example shows failing fails with the message shown."""
    text = DEFAULT_DOC.read_text()
    commands = re.findall(r"^127\.0\.0\.1:6379> XADD qw:jobs \* (.+)$", text, re.MULTILINE)
    assert len(commands) == 3
    results = []
    for command in commands:
        words = shlex.split(command)
        fields = dict(zip(words[::2], words[1::2], strict=True))
        try:
            results.append(parse_job_fields(fields, "1-0").id)
        except JobValidationError as exc:
            results.append(exc.message)
            assert f'"{exc.message}"' in text
    assert results == ["demo-1", "unknown field 'colour'", "demo-5"]
