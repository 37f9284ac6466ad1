"""API keys: with any configured, every `/v1/` request needs `Authorization: Bearer <key>`."""

from __future__ import annotations

import hmac

from starlette.types import ASGIApp, Receive, Scope, Send

from qworker_client.gateway.errors import APIError

OPEN_PATHS = ("/health", "/metrics")


class RequireKey:
    def __init__(self, app: ASGIApp, keys: tuple[str, ...]) -> None:
        self.app = app
        self.keys = tuple(k.encode() for k in keys)

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if self._refused(scope):
            error = APIError(401, "a valid API key is required (Authorization: Bearer <key>)",
                             code="invalid_api_key")
            await error.response()(scope, receive, send)
            return
        await self.app(scope, receive, send)

    def _refused(self, scope: Scope) -> bool:
        if scope["type"] != "http" or not self.keys or scope["path"] in OPEN_PATHS:
            return False
        return not self._allowed(dict(scope["headers"]).get(b"authorization", b""))

    def _allowed(self, header: bytes) -> bool:
        scheme, _, token = header.partition(b" ")
        if scheme.lower() != b"bearer":
            return False
        token = token.strip()
        return any(hmac.compare_digest(token, key) for key in self.keys)
