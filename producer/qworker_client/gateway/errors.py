"""Errors in OpenAI's shape: `{"error": {"message", "type", "param", "code"}}` with its status."""

from __future__ import annotations

from typing import Any

from starlette.responses import JSONResponse

from qworker_client.protocol import LOST_STATE

# HTTP status and OpenAI error type of each job error code (docs/protocol.md, `error` event);
# an unknown code is the server's failure.
_JOB_ERRORS: dict[str, tuple[int, str, str | None]] = {
    "invalid_request": (400, "invalid_request_error", None),
    "prompt_too_long": (400, "invalid_request_error", "context_length_exceeded"),
    "expired": (408, "timeout_error", "expired"),
    LOST_STATE: (503, "server_error", None),  # the job is gone with Redis' state: submit again
}


class APIError(Exception):
    """A request that ends in an OpenAI error response."""

    def __init__(self, status: int, message: str, *, type: str = "invalid_request_error",
                 param: str | None = None, code: str | None = None,
                 headers: dict[str, str] | None = None) -> None:
        super().__init__(message)
        self.status = status
        self.message = message
        self.type = type
        self.param = param
        self.code = code
        self.headers = headers or {}

    def body(self) -> dict[str, Any]:
        return {"error": {"message": self.message, "type": self.type, "param": self.param,
                          "code": self.code}}

    def response(self) -> JSONResponse:
        return JSONResponse(self.body(), status_code=self.status, headers=self.headers)


def bad_request(message: str, param: str | None = None, code: str | None = None) -> APIError:
    return APIError(400, message, param=param, code=code)


def from_job_error(code: str, message: str) -> APIError:
    """The error response of a job that ended with an `error` event."""
    status, kind, openai_code = _JOB_ERRORS.get(code, (500, "server_error", code))
    return APIError(status, message, type=kind, code=openai_code or code)
