"""Wire protocol v1: a job as it arrives on `<prefix>:jobs`, the events of `<prefix>:out:<id>`, and
every key name. Pure pydantic: no torch, no engine, no Redis client (producers import only this).

On the wire every value is a string: numbers in decimal, booleans `true` / `false`, lists and
objects as JSON. `parse_job_fields` turns one stream entry into a validated `Job`, `Job.to_fields`
does the reverse; `event_to_fields` / `parse_event` do the same for output events.
"""

from __future__ import annotations

import json
import math
import re
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Annotated, Any, Literal, Union

from pydantic import (
    BaseModel,
    ConfigDict,
    Field,
    TypeAdapter,
    ValidationError,
    field_validator,
    model_validator,
)

PROTOCOL_VERSION = 1

ID_PATTERN = r"^[A-Za-z0-9._:-]{1,128}$"
_ID_RE = re.compile(ID_PATTERN)
# A model name becomes part of a key (`<prefix>:jobs:{<model>}`): no braces (the hash tag), no glob
# characters, no spaces; room for Hugging Face names, paths and the simulated engine's options.
MODEL_PATTERN = r"^[A-Za-z0-9._:/@+=,-]{1,256}$"
_MODEL_RE = re.compile(MODEL_PATTERN)
# A tenant names whose share of the fleet a job is (docs/protocol.md, "Tenants"); it becomes part
# of Redis hash fields and sorted-set members: a bounded, safe charset, no spaces.
TENANT_PATTERN = r"^[A-Za-z0-9._-]{1,64}$"
_TENANT_RE = re.compile(TENANT_PATTERN)
DEFAULT_TENANT = "default"
# A session names a conversation (or any jobs that share a prompt prefix): a job of a session is
# offered first to the worker that ran the session's last job (docs/protocol.md, "Sessions and
# prefix affinity"). It becomes a hash field and part of sorted-set members: no spaces.
SESSION_PATTERN = r"^[A-Za-z0-9._:-]{1,128}$"
_SESSION_RE = re.compile(SESSION_PATTERN)
# the consumer the fair read parks new entries as (pending in the group, delivered to no worker)
PARKED_CONSUMER = "~ready"
# the consumer an entry offered to its session's worker is pending to while the offer lasts
OFFERED_CONSUMER = "~offered"
QUOTAS_FIELD = ":quotas"  # in `<prefix>:tenants`: some tenant has a tokens-per-minute quota

# Input bounds: every job is bounded before it reaches the engine.
MAX_PROMPT_CHARS = 1_000_000  # `prompt`, and the sum of all `messages` contents
MAX_PROMPT_TOKEN_IDS = 131_072  # `prompt_token_ids`
MAX_MESSAGES = 1_024
MAX_TOKENS_CAP = 32_768  # bound of `max_tokens` and `min_tokens`
MAX_TOKEN_ID = 2**31 - 1
MAX_STOP_STRINGS = 8
MAX_STOP_CHARS = 256
MAX_STOP_TOKEN_IDS = 64
MAX_SEED = 2**63 - 1
MAX_PRIORITY = 1_000_000
MAX_DEADLINE_MS = 2**53  # far beyond any real unix time in ms; keeps JSON numbers exact
MAX_WAIT_MS = 30 * 24 * 3600 * 1000  # `delay_ms`, `start_within_ms`, `timeout_ms`: 30 days
MAX_RESULT_TTL_S = 30 * 24 * 3600  # `result_ttl_s` (a worker caps it at its --max-result-ttl)
MAX_CACHE_SALT_CHARS = 256
MAX_STRUCTURED_CHARS = 65_536  # a `structured_outputs` schema (as compact JSON), regex or grammar
MAX_CHOICES = 256  # strings of `structured_outputs.choice`
MAX_CHOICE_CHARS = 1_024
MAX_LOGPROBS = 20  # alternatives per position of `logprobs` / `prompt_logprobs`
MAX_TOOLS = 128  # functions of `tools`
MAX_TOOL_CALLS = 128  # calls of one assistant message
MAX_TOOL_NAME = r"^[A-Za-z0-9_.-]{1,64}$"  # OpenAI's function names (and dots)
MAX_TOOL_CALL_ID_CHARS = 256
MAX_REASONING_TOKENS = MAX_TOKENS_CAP
MAX_FIELD_BYTES = 4 * 1024 * 1024  # one wire value, before any parsing
MAX_FIELDS = 64  # fields of one entry

DEFAULT_PREFIX = "qw"
# how long a minute of throughput counters (`Keys.throughput`) is kept: the last hour and a bit
THROUGHPUT_TTL_S = 3_900
DEFAULT_GROUP = "workers"

# Error codes of `ErrorEvent.code` (the set is open: clients must accept unknown codes).
INVALID_REQUEST = "invalid_request"
PROMPT_TOO_LONG = "prompt_too_long"
EXPIRED = "expired"
INTERNAL = "internal"
TOO_MANY_DELIVERIES = "too_many_deliveries"  # poison job: delivered more than max_deliveries times
LOST_STATE = "lost_state"  # the job's state vanished from Redis (wiped, restarted empty, trimmed)

# Fields a worker adds to a `<prefix>:dead` entry in front of the original fields. An original
# field whose name collides with one of them is kept as `original.<name>`.
DEAD_META_FIELDS = ("reason", "code", "source", "source_id", "worker")

FinishReason = Literal["stop", "length", "cancelled", "timeout", "tool_calls"]

# one stream entry's fields, as read with or without decode_responses, or as written
WireFields = Mapping[str, str] | Mapping[bytes, bytes] | Mapping[bytes | str, bytes | str]


class JobValidationError(ValueError):
    """A job entry that cannot be run.

    `job_id` is set when the entry has a usable id (the `id` field when valid, else the entry id
    when there is no `id` field), so an error event can go out."""

    def __init__(self, message: str, job_id: str | None, code: str = INVALID_REQUEST) -> None:
        super().__init__(message)
        self.message = message
        self.job_id = job_id
        self.code = code


def is_valid_id(value: str) -> bool:
    # fullmatch: `$` alone would also match before a trailing newline ("job\n")
    return bool(_ID_RE.fullmatch(value))


