"""A request's session (the job field `session`: docs/protocol.md, "Sessions and prefix
affinity"): the worker whose prefix cache holds the conversation is offered its jobs first.

From OpenAI's `prompt_cache_key`, else its `user`, else (a chat) the conversation's opening: the
messages up to its first user message, which every later turn repeats. Hashed: any string a
client sends becomes a bounded, safe session, and no user id is stored in the clear."""

from __future__ import annotations

import hashlib
import json
from typing import Any

from qworker_client.gateway.errors import bad_request


def _digest(kind: str, text: str) -> str:
    return f"{kind}:{hashlib.sha256(text.encode()).hexdigest()[:32]}"


def session_of(body: dict[str, Any], messages: list[dict[str, Any]] | None) -> str | None:
    """The session of a request body (its chat `messages` as the job will carry them)."""
    for name, kind in (("prompt_cache_key", "key"), ("user", "user")):
        value = body.get(name)
        if value is None or value == "":
            continue
        if not isinstance(value, str):
            raise bad_request(f"`{name}` must be a string", param=name)
        return _digest(kind, value)
    if not messages:
        return None
    first_user = next((i for i, m in enumerate(messages) if m.get("role") == "user"), None)
    if first_user is None:
        return None
    opening = messages[:first_user + 1]
    return _digest("chat", json.dumps(opening, sort_keys=True, ensure_ascii=False))
