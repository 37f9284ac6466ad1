"""The worker's side of the append lease (lua.py, `append`): fencing once a step, not once a job.

Each append call sets `<prefix>:lease:<token>` to a value this worker never used before and
tells the script the value it set last. While Redis answers with that value, and no job was
taken from any worker since (`<prefix>:takeovers`), every job checked under the present lease
(its owner hash and next index compared, one by one) is still this worker's and its next index
is the one the worker knows: the script appends its events without reading anything of it.
A lost reply, a Redis restarted from an older copy, a failover that dropped writes, a flush or an
expired lease each leave another value there, and a takeover moves the counter: then every job
is checked one by one again, and the jobs that pass are trusted under a new epoch.

An output's TTL is renewed at most every `REFRESH_S` seconds while its job goes on, to its
`result_ttl` plus that: it lives at least `result_ttl` after its last event, as before."""

from __future__ import annotations

import time
from collections.abc import Iterable, Mapping

import redis

from qworker.service.outcome import OK
from qworker.service.scripts import Lease
from qworker_client.protocol import Keys

REFRESH_S = 10


class AppendLease:
    def __init__(self, keys: Keys, token: str, ttl_ms: int) -> None:
        self.key = keys.lease(token)
        self.takeovers_key = keys.takeovers
        self.ttl_ms = ttl_ms
        self._held = ""  # the value our last answered append set ('' none, or not known)
        self._takeovers = ""
        self._counter = 0
        self._epoch = 0
        self._checked: dict[str, tuple[int, int]] = {}  # job id -> (epoch it was checked in,
        # the index after its last token written)
        self._refreshed: dict[str, float] = {}  # job id -> when its output's TTL was renewed
        self._refreshing: dict[str, float] = {}  # renewals asked by the call under way

    def check_access(self, client: redis.Redis) -> None:
        """Set the lease to a value no append ever names, and read the counter: a worker whose
        ACL lacks these keys (set up before they existed) stops at start with Redis' refusal,
        instead of failing every job's append."""
        self._held = ""
        pipe = client.pipeline(transaction=False)
        pipe.set(self.key, "", px=self.ttl_ms)
        pipe.execute_command("MGET", self.key, self.takeovers_key)  # see Publisher.flush
        pipe.execute()

    def next_call(self) -> Lease:
        self._counter += 1
        self._refreshing = {}
        return Lease(self.key, self.takeovers_key, self._held, self._takeovers,
                     str(self._counter), self.ttl_ms)

    def trusted(self, job_id: str, first_index: int | None) -> bool:
        """Checked under the present epoch, and its first token now (if any) is the one after
        the last written: a resend of events already written is never trusted."""
        checked = self._checked.get(job_id)
        return (checked is not None and checked[0] == self._epoch
                and first_index in (None, checked[1]))

    def refresh_s(self, job_id: str, ttl_s: int) -> int:
        """The TTL this call gives the job's output while it goes on: 0 (leave it) until
        REFRESH_S have passed since the last renewal."""
        now = time.monotonic()
        last = self._refreshed.get(job_id)
        if last is not None and now - last < REFRESH_S:
            return 0
        self._refreshing[job_id] = now
        return ttl_s + REFRESH_S

    def answered(self, lease: Lease, takeovers: str, trusted: bool,
                 status: Mapping[str, str], next_index: Mapping[str, int]) -> None:
        """The call that used `lease` was answered: `status` per job it appended, and the index
        after each one's last token written."""
        self._held, self._takeovers = lease.next, takeovers
        if not trusted:
            self._epoch += 1  # every job not checked by this call is checked again
        for job_id, outcome in status.items():
            if outcome == OK:
                self._checked[job_id] = (self._epoch, next_index[job_id])
                if job_id in self._refreshing:
                    self._refreshed[job_id] = self._refreshing[job_id]
            else:
                self.forget(job_id)

    def unknown(self) -> None:
        """What our last calls set is not known (answered one job at a time): check them all."""
        self._held = ""

    def forget(self, job_id: str) -> None:
        self._checked.pop(job_id, None)
        self._refreshed.pop(job_id, None)

    def keep_only(self, job_ids: Iterable[str]) -> None:
        """Forget the jobs this worker no longer holds."""
        live = set(job_ids)
        for job_id in [j for j in self._checked if j not in live]:
            self.forget(job_id)
        for job_id in [j for j in self._refreshed if j not in live]:
            self._refreshed.pop(job_id)