def is_valid_model(value: str) -> bool:
    return bool(_MODEL_RE.fullmatch(value))


def is_valid_tenant(value: str) -> bool:
    return bool(_TENANT_RE.fullmatch(value))


def is_valid_session(value: str) -> bool:
    return bool(_SESSION_RE.fullmatch(value))


# ----------------------------------------------------------------------------- job


class FunctionCall(BaseModel):
    model_config = ConfigDict(extra="forbid", strict=True, frozen=True)

    name: Annotated[str, Field(pattern=MAX_TOOL_NAME)]
    arguments: Annotated[str, Field(max_length=MAX_PROMPT_CHARS,
                                    description="the arguments as JSON text")]


class ToolCall(BaseModel):
    """A call the model made (OpenAI's shape): in an assistant message, and on `done`."""

    model_config = ConfigDict(extra="forbid", strict=True, frozen=True)

    id: Annotated[str, Field(min_length=1, max_length=MAX_TOOL_CALL_ID_CHARS)]
    type: Literal["function"] = "function"
    function: FunctionCall


class ChatMessage(BaseModel):
    """A chat turn. An assistant turn may hold `tool_calls` (its `content` then may be null); a
    `tool` turn is a call's result, naming the call by `tool_call_id`."""

    model_config = ConfigDict(extra="forbid", strict=True)

    role: Literal["system", "user", "assistant", "tool"]
    content: Annotated[str | None, Field(max_length=MAX_PROMPT_CHARS)] = None
    tool_calls: Annotated[list[ToolCall] | None, Field(
        min_length=1, max_length=MAX_TOOL_CALLS, description="assistant only")] = None
    tool_call_id: Annotated[str | None, Field(
        min_length=1, max_length=MAX_TOOL_CALL_ID_CHARS, description="tool only")] = None

    @model_validator(mode="after")
    def _check(self) -> ChatMessage:
        if self.tool_calls is not None and self.role != "assistant":
            raise ValueError("only an assistant message may hold tool_calls")
        if self.content is None and self.tool_calls is None:
            raise ValueError("content may be null only in an assistant message with tool_calls")
        if self.tool_call_id is not None and self.role != "tool":
            raise ValueError("only a tool message has a tool_call_id")
        return self


class FunctionTool(BaseModel):
    model_config = ConfigDict(extra="forbid", strict=True, frozen=True)

    name: Annotated[str, Field(pattern=MAX_TOOL_NAME)]
    description: Annotated[str | None, Field(max_length=MAX_CHOICE_CHARS * 8)] = None
    parameters: Annotated[dict[str, Any] | None, Field(
        description="a JSON Schema of the arguments (an object)")] = None
    strict: bool | None = None

    @model_validator(mode="after")
    def _check(self) -> FunctionTool:
        size = len(json.dumps(self.parameters or {}, separators=(",", ":")))
        if size > MAX_STRUCTURED_CHARS:
            raise ValueError(f"the parameters schema of {self.name} is longer than "
                             f"{MAX_STRUCTURED_CHARS} characters ({size})")
        return self


class Tool(BaseModel):
    """An OpenAI function tool."""

    model_config = ConfigDict(extra="forbid", strict=True, frozen=True)

    type: Literal["function"]
    function: FunctionTool


class NamedFunction(BaseModel):
    model_config = ConfigDict(extra="forbid", strict=True, frozen=True)

    name: Annotated[str, Field(pattern=MAX_TOOL_NAME)]


class NamedToolChoice(BaseModel):
    """`tool_choice` naming the one function to call."""

    model_config = ConfigDict(extra="forbid", strict=True, frozen=True)

    type: Literal["function"]
    function: NamedFunction


ToolChoice = Literal["none", "auto", "required"] | NamedToolChoice
ReasoningEffort = Literal["low", "medium", "high"]


_STRUCTURED_KINDS = ("json", "json_object", "regex", "choice", "grammar")
ChoiceString = Annotated[str, Field(min_length=1, max_length=MAX_CHOICE_CHARS)]


class StructuredOutputs(BaseModel):
    """Output constrained to exactly one of: a JSON Schema, any JSON object, a regular
    expression, one of a list of strings, a Lark grammar (or GBNF: a grammar with `::=`).
    Whether a schema, regex or grammar compiles is checked by the worker when it takes the job
    (`invalid_request` if not)."""

    model_config = ConfigDict(extra="forbid", strict=True, frozen=True, populate_by_name=True)

    json_schema: Annotated[dict[str, Any] | None, Field(
        alias="json", description="a JSON Schema (an object); the output is compact JSON")] = None
    json_object: Annotated[Literal[True] | None, Field(description="any JSON object")] = None
    regex: Annotated[str | None, Field(min_length=1, max_length=MAX_STRUCTURED_CHARS)] = None
    choice: Annotated[list[ChoiceString] | None, Field(min_length=1, max_length=MAX_CHOICES)
                      ] = None
    grammar: Annotated[str | None, Field(
        min_length=1, max_length=MAX_STRUCTURED_CHARS, description="Lark, or GBNF")] = None

    @model_validator(mode="after")
    def _check(self) -> StructuredOutputs:
        given = [kind for kind, value in zip(_STRUCTURED_KINDS, self._values(), strict=True)
                 if value is not None]
        if len(given) != 1:
            got = ", ".join(given) if given else "none"
            raise ValueError(f"exactly one of {', '.join(_STRUCTURED_KINDS)} is required "
                             f"(got {got})")
        if self.json_schema is not None:
            size = len(json.dumps(self.json_schema, separators=(",", ":")))
            if size > MAX_STRUCTURED_CHARS:
                raise ValueError(f"the JSON Schema is longer than {MAX_STRUCTURED_CHARS} "
                                 f"characters ({size})")
        return self

    def _values(self) -> tuple[Any, ...]:
        return (self.json_schema, self.json_object, self.regex, self.choice, self.grammar)


_PROMPT_FIELDS = ("prompt", "messages", "prompt_token_ids")
TokenId = Annotated[int, Field(ge=0, le=MAX_TOKEN_ID)]
StopString = Annotated[str, Field(min_length=1, max_length=MAX_STOP_CHARS)]


