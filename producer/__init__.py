"""qworker's client library: submit jobs to the Redis queue and follow their output.

Needs only redis-py and pydantic (through `qworker.protocol`), never torch.
"""

from producer.aio import AsyncJob, AsyncProducer
from producer.client import Job, Producer
from producer.connect import ClientOptions
from producer.result import JobError, JobTimeoutError, Result, Timings, Usage
from producer.stats import Stats, StreamStats
from qworker.protocol import DoneEvent, ErrorEvent, JobValidationError, TokenEvent

__all__ = [
    "AsyncJob", "AsyncProducer", "ClientOptions", "DoneEvent", "ErrorEvent", "Job", "JobError",
    "JobTimeoutError", "JobValidationError", "Producer", "Result", "Stats", "StreamStats",
    "Timings", "TokenEvent", "Usage",
]
