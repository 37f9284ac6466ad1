"""`--on-done-rq-queue Q --on-done-rq-func pkg.mod.fn`: an RQ job for every finished job.

When a job's `done` event is written, the worker enqueues `fn({id, text, finish_reason, usage})`
on RQ queue `Q` with RQ's JSON serializer, on the worker's own Redis connection. Only these two
flags choose what runs and where: nothing from a job's fields does.

Delivery: the enqueue follows the `done` event (it cannot be in the same atomic step). A Redis
error keeps the callback pending and it is retried with the next finished job; a worker killed in
between loses it. The RQ job id is derived from the job (prefix, id, first-queued time) and
enqueued with `unique=True` where RQ supports it, so a second worker reporting the same finished
job (a zombie's late publish) does not run the callback twice.

`rq` is imported only when the flags are set.
"""

from __future__ import annotations

import contextlib
import hashlib
import inspect
import re
from collections import deque
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

import redis

from qworker.service.logs import get_logger
from qworker_client.protocol import DoneEvent

if TYPE_CHECKING:
    from qworker.service.job import ActiveJob

FUNC_PATH = re.compile(r"^[A-Za-z_][A-Za-z0-9_]*(\.[A-Za-z_][A-Za-z0-9_]*)+$")
MAX_PENDING = 10_000  # callbacks kept while Redis is down; the oldest are dropped beyond this
RESULT_TTL_S = 24 * 3600


@dataclass(frozen=True)
class OnDoneTarget:
    queue: str
    func: str

    def __post_init__(self) -> None:
        if not self.queue or not self.queue.strip():
            raise ValueError("--on-done-rq-queue must not be empty")
        if not FUNC_PATH.match(self.func):
            raise ValueError(f"--on-done-rq-func {self.func!r}: want a dotted path module.func")

    @classmethod
    def from_flags(cls, queue: str | None, func: str | None) -> OnDoneTarget | None:
        if queue is None and func is None:
            return None
        if queue is None or func is None:
            raise ValueError("--on-done-rq-queue and --on-done-rq-func go together")
        return cls(queue, func)


def callback_payload(job_id: str, done: DoneEvent) -> dict[str, Any]:
    return {
        "id": job_id,
        "text": done.text,
        "finish_reason": done.finish_reason,
        "usage": {"prompt_tokens": done.prompt_tokens,
                  "completion_tokens": done.completion_tokens},
    }


def rq_job_id(prefix: str, job_id: str, t0_ms: int) -> str:
    """An RQ-valid id (`[A-Za-z0-9_-]`), the same for every report of one run of one job."""
    digest = hashlib.sha256(f"{prefix}\0{job_id}\0{t0_ms}".encode()).hexdigest()[:32]
    return f"qworker-done-{digest}"


@dataclass
class OnDone:
    """Enqueues the callback of each finished job on the configured RQ queue."""

    target: OnDoneTarget
    prefix: str
    pending: deque[tuple[str, dict[str, Any]]] = field(default_factory=deque)

    def __post_init__(self) -> None:
        import rq.exceptions  # fails at startup when rq is missing
        from rq import Queue
        from rq.serializers import JSONSerializer

        self._serializer = JSONSerializer
        self._unique = "unique" in inspect.signature(Queue.enqueue_job).parameters  # rq >= 3
        self._duplicate: Any = getattr(rq.exceptions, "DuplicateJobError", ())  # rq >= 3
        self.log = get_logger(on_done_queue=self.target.queue)

    @classmethod
    def from_flags(cls, queue: str | None, func: str | None, prefix: str) -> OnDone | None:
        """None when neither flag is set; ValueError when they are wrong, ImportError without
        rq."""
        target = OnDoneTarget.from_flags(queue, func)
        return None if target is None else cls(target, prefix)

    def notify(self, client: redis.Redis, job: ActiveJob) -> None:
        """Called once a job's terminal event is in Redis; never raises for Redis errors."""
        last = job.outbox[-1] if job.outbox else None
        if isinstance(last, DoneEvent):
            if len(self.pending) >= MAX_PENDING:
                dropped, _ = self.pending.popleft()
                self.log.warning("on-done callback dropped", rq_job_id=dropped)
            rq_id = rq_job_id(self.prefix, job.job_id, job.t0_ms)
            self.pending.append((rq_id, callback_payload(job.job_id, last)))
        self.flush(client)

    def flush(self, client: redis.Redis) -> None:
        while self.pending:
            rq_id, payload = self.pending[0]
            try:
                self._enqueue(client, rq_id, payload)
            except redis.RedisError as exc:
                self.log.warning("on-done enqueue failed, will retry", error=str(exc)[:200],
                                 pending=len(self.pending))
                return
            except Exception:  # a bug here must not stop the worker
                self.log.exception("on-done enqueue failed, dropped", rq_job_id=rq_id)
            self.pending.popleft()

    def _enqueue(self, client: redis.Redis, rq_id: str, payload: dict[str, Any]) -> None:
        from rq import Queue

        queue = Queue(self.target.queue, connection=client, serializer=self._serializer)
        kwargs: dict[str, Any] = {"job_id": rq_id, "result_ttl": RESULT_TTL_S,
                                  "description": f"qworker on-done {payload['id']}"}
        if self._unique:
            kwargs["unique"] = True
        with contextlib.suppress(self._duplicate):  # already enqueued for this job
            queue.enqueue(self.target.func, payload, **kwargs)

