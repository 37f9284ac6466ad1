"""Hostile clients against one gateway (issue 34): an entry id past Redis' bounds and an output key
of the wrong type fail one request, never the others' streams; a request fans out to a bounded
number of jobs, and the queue is bounded by default; deep JSON is a 400; made-up paths do not grow
the metrics."""

from __future__ import annotations

import asyncio
import json
from collections.abc import Iterator
from typing import Any

import httpx2
import pytest
import redis

from qworker_client.connect import ClientOptions
from qworker_client.gateway.app import create_app
from qworker_client.gateway.config import GatewayConfig
from qworker_client.gateway.connection import gateway_client
from qworker_client.gateway.streams.hub import Hub, Item, Mailbox
from qworker_client.protocol import TokenEvent, event_to_fields, parse_entry_id
from tests.gateway_harness import OpenRequest, gateway, live_worker
from tests.service_harness import KEYS, sim_engine, wait_for

SLOW = "sim:step_ms=20"  # 50 tokens a second: the streams run while the hostile request comes
IDLE = "idle"  # a model with a live worker key and no worker: its jobs wait


@pytest.fixture
def url(redis_url: str) -> Iterator[str]:
    with live_worker(redis_url, "gw-hostile", sim_engine(SLOW)), gateway(redis_url) as base:
        yield base


def live_streams(url: str, count: int, max_tokens: int = 100) -> list[OpenRequest]:
    """`count` streamed completions, once each has had its first chunk."""
    streams = [OpenRequest(f"{url}/v1/completions", {"model": "sim", "prompt": f"live {k}",
                                                     "max_tokens": max_tokens, "stream": True})
               for k in range(count)]
    wait_for(lambda: all(s.events or s.ended for s in streams), what="the first chunks")
    assert not any(s.ended for s in streams)
    return streams


def all_done(streams: list[OpenRequest]) -> None:
    for stream in streams:
        stream.join(60)
    assert [(s.done, s.error_codes(), s.failure) for s in streams] == [(True, [], None)] * len(
        streams)


def idle_worker(r: redis.Redis) -> None:
    r.set(KEYS.worker(IDLE), json.dumps({"name": IDLE, "model": IDLE}), ex=120)


def test_ids_past_redis_bounds_are_400_at_the_door() -> None:
    top = 2**64 - 1
    assert parse_entry_id(f"{top}-{top}") == (top, top)
    for bad in (f"1-{top + 1}", f"{top + 1}-0", "²-0", "1-²", "1", "-1-0", " 1-0", "1-0\n",
                "1_0-0", "0x1-0", "1" * 21 + "-0"):
        assert parse_entry_id(bad) is None, bad


def test_an_id_past_redis_bounds_cuts_no_other_stream(url: str) -> None:
    finished = httpx2.post(f"{url}/v1/completions",
                           json={"model": "sim", "prompt": "resume me", "max_tokens": 2})
    job_id = finished.headers["x-qworker-job-id"]
    streams = live_streams(url, 4)
    for last_event_id in (b"1-18446744073709551616", b"18446744073709551616-0",
                          "²-0".encode("latin-1"), b"0/1-18446744073709551616"):
        resumed = httpx2.get(f"{url}/v1/jobs/{job_id}/stream", timeout=30,
                             headers={"Last-Event-ID": last_event_id})
        assert resumed.status_code == 400, (last_event_id, resumed.text)
        assert resumed.json()["error"]["param"] == "last-event-id"
    all_done(streams)


def test_an_output_key_of_the_wrong_type_fails_its_request_only(url: str,
                                                                 redis_url: str) -> None:
    r = redis.Redis.from_url(redis_url)
    idle_worker(r)
    streams = live_streams(url, 4)
    hostile = OpenRequest(f"{url}/v1/completions",
                          {"model": IDLE, "prompt": "x", "max_tokens": 4, "stream": True})
    assert hostile.answered.wait(30) and hostile.status == 200
    r.set(KEYS.out(hostile.job_ids[0]), "not a stream")  # what the hub's XREAD now trips on
    hostile.join(30)
    assert hostile.done and hostile.error_codes() == ["bad_event"], hostile.events
    all_done(streams)


def test_the_hub_ends_only_the_jobs_whose_read_fails(redis_url: str) -> None:
    """At depth, past the routes' checks: an id Redis refuses and a key that is no stream, among
    eight streams read at once."""
    r = redis.Redis.from_url(redis_url)
    jobs = [f"hub-{k}" for k in range(8)]
    for job_id in jobs:
        r.xadd(KEYS.out(job_id), event_to_fields(TokenEvent(i=0, token_id=1, text=job_id)))
    r.delete(KEYS.out("hub-5"))
    r.set(KEYS.out("hub-5"), "not a stream")

    async def follow_all() -> dict[str, list[Item]]:
        client = gateway_client(redis_url, ClientOptions())
        hub = Hub(client, KEYS)
        boxes = {job_id: Mailbox() for job_id in jobs}
        for job_id, box in boxes.items():
            hub.follow({job_id: "1-18446744073709551616" if job_id == "hub-2" else "0-0"}, box)
        try:
            return {job_id: await asyncio.wait_for(box.take(), 10)
                    for job_id, box in boxes.items()}
        finally:
            await hub.close()
            await client.aclose()

    got = asyncio.run(follow_all())
    for job_id, items in got.items():
        (item,) = items
        assert not isinstance(item, BaseException), (job_id, item)
        (entry,) = item[1]
        fields = dict(zip(entry[1][::2], entry[1][1::2], strict=True))
        if job_id in ("hub-2", "hub-5"):
            assert (fields["type"], fields["code"]) == ("error", "bad_event"), fields
        else:
            assert (fields["type"], fields["text"]) == ("token", job_id)