class Job(BaseModel):
    """One generation job. Exactly one of `prompt`, `messages`, `prompt_token_ids`."""

    model_config = ConfigDict(extra="forbid", strict=True, frozen=True)

    id: Annotated[str | None, Field(pattern=ID_PATTERN, description="default: the entry id")] = None
    model: Annotated[str | None, Field(pattern=MODEL_PATTERN, description=(
        "the model to run it; its stream is `<prefix>:jobs:{<model>}`"))] = None
    tenant: Annotated[str | None, Field(pattern=TENANT_PATTERN, description=(
        "whose share of the fleet it runs in (fair share, quotas, usage); unset: `default`"))
    ] = None
    session: Annotated[str | None, Field(pattern=SESSION_PATTERN, description=(
        "a conversation (or jobs sharing a prompt prefix): offered first, for a few tens of ms, "
        "to the worker that ran the session's last job, whose prefix cache holds it"))] = None
    prompt: Annotated[str | None, Field(min_length=1, max_length=MAX_PROMPT_CHARS)] = None
    messages: Annotated[
        list[ChatMessage] | None,
        Field(min_length=1, max_length=MAX_MESSAGES, description="rendered with the chat template"),
    ] = None
    prompt_token_ids: Annotated[
        list[TokenId] | None, Field(min_length=1, max_length=MAX_PROMPT_TOKEN_IDS)
    ] = None
    max_tokens: Annotated[int, Field(ge=1, le=MAX_TOKENS_CAP)] = 256
    # unset (None): the model's default (docs/protocol.md, "Sampling defaults")
    temperature: Annotated[float | None, Field(ge=0.0, le=5.0, description=(
        "0: greedy; unset: the model's default, else 1.0"))] = None
    top_p: Annotated[float | None, Field(gt=0.0, le=1.0, description=(
        "unset: the model's default, else 1.0"))] = None
    top_k: Annotated[int | None, Field(ge=0, le=1_000_000, description=(
        "0: off; unset: the model's default, else 0"))] = None
    min_p: Annotated[float | None, Field(ge=0.0, le=1.0, description=(
        "unset: the model's default, else 0.0"))] = None
    seed: Annotated[int | None, Field(ge=0, le=MAX_SEED)] = None
    stop: Annotated[list[StopString], Field(max_length=MAX_STOP_STRINGS)] = []
    stop_token_ids: Annotated[list[TokenId], Field(max_length=MAX_STOP_TOKEN_IDS)] = []
    ignore_eos: bool = False
    min_tokens: Annotated[int, Field(ge=0, le=MAX_TOKENS_CAP)] = 0
    repetition_penalty: Annotated[float | None, Field(gt=0.0, le=10.0, description=(
        "unset: the model's default, else 1.0"))] = None
    presence_penalty: Annotated[float, Field(ge=-2.0, le=2.0)] = 0.0
    frequency_penalty: Annotated[float, Field(ge=-2.0, le=2.0)] = 0.0
    priority: Annotated[
        int, Field(ge=-MAX_PRIORITY, le=MAX_PRIORITY, description="lower runs first")
    ] = 0
    deadline_ms: Annotated[int | None, Field(ge=0, le=MAX_DEADLINE_MS, description=(
        "absolute start deadline, unix time in ms: not started by then, it ends with error "
        "expired"))] = None
    start_within_ms: Annotated[int | None, Field(ge=0, le=MAX_WAIT_MS, description=(
        "relative start deadline: not started within this many ms of its queueing (a delayed "
        "job: of its due time), it ends with error expired"))] = None
    delay_ms: Annotated[int | None, Field(ge=0, le=MAX_WAIT_MS, description=(
        "a delayed job: it runs no sooner than this many ms after it was queued"))] = None
    not_before_ms: Annotated[int | None, Field(ge=0, le=MAX_DEADLINE_MS, description=(
        "a delayed job: it runs no sooner than this unix time in ms"))] = None
    timeout_ms: Annotated[int | None, Field(ge=1, le=MAX_WAIT_MS, description=(
        "run-time limit, from when a worker first started it: past it, it ends with "
        "finish_reason timeout and its text so far"))] = None
    result_ttl_s: Annotated[int | None, Field(ge=1, le=MAX_RESULT_TTL_S, description=(
        "seconds its output lives after its last event (default, and at most: the worker's "
        "--result-ttl, --max-result-ttl)"))] = None
    cache_salt: Annotated[str | None, Field(
        min_length=1, max_length=MAX_CACHE_SALT_CHARS,
        description="prefix caching: only jobs with the same salt share cached prompt blocks")
    ] = None
    structured_outputs: Annotated[StructuredOutputs | None, Field(
        description="constrain the output: exactly one of json, json_object, regex, choice, "
                    "grammar")] = None
    logprobs: Annotated[int | None, Field(ge=0, le=MAX_LOGPROBS, description=(
        "each token event carries its logprob, and with k > 0 its top k alternatives"))] = None
    prompt_logprobs: Annotated[int | None, Field(ge=0, le=MAX_LOGPROBS, description=(
        "a prompt_logprobs event before the first token: the prompt tokens' logprobs (top k)"))
    ] = None
    logprobs_text: Annotated[bool, Field(description=(
        "each logprob entry also carries its token's own text (`token`)"))] = False
    tools: Annotated[list[Tool] | None, Field(min_length=1, max_length=MAX_TOOLS, description=(
        "function tools, rendered with the chat; the done event carries the calls made"))] = None
    tool_choice: Annotated[ToolChoice | None, Field(description=(
        "none | auto (default) | required | {\"type\": \"function\", \"function\": "
        "{\"name\": ...}}"))] = None
    parallel_tool_calls: Annotated[bool | None, Field(description=(
        "several calls in one turn (default true)"))] = None
    max_reasoning_tokens: Annotated[int | None, Field(ge=0, le=MAX_REASONING_TOKENS, description=(
        "a thinking model's budget: past it, the end of thinking is forced"))] = None
    reasoning_effort: Annotated[ReasoningEffort | None, Field(description=(
        "a thinking budget: low 512, medium 2048, high 8192 tokens (max_reasoning_tokens "
        "wins)"))] = None
    speculate: Annotated[bool, Field(description=(
        "false: never decoded speculatively, on a worker that speculates (the tokens are the "
        "same either way)"))] = True

    @model_validator(mode="after")
    def _check(self) -> Job:
        given = [n for n in _PROMPT_FIELDS if getattr(self, n) is not None]
        if len(given) != 1:
            got = ", ".join(given) if given else "none"
            raise ValueError(f"exactly one of {', '.join(_PROMPT_FIELDS)} is required (got {got})")
        chars = sum(len(m.content or "") + sum(len(c.function.arguments)
                                               for c in m.tool_calls or ())
                    for m in self.messages or ())
        if chars > MAX_PROMPT_CHARS:
            raise ValueError(f"messages hold more than {MAX_PROMPT_CHARS} characters")
        if self.tools is not None and self.messages is None:
            raise ValueError("tools go with `messages` (a chat), not a plain prompt")
        if (self.tool_choice is not None or self.parallel_tool_calls is not None
                ) and self.tools is None:
            raise ValueError("tool_choice and parallel_tool_calls need tools")
        named = self.tool_choice
        if isinstance(named, NamedToolChoice) and self.tools is not None and not any(
                t.function.name == named.function.name for t in self.tools):
            raise ValueError(f"tool_choice names {named.function.name!r}, which is not in tools")
        if self.tools is not None and self.structured_outputs is not None:
            raise ValueError("tools cannot go with structured_outputs")
        if self.min_tokens > self.max_tokens:
            raise ValueError("min_tokens must be <= max_tokens")
        for name in ("temperature", "top_p", "min_p", "repetition_penalty", "presence_penalty",
                     "frequency_penalty"):
            value = getattr(self, name)
            if value is not None and not math.isfinite(value):
                raise ValueError(f"{name} must be finite")
        return self

    @property
    def tenant_or_default(self) -> str:
        return self.tenant or DEFAULT_TENANT

    def to_fields(self) -> dict[str, str]:
        """The XADD fields of this job: only fields that were set, each encoded as a string."""
        out: dict[str, str] = {}
        for name in type(self).model_fields:
            value = getattr(self, name)
            if name not in self.model_fields_set:
                continue
            if value is None:
                continue
            out[name] = encode_value(value)
        return out


