"""qworker: a queue-driven LLM inference worker."""

import os

__version__ = "0.1.0"

# OpenMP threads waiting at a barrier spin this many rounds (libgomp's default: 300,000, about a
# tenth of a second) before they sleep. A step's kernels meet at hundreds of barriers; on a shared
# or CPU-limited machine a spinning thread holds the core its preempted partner needs, and steps
# stretched up to 10x (docs/engine.md, "Prefix caching"). Read once, when libgomp loads with
# torch, so it must be set before torch is imported: importing qworker first does it; an
# operator's own GOMP_SPINCOUNT or OMP_WAIT_POLICY wins.
os.environ.setdefault("GOMP_SPINCOUNT", "20000")
