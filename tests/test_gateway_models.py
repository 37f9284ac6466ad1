"""Through the gateway with the `openai` SDK, a fleet of two models: `model="a"` runs on a's
worker and `model="b"` on b's, `/v1/models` lists both, an unknown model is a 404, and a full
queue of one model does not refuse the other."""

from __future__ import annotations

import json
from collections.abc import Iterator

import openai
import pytest
import redis
from openai import OpenAI

from tests.gateway_harness import gateway, live_worker
from tests.service_harness import KEYS, sim_engine, spy, wait_for


def sdk(base_url: str) -> OpenAI:
    return OpenAI(base_url=f"{base_url}/v1", api_key="unused", max_retries=0, timeout=60)


@pytest.fixture
def fleet(redis_url: str) -> Iterator[tuple[OpenAI, list[str], list[str]]]:
    eng_a, eng_b = sim_engine(), sim_engine()
    ran_a, ran_b = spy(eng_a), spy(eng_b)
    with live_worker(redis_url, "gm-a", eng_a, served_model_name="a"), \
            live_worker(redis_url, "gm-b", eng_b, served_model_name="b"), \
            gateway(redis_url) as url, sdk(url) as client:
        yield client, ran_a, ran_b


def test_each_model_reaches_its_worker(fleet: tuple[OpenAI, list[str], list[str]]) -> None:
    client, ran_a, ran_b = fleet
    assert sorted(m.id for m in client.models.list().data) == ["a", "b"]
    done_a = client.completions.create(model="a", prompt="to a", max_tokens=5, seed=1)
    raw = client.chat.completions.with_raw_response.create(
        model="b", messages=[{"role": "user", "content": "to b"}], max_tokens=5, stream=True)
    streamed = "".join(c.choices[0].delta.content or "" for c in raw.parse() if c.choices)
    two_a = client.completions.create(model="a", prompt="twice", max_tokens=4, n=2, seed=3)
    b_job = raw.headers["x-qworker-job-id"]
    assert done_a.model == "a" and ran_a[0] == done_a.id
    assert b_job in ran_b and streamed
    assert {f"{two_a.id}.0", f"{two_a.id}.1"} <= set(ran_a)
    assert not set(ran_a) & {b_job} and done_a.id not in ran_b
    assert len(ran_a) == 3 and len(ran_b) == 1


def test_an_unknown_model_is_a_404(fleet: tuple[OpenAI, list[str], list[str]]) -> None:
    client, ran_a, ran_b = fleet
    for model in ("c", "a b"):
        with pytest.raises(openai.NotFoundError) as caught:
            client.completions.create(model=model, prompt="x", max_tokens=2)
        assert caught.value.response.json()["error"]["code"] == "model_not_found"
    assert ran_a == ran_b == []


def test_a_full_queue_of_one_model_leaves_the_other_open(redis_url: str) -> None:
    r = redis.Redis.from_url(redis_url)
    for name in ("a", "b"):  # live, not working: nothing is taken
        r.set(KEYS.worker(f"idle-{name}"), json.dumps(
            {"name": f"idle-{name}", "model": "sim", "served_model_name": name}), ex=60)
    for _ in range(2):
        r.xadd(KEYS.jobs_of("b"), {"prompt": "x", "model": "b"})
    with gateway(redis_url, max_queued=2) as url, sdk(url) as client:
        with pytest.raises(openai.RateLimitError):
            client.completions.create(model="b", prompt="x", max_tokens=1)
        raw = client.completions.with_raw_response.create(
            model="a", prompt="x", max_tokens=1, stream=True, extra_body={"detach": True})
        assert raw.status_code == 200
        raw.http_response.close()
        wait_for(lambda: r.xlen(KEYS.jobs_of("a")) == 1, what="a's job to be queued")
        assert r.xlen(KEYS.jobs_of("b")) == 2 and not r.exists(KEYS.jobs)
