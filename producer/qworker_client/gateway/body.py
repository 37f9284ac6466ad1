"""A request's body, bounded before it costs anything: its size (413) from its Content-Length
before a byte of it is read, and counted while a chunked body comes in; its JSON's nesting (400),
so neither a huge body nor a deep one (json's RecursionError) gets past the door.

A refused body is answered with `connection: close`: the rest of it is not read."""

from __future__ import annotations

import json
from typing import Any

from starlette.types import ASGIApp, Message, Receive, Scope, Send

from qworker_client.gateway.batches.files import DEFAULT_MAX_BYTES as MAX_FILE_BYTES
from qworker_client.gateway.errors import APIError, bad_request

MAX_JSON_DEPTH = 64  # arrays and objects inside one another (OpenAI's schemas nest 5 deep)
UPLOAD_PATH = "/v1/files"
UPLOAD_ENVELOPE = 1024 * 1024  # what multipart puts around an uploaded file, at most


class LimitBody:
    """ASGI middleware: a body larger than `max_bytes` (an upload: than the largest file
    taken) is a 413."""

    def __init__(self, app: ASGIApp, max_bytes: int) -> None:
        self.app = app
        self.max_bytes = max_bytes

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        limit = self._limit(scope)
        declared = _content_length(scope)
        if declared is not None and declared > limit:
            await _too_large(limit).response()(scope, receive, send)
            return
        seen = 0

        async def counted() -> Message:
            nonlocal seen
            message = await receive()
            if message["type"] == "http.request":
                seen += len(message.get("body", b""))
                if seen > limit:  # raised in the route, which reads it: the error handler's
                    raise _too_large(limit)
            return message

        await self.app(scope, counted, send)

    def _limit(self, scope: Scope) -> int:
        if scope["method"] == "POST" and scope["path"] == UPLOAD_PATH:
            return MAX_FILE_BYTES + UPLOAD_ENVELOPE
        return self.max_bytes


def parse_json(raw: bytes) -> Any:
    """The body's JSON; 400 when it is not JSON, or nests deeper than `MAX_JSON_DEPTH`."""
    try:
        value = json.loads(raw)
    except RecursionError:
        raise _too_deep() from None
    except ValueError as exc:
        raise bad_request(f"the body is not valid JSON: {exc}") from None
    # a body with fewer brackets than the limit cannot nest deeper: most bodies are not walked
    if raw.count(b"[") + raw.count(b"{") > MAX_JSON_DEPTH and _nests_deeper(value,
                                                                           MAX_JSON_DEPTH):
        raise _too_deep()
    return value


def _nests_deeper(value: Any, limit: int) -> bool:
    """Whether arrays and objects nest more than `limit` deep in `value`: one level at a time."""
    level = [value] if isinstance(value, (list, dict)) else []
    for _ in range(limit):
        level = [child for node in level for child in (node.values() if isinstance(node, dict)
                                                        else node)
                 if isinstance(child, (list, dict))]
        if not level:
            return False
    return True


def _content_length(scope: Scope) -> int | None:
    for name, value in scope["headers"]:
        if name == b"content-length":
            try:
                return int(value)
            except ValueError:
                return None
    return None


def _too_large(limit: int) -> APIError:
    return APIError(413, f"the request body is larger than {limit} bytes",
                    code="body_too_large", headers={"connection": "close"})


def _too_deep() -> APIError:
    return bad_request(f"the body's JSON nests deeper than {MAX_JSON_DEPTH} arrays or objects",
                       code="too_deep")
