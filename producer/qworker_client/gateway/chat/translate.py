"""An OpenAI request body as qworker jobs: one job per choice, in the wire fields of the protocol.

Validation of the fields' values is the protocol's own (at submit); here only the shape of the
OpenAI request is checked, and what qworker cannot do yet is refused with a clear 400.
"""

from __future__ import annotations

import uuid
from dataclasses import dataclass
from typing import Any, Literal

from qworker_client.gateway.chat.session import session_of
from qworker_client.gateway.chat.structured import structured_outputs
from qworker_client.gateway.errors import bad_request
from qworker_client.protocol import MAX_LOGPROBS

Kind = Literal["chat", "completion"]

# OpenAI / vLLM body field -> wire field, taken as they are.
_PLAIN_FIELDS = (
    "temperature", "top_p", "presence_penalty", "frequency_penalty",
    "top_k", "min_p", "repetition_penalty", "min_tokens", "ignore_eos", "stop_token_ids",
    "cache_salt",  # vLLM's: only requests of the same salt share cached prefix blocks
    "speculate",  # qworker's: false opts out of speculative decoding (same tokens either way)
)
_ROLES = {"developer": "system"}  # OpenAI's newer name for the system role


@dataclass(frozen=True)
class Choice:
    """One job: choice `index` of the response, for prompt `prompt_index`."""

    index: int
    prompt_index: int
    job_id: str
    spec: dict[str, Any]  # the job's fields, for `submit_many`


@dataclass(frozen=True)
class GatewayRequest:
    kind: Kind
    response_id: str
    model: str
    choices: list[Choice]
    stream: bool
    include_usage: bool
    detach: bool
    logprobs: bool = False  # choices carry OpenAI's logprobs


def translate(kind: Kind, body: Any, max_n: int, max_prompts: int | None = None,
              max_jobs: int | None = None) -> GatewayRequest:
    """`max_prompts`, `max_jobs` (prompts times `n`): None is no bound."""
    if not isinstance(body, dict):
        raise bad_request("the request body must be a JSON object")
    model = body.get("model")
    if not isinstance(model, str) or not model:
        raise bad_request("`model` is required", param="model")
    _refuse_unsupported(body)
    prompts = _chat_prompt(body) if kind == "chat" else _completion_prompts(body, max_prompts)
    n = _int_field(body, "n", 1, 1, max_n)
    if max_jobs is not None and len(prompts) * n > max_jobs:
        raise bad_request(f"a request may ask for at most {max_jobs} choices (prompts times "
                          f"`n`), not {len(prompts) * n}", param="n" if n > 1 else "prompt")
    response_id = f"{'chatcmpl' if kind == 'chat' else 'cmpl'}-{uuid.uuid4().hex}"
    logprobs = _logprobs(kind, body)
    params = _with_logprobs(_params(body), logprobs)
    params["session"] = session_of(body, prompts[0].get("messages") if kind == "chat" else None)
    choices = []
    for p, prompt in enumerate(prompts):
        for k in range(n):
            index = p * n + k
            job_id = response_id if len(prompts) * n == 1 else f"{response_id}.{index}"
            seed = None if params.get("seed") is None else params["seed"] + k
            spec = {**params, **prompt, "seed": seed, "id": job_id, "model": model}
            choices.append(Choice(index, p, job_id, spec))
    options = body.get("stream_options") or {}
    if not isinstance(options, dict):
        raise bad_request("`stream_options` must be an object", param="stream_options")
    return GatewayRequest(
        kind=kind, response_id=response_id, model=model, choices=choices,
        stream=bool(body.get("stream")), include_usage=bool(options.get("include_usage")),
        detach=bool(body.get("detach")), logprobs=logprobs is not None,
    )


def _params(body: dict[str, Any]) -> dict[str, Any]:
    params = {name: body.get(name) for name in _PLAIN_FIELDS}
    params["max_tokens"] = body.get("max_completion_tokens", body.get("max_tokens"))
    stop = body.get("stop")
    params["stop"] = [stop] if isinstance(stop, str) else stop
    seed = body.get("seed")
    if seed is not None and (not isinstance(seed, int) or isinstance(seed, bool) or seed < 0):
        raise bad_request("`seed` must be a non-negative integer", param="seed")
    params["seed"] = seed
    params["structured_outputs"] = structured_outputs(body)
    params |= _tools(body)
    effort = body.get("reasoning_effort")
    if effort is not None and effort not in ("low", "medium", "high"):
        raise bad_request("`reasoning_effort` must be low, medium or high",
                          param="reasoning_effort")
    params["reasoning_effort"] = effort
    params["max_reasoning_tokens"] = body.get("max_reasoning_tokens")  # vLLM-style extra
    return params


def _tools(body: dict[str, Any]) -> dict[str, Any]:
    """`tools`, `tool_choice`, `parallel_tool_calls` as the job's fields (the protocol checks
    their values; here the shape: only function tools). Without tools, `tool_choice` none or
    auto is what it would be anyway, as OpenAI takes it."""
    tools = body.get("tools")
    choice = body.get("tool_choice")
    parallel = body.get("parallel_tool_calls")
    if not tools:
        if choice not in (None, "none", "auto"):
            raise bad_request("`tool_choice` needs `tools`", param="tool_choice")
        return {}
    if not isinstance(tools, list) or not all(
            isinstance(t, dict) and t.get("type") == "function" for t in tools):
        raise bad_request("`tools` must be a list of function tools", param="tools")
    if choice is not None and not isinstance(choice, (str, dict)):
        raise bad_request("`tool_choice` must be none, auto, required or a named function",
                          param="tool_choice")
    if parallel is not None and not isinstance(parallel, bool):
        raise bad_request("`parallel_tool_calls` must be a boolean", param="parallel_tool_calls")
    return {"tools": tools, "tool_choice": choice, "parallel_tool_calls": parallel}


