"""The consumer group on each stream a worker reads: made at start, and made again whenever Redis
forgets it (`FLUSHALL`, a `DEL` of the stream, a restart with no data), which the worker learns
from a read answered NOGROUP, or UNBLOCKED when the read was blocked in the stream as it went
(`errors.is_group_gone`).

The group is made at id 0 with the stream (MKSTREAM), so entries that a producer added to a
stream it recreated (a plain XADD makes one without a group) are all delivered. Making a group
that exists does nothing, so every worker of a fleet may do it at any time; the one that made it
again says so once, with the streams."""

from __future__ import annotations

from collections.abc import Sequence

import redis
import structlog


class Groups:
    def __init__(self, client: redis.Redis, streams: Sequence[str], group: str,
                 log: structlog.typing.FilteringBoundLogger) -> None:
        self.client = client
        self.streams = list(streams)
        self.group = group
        self.log = log
        self._made = False  # made once: from then on a group made is one Redis forgot

    def ensure(self) -> list[str]:
        """The group on every stream, in one round trip; the streams it was missing on."""
        pipe = self.client.pipeline(transaction=False)
        for stream in self.streams:
            pipe.xgroup_create(stream, self.group, id="0", mkstream=True)
        missing: list[str] = []
        for stream, reply in zip(self.streams, pipe.execute(raise_on_error=False), strict=True):
            if not isinstance(reply, Exception):
                missing.append(stream)
            elif "BUSYGROUP" not in str(reply):
                raise reply
        if missing and self._made:
            self.log.warning("consumer group missing, recreated", group=self.group,
                             streams=missing)
        self._made = True
        return missing
