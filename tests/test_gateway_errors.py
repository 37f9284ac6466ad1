"""Every error status of the gateway, in OpenAI's shape, as the `openai` SDK raises it: 400, 401,
404 (model, route), 429 with Retry-After, 503 without a live worker, and a job's own error."""

from __future__ import annotations

from collections.abc import Iterator

import httpx2
import openai
import pytest
import redis
from openai import OpenAI

from qworker_client.local_redis import free_port
from tests.gateway_harness import gateway, live_worker
from tests.service_harness import KEYS, sim_engine, wait_for

MODEL = "sim"
CHAT = [{"role": "user", "content": "Hi"}]


def sdk(base_url: str, api_key: str = "unused") -> OpenAI:
    return OpenAI(base_url=f"{base_url}/v1", api_key=api_key, max_retries=0)


@pytest.fixture
def client(redis_url: str) -> Iterator[OpenAI]:
    engine = sim_engine(max_model_len=64)
    with live_worker(redis_url, "gw-err", engine), gateway(redis_url) as url, sdk(url) as c:
        yield c


def error_of(exc: openai.APIStatusError) -> dict[str, object]:
    body = exc.response.json()
    assert set(body) == {"error"} and set(body["error"]) == {"message", "type", "param", "code"}
    return body["error"]


def test_a_value_the_protocol_refuses_is_a_400_naming_it(client: OpenAI) -> None:
    with pytest.raises(openai.BadRequestError) as caught:
        client.completions.create(model=MODEL, prompt="x", temperature=9)
    error = error_of(caught.value)
    assert (error["type"], error["param"]) == ("invalid_request_error", "temperature")
    with pytest.raises(openai.BadRequestError) as caught:
        client.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": [
            {"type": "image_url", "image_url": {"url": "http://x"}}]}])
    assert error_of(caught.value)["param"] == "messages[0].content"


def test_a_body_that_is_not_json_is_a_400(client: OpenAI) -> None:
    reply = httpx2.post(f"{client.base_url}chat/completions", content=b"{not json",
                        headers={"content-type": "application/json"})
    assert reply.status_code == 400 and "not valid JSON" in reply.json()["error"]["message"]


def test_a_job_the_worker_refuses_is_its_error_status(client: OpenAI) -> None:
    with pytest.raises(openai.BadRequestError) as caught:  # past the worker's max_model_len
        client.completions.create(model=MODEL, prompt="x" * 200, max_tokens=4)
    assert error_of(caught.value)["code"] == "context_length_exceeded"
    stream = client.completions.create(model=MODEL, prompt="x" * 200, max_tokens=4,
                                       stream=True)
    with pytest.raises(openai.APIError, match="does not fit") as streamed:
        list(stream)  # streamed: an error event, then the end
    assert streamed.value.code == "context_length_exceeded"


def test_an_unknown_model_is_a_404_and_an_unknown_route_too(client: OpenAI) -> None:
    with pytest.raises(openai.NotFoundError) as caught:
        client.completions.create(model="gpt-4o", prompt="x")
    error = error_of(caught.value)
    assert (error["code"], error["param"]) == ("model_not_found", "model")
    with pytest.raises(openai.NotFoundError):
        client.models.retrieve("gpt-4o")
    assert httpx2.get(f"{client.base_url}nowhere").json()["error"]["type"] == (
        "invalid_request_error")


def test_no_live_worker_is_a_503(redis_url: str) -> None:
    with gateway(redis_url) as url, sdk(url) as client:
        with pytest.raises(openai.InternalServerError) as caught:
            client.completions.create(model=MODEL, prompt="x")
        assert caught.value.status_code == 503
        assert error_of(caught.value)["code"] == "no_live_worker"
        assert client.models.list().data == []


def test_a_full_queue_is_a_429_with_retry_after(redis_url: str) -> None:
    with gateway(redis_url, max_queued=2, retry_after_s=3) as url, sdk(url) as client:
        r = redis.Redis.from_url(redis_url)
        r.set(KEYS.worker("idle"), '{"name": "idle", "model": "sim"}', ex=60)  # live, not working
        for _ in range(2):
            r.xadd(KEYS.jobs, {"prompt": "x"})
        with pytest.raises(openai.RateLimitError) as caught:
            client.completions.create(model=MODEL, prompt="x")
        assert caught.value.response.headers["retry-after"] == "3"
        assert error_of(caught.value)["code"] == "queue_full"
        r.delete(KEYS.jobs)
        wait_for(lambda: r.xlen(KEYS.jobs) == 0)
        stream = client.completions.with_raw_response.create(
            model=MODEL, prompt="x", max_tokens=1, n=2, extra_body={"detach": True},
            stream=True)  # room for two: queued (no worker takes them)
        assert stream.status_code == 200 and r.xlen(KEYS.jobs_of(MODEL)) == 2
        stream.http_response.close()
        with pytest.raises(openai.RateLimitError):
            client.completions.create(model=MODEL, prompt="x")
        metrics = httpx2.get(f"{url}/metrics").text
        assert 'qworker_gateway_responses_total{status="429"} 2.0' in metrics
        assert "qworker_gateway_queue_depth 2.0" in metrics


def test_api_keys_are_required_when_given(redis_url: str) -> None:
    with live_worker(redis_url, "gw-auth"), gateway(redis_url, api_keys=("k1", "k2")) as url:
        for key in ("k1", "k2"):
            with sdk(url, key) as client:
                assert client.completions.create(model=MODEL, prompt="x", max_tokens=2).choices
        with sdk(url, "wrong") as client, pytest.raises(openai.AuthenticationError) as caught:
            client.models.list()
        assert error_of(caught.value)["code"] == "invalid_api_key"
        assert httpx2.post(f"{url}/v1/completions", json={}).status_code == 401
        assert httpx2.get(f"{url}/health").status_code == 200  # open: for probes


def test_models_are_the_workers_served_names(redis_url: str) -> None:
    with live_worker(redis_url, "gw-named", served_model_name="tiny-llama"), \
            live_worker(redis_url, "gw-plain"), gateway(redis_url) as url, sdk(url) as client:
        assert sorted(m.id for m in client.models.list()) == ["sim", "tiny-llama"]
        info = redis.Redis.from_url(redis_url).get(KEYS.worker("gw-named"))
        assert info is not None and b'"served_model_name":"tiny-llama"' in info
        reply = client.completions.create(model="tiny-llama", prompt="x", max_tokens=2)
        assert reply.model == "tiny-llama" and reply.choices[0].finish_reason == "length"


def test_an_unreachable_redis_is_a_503(redis_url: str) -> None:
    with gateway(f"redis://127.0.0.1:{free_port()}/0") as url, sdk(url) as client:
        with pytest.raises(openai.InternalServerError) as caught:
            client.models.list()
        assert caught.value.status_code == 503
        assert error_of(caught.value)["code"] == "redis_unavailable"
        assert httpx2.get(f"{url}/health").status_code == 503
