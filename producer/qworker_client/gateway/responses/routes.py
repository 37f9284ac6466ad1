"""`/v1/responses`: create, retrieve (whole, or as its stream from any event), cancel, delete, and
its input items. A response is a chat job and its record in Redis (`record.py`): any gateway
serves any response, and a background one is followed by whichever gateway is asked."""

from __future__ import annotations

import time
from collections.abc import AsyncIterator
from typing import Any

import anyio
from starlette.requests import Request
from starlette.responses import JSONResponse, Response, StreamingResponse

from qworker_client.gateway import owners
from qworker_client.gateway.chat.completions import CLIENT_CLOSED, JOB_ID_HEADER, read_json
from qworker_client.gateway.chat.shaping import Shape
from qworker_client.gateway.chat.translate import Choice, GatewayRequest
from qworker_client.gateway.errors import APIError, bad_request, from_job_error
from qworker_client.gateway.responses import items, record, shape
from qworker_client.gateway.responses.events import Event, ResponseEvents
from qworker_client.gateway.responses.follow import live, replay, settle, settled
from qworker_client.gateway.responses.record import MAX_CHAIN_DEPTH, StoredResponse
from qworker_client.gateway.responses.request import Create, parse_create
from qworker_client.gateway.service import Gateway
from qworker_client.gateway.streams.disconnect import until_disconnect
from qworker_client.gateway.streams.sse import HEADERS, MEDIA_TYPE, encode
from qworker_client.gateway.streams.vanished import Queued
from qworker_client.gateway.tenants import Tenant

MAX_INPUT_ITEMS_LISTED = 100


async def create(gateway: Gateway, request: Request) -> Response:
    body = parse_create(await read_json(request))
    owner = owners.caller(request)
    history, depth = await _chain(gateway, request, body)
    await gateway.catalog.check(body.model)
    tenant = await gateway.admit_tenant(owners.caller_tenant(request), body.model,
                                        [int(body.job.get("priority", 0))])
    await gateway.gate.admit(body.model, 1)
    stored = _new(body, owner, history, depth)
    queued = await _submit(gateway, stored, body, tenant)
    headers = {JOB_ID_HEADER: stored.job_id}
    if body.background and not body.stream:
        return JSONResponse(shape.response_object(stored, "queued", []), headers=headers)
    events = ResponseEvents(stored)
    cancel_on_leave = not body.background
    if body.stream:
        return _event_stream(_sent(gateway, events, events.start(), queued, cancel_on_leave),
                             headers)

    async def abort() -> None:
        await gateway.cancel([stored.job_id], stored.model)

    async def whole() -> dict[str, Any]:
        async for _ in live(gateway, events, queued):
            pass
        await settle(gateway, events)
        return events.response()

    result = await until_disconnect(request.receive, whole, abort)
    if result is None:
        return Response(status_code=CLIENT_CLOSED)
    failed = events.state.error
    if failed is not None:  # as chat completions: the job's error is the request's
        raise from_job_error(failed.code, failed.message)
    return JSONResponse(result, headers=headers)


async def retrieve(gateway: Gateway, request: Request) -> Response:
    stored = await _own(gateway, request)
    if request.query_params.get("stream") not in ("true", "1"):
        return JSONResponse(await settled(gateway, stored))
    after = _starting_after(request.query_params.get("starting_after"))
    events = ResponseEvents(stored)
    first = [*events.start(), *await replay(gateway, events)]
    if stored.final is not None and not events.ended:  # its output stream expired first
        first += events.ended_as(stored.final)
    return _event_stream(_sent(gateway, events, first, None, False, after),
                         {JOB_ID_HEADER: stored.job_id})


async def cancel(gateway: Gateway, request: Request) -> JSONResponse:
    """Cancel a background response (its job); one that has ended is returned as it is."""
    stored = await _own(gateway, request)
    if not stored.background:
        raise bad_request("only a background response can be cancelled", param="response_id")
    current = await settled(gateway, stored)
    if stored.final is not None:
        return JSONResponse(current)
    stored.cancelled = True
    await record.update(gateway.redis, gateway.keys, stored, None)
    await gateway.cancel([stored.job_id], stored.model)
    return JSONResponse({**current, "status": "cancelled"})


async def delete(gateway: Gateway, request: Request) -> JSONResponse:
    stored = await _own(gateway, request)
    await record.delete(gateway.redis, gateway.keys, stored.id)
    return JSONResponse({"id": stored.id, "object": "response", "deleted": True})