# Wire kind of each job field: how its string is decoded before validation.
_JOB_WIRE_KINDS: dict[str, str] = {
    "cache_salt": "str",
    "id": "str", "model": "str", "tenant": "str", "session": "str", "prompt": "str",
    "messages": "json",
    "prompt_token_ids": "json",
    "max_tokens": "int", "temperature": "float", "top_p": "float", "top_k": "int",
    "min_p": "float", "seed": "int", "stop": "json", "stop_token_ids": "json",
    "ignore_eos": "bool", "min_tokens": "int", "repetition_penalty": "float",
    "presence_penalty": "float", "frequency_penalty": "float", "priority": "int",
    "deadline_ms": "int", "start_within_ms": "int", "delay_ms": "int", "not_before_ms": "int",
    "timeout_ms": "int", "result_ttl_s": "int", "structured_outputs": "json",
    "logprobs": "int", "prompt_logprobs": "int", "logprobs_text": "bool",
    "tools": "json", "tool_choice": "word_or_json", "parallel_tool_calls": "bool",
    "max_reasoning_tokens": "int", "reasoning_effort": "str",
    "speculate": "bool",
}
_TOOL_CHOICE_WORDS = ("none", "auto", "required")
assert set(_JOB_WIRE_KINDS) == set(Job.model_fields)

_INT_RE = re.compile(r"^-?[0-9]{1,20}$")
_FLOAT_RE = re.compile(r"^-?([0-9]{1,20}(\.[0-9]{0,20})?|\.[0-9]{1,20})([eE][-+]?[0-9]{1,3})?$")


def encode_value(value: Any) -> str:
    """One Python value as a wire string (decimal numbers, true/false, JSON for lists/objects)."""
    if isinstance(value, bool):
        return "true" if value else "false"
    if isinstance(value, (int, float, str)):
        return str(value) if not isinstance(value, float) else repr(value)
    if isinstance(value, BaseModel):
        return json.dumps(value.model_dump(by_alias=True, exclude_none=True), ensure_ascii=False,
                          separators=(",", ":"))
    if isinstance(value, dict):  # an object field given as a plain dict (structured_outputs)
        return json.dumps(value, ensure_ascii=False, separators=(",", ":"))
    if isinstance(value, (list, tuple)):
        items = [v.model_dump(exclude_none=True) if isinstance(v, BaseModel) else v
                 for v in value]
        return json.dumps(items, ensure_ascii=False, separators=(",", ":"))
    raise TypeError(f"cannot encode {type(value).__name__}")


def _reject_constant(name: str) -> Any:
    raise ValueError(f"{name} is not valid JSON")


def _decode_value(name: str, kind: str, raw: str) -> Any:
    if kind == "str":
        return raw
    if kind == "int":
        if not _INT_RE.match(raw):
            raise ValueError(f"field {name!r}: expected a decimal integer, got {_preview(raw)}")
        return int(raw)
    if kind == "float":
        if not _FLOAT_RE.match(raw):
            raise ValueError(f"field {name!r}: expected a decimal number, got {_preview(raw)}")
        return float(raw)
    if kind == "word_or_json" and raw in _TOOL_CHOICE_WORDS:
        return raw
    if kind == "bool":
        if raw not in ("true", "false"):
            raise ValueError(f"field {name!r}: expected true or false, got {_preview(raw)}")
        return raw == "true"
    try:
        return json.loads(raw, parse_constant=_reject_constant)
    except (ValueError, RecursionError) as exc:
        raise ValueError(f"field {name!r}: invalid JSON ({exc})") from None


def _preview(raw: str, limit: int = 40) -> str:
    return repr(raw if len(raw) <= limit else raw[:limit] + "...")


