"""Prefix affinity: the settings and keys of the reads that offer a session's job to the worker
that ran the session's last job (lua_affinity.py; docs/protocol.md, "Sessions and prefix
affinity")."""

from __future__ import annotations

import time
from collections.abc import Sequence
from typing import Any

from qworker.service.lua_affinity import OFFERED_CONSUMER, SESSION_TTL_MS
from qworker_client.protocol import Keys


class Affinity:
    """How long an offer waits for its worker (`bound_ms`), and how recently a worker must have
    read with room to be offered anything (`live_ms`: longer than an idle worker's blocking wait,
    so an idle worker is offered its sessions' jobs). Its reads say the worker reads (its beat in
    `<prefix>:readers`) every `live_ms / 8`, not every time."""

    def __init__(self, keys: Keys, bound_ms: int, live_ms: int) -> None:
        self.keys = keys
        self.bound_ms = bound_ms
        self.live_ms = live_ms
        self._last_beat = float("-inf")

    def head(self) -> tuple[list[str], list[str | int]]:
        """The keys (offers, readers) and arguments (the offered consumer, bound, live window,
        session TTL, beat) both affinity reads take after their own first ones."""
        now = time.monotonic()
        beat = now - self._last_beat >= self.live_ms / 8000
        if beat:
            self._last_beat = now
        return ([self.keys.offers, self.keys.readers],
                [OFFERED_CONSUMER, self.bound_ms, self.live_ms, SESSION_TTL_MS, int(beat)])

    def stream_keys(self, stream: str) -> list[str]:
        """The keys a stream's reading adds: its model's affinity hash and affinity_seen set."""
        return [self.keys.affinity_of(stream), self.keys.affinity_seen_of(stream)]


def is_affinity_reply(reply: Any) -> bool:
    """An affinity read's reply ({streams, wake}), not a READ's (a list of {stream, entries})."""
    return isinstance(reply, list) and len(reply) == 2 and isinstance(reply[1], int)


def split_reply(reply: Any) -> tuple[Sequence[Any], int]:
    """An affinity read's reply as (the streams' entries as READ's reply, ms until the earliest
    offer this worker could not take expires, -1: none)."""
    streams, wake = reply
    return streams or [], int(wake)
