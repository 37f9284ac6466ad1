"""OpenAI batch lines to and from qworker's batch runner (`qworker_client.batch`): an input line
`{"custom_id", "method", "url", "body"}` becomes a runner line `{"custom_id", <job fields>}`; a
runner result or error becomes an output line `{"id", "custom_id", "response", "error"}`."""

from __future__ import annotations

import json
import uuid
from typing import Any

from qworker_client.gateway.chat import shaping
from qworker_client.gateway.chat.shaping import Shape
from qworker_client.gateway.chat.translate import Kind, translate
from qworker_client.gateway.errors import APIError, from_job_error
from qworker_client.protocol import DoneEvent

ENDPOINTS: dict[str, Kind] = {"/v1/chat/completions": "chat", "/v1/completions": "completion"}


def runner_line(raw: bytes, endpoint: str) -> tuple[str, str, str]:
    """(custom_id, model, runner line as JSON text) of one input line; APIError when it cannot
    run, whatever is wrong with it (not JSON, nested past the parser's depth, wrong types, ...):
    one line fails alone."""
    try:
        return _runner_line(raw, endpoint)
    except APIError:
        raise
    except Exception as exc:  # whatever a hostile line sets off is that line's alone
        message = " ".join(f"{type(exc).__name__}: {exc}".split())[:300]
        raise APIError(400, f"the line cannot be run: {message}") from None


def _runner_line(raw: bytes, endpoint: str) -> tuple[str, str, str]:
    try:
        line = json.loads(raw)
    except (ValueError, RecursionError) as exc:
        raise APIError(400, f"the line is not JSON: {exc}") from None
    custom_id = line.get("custom_id") if isinstance(line, dict) else None
    if not isinstance(custom_id, str) or not custom_id:
        raise APIError(400, "the line has no custom_id", param="custom_id")
    if line.get("url") != endpoint:
        raise APIError(400, f"the line's url must be the batch's endpoint, {endpoint}",
                       param="url")
    request = translate(ENDPOINTS[endpoint], line.get("body"), max_n=1)
    fields = {k: v for k, v in request.choices[0].spec.items() if v is not None and k != "id"}
    text = json.dumps({"custom_id": custom_id, **fields}, ensure_ascii=False)
    return custom_id, request.model, text


def line_custom_id(raw: bytes) -> str | None:
    """The line's `custom_id`, if it has one that can be read."""
    try:
        line = json.loads(raw)
    except (ValueError, RecursionError):
        return None
    value = line.get("custom_id") if isinstance(line, dict) else None
    return value if isinstance(value, str) else None


def output_line(result: dict[str, Any], kind: Kind, model: str, created: int) -> dict[str, Any]:
    """A runner result (`custom_id`, `text`, `finish_reason`, `usage`) as OpenAI's output line."""
    usage = result["usage"]
    done = DoneEvent(finish_reason=result["finish_reason"], text=result["text"],
                     prompt_tokens=usage["prompt_tokens"],
                     completion_tokens=usage["completion_tokens"])
    response_id = f"{'chatcmpl' if kind == 'chat' else 'cmpl'}-{uuid.uuid4().hex}"
    body = shaping.body(Shape(kind, response_id, model, created), [done], done.prompt_tokens)
    return _line(result["custom_id"], {"status_code": 200, "request_id": response_id,
                                       "body": body}, None)


def error_line(custom_id: str | None, code: str, message: str) -> dict[str, Any]:
    """A job that ended with an error event: the HTTP response the request would have had."""
    error = from_job_error(code, message)
    return _line(custom_id, {"status_code": error.status, "request_id": None,
                             "body": error.body()}, None)


def invalid_line(custom_id: str | None, error: APIError) -> dict[str, Any]:
    """A line that could not be run at all."""
    return _line(custom_id, None, {"code": error.code or "invalid_request",
                                   "message": error.message})


def _line(custom_id: str | None, response: dict[str, Any] | None,
          error: dict[str, Any] | None) -> dict[str, Any]:
    return {"id": f"batch_req_{uuid.uuid4().hex}", "custom_id": custom_id, "response": response,
            "error": error}
