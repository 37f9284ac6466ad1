"""`GET /v1/admin/usage?tenant=T&since=YYYY-MM-DD`: each tenant's usage per model and UTC day
(`qworker_client.usage`). A keys file's admin tenant, or an open gateway, sees every tenant's;
any other tenant's key only its own; a plain `--api-key` key none (403). And the tenant gauges of
`/metrics`, for the keys file's tenants only."""

from __future__ import annotations

import datetime as dt

from starlette.requests import Request
from starlette.responses import JSONResponse

from qworker_client.gateway import owners
from qworker_client.gateway.errors import APIError, bad_request
from qworker_client.gateway.service import Gateway
from qworker_client.usage import COUNTERS, days_since, parse_day, rows_of


async def usage_route(gateway: Gateway, request: Request) -> JSONResponse:
    tenant = owners.caller_tenant(request)
    wanted = request.query_params.get("tenant")
    if tenant is not None and not tenant.admin:
        if wanted not in (None, tenant.name):
            raise APIError(403, "a tenant's key reads only its own usage",
                           type="permission_error", code="tenant_not_allowed")
        wanted = tenant.name
    elif tenant is None and owners.caller(request) is not None:
        raise APIError(403, "usage is read with a keys file's key", type="permission_error",
                       code="tenant_not_allowed")
    today = dt.datetime.now(dt.timezone.utc).date()
    try:
        since = parse_day(request.query_params.get("since") or today.isoformat())
    except ValueError as exc:
        raise bad_request(str(exc), param="since") from None
    days = days_since(since, today)
    pipe = gateway.redis.pipeline(transaction=False)
    for day in days:
        pipe.hgetall(gateway.keys.usage(day))
    rows = rows_of(days, await pipe.execute(), wanted)
    return JSONResponse({"object": "list", "data": [row.to_dict() for row in rows]})


async def export_tenant_usage(gateway: Gateway) -> None:
    """Today's usage of each tenant of the keys file into the gauges (no other tenant: a label
    per tenant a producer names would be unbounded)."""
    if gateway.keys_file is None:
        return
    known = gateway.keys_file.tenants
    today = dt.datetime.now(dt.timezone.utc).date().isoformat()
    counts = await gateway.redis.hgetall(gateway.keys.usage(today))
    totals = {(t, c): 0 for t in known for c in COUNTERS}
    for row in rows_of([today], [counts], None):
        if row.tenant in known:
            for c in COUNTERS:
                totals[(row.tenant, c)] += getattr(row, c)
    for (t, c), n in totals.items():
        gateway.metrics.tenant_usage.labels(t, c).set(n)