def _to_str(value: bytes | str, what: str) -> str:
    if isinstance(value, str):
        return value
    try:
        return value.decode("utf-8")
    except UnicodeDecodeError:
        raise ValueError(f"{what} is not valid UTF-8") from None


def _usable_id(fields: WireFields, entry_id: str) -> str | None:
    """The id an error event can go to, before (or without) full validation."""
    raw = None
    for key, value in fields.items():
        if key in ("id", b"id"):
            raw = value
            break
    else:
        return entry_id if is_valid_id(entry_id) else None
    try:
        text = _to_str(raw, "id")
    except ValueError:
        return None
    return text if is_valid_id(text) else None


def parse_job_fields(fields: WireFields, entry_id: str) -> Job:
    """Decode and validate the fields of one `<prefix>:jobs` entry.

    Raises `JobValidationError` (with the usable job id, if any) on anything wrong: unknown or
    non-UTF-8 field names or values, malformed numbers / booleans / JSON, wrong types, values out of
    range, missing or double prompt, a bad id.
    """
    job_id = _usable_id(fields, entry_id)
    try:
        if len(fields) > MAX_FIELDS:
            raise ValueError(f"too many fields ({len(fields)} > {MAX_FIELDS})")
        data: dict[str, Any] = {}
        for raw_key, raw_value in fields.items():
            key = _to_str(raw_key, "a field name")
            kind = _JOB_WIRE_KINDS.get(key)
            if kind is None:
                raise ValueError(f"unknown field {_preview(key)}")
            if len(raw_value) > MAX_FIELD_BYTES:
                raise ValueError(f"field {key!r} is longer than {MAX_FIELD_BYTES} bytes")
            data[key] = _decode_value(key, kind, _to_str(raw_value, f"field {key!r}"))
        data.setdefault("id", entry_id)
        return Job.model_validate(data)
    except ValidationError as exc:
        raise JobValidationError(_validation_message(exc), job_id) from None
    except ValueError as exc:
        raise JobValidationError(str(exc), job_id) from None


def _validation_message(exc: ValidationError) -> str:
    parts = []
    for err in exc.errors()[:5]:
        loc = ".".join(str(p) for p in err["loc"])
        msg = err["msg"].removeprefix("Value error, ")
        parts.append(f"{loc}: {msg}" if loc else msg)
    more = exc.error_count() - len(parts)
    return "; ".join(parts) + (f" (+{more} more)" if more > 0 else "")


# ----------------------------------------------------------------------------- events


class _Event(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True)


class TopLogprob(_Event):
    """One token's log-probability (natural log, from the model's raw logits)."""

    token_id: Annotated[int, Field(ge=0)]
    logprob: float
    token: Annotated[str | None, Field(description="its own text (with logprobs_text)")] = None


class TokenLogprob(TopLogprob):
    """A token's logprob given the tokens before it, and the top k there (a prompt token's in a
    prompt_logprobs event; a generated one's in a client's Result)."""

    top_logprobs: Annotated[list[TopLogprob] | None, Field(description="best first")] = None


def _json_list(value: Any) -> Any:
    """On the wire a list is JSON text."""
    return json.loads(value, parse_constant=_reject_constant) if isinstance(value, str) else value


class TokenEvent(_Event):
    """One generated token. The `text` of all token events joined is exactly the final text."""

    type: Literal["token"] = "token"
    i: Annotated[int, Field(ge=0, description="index of the generated token, from 0")]
    token_id: Annotated[int, Field(ge=0)]
    text: Annotated[str, Field(description="new text; may be empty while text is held back")] = ""
    logprob: Annotated[float | None, Field(description="with logprobs: this token's")] = None
    top_logprobs: Annotated[list[TopLogprob] | None, Field(
        description="with logprobs k > 0: the k most likely tokens here, best first")] = None
    token: Annotated[str | None, Field(
        description="with logprobs_text: this token's own text")] = None
    reasoning: Annotated[str | None, Field(
        description="a thinking model's new thinking text (apart from the answer's `text`)")
    ] = None
    tool_calls: Annotated[list[dict[str, Any]] | None, Field(description=(
        "with tools: calls as OpenAI streams them (delta.tool_calls): a call's first delta has "
        "index, id, type and function.name with empty arguments, then its arguments in pieces"))
    ] = None

    _lists = field_validator("top_logprobs", "tool_calls", mode="before")(_json_list)


class PromptLogprobsEvent(_Event):
    """With prompt_logprobs: written once, just before the first token event."""

    type: Literal["prompt_logprobs"] = "prompt_logprobs"
    prompt_logprobs: Annotated[list[TokenLogprob], Field(
        description="one per prompt token from the second on, in order")]

    _lists = field_validator("prompt_logprobs", mode="before")(_json_list)


class DoneEvent(_Event):
    """The job finished. Times are in ms, counted from when the job was first queued."""

    type: Literal["done"] = "done"
    finish_reason: FinishReason
    text: Annotated[str, Field(description="the whole final text (the answer: no thinking, no "
                                           "tool-call markup)")]
    prompt_tokens: Annotated[int, Field(ge=0)]
    completion_tokens: Annotated[int, Field(ge=0)]
    queue_ms: Annotated[int, Field(ge=0, description="queued until first taken by a worker")] = 0
    ttft_ms: Annotated[int, Field(ge=0, description="queued until the first token")] = 0
    total_ms: Annotated[int, Field(ge=0, description="queued until done")] = 0
    tool_calls: Annotated[list[ToolCall] | None, Field(description=(
        "with tools: the calls made, arguments as JSON text (finish_reason tool_calls)"))] = None
    reasoning: Annotated[str | None, Field(
        description="a thinking model's whole thinking text, when it thought")] = None

    _lists = field_validator("tool_calls", mode="before")(_json_list)


class ErrorEvent(_Event):
    """The job failed or could not be run; no event follows."""

    type: Literal["error"] = "error"
    code: Annotated[str, Field(description="invalid_request | prompt_too_long | expired | "
                                           "too_many_deliveries | lost_state | internal | ...")]
    message: str


Event = Annotated[Union[TokenEvent, DoneEvent, ErrorEvent, PromptLogprobsEvent],  # noqa: UP007
                  Field(discriminator="type")]
