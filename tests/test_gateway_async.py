"""The gateway through the official `openai` SDK's asyncio client: concurrent requests, streamed
and not, each the same text; and the gateway's metrics while and after they run."""

from __future__ import annotations

import asyncio

import httpx2
from openai import AsyncOpenAI

from tests.gateway_harness import gateway, live_worker

MODEL = "sim"


async def _both(client: AsyncOpenAI, seed: int) -> tuple[str, str]:
    messages = [{"role": "user", "content": f"async {seed}"}]
    whole = await client.chat.completions.create(model=MODEL, messages=messages, max_tokens=24,
                                                 seed=seed)
    stream = await client.chat.completions.create(model=MODEL, messages=messages,
                                                  max_tokens=24, seed=seed, stream=True)
    text = "".join([c.choices[0].delta.content or "" async for c in stream])
    return whole.choices[0].message.content or "", text


async def _run(base_url: str) -> list[tuple[str, str]]:
    async with AsyncOpenAI(base_url=f"{base_url}/v1", api_key="unused", max_retries=0) as client:
        return await asyncio.gather(*(_both(client, seed) for seed in range(8)))


def test_concurrent_async_requests_streamed_and_not(redis_url: str) -> None:
    with live_worker(redis_url, "gw-async"), gateway(redis_url) as url:
        pairs = asyncio.run(_run(url))
        metrics = httpx2.get(f"{url}/metrics").text
    assert all(whole == streamed and len(whole) == 24 for whole, streamed in pairs), pairs
    assert len({whole for whole, _ in pairs}) == 8  # each seed its own text
    assert 'qworker_gateway_requests_total{route="/v1/chat/completions"} 16.0' in metrics
    assert 'qworker_gateway_responses_total{status="200"}' in metrics
    assert "qworker_gateway_streams_open 0.0" in metrics
    assert "qworker_gateway_streamed_tokens_total 192.0" in metrics  # 8 streams of 24
