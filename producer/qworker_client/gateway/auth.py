"""API keys: with any configured (a plain list, or a keys file of tenants), every `/v1/` request
needs `Authorization: Bearer <key>`, and acts for that key's owner (`owners`): a plain key's
fingerprint, or a keys file's tenant (`tenants`)."""

from __future__ import annotations

import hashlib
import hmac

from starlette.types import ASGIApp, Receive, Scope, Send

from qworker_client.gateway import owners
from qworker_client.gateway.errors import APIError
from qworker_client.gateway.tenants import KeysFile, Tenant

OPEN_PATHS = ("/health", "/metrics")
OWN_AUTH = "/dashboard"  # checks its visitors itself (a browser logs in: docs/dashboard.md)


class RequireKey:
    def __init__(self, app: ASGIApp, keys: tuple[str, ...],
                 keys_file: KeysFile | None = None) -> None:
        self.app = app
        self.keys = tuple((k.encode(), owners.fingerprint(k.encode())) for k in keys)
        self.keys_file = keys_file
        self._digests: dict[bytes, Tenant] = {}
        self._version = -1

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        needed = self.keys or self.keys_file is not None
        if (scope["type"] == "http" and needed and scope["path"] not in OPEN_PATHS
                and not _under(scope["path"], OWN_AUTH)):
            header = dict(scope["headers"]).get(b"authorization", b"")
            tenant = self._tenant(header)
            owner = owners.tenant_owner(tenant.name) if tenant else self._owner(header)
            if tenant is not None:
                owners.set_tenant(scope, tenant)
            if owner is None:
                error = APIError(401, "a valid API key is required (Authorization: Bearer "
                                 "<key>)", code="invalid_api_key")
                await error.response()(scope, receive, send)
                return
            owners.set_caller(scope, owner)
        await self.app(scope, receive, send)

    def _tenant(self, header: bytes) -> Tenant | None:
        """The keys file's tenant of the key the header bears (looked up by the key's SHA-256:
        the time does not tell how much of a key matched)."""
        if self.keys_file is None:
            return None
        by_key = self.keys_file.current()
        if self._version != self.keys_file.version:
            self._digests = {hashlib.sha256(k.encode()).digest(): t for k, t in by_key.items()}
            self._version = self.keys_file.version
        scheme, _, token = header.partition(b" ")
        if scheme.lower() != b"bearer":
            return None
        return self._digests.get(hashlib.sha256(token.strip()).digest())

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
