"""Protocol v1 unit tests: job parsing and encoding, events, keys, schemas."""

from __future__ import annotations

import json

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from qworker_client.protocol import (
    ID_PATTERN,
    DoneEvent,
    ErrorEvent,
    Job,
    JobValidationError,
    Keys,
    TokenEvent,
    entry_ms,
    event_to_fields,
    json_schemas,
    parse_event,
    parse_job_fields,
)


def _wire(fields: dict[str, str]) -> dict[bytes, bytes]:
    return {k.encode(): v.encode() for k, v in fields.items()}


def test_minimal_job_defaults_and_entry_id() -> None:
    job = parse_job_fields(_wire({"prompt": "hi"}), "1700000000000-0")
    assert job.id == "1700000000000-0"
    assert (job.max_tokens, job.temperature, job.top_p, job.stop, job.seed) == (
        256, None, None, [], None)  # sampling left unset: the model's defaults, at the worker


def test_every_field_decodes() -> None:
    fields = {
        "id": "a.b:c-1_2", "messages": json.dumps([{"role": "user", "content": "x"}]),
        "max_tokens": "10", "temperature": "0.5", "top_p": "0.9", "top_k": "40",
        "min_p": "0.05", "seed": str(2**63 - 1), "stop": '["\\n", "END"]',
        "stop_token_ids": "[2, 3]", "ignore_eos": "true", "min_tokens": "2",
        "repetition_penalty": "1.1", "presence_penalty": "-0.5", "frequency_penalty": "2",
        "priority": "-3", "deadline_ms": "1700000000000",
    }
    job = parse_job_fields(_wire(fields), "1-0")
    assert job.messages[0].content == "x" and job.stop == ["\n", "END"]
    assert job.seed == 2**63 - 1 and job.ignore_eos is True and job.priority == -3
    assert parse_job_fields(job.to_fields(), "9-9") == job


@pytest.mark.parametrize("fields, fragment", [
    ({}, "exactly one of"),
    ({"prompt": "a", "prompt_token_ids": "[1]"}, "got prompt, prompt_token_ids"),
    ({"prompt": "a", "max_tokens": "1e3"}, "decimal integer"),
    ({"prompt": "a", "temperature": "Infinity"}, "decimal number"),
    ({"prompt": "a", "ignore_eos": "True"}, "true or false"),
    ({"prompt": "a", "stop": "[x"}, "invalid JSON"),
    ({"prompt": "a", "stop_token_ids": "[NaN]"}, "invalid JSON"),
    ({"prompt": "a", "extra": "1"}, "unknown field"),
    ({"prompt": "a", "max_tokens": "40000"}, "max_tokens"),
    ({"prompt_token_ids": "[true]"}, "prompt_token_ids.0"),
    ({"prompt": "a", "id": "x" * 129}, "id"),
])
def test_invalid_jobs_name_the_problem(fields: dict[str, str], fragment: str) -> None:
    with pytest.raises(JobValidationError) as info:
        parse_job_fields(_wire(fields), "5-0")
    assert fragment in info.value.message
    assert info.value.code == "invalid_request"


def test_usable_id_of_invalid_jobs() -> None:
    def job_id(fields: dict[bytes, bytes]) -> str | None:
        with pytest.raises(JobValidationError) as info:
            parse_job_fields(fields, "7-0")
        return info.value.job_id

    assert job_id({b"x": b"1"}) == "7-0"  # no id field: the entry id
    assert job_id({b"id": b"mine", b"x": b"1"}) == "mine"
    assert job_id({b"id": b"not mine!", b"prompt": b"a"}) is None
    assert job_id({b"id": b"\xff", b"prompt": b"a"}) is None


def test_non_utf8_is_rejected() -> None:
    with pytest.raises(JobValidationError, match="UTF-8"):
        parse_job_fields({b"prompt": b"\xc3\x28"}, "1-0")
    with pytest.raises(JobValidationError, match="UTF-8"):
        parse_job_fields({b"\xc3\x28": b"x", b"prompt": b"a"}, "1-0")


job_strategy = st.builds(
    Job,
    id=st.from_regex(ID_PATTERN, fullmatch=True),
    prompt=st.text(min_size=1, max_size=50),
    max_tokens=st.integers(1, 32768),
    temperature=st.floats(0, 5, allow_nan=False),
    top_p=st.floats(0.001, 1),
    top_k=st.integers(0, 1000),
    seed=st.none() | st.integers(0, 2**63 - 1),
    stop=st.lists(st.text(min_size=1, max_size=10), max_size=8),
    ignore_eos=st.booleans(),
    presence_penalty=st.floats(-2, 2),
    deadline_ms=st.none() | st.integers(0, 2**53),
)


@settings(max_examples=150, deadline=None)
@given(job_strategy)
def test_job_round_trips_through_the_wire(job: Job) -> None:
    fields = job.to_fields()
    assert all(isinstance(v, str) for v in fields.values())
    assert parse_job_fields(_wire(fields), "1-0") == job


@settings(max_examples=100, deadline=None)
@given(st.dictionaries(st.binary(max_size=12), st.binary(max_size=40), max_size=6))
def test_arbitrary_fields_parse_or_raise_job_validation_error(fields: dict) -> None:
    try:
        parse_job_fields(fields, "3-0")
    except JobValidationError as exc:
        assert exc.message


@pytest.mark.parametrize("event", [
    TokenEvent(i=3, token_id=42, text="é"),
    TokenEvent(i=0, token_id=1, text=""),
    DoneEvent(finish_reason="length", text="abc", prompt_tokens=4, completion_tokens=3,
              queue_ms=1, ttft_ms=5, total_ms=9),
    ErrorEvent(code="expired", message="too late"),
])
def test_events_round_trip(event: TokenEvent | DoneEvent | ErrorEvent) -> None:
    fields = event_to_fields(event)
    assert list(fields)[0] == "type" and all(isinstance(v, str) for v in fields.values())
    assert parse_event(_wire(fields)) == event
    assert parse_event(fields) == event


def test_keys_stay_under_the_prefix() -> None:
    keys = Keys("tenant1:qw")
    names = [keys.jobs, keys.requeue, keys.dead, keys.out("a"), keys.cancel("a"),
             keys.owner("a"), keys.worker("w"), keys.worker_pattern]
    assert all(n.startswith("tenant1:qw:") for n in names)
    assert keys.streams[2:4] == ("tenant1:qw:requeue", "tenant1:qw:jobs")
    assert all(s.startswith("tenant1:qw:") for s in keys.streams)
    assert Keys().out("x") == "qw:out:x"


def test_json_schemas_are_plain_json() -> None:
    schemas = json.loads(json.dumps(json_schemas()))
    assert {"job", "token", "done", "error", "event"} <= set(schemas)
    job = schemas["job"]
    assert job["additionalProperties"] is False
    assert job["properties"]["max_tokens"]["maximum"] == 32768


def test_entry_ms() -> None:
    assert entry_ms("1700000000123-4") == 1700000000123
    assert entry_ms("nope") is None
