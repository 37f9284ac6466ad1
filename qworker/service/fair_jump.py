"""Fair preemption: a tenant that comes while another fills the fleet starts at once, not when the
other's jobs end.

A worker whose engine has no room for its normal band still offers, between two steps, to take
jobs from the front of that band's fair order (lua_fair.py, `jump`): the read hands one over when
its tenant, one job more, would still run no more over its weight on this worker than the tenant
that runs the most over its weight, one job fewer. The worker then preempts the newest of that
tenant's jobs here (requeued, recomputed where it stopped: nothing is lost) and starts the new
one. A tenant alone never preempts itself, and two tenants never trade jobs back and forth: the
rule holds after the swap. The high band already displaces the normal one in the engine (priority);
the low band preempts nothing.
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from typing import Any

from qworker.service.job import ActiveJob, Entry
from qworker.service.lua_fair import JUMPED
from qworker_client.protocol import Keys

JUMPS_PER_READ = 16  # the most jobs one read hands a full worker (lua_fair looks at 16)
# a full worker offers at most this often: a round trip between two steps (each step would cost
# Redis a few commands a step, and the loop a round trip, for nothing while one tenant runs alone)
OFFER_EVERY_S = 0.05
NORMAL_BAND = ""


@dataclass(frozen=True)
class Jumps:
    """A full worker's offer (the fair read's last argument)."""

    positions: tuple[int, ...]  # 1-based, among the read's streams: the normal band's job streams
    running: dict[str, int]  # the normal band's jobs running on the worker, per tenant
    most: int = JUMPS_PER_READ

    def arg(self) -> str:
        counts = " ".join(f"{tenant} {n}" for tenant, n in sorted(self.running.items()))
        return f"{self.most} {','.join(map(str, self.positions))} {counts}".strip()


NO_JUMPS = "0"  # the argument when there is no offer


def offer(jobs: Iterable[ActiveJob], streams: Sequence[str], keys: Keys) -> Jumps | None:
    """The offer of a worker whose normal band has no room: None when no preemption could
    make one (no tenant runs two jobs of that band here)."""
    running = Counter(job.job.tenant_or_default for job in jobs
                      if job.in_engine and keys.stream_band(job.entry.stream) == NORMAL_BAND)
    if not running or max(running.values()) < 2:
        return None
    positions = tuple(k for k, stream in enumerate(streams, start=1)
                      if not keys.is_requeue(stream) and keys.stream_band(stream) == NORMAL_BAND)
    return Jumps(positions, dict(running)) if positions else None


def split_jumped(reply: Any) -> tuple[Any, dict[str, str]]:
    """A fair read's reply without its `~jumped` element, and that element as entry id -> the
    tenant to preempt for it."""
    if not reply:
        return reply, {}
    kept, victims = [], {}
    for element in reply:
        if _text(element[0]) == JUMPED:
            flat = [_text(v) for v in element[1]]
            victims = dict(zip(flat[::2], flat[1::2], strict=True))
        else:
            kept.append(element)
    return kept, victims


def mark_jumped(entries: Sequence[Entry], victims: dict[str, str]) -> None:
    for entry in entries:
        entry.displaces = victims.get(entry.entry_id)


def newest_of(jobs: Sequence[ActiveJob], tenant: str, keys: Keys) -> ActiveJob | None:
    """The job to preempt for a tenant's: its newest on this worker in the normal band (the
    least to recompute, as the engine preempts the newest of equals)."""
    found = [job for job in jobs if job.in_engine and job.job.tenant_or_default == tenant
             and keys.stream_band(job.entry.stream) == NORMAL_BAND]
    return found[-1] if found else None  # the jobs table is in the order they started here


def _text(value: object) -> str:
    return value.decode() if isinstance(value, bytes) else str(value)