def _with_logprobs(params: dict[str, Any], k: int | None) -> dict[str, Any]:
    """Logprobs with each token's text: the gateway has no tokenizer."""
    return params if k is None else {**params, "logprobs": k, "logprobs_text": True}


def _logprobs(kind: Kind, body: dict[str, Any]) -> int | None:
    """The job's `logprobs` (top k) from chat's `logprobs: true` + `top_logprobs: k`, or
    completions' `logprobs: k`; None: not asked."""
    if kind == "completion":
        if body.get("logprobs") is None:
            return None
        return _int_field(body, "logprobs", 0, 0, MAX_LOGPROBS)
    asked = body.get("logprobs")
    if asked is not None and not isinstance(asked, bool):
        raise bad_request("`logprobs` must be a boolean", param="logprobs")
    if body.get("top_logprobs") is not None and not asked:
        raise bad_request("`top_logprobs` needs `logprobs: true`", param="top_logprobs")
    return _int_field(body, "top_logprobs", 0, 0, MAX_LOGPROBS) if asked else None


def _refuse_unsupported(body: dict[str, Any]) -> None:
    for name in ("functions", "logit_bias", "suffix"):
        if body.get(name):
            raise bad_request(f"`{name}` is not supported", param=name)
    if body.get("echo"):
        raise bad_request("`echo` is not supported", param="echo")
    if (body.get("best_of") or 1) != 1:
        raise bad_request("`best_of` is not supported", param="best_of")


def _int_field(body: dict[str, Any], name: str, default: int, low: int, high: int) -> int:
    value = body.get(name)
    if value is None:
        return default
    if not isinstance(value, int) or isinstance(value, bool) or not low <= value <= high:
        raise bad_request(f"`{name}` must be an integer from {low} to {high}", param=name)
    return value


def _chat_prompt(body: dict[str, Any]) -> list[dict[str, Any]]:
    messages = body.get("messages")
    if not isinstance(messages, list) or not messages:
        raise bad_request("`messages` must be a non-empty list", param="messages")
    return [{"messages": [_message(m, i) for i, m in enumerate(messages)]}]


def _message(message: Any, i: int) -> dict[str, Any]:
    param = f"messages[{i}]"
    if not isinstance(message, dict) or not isinstance(message.get("role"), str):
        raise bad_request("a message must be an object with a `role`", param=param)
    given: str = message["role"]
    role = _ROLES.get(given, given)
    calls = message.get("tool_calls") if role == "assistant" else None
    content = message.get("content")
    out: dict[str, Any] = {"role": role, "content": (
        None if content is None and calls else _content(content, f"{param}.content"))}
    if calls:
        if not isinstance(calls, list):
            raise bad_request("`tool_calls` must be a list", param=f"{param}.tool_calls")
        out["tool_calls"] = [_call(c, f"{param}.tool_calls[{k}]") for k, c in enumerate(calls)]
    if role == "tool":
        out["tool_call_id"] = message.get("tool_call_id")
    return out


def _call(call: Any, param: str) -> dict[str, Any]:
    """An earlier call as the history sends it back: id, type, function name and arguments."""
    function = call.get("function") if isinstance(call, dict) else None
    if not isinstance(function, dict):
        raise bad_request("a tool call needs a `function` object", param=param)
    return {"id": call.get("id"), "type": call.get("type", "function"),
            "function": {"name": function.get("name"), "arguments": function.get("arguments")}}


def _content(content: Any, param: str) -> str:
    if isinstance(content, str):
        return content
    if not isinstance(content, list):
        raise bad_request("`content` must be a string or a list of text parts", param=param)
    texts = []
    for part in content:
        if not isinstance(part, dict) or part.get("type") != "text":
            raise bad_request("only text content parts are supported", param=param)
        if not isinstance(part.get("text"), str):
            raise bad_request("a text part needs a string `text`", param=param)
        texts.append(part["text"])
    return "".join(texts)


def _completion_prompts(body: dict[str, Any], max_prompts: int | None) -> list[dict[str, Any]]:
    """`prompt`: a string, a list of strings, a list of token ids or a list of such lists (at
    most `max_prompts` of them)."""
    prompt = body.get("prompt")
    if isinstance(prompt, str):
        return [{"prompt": prompt}]
    if isinstance(prompt, list) and prompt:
        if max_prompts is not None and len(prompt) > max_prompts and not _is_token_ids(prompt):
            raise bad_request(f"`prompt` may hold at most {max_prompts} prompts, not "
                              f"{len(prompt)}", param="prompt")
        if all(isinstance(p, str) for p in prompt):
            return [{"prompt": p} for p in prompt]
        if all(_is_token_ids(p) for p in prompt):
            return [{"prompt_token_ids": p} for p in prompt]
        if _is_token_ids(prompt):
            return [{"prompt_token_ids": prompt}]
    raise bad_request("`prompt` must be a string, a list of strings, a list of token ids or a "
                      "list of lists of token ids", param="prompt")


def _is_token_ids(value: Any) -> bool:
    return (isinstance(value, list) and bool(value)
            and all(isinstance(t, int) and not isinstance(t, bool) for t in value))
