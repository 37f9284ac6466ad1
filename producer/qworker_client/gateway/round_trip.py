"""Several commands in one round trip on one of the pool's connections, without redis-py's
Pipeline: its command stack, its per-command response callbacks and its wrappers cost the
gateway about as much per request as the rest of the submit."""

from __future__ import annotations

from collections.abc import Sequence

import redis.asyncio
from redis.exceptions import ResponseError

from qworker_client.retry import TRANSIENT_ERRORS

Command = Sequence[str | int | float | bytes]


async def round_trip(pool: redis.asyncio.ConnectionPool, commands: Sequence[Command]
                     ) -> list[object] | None:
    """Each command's reply as the parser gives it (an error reply as its ResponseError), or
    None when the connection failed: what ran of them is then unknown."""
    try:
        conn = await pool.get_connection()
    except TRANSIENT_ERRORS:
        return None
    try:
        await conn.send_packed_command(conn.pack_commands(commands), check_health=False)
        replies: list[object] = []
        for _ in commands:
            try:
                replies.append(await conn.read_response())
            except ResponseError as exc:  # read whole: the connection stays in step
                replies.append(exc)
        return replies
    except TRANSIENT_ERRORS:  # the connection has disconnected itself
        return None
    finally:
        await pool.release(conn)
