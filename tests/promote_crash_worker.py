"""A test worker process that dies while it promotes delayed jobs.

`python -m tests.promote_crash_worker URL NAME CRASH_LOG`: a `qworker serve`-like worker on the
simulated engine (1 ms steps, claim-idle 300 ms, a look for due jobs every 50 ms). The first time
it looks and jobs are due, it sends the promote script to Redis and SIGKILLs itself before the
reply comes: no exception, no cleanup, as a segfault or an OOM kill in the middle of the call
(Redis still runs the script it has received: all of its moves or none). Before that it appends
`<name> <jobs due>` to CRASH_LOG. Only tests start it; nothing of it is in the product.
"""

from __future__ import annotations

import os
import signal
import sys
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

import redis

from qworker.service.config import ServiceConfig
from qworker.service.scripts import Scripts
from qworker.service.worker import Worker
from tests.service_harness import sim_engine


@dataclass(frozen=True)
class DyingScripts(Scripts):
    crash_log: str = ""
    name: str = ""

    def promote(self, client: redis.Redis, *, delayed: str, delayed_jobs: str,
                streams: Sequence[str], count: int) -> tuple[int, int]:
        seconds, micros = client.time()
        due = int(client.zcount(delayed, "-inf", seconds * 1000 + micros // 1000))
        if due == 0:
            return super().promote(client, delayed=delayed, delayed_jobs=delayed_jobs,
                                   streams=streams, count=count)
        with open(self.crash_log, "a") as log:
            log.write(f"{self.name} {due}\n")
            log.flush()
            os.fsync(log.fileno())
        connection = client.connection_pool.get_connection()
        connection.send_command("EVALSHA", self.promote_sha, 5, delayed, delayed_jobs, *streams,
                                count)
        os.kill(os.getpid(), signal.SIGKILL)
        raise AssertionError("unreachable")


def main(url: str, name: str, crash_log: str) -> int:
    config = ServiceConfig(redis_url=url, name=name, model="sim", claim_idle_ms=300,
                           delayed_poll_ms=50)
    worker = Worker(sim_engine("sim:step_ms=1"), config)
    worker.promoter.scripts = DyingScripts(crash_log=str(Path(crash_log)), name=name)
    signal.signal(signal.SIGTERM, lambda *_: worker.request_stop())
    return worker.run()


if __name__ == "__main__":
    sys.exit(main(*sys.argv[1:4]))
