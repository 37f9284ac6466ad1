"""A tenant's tokens-per-minute quota across two gateways and two workers on one redis-server:
the tokens admitted in a minute never pass the quota by more than one job's worth, the gateways
answer 429 with Retry-After once it is used, jobs queued straight into Redis wait held in their
tenant's queue (not failed, not lost) while another tenant's run, and `qworker jobs` says so."""

from __future__ import annotations

import json
import threading
import time
from collections import Counter
from pathlib import Path

import httpx2
import pytest
import redis

from qworker_client.cli import main as cli_main
from qworker_client.client import Producer
from qworker_client.jobs import list_jobs
from tests.gateway_harness import gateway, live_worker
from tests.service_harness import KEYS, sim_engine, wait_for, wait_terminal

QUOTA = 300
BODY = {"model": "sim", "messages": [{"role": "user", "content": "count"}], "max_tokens": 30,
        "ignore_eos": True}


def with_the_minute_ahead(need_s: float = 20.0) -> None:
    """The quota counts whole clock minutes: the test runs inside one, or the held jobs start
    at the next and the charges read mid-correction."""
    left = 60 - time.time() % 60
    if left < need_s:
        time.sleep(left + 0.05)


def test_a_quota_holds_across_gateways_and_workers(redis_url: str, tmp_path: Path,
                                                   capsys: pytest.CaptureFixture[str]) -> None:
    keys_file = tmp_path / "keys.json"
    keys_file.write_text(json.dumps({"tenants": {
        "capped": {"keys": ["sk-capped"], "tokens_per_minute": QUOTA},
        "free": {"keys": ["sk-free"]}}}))
    client = redis.Redis.from_url(redis_url, decode_responses=True)
    statuses: list[int] = []
    retry_after: list[str] = []
    with_the_minute_ahead()
    minute = int(time.time()) // 60
    with live_worker(redis_url, "qa", sim_engine("sim:step_ms=2")), \
            live_worker(redis_url, "qb", sim_engine("sim:step_ms=2")), \
            gateway(redis_url, keys_file=str(keys_file), max_queued=None) as one, \
            gateway(redis_url, keys_file=str(keys_file), max_queued=None) as two:

        def ask(url: str) -> None:
            for _ in range(8):
                try:
                    reply = httpx2.post(f"{url}/v1/chat/completions", json=BODY, timeout=5,
                                        headers={"authorization": "Bearer sk-capped"})
                except httpx2.TimeoutException:  # admitted by the gateway, then held by the
                    statuses.append(0)  # fair read until the next minute: it waits queued
                    continue
                statuses.append(reply.status_code)
                if reply.status_code == 429:
                    retry_after.append(reply.headers.get("retry-after", ""))

        askers = [threading.Thread(target=ask, args=(url,)) for url in (one, two, one, two)]
        for t in askers:
            t.start()
        for t in askers:
            t.join(120)
        for k in range(6):  # straight into Redis: they wait for the next minute, held
            client.xadd(KEYS.jobs, {"id": f"direct{k}", "tenant": "capped", "prompt": "count",
                                    "max_tokens": "30"})
        with Producer(redis_url) as producer:  # the same, with a submit marker: `status` knows it
            producer.submit("count", id="submitted", tenant="capped", max_tokens=30)
        client.xadd(KEYS.jobs, {"id": "other", "tenant": "free", "prompt": "hi",
                                "max_tokens": "3"})
        client.xadd(KEYS.jobs, {"id": "rogue", "tenant": "rogue", "prompt": "hi",
                                "max_tokens": "3"})
        wait_terminal(client, ["other", "rogue"], timeout=30)  # others are not held with them
        wait_for(lambda: client.zcard(KEYS.held_of(KEYS.jobs)) > 0, timeout=10,
                 what="the direct jobs held")
        rows = {row.job_id: row for row in list_jobs(client, KEYS, 100)}
        capsys.readouterr()
        assert cli_main(["status", "submitted", "--json", "--redis-url", redis_url]) == 0
        status = [json.loads(line) for line in capsys.readouterr().out.splitlines()
                  if line.startswith("{")]  # not the workers' log lines
        assert cli_main(["status", "other", "--json", "--redis-url", redis_url]) == 0
        other = [json.loads(line) for line in capsys.readouterr().out.splitlines()
                 if line.startswith("{")]
        own = httpx2.get(f"{one}/v1/admin/usage", headers={"authorization": "Bearer sk-capped"})
        denied = httpx2.get(f"{two}/v1/admin/usage?tenant=capped",
                            headers={"authorization": "Bearer sk-free"})
        metrics = httpx2.get(f"{two}/metrics").text
    assert int(time.time()) // 60 == minute, "the test outran its minute: the figures below mix two"
    assert {(r["tenant"], r["model"]) for r in own.json()["data"]} == {("capped", "sim")}
    assert denied.status_code == 403
    assert 'qworker_tenant_usage_today{counter="jobs",tenant="free"} 1.0' in metrics
    assert 'tenant="rogue"' not in metrics  # not in the keys file: no label of its own
    day = client.hgetall(next(iter(client.scan_iter(match=KEYS.usage("*")))))
    ran = int(day["capped|sim|jobs"])
    made = int(day["capped|sim|prompt_tokens"]) + int(day["capped|sim|completion_tokens"])
    one_job = made / ran  # every job of the capped tenant is the same size
    counted = {key: int(client.hget(key, "capped") or 0)
               for key in client.scan_iter(match=KEYS.tpm(0).removesuffix("0") + "*")}
    print(f"FIGURES quota={QUOTA} counted={counted} made={made} jobs={ran} "
          f"one_job={one_job:.0f} statuses={dict(Counter(statuses))}")
    assert sum(counted.values()) == made  # the charges corrected to what the jobs made
    assert all(n <= QUOTA + one_job for n in counted.values()), counted
    assert statuses.count(200) >= 1 and statuses.count(429) >= 1, statuses
    assert all(value.isdigit() and 1 <= int(value) <= 60 for value in retry_after)
    assert set(statuses) <= {200, 429, 0}
    held = [r for r in rows.values() if r.job_id.startswith("direct")]
    assert any(r.status == "queued" and r.detail.startswith("held: quota") for r in held), held
    assert [(s["status"], s.get("detail")) for s in status] == [("queued", "held: quota")]
    assert [(s["status"], s.get("detail")) for s in other] == [("done", None)]
    assert client.xlen(KEYS.dead) == 0  # nothing failed
    capsys.readouterr()
    assert cli_main(["usage", "--tenant", "capped", "--json", "--redis-url", redis_url]) == 0
    listed = [json.loads(line) for line in capsys.readouterr().out.splitlines()]
    assert [(r["tenant"], r["jobs"]) for r in listed] == [("capped", ran)]
    assert cli_main(["usage", "--since", "yesterday", "--redis-url", redis_url]) == 2
    assert "not a day" in capsys.readouterr().err
    client.close()
