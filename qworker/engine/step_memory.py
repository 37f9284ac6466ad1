"""The buffers each step allocates and frees, kept for the next step.

A step's activations are large (a 2,048-token step of a 1.5B model makes a 147 MB float32 MLP
output) and live for one step. glibc's malloc serves a block above its mmap threshold (which
adapts up to 32 MB) with a fresh mapping that it unmaps when freed, and hands the top of its heap
back past the trim threshold: every step then faults its buffers in again as zeroed pages
(workload v1 on a 1.5B model: 3.6 million page faults in 24 requests, 10% of the CPU in the
kernel). Raised once the model is loaded and its weights settled (`Engine.prepare`), the
thresholds keep those buffers in the heap (141 thousand faults, 1.19x the throughput): the
resident size then holds the largest step's buffers, as with the tcmalloc vLLM preloads.
"""

from __future__ import annotations

import ctypes

import structlog

log = structlog.get_logger()

M_TRIM_THRESHOLD, M_MMAP_THRESHOLD = -1, -3  # glibc's mallopt parameters
MAPPED_FROM = 512 << 20  # a block this large still gets its own mapping (a KV cache, a weight)
TRIMMED_PAST = 1 << 30  # free bytes at the heap's top handed back to the system past this


def keep_step_buffers() -> bool:
    """Hands the heap's free memory back (what loading left), then sets the thresholds; False
    (nothing changed) where the C library is not glibc."""
    libc = ctypes.CDLL(None)
    mallopt, malloc_trim = getattr(libc, "mallopt", None), getattr(libc, "malloc_trim", None)
    if mallopt is None or malloc_trim is None:
        return False
    malloc_trim(0)
    kept = bool(mallopt(M_MMAP_THRESHOLD, MAPPED_FROM)) and bool(mallopt(M_TRIM_THRESHOLD,
                                                                       TRIMMED_PAST))
    log.debug("step_buffers_kept", kept=kept, mapped_from=MAPPED_FROM, trimmed_past=TRIMMED_PAST)
    return kept
