"""Structured output through the gateway with the official `openai` SDK: OpenAI's
`response_format`, vLLM's `structured_outputs` and legacy `guided_*` reach the job's
`structured_outputs`; the worker (simulated, real redis-server) keeps the text in the grammar."""

from __future__ import annotations

import json
import re
from collections.abc import Iterator
from typing import Any

import openai
import pytest
from openai import OpenAI

from qworker_client.gateway.chat.structured import structured_outputs
from qworker_client.gateway.errors import APIError
from tests.gateway_harness import gateway, live_worker

MODEL = "sim"
SCHEMA = {"type": "object", "properties": {"ok": {"type": "boolean"}, "n": {"enum": [1, 2]}},
          "required": ["ok", "n"], "additionalProperties": False}
USER = [{"role": "user", "content": "hi"}]


@pytest.fixture
def client(redis_url: str) -> Iterator[OpenAI]:
    with live_worker(redis_url, "gw-structured"), gateway(redis_url) as url, \
            OpenAI(base_url=f"{url}/v1", api_key="unused", max_retries=0) as sdk:
        yield sdk


def test_each_form_of_constraint_reaches_the_worker(client: OpenAI) -> None:
    r = client.chat.completions.create(
        model=MODEL, messages=USER, max_tokens=40, seed=1,  # type: ignore[arg-type]
        response_format={"type": "json_schema",
                         "json_schema": {"name": "reply", "schema": SCHEMA, "strict": True}})
    assert set(json.loads(r.choices[0].message.content or "")) == {"ok", "n"}
    r = client.chat.completions.create(
        model=MODEL, messages=USER, max_tokens=10,  # type: ignore[arg-type]
        extra_body={"structured_outputs": {"choice": ["yes", "no"]}})
    assert r.choices[0].message.content in ("yes", "no")
    assert r.choices[0].finish_reason == "stop"
    c = client.completions.create(model=MODEL, prompt="id:", max_tokens=10,
                                  extra_body={"guided_regex": "[a-f]{4}"})
    assert re.fullmatch("[a-f]{4}", c.choices[0].text), c.choices[0].text


def test_an_invalid_schema_is_an_error_not_a_text(client: OpenAI) -> None:
    with pytest.raises(openai.BadRequestError) as caught:
        client.chat.completions.create(
            model=MODEL, messages=USER, max_tokens=5,  # type: ignore[arg-type]
            response_format={"type": "json_schema",
                             "json_schema": {"name": "x", "schema": {"type": "objekt"}}})
    assert "structured_outputs" in str(caught.value)


@pytest.mark.parametrize(("body", "want"), [
    ({}, None),
    ({"response_format": {"type": "text"}}, None),
    ({"response_format": {"type": "json_object"}}, {"json_object": True}),
    ({"response_format": {"type": "json_schema", "json_schema": {"schema": SCHEMA}}},
     {"json": SCHEMA}),
    ({"structured_outputs": {"json": json.dumps(SCHEMA), "disable_any_whitespace": True}},
     {"json": SCHEMA}),
    ({"structured_outputs": {"grammar": "start: /a+/"}}, {"grammar": "start: /a+/"}),
    ({"guided_json": SCHEMA, "guided_decoding_backend": "xgrammar"}, {"json": SCHEMA}),
    ({"guided_choice": ["a", "b"]}, {"choice": ["a", "b"]}),
    ({"guided_grammar": "root ::= \"x\""}, {"grammar": "root ::= \"x\""}),
])
def test_the_mapping(body: dict[str, Any], want: dict[str, Any] | None) -> None:
    assert structured_outputs(body) == want


@pytest.mark.parametrize(("body", "param"), [
    ({"response_format": {"type": "xml"}}, "response_format"),
    ({"response_format": {"type": "json_schema", "json_schema": {"name": "x"}}},
     "response_format"),
    ({"structured_outputs": {"structural_tag": "x"}}, "structured_outputs"),
    ({"structured_outputs": {"regex": "a", "choice": ["b"]}}, "structured_outputs"),
    ({"structured_outputs": {"json": "{not json"}}, "structured_outputs"),
    ({"guided_regex": "a", "response_format": {"type": "json_object"}}, "guided_regex"),
    ({"guided_json": {}, "guided_whitespace_pattern": " "}, "guided_whitespace_pattern"),
])
def test_what_is_refused_names_its_parameter(body: dict[str, Any], param: str) -> None:
    with pytest.raises(APIError) as caught:
        structured_outputs(body)
    assert (caught.value.status, caught.value.param) == (400, param)
