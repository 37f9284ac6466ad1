"""A step's large buffers are reused by the next steps, not faulted in again as fresh pages
(each case in a process of its own: the allocator's settings are the whole process's)."""

from __future__ import annotations

import json
import subprocess
import sys

STEP = """
import json, resource, sys, torch
from qworker.engine.step_memory import keep_step_buffers
def step():  # buffers of a few sizes above glibc's largest adaptive mmap threshold (32 MB)
    a = torch.empty(40 << 20, dtype=torch.uint8).fill_(1)
    b = torch.empty(80 << 20, dtype=torch.uint8).fill_(1)
    c = torch.empty(20 << 20, dtype=torch.uint8).fill_(1)
    del a
    d = torch.empty(30 << 20, dtype=torch.uint8).fill_(1)
def faults():
    before = resource.getrusage(resource.RUSAGE_SELF).ru_minflt
    step()
    return resource.getrusage(resource.RUSAGE_SELF).ru_minflt - before
kept = keep_step_buffers() if sys.argv[1] == "keep" else None
print(json.dumps({"kept": kept, "faults": [faults() for _ in range(6)]}))
"""
def _steps(mode: str) -> dict[str, object]:
    out = subprocess.run([sys.executable, "-c", STEP, mode], capture_output=True, text=True,
                         timeout=120, check=True).stdout
    return json.loads(out.splitlines()[-1])


def test_after_the_warm_up_steps_fault_almost_none_of_their_buffers() -> None:
    kept, plain = _steps("keep"), _steps("plain")
    assert kept["kept"] is True
    later_kept, later_plain = kept["faults"][-3:], plain["faults"][-3:]  # type: ignore[index]
    assert sum(later_plain) > 0  # the default: mapped afresh again and again
    # (counted in faults, not bytes: a machine with transparent huge pages faults 2 MB at once)
    assert sum(later_kept) * 10 < sum(later_plain), (kept, plain)