def test_a_request_fans_out_to_a_bounded_number_of_jobs(url: str, redis_url: str) -> None:
    r = redis.Redis.from_url(redis_url)
    many = httpx2.post(f"{url}/v1/completions", timeout=60, json={
        "model": "sim", "prompt": [f"p{k}" for k in range(20_000)], "max_tokens": 1})
    assert many.status_code == 400, many.text[:200]
    assert many.json()["error"]["param"] == "prompt" and "256" in many.json()["error"]["message"]
    times_n = httpx2.post(f"{url}/v1/completions", json={
        "model": "sim", "prompt": [f"p{k}" for k in range(17)], "n": 16, "max_tokens": 1})
    assert times_n.status_code == 400 and "256" in times_n.json()["error"]["message"]
    assert r.xlen(KEYS.jobs_of("sim")) == 0 and not r.keys(KEYS.submitted("*"))


def test_the_queue_is_bounded_by_default(redis_url: str) -> None:
    r = redis.Redis.from_url(redis_url)
    idle_worker(r)
    bound = GatewayConfig().max_queued
    assert bound is not None
    pipe = r.pipeline(transaction=False)
    for _ in range(bound):
        pipe.xadd(KEYS.jobs_of(IDLE), {"prompt": "waiting"})
    pipe.execute()
    with gateway(redis_url) as base:
        refused = httpx2.post(f"{base}/v1/completions", timeout=30,
                              json={"model": IDLE, "prompt": "one more", "stream": True})
    assert refused.status_code == 429 and refused.json()["error"]["code"] == "queue_full"


@pytest.mark.parametrize("depth", [100_000, 65])
def test_deeply_nested_json_is_a_400(url: str, depth: int) -> None:
    nested = "[" * depth + "]" * depth
    body = f'{{"model": "sim", "prompt": "x", "max_tokens": 1, "stop": {nested}}}'
    reply = httpx2.post(f"{url}/v1/completions", content=body.encode(), timeout=30,
                        headers={"content-type": "application/json"})
    assert reply.status_code == 400, reply.text[:200]
    assert reply.json()["error"]["code"] == "too_deep"


async def _asgi_get(app: Any, path: str, headers: list[tuple[bytes, bytes]]
                    ) -> tuple[int, bytes]:
    """One GET through the app in this process (no socket): its status and body."""
    scope = {"type": "http", "asgi": {"version": "3.0"}, "http_version": "1.1", "method": "GET",
             "scheme": "http", "path": path, "raw_path": path.encode(), "query_string": b"",
             "root_path": "", "headers": headers, "server": ("test", 80),
             "client": ("test", 1)}
    status: list[int] = []
    body: list[bytes] = []

    async def receive() -> dict[str, Any]:
        return {"type": "http.request", "body": b"", "more_body": False}

    async def send(message: dict[str, Any]) -> None:
        if message["type"] == "http.response.start":
            status.append(message["status"])
        elif message["type"] == "http.response.body":
            body.append(message.get("body", b""))

    await app(scope, receive, send)
    return status[0], b"".join(body)


def test_made_up_paths_share_one_metrics_label(redis_url: str) -> None:
    app = create_app(GatewayConfig(redis_url=redis_url, api_keys=("key",)))

    async def run() -> tuple[list[int], int, bytes]:
        statuses = [(await _asgi_get(app, path, []))[0] for k in range(10_000)
                    for path in (f"/v1/made/up/{k}", f"/x{k}")]
        authorized = [(b"authorization", b"Bearer key")]
        statuses.append((await _asgi_get(app, "/v1/jobs/some-job", authorized))[0])
        try:
            return statuses, *await _asgi_get(app, "/metrics", [])
        finally:
            await app.state.gateway.close()

    statuses, status, exposition = asyncio.run(run())
    # keyed before any work; with a key, a job it did not submit is a 404 (Ownership)
    assert set(statuses[:-1]) == {401} and statuses[-1] == 404
    assert status == 200
    labels = {line for line in exposition.decode().splitlines()
              if line.startswith("qworker_gateway_requests_total{")}
    assert labels == {'qworker_gateway_requests_total{route="other"} 20000.0',
                      'qworker_gateway_requests_total{route="/v1/jobs/{job_id}"} 1.0',
                      'qworker_gateway_requests_total{route="/metrics"} 1.0'}
