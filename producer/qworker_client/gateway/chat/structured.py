"""Structured output in an OpenAI / vLLM request body, as the job's `structured_outputs` field.

Taken from exactly one of: OpenAI's `response_format` (`json_object`, `json_schema`; `text` is
no constraint), vLLM's `structured_outputs` object (`json`, `json_object`, `regex`, `choice`,
`grammar`), or vLLM's older `guided_json` / `guided_regex` / `guided_choice` / `guided_grammar`.
The constraint's own validity (does the schema or grammar compile) is the worker's to judge: an
invalid one ends the job with `invalid_request`.
"""

from __future__ import annotations

import json
from typing import Any

from qworker_client.gateway.errors import bad_request

_KINDS = ("json", "json_object", "regex", "choice", "grammar")
_GUIDED = {"guided_json": "json", "guided_regex": "regex", "guided_choice": "choice",
           "guided_grammar": "grammar"}
# vLLM options that only tune a backend: accepted and left to the worker's choice
_IGNORED = ("guided_decoding_backend", "backend", "disable_any_whitespace",
            "disable_fallback", "disable_additional_properties")


def structured_outputs(body: dict[str, Any]) -> dict[str, Any] | None:
    """The job's `structured_outputs` field for this request, or None when unconstrained."""
    found = [(param, value) for param, value in (
        ("response_format", _response_format(body.get("response_format"))),
        ("structured_outputs", _vllm(body.get("structured_outputs"))),
        *((name, _guided(name, body.get(name))) for name in _GUIDED),
    ) if value is not None]
    if len(found) > 1:
        names = ", ".join(f"`{param}`" for param, _ in found)
        raise bad_request(f"give one output constraint, not several ({names})", param=found[1][0])
    if body.get("guided_whitespace_pattern") is not None:
        raise bad_request("`guided_whitespace_pattern` is not supported (JSON is compact)",
                          param="guided_whitespace_pattern")
    return found[0][1] if found else None


def _response_format(fmt: Any) -> dict[str, Any] | None:
    if fmt is None:
        return None
    kind = fmt.get("type") if isinstance(fmt, dict) else None
    if kind == "text":
        return None
    if kind == "json_object":
        return {"json_object": True}
    if kind == "json_schema":
        spec = fmt.get("json_schema")
        schema = spec.get("schema") if isinstance(spec, dict) else None
        if not isinstance(schema, dict):
            raise bad_request("`response_format.json_schema.schema` must be a JSON Schema object",
                              param="response_format")
        return {"json": schema}
    raise bad_request("`response_format.type` must be text, json_object or json_schema",
                      param="response_format")


def _vllm(spec: Any) -> dict[str, Any] | None:
    if spec is None:
        return None
    if not isinstance(spec, dict):
        raise bad_request("`structured_outputs` must be an object", param="structured_outputs")
    given = {k: v for k, v in spec.items() if v not in (None, False) and k not in _IGNORED}
    unknown = sorted(set(given) - set(_KINDS))
    if unknown:
        raise bad_request(f"`structured_outputs.{unknown[0]}` is not supported (use one of "
                          f"{', '.join(_KINDS)})", param="structured_outputs")
    if len(given) != 1:
        raise bad_request(f"`structured_outputs` needs exactly one of {', '.join(_KINDS)}",
                          param="structured_outputs")
    (kind, value), = given.items()
    return {kind: _schema(value, "structured_outputs") if kind == "json" else value}


def _guided(name: str, value: Any) -> dict[str, Any] | None:
    if value is None:
        return None
    kind = _GUIDED[name]
    return {kind: _schema(value, name) if kind == "json" else value}


def _schema(value: Any, param: str) -> Any:
    """A JSON Schema given as an object or as its JSON text (vLLM takes both)."""
    if not isinstance(value, str):
        return value
    try:
        return json.loads(value)
    except ValueError:
        raise bad_request("the JSON Schema is not valid JSON", param=param) from None
