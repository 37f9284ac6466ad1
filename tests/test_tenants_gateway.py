"""The keys file: a key acts for its tenant (its jobs carry the tenant, all of a tenant's keys see
them), a model it may not use is a 403, the file is reread when it changes and the tenants'
weights and quotas reach Redis; the plain key list keeps working beside it."""

from __future__ import annotations

import json
import os
import time
from collections.abc import Iterator
from pathlib import Path

import httpx2
import pytest
import redis

from qworker_client.gateway.tenants import KeysFileError, Tenant, parse_keys_file, refusal
from qworker_client.jobs import list_jobs
from tests.gateway_harness import gateway, live_worker
from tests.service_harness import KEYS, sim_engine, wait_for

PLAIN = "sk-plain-0123456789"
CHAT = {"model": "sim", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 3}


def write_keys(path: Path, tenants: dict[str, dict[str, object]]) -> None:
    path.write_text(json.dumps({"tenants": tenants}))
    stamp = time.time() + 2 * (path.stat().st_mtime - time.time() + 1)  # a new mtime for sure
    os.utime(path, (stamp, stamp))


@pytest.fixture
def keys_file(tmp_path: Path) -> Path:
    path = tmp_path / "keys.json"
    write_keys(path, {"acme": {"keys": ["sk-acme-1", "sk-acme-2"], "weight": 3,
                               "tokens_per_minute": 5000},
                      "tiny": {"keys": ["sk-tiny"], "models": ["other"], "max_band": "low"}})
    return path


@pytest.fixture
def base_url(redis_url: str, keys_file: Path) -> Iterator[str]:
    with live_worker(redis_url, "gw-tenants", sim_engine("sim:step_ms=1")), \
            gateway(redis_url, api_keys=(PLAIN,), keys_file=str(keys_file)) as url:
        yield url


def post(base_url: str, key: str, body: dict[str, object]) -> httpx2.Response:
    return httpx2.post(f"{base_url}/v1/chat/completions", json=body, timeout=30,
                       headers={"authorization": f"Bearer {key}"})


def test_a_keys_jobs_are_its_tenants(base_url: str, redis_url: str, keys_file: Path) -> None:
    reply = post(base_url, "sk-acme-1", CHAT)
    assert reply.status_code == 200, reply.text
    job_id = reply.headers["x-qworker-job-id"]
    status = httpx2.get(f"{base_url}/v1/jobs/{job_id}", timeout=10,
                        headers={"authorization": "Bearer sk-acme-2"})  # the tenant's other key
    assert status.json()["status"] == "done"
    assert post(base_url, PLAIN, CHAT).status_code == 200  # the plain list still works
    denied = post(base_url, "sk-tiny", CHAT)
    assert denied.status_code == 403 and "may not use model 'sim'" in denied.text
    assert post(base_url, "sk-nobody", CHAT).status_code == 401
    answer = httpx2.post(f"{base_url}/v1/responses", timeout=30,  # the Responses API's too
                         json={"model": "sim", "input": "hi", "max_output_tokens": 3},
                         headers={"authorization": "Bearer sk-acme-2"})
    assert answer.status_code == 200, answer.text
    refused = httpx2.post(f"{base_url}/v1/responses", timeout=30,
                          json={"model": "sim", "input": "hi", "max_output_tokens": 3},
                          headers={"authorization": "Bearer sk-tiny"})
    assert refused.status_code == 403 and "may not use model 'sim'" in refused.text
    client = redis.Redis.from_url(redis_url, decode_responses=True)
    rows = {row.job_id: row for row in list_jobs(client, KEYS, 50)}
    assert rows[job_id].tenant == "acme"
    assert rows[answer.headers["x-qworker-job-id"]].tenant == "acme"
    assert client.hgetall(KEYS.tenants) == {"acme": "3 5000 0", "tiny": "1 0 0",
                                               ":quotas": "1"}

    write_keys(keys_file, {"newco": {"keys": ["sk-new"], "weight": 2}})  # reread on change
    wait_for(lambda: post(base_url, "sk-new", CHAT).status_code == 200, timeout=10,
             what="the changed keys file")
    assert post(base_url, "sk-acme-1", CHAT).status_code == 401
    assert client.hgetall(KEYS.tenants) == {"newco": "2 0 0"}
    client.close()


def test_bands_and_bad_files_are_refused() -> None:
    low_only = Tenant("t", max_band="normal")
    assert refusal(low_only, "m", [0, 5]) is None
    assert "priority band above 'normal'" in (refusal(low_only, "m", [-1]) or "")
    for text, why in (("{", "not valid JSON"), ('{"tenants": {"a b": {}}}', "must match"),
                      ('{"tenants": {"a": {"weight": 0}}}', "weight must be"),
                      ('{"tenants": {"a": {"keys": ["k"]}, "b": {"keys": ["k"]}}}', "used once"),
                      ('{"tenants": {"a": {"colour": 1}}}', "known fields"),
                      ('{"tenants": {"a": {"concurrent_jobs": -1}}}', "positive integers")):
        with pytest.raises(KeysFileError, match=why):
            parse_keys_file(text, "keys.json")