async def input_items(gateway: Gateway, request: Request) -> JSONResponse:
    """The response's input items, newest first (`order=asc`: oldest), `limit` (1 to 100) from
    after the item `after`."""
    stored = await _own(gateway, request)
    found = list(stored.input)
    if request.query_params.get("order", "desc") != "asc":
        found.reverse()
    after = request.query_params.get("after")
    if after is not None:
        ids = [item["id"] for item in found]
        found = found[ids.index(after) + 1:] if after in ids else []
    limit = _limit(request.query_params.get("limit"))
    page = found[:limit]
    return JSONResponse({"object": "list", "data": page,
                         "first_id": page[0]["id"] if page else None,
                         "last_id": page[-1]["id"] if page else None,
                         "has_more": len(found) > limit})


async def _chain(gateway: Gateway, request: Request, body: Create
                 ) -> tuple[list[items.Message], int]:
    """The chat messages of the conversation before this response, and its chain's depth."""
    if body.previous_response_id is None:
        return [], 1
    previous = await _own(gateway, request, body.previous_response_id, "previous_response_id")
    await settled(gateway, previous)
    if previous.final is None:
        raise bad_request(f"the previous response {previous.id} has not ended yet",
                          param="previous_response_id")
    if previous.depth >= MAX_CHAIN_DEPTH:
        raise bad_request(f"a conversation may chain at most {MAX_CHAIN_DEPTH} responses: "
                          "start a new one", param="previous_response_id")
    history = [*previous.history, *items.messages(previous.input),
               *items.messages(previous.final.output)]
    return history, previous.depth + 1


def _new(body: Create, owner: owners.Owner, history: list[items.Message], depth: int
         ) -> StoredResponse:
    response_id = items.new_id("resp")
    return StoredResponse(
        id=response_id, job_id="resp-" + response_id.removeprefix("resp_"),
        created_at=int(time.time()), model=body.model, request=body.shown, input=body.input,
        history=history, depth=depth, owner=owner, background=body.background,
        store=body.store)


async def _submit(gateway: Gateway, stored: StoredResponse, body: Create,
                  tenant: Tenant | None) -> Queued | None:
    """The response's job queued, its record set beside it (when stored)."""
    spec = {**body.job, "id": stored.job_id, "messages": body.messages(stored.history)}
    job = GatewayRequest(kind="chat", response_id=stored.job_id, model=body.model,
                         choices=[Choice(0, 0, stored.job_id, spec)], stream=body.stream,
                         include_usage=False, detach=body.background)
    records = {record.key(gateway.keys, stored.id): stored.to_json()} if body.store else {}
    shown = Shape("chat", stored.job_id, body.model, stored.created_at)
    queued = await gateway.submit(job, shown, stored.owner, records, tenant)
    return queued.get(stored.job_id)


async def _sent(gateway: Gateway, events: ResponseEvents, first: list[Event],
                queued: Queued | None, cancel_on_leave: bool, after: int = -1
                ) -> AsyncIterator[str]:
    """The SSE frames of the events past sequence number `after`: `first`, then the live ones.
    A client that leaves first cancels the job when `cancel_on_leave`."""
    try:
        yield _frames(first, after)
        if not events.ended:
            async for found in live(gateway, events, queued):
                yield _frames(found, after)
        await settle(gateway, events)
    finally:
        if cancel_on_leave and not events.ended:
            with anyio.CancelScope(shield=True):
                await gateway.cancel([events.stored.job_id], events.stored.model)


def _frames(events: list[Event], after: int) -> str:
    return "".join(f"event: {e['type']}\ndata: {encode(e)}\n\n" for e in events
                   if e["sequence_number"] > after)


def _event_stream(frames: AsyncIterator[str], headers: dict[str, str]) -> StreamingResponse:
    return StreamingResponse(frames, media_type=MEDIA_TYPE, headers={**HEADERS, **headers})


async def _own(gateway: Gateway, request: Request, response_id: str | None = None,
               param: str = "response_id") -> StoredResponse:
    """The stored response, when the caller may see it; else 404 (another key's, deleted,
    expired, not stored, or never made)."""
    response_id = response_id or request.path_params["response_id"]
    stored = None
    if len(response_id) <= 128:
        stored = await record.load(gateway.redis, gateway.keys, response_id)
    if stored is None or not owners.may_see(stored.owner, owners.caller(request)):
        raise APIError(404, f"no response {response_id} (unknown, expired, deleted, not stored, "
                       "or not this API key's)", param=param, code="response_not_found")
    return stored


def _starting_after(value: str | None) -> int:
    if value is None:
        return -1
    try:
        after = int(value)
    except ValueError:
        raise bad_request("`starting_after` must be an integer", param="starting_after") from None
    if after < -1:
        raise bad_request("`starting_after` must be -1 or more", param="starting_after")
    return after


def _limit(value: str | None) -> int:
    if value is None:
        return 20
    if not value.isdigit() or not 1 <= int(value) <= MAX_INPUT_ITEMS_LISTED:
        raise bad_request(f"`limit` must be an integer from 1 to {MAX_INPUT_ITEMS_LISTED}",
                          param="limit")
    return int(value)
