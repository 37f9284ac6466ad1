"""A job's sampling fields as the engine's `SamplingParams`, by name."""

from __future__ import annotations

import hashlib
import json
from collections.abc import Mapping

from qworker.engine.request import Prompt, SamplingParams, StructuredOutputs, ToolCalling
from qworker.engine.request import sampling_params as engine_sampling_params
from qworker_client.protocol import Job, NamedToolChoice
from qworker_client.protocol import StructuredOutputs as WireStructuredOutputs

# the fields of a job that say what to run and when, not how to sample: every other field of a
# Job is the SamplingParams field of the same name (tests/test_settings.py holds them equal)
JOB_NOT_SAMPLING = frozenset({"id", "model", "tenant", "session", "cache_salt", "prompt",
                              "messages", "prompt_token_ids", "priority", "logprobs_text",
                              "deadline_ms", "start_within_ms", "delay_ms", "not_before_ms",
                              "timeout_ms", "result_ttl_s", "tools", "tool_choice",
                              "parallel_tool_calls", "max_reasoning_tokens", "reasoning_effort"})


def default_seed(job_id: str) -> int:
    """A job without a seed still samples reproducibly, so a resumed run continues exactly."""
    return int.from_bytes(hashlib.sha256(job_id.encode()).digest()[:8], "big") >> 1


def sampling_params(job: Job, job_id: str,
                    model_defaults: Mapping[str, float | int] | None = None) -> SamplingParams:
    """The job's sampling fields by name (lists as tuples); a job without a seed gets its own;
    what it leaves unset (temperature, top_p, top_k, min_p, repetition_penalty) is the model's
    default (`model_defaults`, the engine's `sampling_defaults`), else the engine's own."""
    values = {name: getattr(job, name) for name in Job.model_fields
              if name not in JOB_NOT_SAMPLING}
    values = {name: tuple(v) if isinstance(v, list) else v for name, v in values.items()}
    if values["seed"] is None:
        values["seed"] = default_seed(job_id)
    values["structured_outputs"] = structured_outputs(job.structured_outputs)
    return engine_sampling_params(values, model_defaults or {})


def structured_outputs(wire: WireStructuredOutputs | None) -> StructuredOutputs | None:
    """The engine's form of a job's constraint (a schema as JSON text, choices as a tuple)."""
    if wire is None:
        return None
    schema = json.dumps(wire.json_schema) if wire.json_schema is not None else None
    choice = tuple(wire.choice) if wire.choice is not None else None
    return StructuredOutputs(json=schema, json_object=bool(wire.json_object), regex=wire.regex,
                             choice=choice, grammar=wire.grammar)


# `reasoning_effort` as a thinking budget in tokens (docs/protocol.md "Reasoning")
EFFORT_BUDGETS = {"low": 512, "medium": 2048, "high": 8192}


def prompt_of(job: Job) -> Prompt:
    """What the engine's front door encodes: the job's text, chat (with its tools) or ids."""
    if job.prompt_token_ids is not None:
        return Prompt(token_ids=tuple(job.prompt_token_ids))
    if job.messages is None:
        return Prompt(text=job.prompt or "")
    tools = () if job.tools is None or job.tool_choice == "none" else tuple(
        t.model_dump(exclude_none=True) for t in job.tools)
    return Prompt(messages=tuple(m.model_dump(exclude_none=True) for m in job.messages),
                  tools=tools)


def tool_calling(job: Job) -> ToolCalling | None:
    """The job's tools as the engine parses (and constrains) their calls; None: no tools."""
    if job.tools is None:
        return None
    choice = job.tool_choice
    name = choice.function.name if isinstance(choice, NamedToolChoice) else choice or "auto"
    functions = tuple(t.function.model_dump(exclude_none=True) for t in job.tools)
    return ToolCalling(functions, name, job.parallel_tool_calls is not False)


def reasoning_budget(job: Job) -> int | None:
    if job.max_reasoning_tokens is not None:
        return job.max_reasoning_tokens
    return EFFORT_BUDGETS[job.reasoning_effort] if job.reasoning_effort is not None else None
