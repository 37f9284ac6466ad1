"""Who owns what the gateway makes: with API keys, the key a request came with owns the jobs,
files and batches it made, and no other key sees them (404, as for what does not exist). Without
keys (an open gateway) there are no owners and everything is seen, as before keys existed.

An owner is one string, stored beside what it owns: a fingerprint of its key (never the key
itself), so that Redis and the files directory hold nothing a client could authenticate with. A
key of the keys file acts for its tenant instead: `tenant:<name>`, so all of a tenant's keys see
what any of them made.
"""

from __future__ import annotations

import hashlib
from typing import TYPE_CHECKING

from starlette.requests import Request
from starlette.types import Scope

if TYPE_CHECKING:
    from qworker_client.gateway.tenants import Tenant

Owner = str | None  # None: the open gateway's requests (and the gateway's own work): see all
SCOPE_KEY = "qworker.owner"
TENANT_KEY = "qworker.tenant"


def fingerprint(api_key: bytes) -> str:
    """The owner of what a key makes: 128 bits of SHA-256 over the key (domain-separated)."""
    return "key-" + hashlib.sha256(b"qworker owner\0" + api_key).hexdigest()[:32]


def tenant_owner(name: str) -> str:
    return f"tenant:{name}"


def set_caller(scope: Scope, owner: str) -> None:
    scope[SCOPE_KEY] = owner


def set_tenant(scope: Scope, tenant: Tenant) -> None:
    scope[TENANT_KEY] = tenant


def caller_tenant(request: Request) -> Tenant | None:
    """The keys file's tenant a request acts for (None: a plain key, or an open gateway)."""
    return request.scope.get(TENANT_KEY)


def caller(request: Request) -> Owner:
    """The owner a request acts for (set by `auth.RequireKey`); None on an open gateway."""
    owner = request.scope.get(SCOPE_KEY)
    return owner if isinstance(owner, str) else None


def may_see(owner: Owner, viewer: Owner) -> bool:
    """Whether `viewer` sees what `owner` made: always on an open gateway (viewer None), else only
    its own (what was made with no owner, before keys were set, is nobody's)."""
    return viewer is None or owner == viewer