AnyEvent = TokenEvent | DoneEvent | ErrorEvent | PromptLogprobsEvent
_EVENT_ADAPTER: TypeAdapter[AnyEvent] = TypeAdapter(Event)
TERMINAL_TYPES = ("done", "error")


def event_to_fields(event: AnyEvent) -> dict[str, str]:
    """The XADD fields of an event, `type` first; every value a string (fields left unset, None,
    are not written)."""
    fields: dict[str, str] = {"type": event.type}
    for name in type(event).model_fields:
        value = getattr(event, name)
        if name != "type" and value is not None:
            fields[name] = encode_value(value)
    return fields


def parse_event(fields: WireFields) -> AnyEvent:
    """Decode one `<prefix>:out:<id>` entry (as read with or without decode_responses)."""
    data = {_to_str(k, "a field name"): _to_str(v, "a field value") for k, v in fields.items()}
    return _EVENT_ADAPTER.validate_python(data)


# ----------------------------------------------------------------------------- keys

# Priority bands, most urgent first: a job's band is the sign of its priority (`band_of`). Each band
# has its own work streams (`Keys.jobs_of`, `Keys.requeue_of`); workers read them in this order, so
# a worker with room takes the most urgent waiting job. The normal band ("") has v1's streams.
BANDS = ("high", "", "low")


def band_of(priority: int) -> str:
    """The band of a job's priority: `high` below 0, `low` above, normal ("") at 0."""
    return "high" if priority < 0 else "low" if priority > 0 else ""


def band_of_fields(fields: Mapping[str, str]) -> str:
    """The band of a job's wire fields (normal where `priority` is missing or not a number: the
    worker refuses such a job wherever it is)."""
    try:
        return band_of(int(fields.get("priority") or 0))
    except ValueError:
        return ""


class ModelNeededError(ValueError):
    """A job's keys asked for without its model, on a Redis Cluster (where they live in the
    model's hash slot)."""


