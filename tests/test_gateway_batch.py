"""OpenAI's Batch API through the `openai` SDK (`client.files`, `client.batches`): a batch
submitted, polled and downloaded, its lines the responses single requests give; lines that
cannot run in the error file; a batch cancelled."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import openai
import pytest
from openai import OpenAI

from qworker_client.local_redis import free_port
from tests.gateway_harness import gateway, live_worker
from tests.service_harness import ROOT, sim_engine, wait_for
from tests.test_gateway_cli import up


def jsonl(lines: list[dict[str, object]]) -> bytes:
    return "".join(json.dumps(line) + "\n" for line in lines).encode()


def chat_line(custom_id: str, content: str, **params: object) -> dict[str, object]:
    return {"custom_id": custom_id, "method": "POST", "url": "/v1/chat/completions",
            "body": {"model": "sim", "messages": [{"role": "user", "content": content}],
                     **params}}


@pytest.fixture
def client(redis_url: str, tmp_path: Path) -> Iterator[OpenAI]:
    with live_worker(redis_url, "gw-batch", sim_engine("sim:step_ms=5")), \
            gateway(redis_url, files_dir=str(tmp_path / "files")) as url, \
            OpenAI(base_url=f"{url}/v1", api_key="unused", max_retries=0) as sdk:
        yield sdk


def finished(client: OpenAI, batch_id: str) -> object:
    batch = client.batches.retrieve(batch_id)
    return batch if batch.status in ("completed", "cancelled", "failed", "expired") else None


def test_a_batch_submitted_polled_and_downloaded(client: OpenAI) -> None:
    lines = [chat_line(f"q{k}", f"question {k}", max_tokens=6 + k, seed=k) for k in range(5)]
    lines.append({**chat_line("bad-url", "x"), "url": "/v1/embeddings"})
    lines.append(chat_line("bad-temp", "x", temperature=9))
    uploaded = client.files.create(file=("in.jsonl", jsonl(lines)), purpose="batch")
    assert uploaded.purpose == "batch" and uploaded.bytes == len(jsonl(lines))
    batch = client.batches.create(input_file_id=uploaded.id, endpoint="/v1/chat/completions",
                                  completion_window="24h")
    assert batch.status in ("validating", "in_progress")
    batch = wait_for(lambda: finished(client, batch.id), timeout=60, what="the batch")
    assert batch.status == "completed" and batch.output_file_id and batch.error_file_id
    assert batch.request_counts is not None
    assert (batch.request_counts.total, batch.request_counts.completed,
            batch.request_counts.failed) == (7, 5, 2)
    out = [json.loads(x) for x in client.files.content(batch.output_file_id).text.splitlines()]
    by_id = {line["custom_id"]: line for line in out}
    assert sorted(by_id) == [f"q{k}" for k in range(5)]
    for k in range(5):
        response = by_id[f"q{k}"]["response"]
        single = client.chat.completions.create(model="sim", max_tokens=6 + k, seed=k,
                                                messages=[{"role": "user",
                                                           "content": f"question {k}"}])
        assert response["status_code"] == 200
        body = response["body"]
        assert body["object"] == "chat.completion" and body["model"] == "sim"
        assert body["choices"][0]["message"]["content"] == single.choices[0].message.content
        assert single.usage is not None
        assert body["usage"]["completion_tokens"] == single.usage.completion_tokens == 6 + k
    errors = {json.loads(x)["custom_id"]: json.loads(x)
              for x in client.files.content(batch.error_file_id).text.splitlines()}
    assert errors["bad-url"]["error"]["message"].startswith("the line's url")
    assert errors["bad-temp"]["response"]["status_code"] == 400


def test_a_batch_cancelled(client: OpenAI) -> None:
    lines = [chat_line(f"c{k}", "long", max_tokens=2000) for k in range(6)]
    uploaded = client.files.create(file=("in.jsonl", jsonl(lines)), purpose="batch")
    batch = client.batches.create(input_file_id=uploaded.id, endpoint="/v1/chat/completions",
                                  completion_window="24h")
    wait_for(lambda: client.batches.retrieve(batch.id).status == "in_progress",
             what="the batch to run")
    assert client.batches.cancel(batch.id).status == "cancelling"
    batch = wait_for(lambda: finished(client, batch.id), timeout=60, what="the cancel")
    assert batch.status == "cancelled" and batch.output_file_id
    out = [json.loads(x) for x in client.files.content(batch.output_file_id).text.splitlines()]
    reasons = {line["response"]["body"]["choices"][0]["finish_reason"] for line in out}
    assert reasons <= {"cancelled"}  # nothing ran to its 2000 tokens


def error_lines(client: OpenAI, file_id: str | None) -> dict[str | None, dict[str, object]]:
    assert file_id is not None
    return {json.loads(x)["custom_id"]: json.loads(x)
            for x in client.files.content(file_id).text.splitlines()}


def test_a_hostile_line_fails_alone(client: OpenAI) -> None:
    deep = ('{"custom_id": "deep", "method": "POST", "url": "/v1/chat/completions", "body": '
            + "[" * 100_000 + "]" * 100_000 + "}")
    lines = [json.dumps(chat_line("q0", "fine", max_tokens=4)), deep,
             json.dumps({**chat_line("ghost", "x"), "body": {"model": "nobody-serves-this",
                                                              "messages": [{"role": "user",
                                                                            "content": "x"}]}}),
             json.dumps({**chat_line("types", "x"), "body": {"model": 7, "messages": "x"}}),
             json.dumps(chat_line("q1", "fine too", max_tokens=4))]
    uploaded = client.files.create(file=("in.jsonl", "\n".join(lines).encode()),
                                   purpose="batch")
    batch = client.batches.create(input_file_id=uploaded.id, endpoint="/v1/chat/completions",
                                  completion_window="24h")
    batch = wait_for(lambda: finished(client, batch.id), timeout=60, what="the batch")
    assert batch.status == "completed" and batch.request_counts is not None
    assert (batch.request_counts.completed, batch.request_counts.failed) == (2, 3)
    out = client.files.content(batch.output_file_id).text.splitlines()
    assert sorted(json.loads(x)["custom_id"] for x in out) == ["q0", "q1"]
    errors = error_lines(client, batch.error_file_id)
    assert errors["ghost"]["error"]["code"] == "model_not_found"
    assert errors[None]["error"]["message"].startswith("the line is not JSON")  # the deep one
    assert errors["types"]["error"]["code"] == "invalid_request"


def test_the_completion_window_is_kept(client: OpenAI) -> None:
    lines = [chat_line(f"q{k}", f"quick {k}", max_tokens=4) for k in range(3)]
    lines.append(chat_line("slow", "long", max_tokens=20000, ignore_eos=True))
    uploaded = client.files.create(file=("in.jsonl", jsonl(lines)), purpose="batch")
    batch = client.batches.create(input_file_id=uploaded.id, endpoint="/v1/chat/completions",
                                  completion_window="3s")
    assert batch.expires_at == batch.created_at + 3
    batch = wait_for(lambda: finished(client, batch.id), timeout=30, what="the window")
    assert batch.status == "expired" and batch.expired_at and batch.request_counts is not None
    assert (batch.request_counts.completed, batch.request_counts.failed) == (3, 1)
    out = client.files.content(batch.output_file_id).text.splitlines()
    assert sorted(json.loads(x)["custom_id"] for x in out) == ["q0", "q1", "q2"]
    assert error_lines(client, batch.error_file_id)["slow"]["error"]["code"] == "batch_expired"
    with pytest.raises(openai.BadRequestError, match="completion_window"):
        client.batches.create(input_file_id=uploaded.id, endpoint="/v1/chat/completions",
                              completion_window="25h")


def test_with_no_live_worker_lines_wait_for_the_window(redis_url: str, tmp_path: Path) -> None:
    with gateway(redis_url, files_dir=str(tmp_path / "files")) as url, \
            OpenAI(base_url=f"{url}/v1", api_key="unused", max_retries=0) as sdk:
        uploaded = sdk.files.create(file=("in.jsonl", jsonl([chat_line("w", "x")])),
                                    purpose="batch")
        batch = sdk.batches.create(input_file_id=uploaded.id, endpoint="/v1/chat/completions",
                                   completion_window="2s")
        wait_for(lambda: sdk.batches.retrieve(batch.id).status == "in_progress",
                 what="the batch to wait")
        batch = wait_for(lambda: finished(sdk, batch.id), timeout=30, what="the window")
        assert batch.status == "expired"
        assert error_lines(sdk, batch.error_file_id)["w"]["error"]["code"] == "model_not_found"


def test_without_a_files_dir_there_are_no_batches(redis_url: str) -> None:
    with gateway(redis_url) as url, OpenAI(base_url=f"{url}/v1", api_key="unused",
                                           max_retries=0) as sdk, \
            pytest.raises(openai.NotFoundError, match="files-dir"):
        sdk.batches.retrieve("batch_x")


def spawn_gateway(redis_url: str, port: int, files: Path) -> subprocess.Popen[bytes]:
    return subprocess.Popen(
        [sys.executable, "-m", "qworker_client", "gateway", "--redis-url", redis_url, "--port",
         str(port), "--files-dir", str(files), "--log-level", "warning"],
        cwd=ROOT, env={**os.environ, "PYTHONPATH": str(ROOT)})


def test_a_batch_goes_on_after_its_gateway_is_killed(redis_url: str, tmp_path: Path) -> None:
    port, files = free_port(), tmp_path / "files"
    base = f"http://127.0.0.1:{port}"
    lines = [chat_line(f"r{k}", f"resume {k}", max_tokens=40, seed=k) for k in range(12)]
    with live_worker(redis_url, "gw-resume", sim_engine("sim:step_ms=20", max_num_seqs=4)):
        first = spawn_gateway(redis_url, port, files)
        try:
            wait_for(lambda: up(base), what="the gateway")
            with OpenAI(base_url=f"{base}/v1", api_key="unused", max_retries=0) as sdk:
                uploaded = sdk.files.create(file=("in.jsonl", jsonl(lines)), purpose="batch")
                batch = sdk.batches.create(input_file_id=uploaded.id, completion_window="24h",
                                           endpoint="/v1/chat/completions")
                wait_for(lambda: sdk.batches.retrieve(batch.id).status == "in_progress",
                         what="the batch to run")
        finally:
            first.kill()
            first.wait(30)
        record = json.loads((files / f"{batch.id}.batch.json").read_text())
        assert record["status"] == "in_progress"  # killed halfway
        second = spawn_gateway(redis_url, port, files)
        try:
            wait_for(lambda: up(base), what="the second gateway")
            with OpenAI(base_url=f"{base}/v1", api_key="unused", max_retries=0) as sdk:
                done = wait_for(lambda: finished(sdk, batch.id), timeout=120, what="the batch")
                assert done.status == "completed"
                out = sdk.files.content(done.output_file_id).text.splitlines()
        finally:
            second.send_signal(signal.SIGTERM)
            second.wait(30)
    ids = [json.loads(line)["custom_id"] for line in out]
    assert sorted(ids) == sorted(f"r{k}" for k in range(12))  # each line once
