"""pydantic-ai's agent does a tool call through the gateway's chat completions and answers with
its result, over a real worker (the simulated engine, as in test_gateway_agents.py: the tool takes
an enum, and the free answer ends with `eos_every`) and a real redis-server. pydantic-ai needs
Python 3.11 (the project runs on 3.10, where the test extra leaves it out)."""

from __future__ import annotations

import sys
from collections.abc import Callable
from dataclasses import dataclass
from typing import Literal

import pytest

if sys.version_info < (3, 11):
    pytest.skip("pydantic-ai needs Python 3.11", allow_module_level=True)

from pydantic_ai import Agent, ModelRequest, ModelResponse, RunContext, ToolReturnPart  # noqa: E402
from pydantic_ai.capabilities import AbstractCapability  # noqa: E402
from pydantic_ai.models.openai import OpenAIChatModel  # noqa: E402
from pydantic_ai.providers.openai import OpenAIProvider  # noqa: E402
from pydantic_ai.settings import ModelSettings  # noqa: E402

from tests.gateway_harness import gateway, live_worker  # noqa: E402
from tests.service_harness import sim_engine  # noqa: E402


@dataclass
class FirstStepCallsTheTool(AbstractCapability[None]):
    """pydantic-ai refuses a static forced tool choice (it would never let the run end): force
    the named tool on the first request only, as its docs advise."""

    tool: str

    def get_model_settings(self) -> Callable[[RunContext[None]], ModelSettings]:
        return lambda ctx: ModelSettings(
            tool_choice=[self.tool] if ctx.run_step <= 1 else "auto")


def test_a_pydantic_ai_agent_calls_a_tool_and_answers_with_its_result(redis_url: str) -> None:
    called: list[str] = []

    def get_weather(city: Literal["Paris", "Rome"]) -> str:
        """The weather of a city."""
        called.append(city)
        return f"sunny in {city}"

    engine = sim_engine("sim:step_ms=2,eos_every=40")
    with live_worker(redis_url, "gw-pydantic-ai", engine), gateway(redis_url) as url:
        model = OpenAIChatModel("sim", provider=OpenAIProvider(base_url=f"{url}/v1",
                                                               api_key="unused"))
        agent = Agent(model, tools=[get_weather], instructions="Use the tool.",
                      capabilities=[FirstStepCallsTheTool("get_weather")],
                      model_settings=ModelSettings(max_tokens=300, parallel_tool_calls=False))
        result = agent.run_sync("What is the weather in Paris?")
    assert len(called) == 1 and called[0] in ("Paris", "Rome")  # the tool ran, with a valid arg
    messages = result.all_messages()
    returns = [p for m in messages if isinstance(m, ModelRequest) for p in m.parts
               if isinstance(p, ToolReturnPart)]
    assert [r.content for r in returns] == [f"sunny in {called[0]}"]
    # the result went back to the model (the request after the call), which answered in text
    assert isinstance(messages[-1], ModelResponse) and isinstance(result.output, str)
    assert result.output and messages[-1].finish_reason == "stop"
