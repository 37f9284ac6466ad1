"""`POST /v1/chat/completions` and `POST /v1/completions`: jobs queued, their output returned."""

from __future__ import annotations

import time
from typing import Any

from starlette.requests import Request
from starlette.responses import JSONResponse, Response
from starlette.types import ASGIApp

from qworker_client.gateway import owners
from qworker_client.gateway.body import parse_json
from qworker_client.gateway.chat.shaping import Shape
from qworker_client.gateway.chat.translate import GatewayRequest, Kind, translate
from qworker_client.gateway.metrics import Timing
from qworker_client.gateway.service import Gateway
from qworker_client.gateway.streams import frames
from qworker_client.gateway.streams.disconnect import EventStream, until_disconnect
from qworker_client.gateway.streams.live import LiveStream
from qworker_client.gateway.streams.reader import OutputReader
from qworker_client.result import START_ID

JOB_ID_HEADER = "x-qworker-job-id"
CLIENT_CLOSED = 499  # nginx's status for a client that left first: never seen by that client


ROUTES = {"chat": "/v1/chat/completions", "completion": "/v1/completions"}


async def complete(gateway: Gateway, request: Request, kind: Kind) -> ASGIApp:
    started = time.perf_counter()
    config = gateway.config
    req = translate(kind, await read_json(request), config.max_n, config.max_prompts,
                    config.max_jobs)
    await gateway.catalog.check(req.model)
    tenant = await gateway.admit_tenant(owners.caller_tenant(request), req.model,
                                        [int(c.spec.get("priority", 0)) for c in req.choices])
    timing = Timing(gateway.metrics, ROUTES[kind], req.model, started)  # a model of the catalog
    await gateway.gate.admit(req.model, len(req.choices))  # /metrics reads the depth itself
    shape = Shape(kind, req.response_id, req.model, int(time.time()), req.logprobs)
    queued = await gateway.submit(req, shape, owners.caller(request), tenant=tenant)
    job_ids = [c.job_id for c in req.choices]
    headers = {JOB_ID_HEADER: ",".join(job_ids)}

    async def abort() -> None:
        if not req.detach:
            await gateway.cancel(job_ids, req.model)

    reader = OutputReader(gateway.hub_of(req.model), dict.fromkeys(job_ids, START_ID), queued)
    follow = _follow(gateway, req, shape)
    if req.stream:
        return EventStream(LiveStream(reader, follow, gateway.metrics, timing), abort, headers)
    result = await until_disconnect(request.receive, lambda: frames.body(reader, follow), abort)
    if result is None:
        return Response(status_code=CLIENT_CLOSED)
    timing.done()  # the body is made: what is left is its send, the server's
    return JSONResponse(result, headers=headers)


def _follow(gateway: Gateway, req: GatewayRequest, shape: Shape) -> frames.Follow:
    return frames.Follow(
        shape=shape,
        index={c.job_id: c.index for c in req.choices},
        prompt={c.job_id: c.prompt_index for c in req.choices},
        include_usage=req.include_usage,
        tagged=len(req.choices) > 1,
        cancel=lambda job_ids: gateway.cancel(job_ids, req.model),
        coalesce=gateway.config.stream_interval_ms > 0,
    )


async def read_json(request: Request) -> Any:
    """The body's JSON (bounded in size by `body.LimitBody`, in nesting by `parse_json`)."""
    return parse_json(await request.body())
