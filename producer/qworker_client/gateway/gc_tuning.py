"""The gateway process's cyclic garbage collector, set for what it allocates.

Each read of the output streams makes a few thousand short-lived lists and tuples (hiredis' reply,
the batches, the frames' parts), nearly all freed by their reference counts; with Python's
default threshold (a collection every 700 container allocations) the collector still ran several
times per read, and each older-generation pass walked every object the imports had made
(starlette, pydantic, redis-py): about a seventh of the gateway's CPU under 256 streams. The
objects alive at startup are frozen (never walked again) and the youngest generation collected
every `GEN0_THRESHOLD` allocations; the older generations keep their ratios.
"""

from __future__ import annotations

import gc

GEN0_THRESHOLD = 20_000


def tune_gc(gen0_threshold: int = GEN0_THRESHOLD) -> None:
    """Freeze what is alive now and collect the youngest generation less often: call once the
    process has imported and built what it serves with."""
    assert gen0_threshold > 0, gen0_threshold
    gc.collect()
    gc.freeze()
    _, gen1, gen2 = gc.get_threshold()
    gc.set_threshold(gen0_threshold, gen1, gen2)
