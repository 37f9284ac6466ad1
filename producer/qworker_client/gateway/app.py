"""The gateway's ASGI app: routes, auth, metrics and errors in OpenAI's shape."""

from __future__ import annotations

import logging
from collections.abc import AsyncIterator, Awaitable, Callable
from contextlib import asynccontextmanager
from typing import Any

import redis
from starlette.applications import Starlette
from starlette.exceptions import HTTPException
from starlette.middleware import Middleware
from starlette.requests import Request
from starlette.responses import JSONResponse, Response
from starlette.routing import Mount, Route
from starlette.types import Receive, Scope, Send

from qworker_client.dashboard.app import create_dashboard
from qworker_client.gateway.auth import OWN_AUTH, RequireKey
from qworker_client.gateway.batches import routes as batch_routes
from qworker_client.gateway.body import LimitBody
from qworker_client.gateway.catalog import model_card, model_list
from qworker_client.gateway.chat.completions import complete
from qworker_client.gateway.config import GatewayConfig
from qworker_client.gateway.errors import APIError
from qworker_client.gateway.metrics import CountResponses
from qworker_client.gateway.responses import routes as responses
from qworker_client.gateway.service import Gateway
from qworker_client.gateway.streams import jobs
from qworker_client.gateway.streams.disconnect import RAW_SEND
from qworker_client.gateway.usage_route import export_tenant_usage, usage_route

log = logging.getLogger("qworker.gateway")
Handler = Callable[[Gateway, Request], Awaitable[Any]]


class GatewayApp(Starlette):
    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        scope[RAW_SEND] = send  # the server's, for the streams' body pieces (disconnect.py)
        await super().__call__(scope, receive, send)


def create_app(config: GatewayConfig) -> Starlette:
    gateway = Gateway(config)

    def route(path: str, handler: Handler, method: str = "GET") -> Route:
        async def endpoint(request: Request) -> Any:
            return await handler(gateway, request)

        return Route(path, endpoint, methods=[method])

    @asynccontextmanager
    async def lifespan(_: Starlette) -> AsyncIterator[None]:
        if gateway.batches is not None:
            gateway.batches.resume_unfinished()
        await gateway.publish_tenants()
        yield
        await gateway.close()

    routes: list[Route | Mount] = [
        route("/v1/chat/completions", lambda g, r: complete(g, r, "chat"), "POST"),
        route("/v1/completions", lambda g, r: complete(g, r, "completion"), "POST"),
        route("/v1/models", _models),
        route("/v1/models/{model:path}", _model),
        route("/v1/jobs/{job_id}", jobs.status),
        route("/v1/jobs/{job_id}/stream", jobs.resume),
        route("/v1/responses", responses.create, "POST"),
        route("/v1/responses/{response_id}", responses.retrieve),
        route("/v1/responses/{response_id}", responses.delete, "DELETE"),
        route("/v1/responses/{response_id}/cancel", responses.cancel, "POST"),
        route("/v1/responses/{response_id}/input_items", responses.input_items),
        route("/v1/files", batch_routes.upload, "POST"),
        route("/v1/files/{file_id}", batch_routes.file_info),
        route("/v1/files/{file_id}/content", batch_routes.file_content),
        route("/v1/batches", batch_routes.create_batch, "POST"),
        route("/v1/batches/{batch_id}", batch_routes.get_batch),
        route("/v1/batches/{batch_id}/cancel", batch_routes.cancel_batch, "POST"),
        route("/v1/admin/usage", usage_route),
        route("/health", _health),
        route("/metrics", _metrics),
        Mount(OWN_AUTH, create_dashboard(config.redis_url, config.prefix, config.api_keys,
                                         config.admin_keys, config.result_ttl_s)),
    ]
    app = GatewayApp(
        routes=routes, lifespan=lifespan,
        middleware=[Middleware(CountResponses, metrics=gateway.metrics, routes=routes),
                    Middleware(RequireKey, keys=config.api_keys, keys_file=gateway.keys_file),
                    Middleware(LimitBody, max_bytes=config.max_body_bytes)],
        exception_handlers={APIError: _api_error, HTTPException: _http_error,
                            redis.RedisError: _redis_error, Exception: _server_error},
    )
    app.state.gateway = gateway
    return app


async def _models(gateway: Gateway, _: Request) -> JSONResponse:
    return JSONResponse(model_list(await gateway.catalog.models()))


async def _model(gateway: Gateway, request: Request) -> JSONResponse:
    model = request.path_params["model"]
    await gateway.catalog.check(model)
    return JSONResponse(model_card(model, (await gateway.catalog.models())[model]))


async def _health(gateway: Gateway, _: Request) -> JSONResponse:
    try:
        await gateway.redis.ping()
    except redis.RedisError as exc:
        return JSONResponse({"status": "redis unreachable", "error": str(exc)}, status_code=503)
    return JSONResponse({"status": "ok"})


async def _metrics(gateway: Gateway, _: Request) -> Response:
    models = [None, *await gateway.catalog.models()]  # model-less, and each live model's
    gateway.metrics.queue_depth.set(await gateway.gate.unfinished(models))
    await export_tenant_usage(gateway)
    content, media_type = gateway.metrics.exposition()
    return Response(content, media_type=media_type)


async def _api_error(_: Request, exc: Exception) -> Response:
    assert isinstance(exc, APIError)
    return exc.response()


async def _http_error(_: Request, exc: Exception) -> Response:
    assert isinstance(exc, HTTPException)
    kind = "invalid_request_error" if exc.status_code < 500 else "server_error"
    return APIError(exc.status_code, str(exc.detail), type=kind).response()


async def _redis_error(_: Request, exc: Exception) -> Response:
    log.warning("redis failed under a request: %s: %s", type(exc).__name__, exc)
    return APIError(503, f"the queue is unreachable ({type(exc).__name__}); retry later",
                    type="server_error", code="redis_unavailable").response()


async def _server_error(_: Request, exc: Exception) -> Response:
    log.exception("request failed", exc_info=exc)
    return APIError(500, f"internal error: {type(exc).__name__}", type="server_error").response()