@dataclass(frozen=True)
class Keys:
    """Every Redis key of the protocol, under one prefix: nothing is written outside it.

    `slot`, on a Redis Cluster: the model whose hash slot holds every key of this view. Each key
    that a script may touch with others then carries the hash tag `{<model>}` after its kind
    (`qw:out:{M}:<id>`, `qw:tenants:{M}`; the work streams have it anyway), and there are no
    model-less streams (docs/protocol.md, "Redis Cluster"). None: one Redis, keys as in v1."""

    prefix: str = DEFAULT_PREFIX
    slot: str | None = None

    def __post_init__(self) -> None:
        if self.slot is not None:
            _checked_model(self.slot)

    def in_slot(self, model: str | None) -> Keys:
        """The same keys in `model`'s hash slot (a Cluster's view of one model's keys)."""
        if model is None:
            raise ModelNeededError("on a Redis Cluster every job names its model (its keys live "
                                   "in that model's hash slot)")
        return Keys(self.prefix, model)

    def _key(self, kind: str, rest: str | None = None) -> str:
        """`<prefix>:<kind>`, then `:{<slot>}` on a Cluster, then `:<rest>`."""
        key = f"{self.prefix}:{kind}"
        if self.slot is not None:
            key += f":{{{self.slot}}}"
        return key if rest is None else f"{key}:{rest}"

    @property
    def jobs(self) -> str:
        return f"{self.prefix}:jobs"

    @property
    def requeue(self) -> str:
        return f"{self.prefix}:requeue"

    @property
    def dead(self) -> str:
        return self._key("dead")

    @property
    def recent(self) -> str:
        """The jobs workers ended lately, newest last (`RecentJob`; capped, see `qworker jobs`)."""
        return f"{self.prefix}:recent"

    @property
    def kv_events(self) -> str:
        """The workers' KV events, a stream trimmed to about `--kv-events-maxlen` entries: one
        entry per batch of one worker's cache changes (docs/protocol.md, "KV events";
        qworker_client/kv_events.py reads it)."""
        return f"{self.prefix}:kv_events"

    @property
    def tenants(self) -> str:
        """The tenants' weights and quotas, a hash: tenant -> `weight tokens_per_minute
        concurrent_jobs` (0: no limit); absent: weight 1, no limits (written by the gateway from
        its keys file, or by hand)."""
        return self._key("tenants")

    def tpm(self, minute: int) -> str:
        """Tokens (prompt + completion) each tenant's jobs made in one minute (unix time // 60),
        a hash: tenant -> tokens; counted by the workers as the tokens are written, kept 2 min."""
        return self._key("tpm", str(minute))

    @property
    def running(self) -> str:
        """The jobs the fair read handed out under quotas and not yet ended, a sorted set of
        members `<tenant>\\0<stream>\\0<entry id>` (score 0): a tenant's concurrent jobs."""
        return self._key("running")

    def usage(self, day: str) -> str:
        """One UTC day's usage (`YYYY-MM-DD`), a hash: `<tenant>|<model>|<counter>` -> count
        (counters: jobs, prompt_tokens, completion_tokens, errors; model `-`: none)."""
        return f"{self.prefix}:usage:{day}"
    def throughput(self, minute: int | str) -> str:
        """One minute's counters (unix minute): tokens and jobs ended per model and per worker,
        written by the workers with each ended job, kept `THROUGHPUT_TTL_S` (the dashboard)."""
        return f"{self.prefix}:tput:{minute}"

    def out(self, job_id: str) -> str:
        return self._key("out", job_id)

    def cancel(self, job_id: str) -> str:
        return self._key("cancel", job_id)

    def submitted(self, job_id: str) -> str:
        """Submit marker (the first entry id, TTL result_ttl): a job id is queued only once."""
        return self._key("sub", job_id)

    def owner(self, job_id: str) -> str:
        """Hash of the job's current owner (fencing token) and first-queued / started times."""
        return self._key("owner", job_id)

    def worker(self, name: str) -> str:
        """A live worker's key (JSON `WorkerInfo`, with a TTL the worker keeps renewing)."""
        return self._key("worker", name)

    @property
    def worker_pattern(self) -> str:
        """SCAN pattern matching every live worker's key (on a Cluster, from a view with no
        slot: every model's)."""
        return self.worker("*")

    def worker_name(self, key: str) -> str:
        """The worker named by a key that `worker_pattern` matched (its slot's tag dropped)."""
        name = key.removeprefix(f"{self.prefix}:worker:")
        if name.startswith("{") and "}:" in name:
            name = name[name.index("}:") + 2:]
        return name

    @property
    def offers(self) -> str:
        """Entries offered to their session's worker, a sorted set: `<worker> <stream> <entry
        id>` -> the offer's expiry (unix ms)."""
        return self._key("offers")

    @property
    def readers(self) -> str:
        """The workers that read with room lately, a sorted set: name -> its last read (unix ms):
        who may be offered a session's job."""
        return self._key("readers")

    def affinity_of(self, stream: str) -> str:
        """The sessions of a work stream's model (or of the model-less streams), a hash: session
        -> the worker that took its last job; `<prefix>:affinity[:{<model>}]`."""
        return self._model_key("affinity", self.stream_model(stream))

    def affinity_seen_of(self, stream: str) -> str:
        """When each session of `affinity_of(stream)` last had a job taken, a sorted set: session
        -> unix ms (old records are dropped by it)."""
        return self._model_key("affinity_seen", self.stream_model(stream))

    def _model_key(self, name: str, model: str | None) -> str:
        return f"{self.prefix}:{name}" + ("" if model is None else f":{{{model}}}")

    def alone(self, token: str) -> str:
        """The job the worker with fencing token `token` runs alone right now (see
        docs/operating.md, "Poison jobs"; the worker's `scripts.alone_key`)."""
        return self._key("alone", token)

    def lease(self, token: str) -> str:
        """The append lease of the worker with fencing token `token` (a string with a TTL): the
        value the worker's last append set, so its next append knows that nothing it wrote was
        lost or rolled back since (see docs/protocol.md, "Fencing once a step")."""
        return self._key("lease", token)

    @property
    def takeovers(self) -> str:
        """How many times a job was taken from another worker (an integer): any take makes
        every worker check its jobs' owners on its next append."""
        return self._key("takeovers")

    def batch(self, batch_id: str) -> str:
        """The batch runner's hash of the jobs one batch submitted (job id -> entry id)."""
        return self._key("batch", batch_id)

    def gateway_job(self, job_id: str) -> str:
        """The gateway's record of a job it submitted (JSON: its response's shape, its owner)."""
        return self._key("gw", job_id)

    def response(self, response_id: str) -> str:
        """The gateway's record of a Responses API response (JSON: its request, input, chain
        and, once ended, its output)."""
        return f"{self.prefix}:resp:{response_id}"

    def delayed_of(self, model: str | None) -> str:
        """The delayed jobs of a model (none: model-less), a sorted set: job id -> due unix ms
        (`<prefix>:delayed`, `<prefix>:delayed:{<model>}`, in the model's hash slot)."""
        return _work_stream(f"{self.prefix}:delayed", model, "")

    def delayed_jobs_of(self, model: str | None) -> str:
        """The delayed jobs' fields, a hash: job id -> JSON [band, field, value, ...]
        (`<prefix>:delayed:jobs`, `<prefix>:delayed:jobs:{<model>}`)."""
        return _work_stream(f"{self.prefix}:delayed:jobs", model, "")

    @property
    def delayed_pattern(self) -> str:
        """SCAN pattern matching every model's delayed set (and its jobs' hash)."""
        return f"{self.prefix}:delayed:*"

    def jobs_of(self, model: str | None, band: str = "") -> str:
        """The stream a job goes to: `<prefix>:jobs`, or `<prefix>:jobs:{<model>}` for a job that
        names its model (the `{...}` hash tag keeps a model's keys in one Cluster slot); in the
        high or low band `<prefix>:jobs:high`, `<prefix>:jobs:high:{<model>}`, ..."""
        return _work_stream(self.jobs, model, band)

    def requeue_of(self, model: str | None, band: str = "") -> str:
        """Where a started job goes back to: `<prefix>:requeue`, or `<prefix>:requeue:{<model>}`
        (in the high or low band `<prefix>:requeue:high`, `<prefix>:requeue:high:{<model>}`)."""
        return _work_stream(self.requeue, model, band)

    def ready_of(self, stream: str) -> str:
        """A job stream's new entries in fair order (a sorted set: `<entry id> <tenant>` -> start
        tag), `<prefix>:ready` + the stream's suffix (`<prefix>:ready:high:{<model>}`): in its
        model's hash slot."""
        return self._fair_key(stream, "ready")

    def vtime_of(self, stream: str) -> str:
        """A job stream's virtual times (a hash: tenant -> its finish tag, `:v` -> the stream's),
        `<prefix>:vtime` + the stream's suffix."""
        return self._fair_key(stream, "vtime")

    def held_of(self, stream: str) -> str:
        """A job stream's entries held over their tenant's quota (a sorted set like the ready
        one), `<prefix>:held` + the stream's suffix."""
        return self._fair_key(stream, "held")

    def _fair_key(self, stream: str, name: str) -> str:
        if stream != self.jobs and not stream.startswith(self.jobs + ":"):
            raise ValueError(f"{stream!r} is not a job stream")
        return f"{self.prefix}:{name}{stream[len(self.jobs):]}"

    def stream_model(self, stream: str) -> str | None:
        """The model of a work stream (None: a model-less one)."""
        for base in (self.jobs, self.requeue):
            for band in BANDS:
                head = _work_stream(base, None, band) + ":{"
                if stream.startswith(head) and "}" in stream[len(head):]:
                    return stream[len(head):stream.index("}", len(head))]
        return None

    def stream_band(self, stream: str) -> str:
        """The priority band of a work stream."""
        for base in (self.jobs, self.requeue):
            for band in BANDS[::2]:
                key = _work_stream(base, None, band)
                if stream == key or stream.startswith(key + ":{"):
                    return band
        return ""

    def is_requeue(self, stream: str) -> bool:
        return stream == self.requeue or stream.startswith(self.requeue + ":")

    @property
    def streams(self) -> tuple[str, ...]:
        """The model-less streams in the order workers read them (see `streams_for`)."""
        return self.streams_for(None)

    def streams_for(self, model: str | None) -> tuple[str, ...]:
        """The streams a worker serving `model` reads, in order: band by band, most urgent
        first (BANDS), and in each band requeued work first (its model's, then model-less), then
        new jobs (its model's, then model-less)."""
        return tuple(key for band in BANDS for key in self.band_streams(model, band))

    def band_streams(self, model: str | None, band: str) -> tuple[str, ...]:
        """One band's streams that a worker serving `model` reads, in order."""
        if model is None:
            return (self.requeue_of(None, band), self.jobs_of(None, band))
        if self.slot is not None:  # a Cluster has no model-less streams
            return (self.requeue_of(model, band), self.jobs_of(model, band))
        return (self.requeue_of(model, band), self.requeue_of(None, band),
                self.jobs_of(model, band), self.jobs_of(None, band))

    @property
    def model_stream_patterns(self) -> tuple[str, str]:
        """SCAN patterns matching every per-model stream (new jobs, requeued work), and every
        stream of the high and low bands."""
        return (f"{self.jobs}:*", f"{self.requeue}:*")


