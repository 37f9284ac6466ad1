"""qworker's client library: submit jobs to the Redis queue and follow their output.

Needs only redis-py and pydantic (through `qworker_client.protocol`), never torch.
"""

from qworker_client.aio import AsyncJob, AsyncProducer
from qworker_client.client import Job, Producer
from qworker_client.connect import ClientOptions
from qworker_client.protocol import DoneEvent, ErrorEvent, JobValidationError, TokenEvent
from qworker_client.result import JobError, JobTimeoutError, Result, Timings, Usage
from qworker_client.stats import Stats, StreamStats

__all__ = [
    "AsyncJob", "AsyncProducer", "ClientOptions", "DoneEvent", "ErrorEvent", "Job", "JobError",
    "JobTimeoutError", "JobValidationError", "Producer", "Result", "Stats", "StreamStats",
    "Timings", "TokenEvent", "Usage",
]
