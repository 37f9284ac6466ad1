"""Structured output through a real redis-server: constrained jobs submitted with the client finish
inside their grammar; an invalid schema, regex or grammar is refused at intake (invalid_request,
dead-lettered) while the worker goes on."""

from __future__ import annotations

import json
import re

import redis

from qworker_client import Producer
from qworker_client.protocol import ErrorEvent
from tests.service_harness import (
    KEYS,
    check_stream,
    group_pending,
    sim_engine,
    terminal,
    thread_worker,
    wait_for,
    wait_terminal,
)

SCHEMA = {"type": "object", "properties": {"ok": {"type": "boolean"},
                                           "n": {"enum": [1, 2, 3]}},
          "required": ["ok", "n"], "additionalProperties": False}
GOOD = {
    "choice": {"choice": ["red", "green", "blue"]},
    "regex": {"regex": "[A-Z]{2}-[0-9]{3}"},
    "json": {"json": SCHEMA},
    "grammar": {"grammar": 'start: "x" NUM\nNUM: /[0-9]{2}/'},
}
INVALID = {
    "bad-regex": {"regex": "[a-"},
    "bad-schema": {"json": {"type": "objekt"}},
    "bad-ref": {"json": {"$ref": "#/definitions/missing"}},
    "bad-grammar": {"grammar": "start: nothing_here"},
}


def test_constrained_jobs_finish_in_their_grammar_and_invalid_ones_are_refused(
        redis_url: str) -> None:
    client = redis.Redis.from_url(redis_url)
    with thread_worker(redis_url, "structured", sim_engine("sim:step_ms=1")) as w, \
            Producer(redis_url) as producer:
        for name, so in [*GOOD.items(), *INVALID.items()]:
            producer.submit("hello", id=name, max_tokens=40, seed=2, structured_outputs=so)
        producer.submit("hello", id="plain", max_tokens=5)
        wait_terminal(client, [*GOOD, *INVALID, "plain"])
        wait_for(lambda: client.xlen(KEYS.dead) == len(INVALID), what="dead letters")
        assert w.stop() == 0
    texts = {name: check_stream(client, name).text for name in [*GOOD, "plain"]}
    assert texts["choice"] in ("red", "green", "blue")
    assert re.fullmatch("[A-Z]{2}-[0-9]{3}", texts["regex"]), texts["regex"]
    assert set(json.loads(texts["json"])) == {"ok", "n"}
    assert re.fullmatch("x[0-9]{2}", texts["grammar"]), texts["grammar"]
    dead = {f[b"id"].decode(): f for _, f in client.xrange(KEYS.dead)}
    for name in INVALID:
        event = terminal(client, name)
        assert isinstance(event, ErrorEvent) and event.code == "invalid_request", (name, event)
        assert event.message.startswith("structured_outputs: "), event.message
        assert dead[name][b"code"] == b"invalid_request"
    assert group_pending(client) == 0
