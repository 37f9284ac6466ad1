"""API keys: with any configured, every `/v1/` request needs `Authorization: Bearer <key>`, and
acts for that key's owner (`owners`)."""

from __future__ import annotations

import hmac

from starlette.types import ASGIApp, Receive, Scope, Send

from qworker_client.gateway import owners
from qworker_client.gateway.errors import APIError

OPEN_PATHS = ("/health", "/metrics")
OWN_AUTH = "/dashboard"  # checks its visitors itself (a browser logs in: docs/dashboard.md)


class RequireKey:
    def __init__(self, app: ASGIApp, keys: tuple[str, ...]) -> None:
        self.app = app
        self.keys = tuple((k.encode(), owners.fingerprint(k.encode())) for k in keys)

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if (scope["type"] == "http" and self.keys and scope["path"] not in OPEN_PATHS
                and not _under(scope["path"], OWN_AUTH)):
            owner = self._owner(dict(scope["headers"]).get(b"authorization", b""))
            if owner is None:
                error = APIError(401, "a valid API key is required (Authorization: Bearer "
                                 "<key>)", code="invalid_api_key")
                await error.response()(scope, receive, send)
                return
            owners.set_caller(scope, owner)
        await self.app(scope, receive, send)

    def _owner(self, header: bytes) -> str | None:
        """The owner of the key the header bears; None when it bears none of ours."""
        scheme, _, token = header.partition(b" ")
        if scheme.lower() != b"bearer":
            return None
        token = token.strip()
        found = None
        for key, owner in self.keys:  # every key compared: the time does not tell which matched
            if hmac.compare_digest(token, key):
                found = owner
        return found


def _under(path: str, root: str) -> bool:
    return path == root or path.startswith(root + "/")
