"""The gateway's Prometheus metrics: requests, responses by status, streams open, queue depth,
and the latency of completions by model: the time to a stream's first chunk, a request's duration.

What changes per request or per read is counted in plain ints and dicts and put into the
Prometheus objects when scraped: a Counter's or a Gauge's inc takes a lock, and their `labels`
looks its child up, several times per request (the streamed-tokens count alone was 2% of the
gateway's CPU, counted per read).

A request's route label is the path of the app's route it matches (`/v1/jobs/{job_id}`), or
`other`: the labels are as few as the routes, whatever paths clients make up. The latencies'
`model` label is a model of the catalog (a completion is timed only once its model has passed
`Catalog.check`: a live worker's or a declared one), and their `route` one of the two completion
routes: as few labels as the fleet has models."""

from __future__ import annotations

import time
from collections import Counter as Tally
from collections.abc import Sequence

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, generate_latest
from prometheus_client.exposition import CONTENT_TYPE_LATEST
from starlette.routing import Match, Mount, Route
from starlette.types import ASGIApp, Message, Receive, Scope, Send

OTHER_ROUTE = "other"  # the label of every path that is no route of the app
# seconds, as vLLM's time-to-first-token and end-to-end request latency buckets (fewer of them)
FIRST_CHUNK_BUCKETS = (0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 20.0, 40.0, 80.0,
                       160.0, 640.0)
REQUEST_BUCKETS = (0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 20.0, 40.0, 80.0, 160.0, 320.0, 640.0,
                   1280.0, 2560.0)


class Metrics:
    def __init__(self) -> None:
        self.registry = CollectorRegistry()
        self.requests = Counter("qworker_gateway_requests", "HTTP requests, by route",
                                ["route"], registry=self.registry)
        self.responses = Counter("qworker_gateway_responses", "HTTP responses, by status",
                                 ["status"], registry=self.registry)
        self.streams_open = Gauge("qworker_gateway_streams_open", "event streams being sent",
                                  registry=self.registry)
        self.queue_depth = Gauge("qworker_gateway_queue_depth",
                                 "unfinished jobs when last looked at", registry=self.registry)
        self.tokens = Counter("qworker_gateway_streamed_tokens", "token events passed on",
                              registry=self.registry)
        # labelled only with the keys file's tenants: bounded
        self.tenant_usage = Gauge("qworker_tenant_usage_today",
                                  "a tenant's usage today (UTC), all models, as the workers "
                                  "counted it", ["tenant", "counter"], registry=self.registry)
        self.first_chunk = Histogram(
            "qworker_gateway_first_chunk_seconds", "a streamed completion: from its request's "
            "arrival to its first chunk of events, by model", ["model"],
            buckets=FIRST_CHUNK_BUCKETS, registry=self.registry)
        self.request_seconds = Histogram(
            "qworker_gateway_request_seconds", "a completion request (streamed or not): from its "
            "arrival to its response's last byte, by route and model", ["route", "model"],
            buckets=REQUEST_BUCKETS, registry=self.registry)
        self.open_streams = 0  # put in `streams_open` when scraped
        self._tokens = 0  # counted per read of a stream; put in `tokens` when scraped
        self._routes: Tally[str] = Tally()
        self._statuses: Tally[str] = Tally()

    def count_tokens(self, n: int) -> None:
        self._tokens += n

    def count_request(self, route: str) -> None:
        self._routes[route] += 1

    def count_response(self, status: int) -> None:
        self._statuses[str(status)] += 1

    def exposition(self) -> tuple[bytes, str]:
        self.tokens.inc(self._tokens)
        self._tokens = 0
        for counter, tally in ((self.requests, self._routes), (self.responses, self._statuses)):
            for label, n in tally.items():
                counter.labels(label).inc(n)
            tally.clear()
        self.streams_open.set(self.open_streams)
        return generate_latest(self.registry), CONTENT_TYPE_LATEST


class Timing:
    """One completion request's clock, from its arrival (`time.perf_counter`)."""

    def __init__(self, metrics: Metrics, route: str, model: str, started: float) -> None:
        self.metrics = metrics
        self.route = route
        self.model = model
        self.started = started
        self._first_seen = False

    def first_chunk(self) -> None:
        """A stream's chunk with tokens was written: the first one is observed."""
        if not self._first_seen:
            self._first_seen = True
            self.metrics.first_chunk.labels(self.model).observe(time.perf_counter() -
                                                                self.started)

    def done(self) -> None:
        """The response's last byte was written."""
        self.metrics.request_seconds.labels(self.route, self.model).observe(
            time.perf_counter() - self.started)


class CountResponses:
    """ASGI middleware: counts each HTTP request by route and its response by status."""

    def __init__(self, app: ASGIApp, metrics: Metrics, routes: Sequence[Route | Mount]
                 ) -> None:
        self.app = app
        self.metrics = metrics
        self.routes = routes

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        self.metrics.count_request(self._route(scope))

        async def counting(message: Message) -> None:
            if message["type"] == "http.response.start":
                self.metrics.count_response(message["status"])
            await send(message)

        await self.app(scope, receive, counting)

    def _route(self, scope: Scope) -> str:
        """The path of the route the request is for (any method), else `other`."""
        for route in self.routes:
            if route.matches(scope)[0] is not Match.NONE:
                return route.path
        return OTHER_ROUTE
