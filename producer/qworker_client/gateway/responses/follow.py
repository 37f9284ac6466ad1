"""A response's events from its job's output stream: what the stream holds now (`replay`), then
what the hub's reads bring (`live`), until the job's end; and the record brought up to date once
its end is seen (`settle`)."""

from __future__ import annotations

from collections.abc import AsyncIterator
from typing import Any, cast

from qworker_client.gateway.responses import record, shape
from qworker_client.gateway.responses.events import Event, ResponseEvents
from qworker_client.gateway.service import Gateway
from qworker_client.gateway.streams.hub import Mailbox
from qworker_client.gateway.streams.vanished import Queued


async def replay(gateway: Gateway, events: ResponseEvents) -> list[Event]:
    """The events of what the job's output stream holds now (no wait)."""
    found: list[Event] = []
    view = gateway.slots.of(events.stored.model)
    entries = await view.redis.xrange(view.keys.out(events.stored.job_id))
    for entry_id, fields in cast(list[tuple[str, dict[str, str]]], entries or []):
        found += events.entry(entry_id, fields)
        if events.ended:
            break
    return found


async def live(gateway: Gateway, events: ResponseEvents, queued: Queued | None = None
               ) -> AsyncIterator[list[Event]]:
    """The events of each read that brings any, from after the last entry taken, until the job
    has ended (a job whose state vanished ends with `lost_state`, as the hub finds it)."""
    job_id = events.stored.job_id
    mailbox = Mailbox()
    hub = gateway.hub_of(events.stored.model)
    hub.follow({job_id: events.state.last_id}, mailbox,
                       None if queued is None else {job_id: queued})
    try:
        while not events.ended:
            for item in await mailbox.take():
                if isinstance(item, BaseException):
                    raise item
                found: list[Event] = []
                for entry_id, listed in item[1]:
                    found += events.entry(entry_id, dict(zip(listed[::2], listed[1::2],
                                                             strict=True)))
                if found:
                    yield found
    finally:
        hub.drop([job_id], mailbox)


async def settle(gateway: Gateway, events: ResponseEvents) -> None:
    """Keep the response's end in its record, once seen (the record's TTL starts again: a
    response is kept the result TTL from its end)."""
    stored = events.stored
    if events.final is None or stored.final is not None:
        return
    stored.final = events.final
    if stored.store:
        await record.update(gateway.redis, gateway.keys, stored, gateway.config.result_ttl_s)


async def settled(gateway: Gateway, stored: record.StoredResponse) -> dict[str, Any]:
    """The response object as its record and its job's output stream hold it now; its end
    kept in the record (`stored.final`) when seen."""
    if stored.final is None:
        events = ResponseEvents(stored)
        events.start()
        await replay(gateway, events)
        await settle(gateway, events)
        if stored.final is None:
            return events.response()
    return shape.response_object(stored, stored.final.status, [], stored.final)
