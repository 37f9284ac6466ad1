"""API keys are owners: what one key made (jobs, their streams and status, files, batches) is a
404 to another key, a job queued straight into Redis is no key's, the keys themselves are
stored nowhere, and ids that are no file or batch of ours are 404s (not 500s)."""

from __future__ import annotations

import json
from collections.abc import Iterator
from pathlib import Path

import httpx2
import pytest
import redis

from qworker_client import Producer
from qworker_client.gateway.owners import fingerprint
from tests.gateway_harness import gateway, live_worker
from tests.service_harness import KEYS, sim_engine, wait_for
from tests.test_gateway_batch import chat_line, jsonl

ALICE, BOB = "sk-alice-0123456789", "sk-bob-9876543210"
CHAT = {"model": "sim", "messages": [{"role": "user", "content": "mine"}], "max_tokens": 6}


@pytest.fixture
def base_url(redis_url: str, tmp_path: Path) -> Iterator[str]:
    with live_worker(redis_url, "gw-owners", sim_engine("sim:step_ms=2")), \
            gateway(redis_url, api_keys=(ALICE, BOB), files_dir=str(tmp_path / "files")) as url:
        yield url


@pytest.fixture
def alice(base_url: str) -> Iterator[httpx2.Client]:
    with httpx2.Client(base_url=base_url, headers={"authorization": f"Bearer {ALICE}"},
                       timeout=30) as http:
        yield http


@pytest.fixture
def bob(base_url: str) -> Iterator[httpx2.Client]:
    with httpx2.Client(base_url=base_url, headers={"authorization": f"Bearer {BOB}"},
                       timeout=30) as http:
        yield http


def code(reply: httpx2.Response) -> tuple[int, str | None]:
    return reply.status_code, reply.json()["error"]["code"] if reply.status_code >= 400 else None


def test_a_key_does_not_see_another_keys_jobs(alice: httpx2.Client, bob: httpx2.Client,
                                              redis_url: str) -> None:
    reply = alice.post("/v1/chat/completions", json={**CHAT, "n": 2})
    assert reply.status_code == 200
    job_ids = reply.headers["x-qworker-job-id"].split(",")
    for job_id in job_ids:
        assert alice.get(f"/v1/jobs/{job_id}").json()["status"] == "done"
        assert alice.get(f"/v1/jobs/{job_id}/stream").text.endswith("data: [DONE]\n\n")
        assert code(bob.get(f"/v1/jobs/{job_id}")) == (404, "job_not_found")
        assert code(bob.get(f"/v1/jobs/{job_id}/stream")) == (404, "job_not_found")
    with Producer(redis_url) as producer:  # queued straight into Redis: no key's
        raw = producer.submit("raw", max_tokens=2)
        raw.result(timeout=30)
    assert code(alice.get(f"/v1/jobs/{raw.id}")) == (404, "job_not_found")
    assert code(alice.get(f"/v1/jobs/{raw.id}/stream")) == (404, "job_not_found")
    assert code(alice.get("/v1/jobs/never-was")) == (404, "job_not_found")
    with redis.Redis.from_url(redis_url) as client:
        stored = [client.get(KEYS.gateway_job(job_id)) or b"" for job_id in job_ids]
    assert all(ALICE.encode() not in value for value in stored)  # a fingerprint, not the key
    assert {json.loads(value)["owner"] for value in stored} == {fingerprint(ALICE.encode())}


def test_a_key_does_not_see_another_keys_files_or_batches(
        alice: httpx2.Client, bob: httpx2.Client, tmp_path: Path) -> None:
    lines = jsonl([chat_line("a1", "for alice", max_tokens=4)])
    upload = alice.post("/v1/files", data={"purpose": "batch"},
                        files={"file": ("in.jsonl", lines)}).json()
    assert alice.get(f"/v1/files/{upload['id']}/content").content == lines
    assert code(bob.get(f"/v1/files/{upload['id']}")) == (404, "file_not_found")
    assert code(bob.get(f"/v1/files/{upload['id']}/content")) == (404, "file_not_found")
    request = {"input_file_id": upload["id"], "endpoint": "/v1/chat/completions"}
    assert code(bob.post("/v1/batches", json=request)) == (404, "file_not_found")
    batch = alice.post("/v1/batches", json=request).json()
    assert "owner" not in batch and "owner" not in upload
    assert code(bob.get(f"/v1/batches/{batch['id']}")) == (404, "batch_not_found")
    assert code(bob.post(f"/v1/batches/{batch['id']}/cancel")) == (404, "batch_not_found")
    done = wait_for(lambda: _ended(alice.get(f"/v1/batches/{batch['id']}").json()),
                    what="the batch")
    assert done["status"] == "completed", done
    assert alice.get(f"/v1/files/{done['output_file_id']}/content").status_code == 200
    assert code(bob.get(f"/v1/files/{done['output_file_id']}/content")) == (404,
                                                                            "file_not_found")
    for path in (tmp_path / "files").rglob("*"):
        assert not path.is_file() or ALICE.encode() not in path.read_bytes(), path


def _ended(batch: dict[str, object]) -> dict[str, object] | None:
    return batch if batch["status"] not in ("validating", "in_progress", "finalizing") else None


def test_ids_that_are_no_file_or_batch_are_404(alice: httpx2.Client) -> None:
    upload = alice.post("/v1/files", data={"purpose": "batch"},
                        files={"file": ("in.jsonl", jsonl([chat_line("x", "x")]))}).json()
    batch = alice.post("/v1/batches", json={"input_file_id": upload["id"],
                                            "endpoint": "/v1/chat/completions"}).json()
    for path in (f"/v1/files/file-{'a' * 300}", f"/v1/files/file-{'a' * 300}/content",
                 f"/v1/files/{batch['id']}.batch", f"/v1/files/{batch['id']}.batch/content",
                 f"/v1/files/{upload['id']}.json"):
        assert code(alice.get(path)) == (404, "file_not_found"), path
    for path in (f"/v1/batches/batch_{'a' * 300}", f"/v1/batches/{upload['id']}"):
        assert code(alice.get(path)) == (404, "batch_not_found"), path
    assert code(alice.post(f"/v1/batches/batch_{'b' * 300}/cancel")) == (404, "batch_not_found")