class RecentJob(BaseModel):
    """An entry of `<prefix>:recent`: a job a worker ended, written with its terminal event."""

    model_config = ConfigDict(extra="allow")

    id: str
    model: Annotated[str, Field(description="the stream's model; empty: a model-less job")] = ""
    tenant: Annotated[str, Field(description="the job's tenant")] = DEFAULT_TENANT
    status: Literal["done", "error"]
    reason: Annotated[str, Field(description="the finish reason (done) or the error code")]
    tokens: Annotated[int, Field(ge=0, description="tokens generated")] = 0
    worker: Annotated[str, Field(description="the worker that ended it")] = ""

    def to_fields(self) -> dict[str, str]:
        return {name: encode_value(value) for name, value in self.model_dump().items()}


class WorkerInfo(BaseModel):
    """Value of a live worker's key."""

    model_config = ConfigDict(extra="allow")

    name: str
    host: str
    pid: int
    model: str
    group: str
    started_ms: int
    running: int = 0
    free_slots: int = 0
    draining: bool = False
    native: str = ""  # the native CPU kernels' level, or "missing: <why>"
    served_model_name: str = ""  # the name clients ask for (`--served-model-name`; "": `model`)
    chat: bool | None = None  # whether its model has a chat template (None: an older worker)
    version: str = ""  # the worker's package version ("": an older worker)
    kv_used: float | None = None  # the share of its KV cache blocks in use (None: not known)
    liveness_ms: int = 0  # the key's TTL at each beat (0: not known): how old its last beat is


def _work_stream(base: str, model: str | None, band: str) -> str:
    if band not in BANDS:
        raise ValueError(f"unknown priority band {band!r} (want one of {BANDS})")
    key = f"{base}:{band}" if band else base
    return key if model is None else f"{key}:{{{_checked_model(model)}}}"


def _checked_model(model: str) -> str:
    if not is_valid_model(model):
        raise ValueError(f"invalid model name {model!r} (want {MODEL_PATTERN})")
    return model


def entry_ms(entry_id: str) -> int | None:
    """Milliseconds part of a stream entry id, or None when it is not one."""
    head, _, _ = entry_id.partition("-")
    return int(head) if head.isdigit() else None


_ENTRY_ID_RE = re.compile(r"([0-9]{1,20})-([0-9]{1,20})")
_U64_MAX = 2**64 - 1


def parse_entry_id(text: str) -> tuple[int, int] | None:
    """A stream entry id `<ms>-<seq>` as (ms, seq), in the order Redis sorts ids; None when Redis
    would refuse it: both parts ASCII digits (`str.isdigit` takes "²" too) and unsigned 64-bit.
    An id checked here cannot fail a read of several streams at once (the gateway's hub)."""
    match = _ENTRY_ID_RE.fullmatch(text)
    if match is None:
        return None
    ms, seq = int(match[1]), int(match[2])
    return (ms, seq) if ms <= _U64_MAX and seq <= _U64_MAX else None


def json_schemas() -> dict[str, dict[str, Any]]:
    """JSON Schema of a job and of each output event (and of any event, discriminated by type)."""
    return {
        "job": Job.model_json_schema(),
        "token": TokenEvent.model_json_schema(),
        "done": DoneEvent.model_json_schema(),
        "error": ErrorEvent.model_json_schema(),
        "prompt_logprobs": PromptLogprobsEvent.model_json_schema(),
        "event": _EVENT_ADAPTER.json_schema(),
        "worker": WorkerInfo.model_json_schema(),
        "recent": RecentJob.model_json_schema(),
    }


__all__ = [
    "DEAD_META_FIELDS", "DEFAULT_GROUP", "DEFAULT_PREFIX", "DEFAULT_TENANT", "EXPIRED",
    "ID_PATTERN", "INTERNAL", "OFFERED_CONSUMER", "PARKED_CONSUMER", "SESSION_PATTERN",
    "TENANT_PATTERN",
    "INVALID_REQUEST", "LOST_STATE", "MAX_LOGPROBS", "MODEL_PATTERN", "PROMPT_TOO_LONG",
    "PROTOCOL_VERSION", "TERMINAL_TYPES", "TOO_MANY_DELIVERIES", "AnyEvent", "ChatMessage",
    "DoneEvent", "ErrorEvent", "FunctionCall", "FunctionTool", "NamedToolChoice", "Tool",
    "ModelNeededError", "ToolCall", "ToolChoice",
    "Event", "FinishReason", "Job", "JobValidationError", "Keys", "PromptLogprobsEvent",
    "RecentJob",
    "TokenEvent", "TokenLogprob", "TopLogprob", "WorkerInfo", "encode_value", "entry_ms",
    "event_to_fields", "is_valid_id", "is_valid_model", "is_valid_session", "is_valid_tenant",
    "json_schemas",
    "parse_entry_id",
    "parse_event", "parse_job_fields",
]
