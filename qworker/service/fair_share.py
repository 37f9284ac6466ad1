"""What the fair read charged a job (lua_fair.py): which entries, and how much, for the
corrections as the job goes (usage.py)."""

from __future__ import annotations

import math
from collections.abc import Sequence
from typing import Any

from qworker.service.job import Entry
from qworker.service.lua_fair import CHARGED, PARKED_CONSUMER
from qworker_client.protocol import Keys, WireFields


def mark_charged(reply: Any, entries: Sequence[Entry], keys: Keys) -> None:
    """When the fair read charged what it handed out (its reply ends with CHARGED), the entries
    of job streams were charged their estimate (corrected by `usage` as the job goes)."""
    if reply and _text(reply[-1][0]) == CHARGED:
        for entry in entries:
            entry.charged = not keys.is_requeue(entry.stream)


def running_member(tenant: str, entry: Entry) -> str:
    """The job's member of the running set (lua_fair: `<tenant>\0<stream>\0<entry id>`)."""
    return f"{tenant}\0{entry.stream}\0{entry.entry_id}"


def stale_running(client: Any, keys: Keys, group: str, start: str, count: int = 100
                  ) -> tuple[list[str], str]:
    """Members of the running set from `start` (a ZRANGEBYLEX bound) whose entry is no longer
    pending to a worker (ended, requeued, or its worker's count was lost with it): (them, where
    the next look starts)."""
    members = [m.decode() if isinstance(m, bytes) else m
               for m in client.zrangebylex(keys.running, start, "+", 0, count)]
    pipe = client.pipeline(transaction=False)
    for m in members:
        _, stream, entry_id = m.split("\0")
        pipe.xpending_range(stream, group, min=entry_id, max=entry_id, count=1)
    stale = [m for m, rows in zip(members, pipe.execute(raise_on_error=False), strict=True)
             if not isinstance(rows, Exception)
             and not any(_text(r["consumer"]) != PARKED_CONSUMER for r in rows)]
    following = "(" + members[-1] if len(members) == count else "-"
    return stale, following


def _text(value: object) -> str:
    return value.decode() if isinstance(value, bytes) else str(value)


def _raw(fields: WireFields, name: str) -> bytes | None:
    for key, value in fields.items():
        if key in (name, name.encode()):
            return value.encode() if isinstance(value, str) else value
    return None


def max_tokens_of(fields: WireFields) -> int:
    raw = _raw(fields, "max_tokens")
    return int(raw) if raw is not None and raw.isdigit() else 256


def prompt_estimate(fields: WireFields) -> int:
    """The prompt's tokens as the fair read estimates them (lua_fair's `cost_of`, on the same raw
    fields): 4 bytes a token, or the ids given."""
    ids = _raw(fields, "prompt_token_ids")
    if ids is not None:
        return ids.count(b",") + 1
    return math.ceil(len(_raw(fields, "prompt") or _raw(fields, "messages") or b"") / 4)


def prompt_charge(fields: WireFields) -> int:
    """The prompt's tokens as a quota charges them when the job is handed out (lua_fair's
    `cost_of`): a byte a token (more than a tokenizer makes of text), or the ids given."""
    ids = _raw(fields, "prompt_token_ids")
    if ids is not None:
        return ids.count(b",") + 1
    return len(_raw(fields, "prompt") or _raw(fields, "messages") or b"")


def cost_of(fields: WireFields) -> int:
    """What the fair share counts a job: its prompt's estimate plus `max_tokens`."""
    return max(prompt_estimate(fields) + max_tokens_of(fields), 1)


def charge_of(fields: WireFields) -> int:
    """What a quota charges a job when it is handed out: its prompt's charge plus `max_tokens`."""
    return max(prompt_charge(fields) + max_tokens_of(fields), 1)
