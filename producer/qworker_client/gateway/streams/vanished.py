"""Jobs whose state vanished from Redis (it restarted empty or was flushed, the stream a job was
queued to was trimmed): nothing will ever be written to their output streams, so a request
following one would wait forever. The hub looks up the jobs it follows that have been quiet for
`QUIET_S` (at most `MAX_LOOKUPS` a round, every `EVERY_S`, the longest quiet first) and ends those
found vanished with an `error` event of code `lost_state`.

A job is there while any of these is (docs/protocol.md): its output stream (it started, or ended:
the hub reads what is in it), its owner hash (a worker took it; a requeued job keeps it, with
worker ''), or its entry in the stream it was queued to (not taken yet: an entry goes only when
acked, once the job's end is written, or when requeued). Asked in that order from the entry on, in
one round trip (the out stream and owner hash in one EXISTS), so a job that moves on between the
two is not missed: every step that removes one of them puts another in place first, or in the
same script. A job whose entry the gateway does not know (a resumed stream) counts its submit
marker instead, which a trim leaves: such a job is found vanished only once Redis lost it all.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass

import redis.asyncio

from qworker_client.gateway.round_trip import Command, round_trip
from qworker_client.protocol import LOST_STATE, ErrorEvent, Keys

QUIET_S = 3.0  # a job without news this long is looked up
EVERY_S = 1.0  # how often the hub looks for quiet jobs
MAX_LOOKUPS = 512  # jobs looked up in one round at most (two commands each)

LOST = ErrorEvent(code=LOST_STATE, message="the job's state vanished from Redis (restarted empty, "
                  "flushed, or its queue trimmed): it cannot finish; submit it again")


@dataclass(frozen=True)
class Queued:
    """Where a job was queued: its stream and its entry there, as the submit script answered."""

    stream: str
    entry_id: str


async def vanished(pool: redis.asyncio.ConnectionPool, keys: Keys,
                   jobs: Mapping[str, Queued | None]) -> list[str] | None:
    """The jobs of which nothing is left in Redis; None when Redis could not be asked. A job
    whose lookup got an error reply is taken as there."""
    commands: list[Command] = []
    for job_id, queued in jobs.items():
        if queued is not None:
            commands.append(("XRANGE", queued.stream, queued.entry_id, queued.entry_id))
        marker = (keys.submitted(job_id),) if queued is None else ()
        commands.append(("EXISTS", keys.out(job_id), keys.owner(job_id), *marker))
    replies = await round_trip(pool, commands)
    if replies is None:
        return None
    answers = iter(replies)
    gone = []
    for job_id, queued in jobs.items():
        entry = next(answers) if queued is not None else []
        counted = next(answers)
        if entry == [] and counted == 0:
            gone.append(job_id)
    return gone
