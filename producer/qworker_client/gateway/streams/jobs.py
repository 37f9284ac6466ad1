"""`GET /v1/jobs/{job_id}` (its status) and `GET /v1/jobs/{job_id}/stream` (its stream again,
after `Last-Event-ID`, in the chunks it was first sent in). A resumed stream never cancels its
job when the client goes."""

from __future__ import annotations

from starlette.requests import Request
from starlette.responses import JSONResponse
from starlette.types import ASGIApp

from qworker_client.gateway import owners
from qworker_client.gateway.chat.completions import JOB_ID_HEADER
from qworker_client.gateway.errors import APIError, bad_request
from qworker_client.gateway.service import Gateway
from qworker_client.gateway.slots import SlotView
from qworker_client.gateway.streams import frames, meta
from qworker_client.gateway.streams.disconnect import EventStream
from qworker_client.gateway.streams.live import LiveStream
from qworker_client.gateway.streams.reader import OutputReader
from qworker_client.protocol import ID_PATTERN, TERMINAL_TYPES, is_valid_id, parse_entry_id
from qworker_client.result import START_ID
from qworker_client.status import job_status_async


def _job_id(request: Request) -> str:
    job_id = request.path_params["job_id"]
    if not is_valid_id(job_id):
        raise bad_request(f"invalid job id (want {ID_PATTERN})", param="job_id")
    return job_id


async def status(gateway: Gateway, request: Request) -> JSONResponse:
    job_id = _job_id(request)
    job = None
    if owners.caller(request) is not None or gateway.slots.cluster is not None:
        job = await _own_meta(gateway, request, job_id)  # with API keys: only the owner's
    view = gateway.slots.of(None if job is None else job.shape.model)
    found = await job_status_async(view.redis, view.keys, job_id)
    return JSONResponse(found.to_dict())


async def resume(gateway: Gateway, request: Request) -> ASGIApp:
    job_id = _job_id(request)
    job = await _own_meta(gateway, request, job_id)
    after = _after(request.headers.get("last-event-id"))
    follow = frames.Follow(shape=job.shape, index={job_id: job.index}, prompt={job_id: 0},
                            include_usage=job.include_usage, tagged=False, cancel=_keep,
                            coalesce=gateway.config.stream_interval_ms > 0)
    headers = {JOB_ID_HEADER: job_id}
    view = gateway.slots.of(job.shape.model)
    if await _ended_at_or_before(view, job_id, after):
        return EventStream(None, _keep, headers)  # only [DONE]
    reader = OutputReader(view.hub, {job_id: after})
    return EventStream(LiveStream(reader, follow, gateway.metrics), _keep, headers)


async def _own_meta(gateway: Gateway, request: Request, job_id: str) -> meta.JobMeta:
    """The job's gateway record, when the caller may see the job; else 404, whether the job is
    another key's, was queued straight into Redis (no record), or does not exist."""
    job = await meta.load(gateway.redis, gateway.keys.prefix, job_id)
    if job is None or not owners.may_see(job.owner, owners.caller(request)):
        raise APIError(404, f"no job {job_id} (unknown, expired, not submitted through the "
                       "gateway, or not this API key's)", param="job_id", code="job_not_found")
    return job


def _after(last_event_id: str | None) -> str:
    """The entry id to read after: `Last-Event-ID` without its `<choice>/` tag."""
    if not last_event_id:
        return START_ID
    entry = last_event_id.rpartition("/")[2].strip()
    if parse_entry_id(entry) is None:  # Redis' own bounds: a bad id would fail the hub's read
        raise bad_request("Last-Event-ID is not an event id of this stream", param="last-event-id")
    return entry


async def _ended_at_or_before(view: SlotView, job_id: str, after: str) -> bool:
    """Whether the stream's terminal event is at or before `after`: nothing is left to send."""
    last = await view.redis.xrevrange(view.keys.out(job_id), count=1)
    if not last or (last[0][1] or {}).get("type") not in TERMINAL_TYPES:
        return False
    end, seen = parse_entry_id(str(last[0][0])), parse_entry_id(after)
    return end is not None and seen is not None and end <= seen


async def _keep(*_: object) -> None:
    """A resumed stream leaves its job alone."""
