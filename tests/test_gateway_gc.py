"""The gateway process's garbage collector settings (`gateway.gc_tuning`), in a process of its
own (freezing is for the whole process)."""

from __future__ import annotations

import subprocess
import sys

CHECK = """
import gc
from qworker_client.gateway.gc_tuning import GEN0_THRESHOLD, tune_gc
before = gc.get_threshold()
tune_gc()
assert gc.get_freeze_count() > 1000, gc.get_freeze_count()  # the imports' objects
assert gc.get_threshold() == (GEN0_THRESHOLD, *before[1:]), gc.get_threshold()
assert GEN0_THRESHOLD > before[0]
"""


def test_tune_gc_freezes_what_is_alive_and_collects_the_young_less_often() -> None:
    subprocess.run([sys.executable, "-c", CHECK], check=True, timeout=60)
