"""A test worker process whose engine dies like a segfault on a poison job.

`python -m tests.poison_worker URL NAME CRASH_LOG`: a `qworker serve`-like worker on the simulated
engine (20 ms steps, claim-idle 300 ms, --max-crashes 3, and --max-deliveries 2: innocent jobs
must not be charged for the deaths a poison job caused). When an engine step holds a sequence
whose prompt contains `POISON`, it appends `<name> <sequences in the step>` to CRASH_LOG and
SIGKILLs itself: no exception, no cleanup, as a segfault or an OOM kill. Only tests start it;
nothing of it is in the product.
"""

from __future__ import annotations

import os
import signal
import sys
from pathlib import Path

from qworker.engine.hash_runner import HashRunner
from qworker.engine.sequence import Sequence
from qworker.service.config import ServiceConfig
from qworker.service.worker import Worker
from tests.service_harness import sim_engine

TRIGGER = b"POISON"


class PoisonRunner(HashRunner):
    """The hash model, but a step with a poison sequence kills the process."""

    def __init__(self, inner: HashRunner, name: str, crash_log: Path) -> None:
        super().__init__(inner.max_context, inner.step_ms, inner.token_us, inner.eos_every)
        self.name, self.crash_log = name, crash_log

    def run(self, work: list[tuple[Sequence, int]]) -> dict[Sequence, int]:
        if any(TRIGGER in bytes(seq.token_ids[:seq.num_prompt_tokens]) for seq, _ in work):
            with open(self.crash_log, "a") as log:
                log.write(f"{self.name} {len(work)}\n")
                log.flush()
                os.fsync(log.fileno())
            os.kill(os.getpid(), signal.SIGKILL)
        return super().run(work)


def main(url: str, name: str, crash_log: str) -> int:
    engine = sim_engine("sim:step_ms=20")
    engine.runner = PoisonRunner(engine.runner, name, Path(crash_log))
    config = ServiceConfig(redis_url=url, name=name, model="sim", claim_idle_ms=300,
                           max_crashes=3, max_deliveries=2)
    worker = Worker(engine, config)
    signal.signal(signal.SIGTERM, lambda *_: worker.request_stop())
    return worker.run()


if __name__ == "__main__":
    sys.exit(main(*sys.argv[1:4]))
