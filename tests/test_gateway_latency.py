"""The gateway's latency histograms on /metrics: a streamed completion's time to its first chunk
and every completion's duration, by model (only the catalog's) and route (only the two)."""

from __future__ import annotations

import httpx2
from prometheus_client.parser import text_string_to_metric_families

from tests.gateway_harness import gateway, live_worker
from tests.service_harness import sim_engine

MODEL = "sim"


def samples(base: str) -> dict[tuple[str, tuple[tuple[str, str], ...]], float]:
    """Every sample of the gateway's /metrics: (name, sorted labels) -> value."""
    text = httpx2.get(f"{base}/metrics").text
    return {(s.name, tuple(sorted(s.labels.items()))): s.value
            for family in text_string_to_metric_families(text) for s in family.samples}


def counts(found: dict[tuple[str, tuple[tuple[str, str], ...]], float], name: str
           ) -> dict[tuple[tuple[str, str], ...], float]:
    return {labels: v for (n, labels), v in found.items() if n == f"{name}_count"}


def test_completions_are_timed_by_model_and_route(redis_url: str) -> None:
    with live_worker(redis_url, "gw-latency", sim_engine("sim:step_ms=5")), \
            gateway(redis_url) as base:
        chat = {"model": MODEL, "messages": [{"role": "user", "content": "hi"}], "max_tokens": 6}
        assert httpx2.post(f"{base}/v1/chat/completions", json=chat, timeout=30).status_code == 200
        with httpx2.stream("POST", f"{base}/v1/chat/completions", json={**chat, "stream": True},
                           timeout=30) as streamed:
            events = [line for line in streamed.iter_lines() if line.startswith("data: ")]
        assert events[-1] == "data: [DONE]"
        text = {"model": MODEL, "prompt": "hi", "max_tokens": 4, "stream": True}
        with httpx2.stream("POST", f"{base}/v1/completions", json=text, timeout=30) as streamed:
            assert list(streamed.iter_lines())
        for model in ("no-such-model", "x" * 200):  # 404s: no label of theirs
            assert httpx2.post(f"{base}/v1/completions", json={**text, "model": model},
                               timeout=30).status_code == 404
        found = samples(base)
    chat_route = ("route", "/v1/chat/completions")
    assert counts(found, "qworker_gateway_request_seconds") == {
        (("model", MODEL), chat_route): 2.0,
        (("model", MODEL), ("route", "/v1/completions")): 1.0}
    assert counts(found, "qworker_gateway_first_chunk_seconds") == {(("model", MODEL),): 2.0}
    first = found["qworker_gateway_first_chunk_seconds_sum", (("model", MODEL),)]
    chat_total = found["qworker_gateway_request_seconds_sum", (("model", MODEL), chat_route)]
    assert 0 < first <= chat_total, "a stream's first chunk comes before its end"
    buckets = [labels for (n, labels) in found if n == "qworker_gateway_request_seconds_bucket"]
    assert {dict(labels)["model"] for labels in buckets} == {MODEL}
