"""Who may look and who may act. With the gateway's API keys (`--api-key`) a key opens the
dashboard read-only; an admin key (`--admin-key`) opens it with retry, cancel and purge. With no
key of either kind it is open, and every visitor is admin (bind it to localhost then).

A browser logs in once with its key (the login form): it gets a session cookie (HttpOnly,
SameSite=Strict, scoped to the dashboard) that holds its role and a MAC by a secret of this
process, never the key; a script may send `Authorization: Bearer KEY` instead. Every form that
writes carries a CSRF token, a MAC of the session; a write without the right one is refused."""

from __future__ import annotations

import hashlib
import hmac
import secrets
from typing import Literal

from starlette.requests import Request

Role = Literal["viewer", "admin"]
COOKIE = "qw_dashboard"
SESSION_S = 12 * 3600


class Access:
    def __init__(self, api_keys: tuple[str, ...] = (), admin_keys: tuple[str, ...] = ()
                 ) -> None:
        self._keys = [(k.encode(), "viewer") for k in api_keys]
        self._keys += [(k.encode(), "admin") for k in admin_keys]
        self.open = not self._keys
        self._secret = secrets.token_bytes(32)

    def role_of_key(self, key: str) -> Role | None:
        """The role `key` opens; None when it is none of ours."""
        found: Role | None = None
        token = key.strip().encode()
        for known, role in self._keys:  # every key compared: the time does not tell which
            if hmac.compare_digest(token, known) and found != "admin":
                found = role  # type: ignore[assignment]
        return found

    def session(self, role: Role) -> str:
        """A cookie value for `role`."""
        nonce = secrets.token_urlsafe(12)
        return f"{role}.{nonce}.{self._mac('session', role, nonce)}"

    def role(self, request: Request) -> Role | None:
        """The visitor's role: by its bearer key, else its session cookie; None: not let in."""
        if self.open:
            return "admin"
        scheme, _, token = request.headers.get("authorization", "").partition(" ")
        if scheme.lower() == "bearer":
            return self.role_of_key(token)
        role, _, rest = request.cookies.get(COOKIE, "").partition(".")
        nonce, _, mac = rest.partition(".")
        if role in ("viewer", "admin") and hmac.compare_digest(
                mac.encode(), self._mac("session", role, nonce).encode()):
            return role  # type: ignore[return-value]
        return None

    def csrf_token(self, request: Request) -> str:
        """The token the visitor's forms carry: a MAC of its session (of the open dashboard's
        visitor, for an open one)."""
        return self._mac("csrf", request.cookies.get(COOKIE, "") if not self.open else "open")

    def csrf_ok(self, request: Request, token: str) -> bool:
        return hmac.compare_digest(token.encode(), self.csrf_token(request).encode())

    def _mac(self, *parts: str) -> str:
        return hmac.new(self._secret, "\0".join(parts).encode(), hashlib.sha256).hexdigest()[:40]
