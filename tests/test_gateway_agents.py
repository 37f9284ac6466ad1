"""The OpenAI Agents SDK (`openai-agents`) runs an agent with two function tools to completion
through the gateway, over a real worker (the simulated engine: its byte model writes whatever the
call grammar allows) and a real redis-server: once through its chat completions model and once
through its Responses model (`/v1/responses`). Tool
choice is forced on the first turn; the SDK resets it to auto after a call, as it does for every
model. The tools take enums: the byte model's free strings would run to max_tokens; and its free
answer ends (`eos_every`), since the Responses model takes a response cut at max_output_tokens
(`incomplete`) for a failure."""

from __future__ import annotations

import asyncio
from collections.abc import Callable
from typing import Literal

import pytest
from agents import (
    Agent,
    Model,
    ModelSettings,
    OpenAIChatCompletionsModel,
    OpenAIResponsesModel,
    Runner,
    function_tool,
    set_tracing_disabled,
)
from openai import AsyncOpenAI

from tests.gateway_harness import gateway, live_worker
from tests.service_harness import sim_engine

MODELS: dict[str, Callable[[AsyncOpenAI], Model]] = {
    "chat completions": lambda client: OpenAIChatCompletionsModel(model="sim",
                                                                  openai_client=client),
    "responses": lambda client: OpenAIResponsesModel(model="sim", openai_client=client),
}


@pytest.mark.parametrize("api", sorted(MODELS))
def test_an_agent_with_two_tools_runs_to_completion(redis_url: str, api: str) -> None:
    called: list[tuple[str, str]] = []

    @function_tool
    def get_weather(city: Literal["Paris", "Rome"]) -> str:
        """The weather of a city."""
        called.append(("get_weather", city))
        return f"sunny in {city}"

    @function_tool
    def get_time(timezone: Literal["UTC", "CET"]) -> str:
        """The time in a timezone."""
        called.append(("get_time", timezone))
        return "12:00"

    async def run(url: str) -> object:
        client = AsyncOpenAI(base_url=f"{url}/v1", api_key="unused", max_retries=0, timeout=60)
        agent = Agent(name="helper", instructions="Use the tools.",
                      model=MODELS[api](client), tools=[get_weather, get_time],
                      model_settings=ModelSettings(tool_choice="required", max_tokens=300,
                                                   parallel_tool_calls=False))
        result = await Runner.run(agent, "What is the weather in Paris?", max_turns=4)
        await client.close()
        return result.final_output

    set_tracing_disabled(True)  # no network here: the SDK would export its traces
    engine = sim_engine("sim:step_ms=2,eos_every=40")
    with live_worker(redis_url, f"gw-agents-{api[0]}", engine), gateway(redis_url) as url:
        final = asyncio.run(run(url))
    assert called and called[0][0] in ("get_weather", "get_time")  # the SDK ran the tool
    assert called[0][1] in ("Paris", "Rome", "UTC", "CET")
    # and the run finished (Runner.run raises otherwise); the simulated model's answer may be
    # empty where its bytes hit EOS at once
    assert isinstance(final, str)

