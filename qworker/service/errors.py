"""Redis errors by scope: not now (back off and retry), one job's keys (fail that job), Redis forgot
the consumer group (recreate it, see groups.py), or the worker cannot work at all (exit 2).

The scope of an error reply depends on the call: the same NOPERM means "this job" when it answers a
command on one job's keys (its output stream, owner hash) and "this worker" when it answers a read
of the job stream or the group. So the caller that knows which keys a command touched asks
`job_error` of each reply; an error escaping a worker-wide phase is `cannot_work`. A few replies
are worker-wide wherever they come from: a cluster redirection or cross-slot call (the worker talks
to Redis Cluster, which it does not support) and an unknown command (Redis too old, or renamed).
"""

from __future__ import annotations

import redis

_E = redis.exceptions
# Failures that mean "not now": connection lost or refused, loading after a restart (a
# ConnectionError), failover, out of memory; the loop backs off and retries.
REDIS_DOWN = (_E.ConnectionError, _E.TimeoutError, _E.ReadOnlyError, _E.OutOfMemoryError,
              _E.TryAgainError, _E.MasterDownError, _E.ClusterDownError)
TRANSIENT_REPLIES = ("MISCONF", "NOREPLICAS", "BUSY ", "LOADING")  # without their own class
# Replies that mean no command of this worker can work, whichever keys it names.
FATAL_REPLIES = ("MOVED", "ASK ", "CROSSSLOT", "NOAUTH", "WRONGPASS", "ERR unknown command",
                 "ERR unknown subcommand")
EXIT_CODE = 2  # `qworker serve` exits with this when it cannot work


class CannotWork(Exception):
    """Redis refuses what every job needs (ACL on the job stream, cluster, unknown command)."""


def is_transient(exc: BaseException) -> bool:
    if isinstance(exc, REDIS_DOWN):
        return True
    return isinstance(exc, redis.ResponseError) and str(exc).startswith(TRANSIENT_REPLIES)


def is_group_gone(exc: BaseException) -> bool:
    """The group or its stream is gone (FLUSHALL, DEL, a restart without data): NOGROUP, or
    UNBLOCKED to a read that was blocked in it when it went."""
    return isinstance(exc, redis.ResponseError) and (
        "NOGROUP" in str(exc) or str(exc).startswith("UNBLOCKED"))


def is_fatal_reply(exc: BaseException) -> bool:
    return isinstance(exc, redis.ResponseError) and (
        isinstance(exc, _E.AskError) or str(exc).startswith(FATAL_REPLIES)
        or "CROSSSLOT" in str(exc))


def job_error(reply: object) -> str | None:
    """None for a good reply. For an error reply to a command on one job's keys: its message,
    when it concerns that job only (WRONGTYPE, NOPERM on the key, a script error). Raises the
    error itself when it is not the job's (transient, missing script, missing group), and
    `CannotWork` when nothing this worker does can work."""
    if not isinstance(reply, Exception):
        return None
    if (not isinstance(reply, redis.ResponseError) or isinstance(reply, _E.NoScriptError)
            or is_transient(reply) or is_group_gone(reply)):
        raise reply
    if is_fatal_reply(reply):
        raise cannot_work(reply)
    return f"{type(reply).__name__}: {short(reply)}"


def cannot_work(exc: BaseException) -> CannotWork:
    return CannotWork(f"{type(exc).__name__}: {short(exc)}")


def short(exc: BaseException, limit: int = 300) -> str:
    return " ".join(str(exc).split())[:limit]
