"""A table of bad jobs, submitted between valid ones to one worker: each bad one gets its error
event (when it has a usable id) and a dead-letter entry, the valid ones finish, the worker stays up,
and nothing is written outside the prefix."""

from __future__ import annotations

import json

import redis

from qworker.service.intake import MAX_DEAD_VALUE_BYTES
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

P = {b"prompt": b"hello"}
BAD: list[tuple[str, dict[bytes, bytes], str]] = [
    # (name, fields without id, expected code)
    ("no-prompt", {b"max_tokens": b"5"}, "invalid_request"),
    ("prompt-and-messages", {**P, b"messages": b'[{"role":"user","content":"x"}]'},
     "invalid_request"),
    ("prompt-and-ids", {**P, b"prompt_token_ids": b"[1,2]"}, "invalid_request"),
    ("empty-prompt", {b"prompt": b""}, "invalid_request"),
    ("bad-json-messages", {b"messages": b'[{"role":'}, "invalid_request"),
    ("messages-not-list", {b"messages": b'{"role":"user","content":"x"}'}, "invalid_request"),
    ("messages-empty", {b"messages": b"[]"}, "invalid_request"),
    ("messages-bad-role", {b"messages": b'[{"role":"wizard","content":"x"}]'}, "invalid_request"),
    ("messages-extra-key", {b"messages": b'[{"role":"user","content":"x","name":"a"}]'},
     "invalid_request"),
    ("messages-content-int", {b"messages": b'[{"role":"user","content":5}]'}, "invalid_request"),
    ("ids-strings", {b"prompt_token_ids": b'["a"]'}, "invalid_request"),
    ("ids-negative", {b"prompt_token_ids": b"[-1]"}, "invalid_request"),
    ("ids-empty", {b"prompt_token_ids": b"[]"}, "invalid_request"),
    ("ids-huge", {b"prompt_token_ids": b"[1099511627776]"}, "invalid_request"),
    ("ids-float", {b"prompt_token_ids": b"[1.5]"}, "invalid_request"),
    ("ids-outside-vocab", {b"prompt_token_ids": b"[300]"}, "invalid_request"),
    ("max-tokens-zero", {**P, b"max_tokens": b"0"}, "invalid_request"),
    ("max-tokens-word", {**P, b"max_tokens": b"many"}, "invalid_request"),
    ("max-tokens-huge", {**P, b"max_tokens": b"9" * 30}, "invalid_request"),
    ("max-tokens-float", {**P, b"max_tokens": b"1.5"}, "invalid_request"),
    ("max-tokens-empty", {**P, b"max_tokens": b""}, "invalid_request"),
    ("temperature-negative", {**P, b"temperature": b"-1"}, "invalid_request"),
    ("temperature-nan", {**P, b"temperature": b"nan"}, "invalid_request"),
    ("temperature-inf", {**P, b"temperature": b"1e999"}, "invalid_request"),
    ("top-p-zero", {**P, b"top_p": b"0"}, "invalid_request"),
    ("seed-negative", {**P, b"seed": b"-1"}, "invalid_request"),
    ("seed-2-64", {**P, b"seed": str(2**64).encode()}, "invalid_request"),
    ("stop-too-many", {**P, b"stop": json.dumps(["s"] * 9).encode()}, "invalid_request"),
    ("stop-not-list", {**P, b"stop": b'"x"'}, "invalid_request"),
    ("stop-too-long", {**P, b"stop": json.dumps(["x" * 300]).encode()}, "invalid_request"),
    ("stop-empty-string", {**P, b"stop": b'[""]'}, "invalid_request"),
    ("ignore-eos-yes", {**P, b"ignore_eos": b"yes"}, "invalid_request"),
    ("unknown-field", {**P, b"foo": b"bar"}, "invalid_request"),
    ("min-over-max", {**P, b"max_tokens": b"3", b"min_tokens": b"4"}, "invalid_request"),
    ("penalty-zero", {**P, b"repetition_penalty": b"0"}, "invalid_request"),
    ("priority-huge", {**P, b"priority": b"10000000000"}, "invalid_request"),
    ("prompt-non-utf8", {b"prompt": b"\xff\xfe\xfd"}, "invalid_request"),
    ("field-name-non-utf8", {**P, b"\xff": b"1"}, "invalid_request"),
    ("prompt-over-model", {b"prompt": b"y" * 300}, "prompt_too_long"),
    ("prompt-over-cap", {b"prompt": b"z" * 1_000_001}, "invalid_request"),
    ("deadline-past", {**P, b"deadline_ms": b"1000"}, "expired"),
]
BAD_IDS: list[tuple[str, dict[bytes, bytes]]] = [
    ("id-with-space", {b"id": b"bad id", **P}),
    ("id-too-long", {b"id": b"x" * 129, **P}),
    ("id-empty", {b"id": b"", **P}),
    ("id-non-utf8", {b"id": b"\xff", **P}),
    ("id-slash", {b"id": b"a/b", **P}),
]


def test_bad_jobs_are_dead_lettered_and_the_worker_goes_on(redis_url: str) -> None:
    assert len(BAD) + len(BAD_IDS) >= 25
    client = redis.Redis.from_url(redis_url)
    engine = sim_engine("sim:step_ms=1,max_model_len=256")
    good: list[str] = []
    entry_of: dict[str, str] = {}
    with thread_worker(redis_url, "bad", engine, claim_idle_ms=1000) as w:
        cases = [(name, {b"id": name.encode(), **f}) for name, f, _ in BAD] + BAD_IDS
        for k, (name, fields) in enumerate(cases):
            entry_of[name] = client.xadd(KEYS.jobs, fields).decode()
            good_id = f"good-{k}"
            client.xadd(KEYS.jobs, {"id": good_id, "prompt": f"fine {k}", "max_tokens": "6"})
            good.append(good_id)
        wait_terminal(client, good + [name for name, _, _ in BAD])
        wait_for(lambda: client.xlen(KEYS.dead) == len(cases), what="dead letters")
        assert w.thread.is_alive()
        assert w.stop() == 0
    dead = {f[b"source_id"].decode(): f for _, f in client.xrange(KEYS.dead)}
    for name, fields, code in BAD:
        event = terminal(client, name)
        assert isinstance(event, ErrorEvent) and event.code == code, (name, event)
        assert len(client.xrange(KEYS.out(name))) == 1, name  # the error, nothing else
        entry = dead[entry_of[name]]
        assert entry[b"code"].decode() == code and entry[b"reason"], name
        for key, value in fields.items():  # original fields kept, long values cut (size noted)
            name_of = b"original." + key if key in (b"code", b"reason") else key
            assert entry[name_of] == value[:MAX_DEAD_VALUE_BYTES], name
            if len(value) > MAX_DEAD_VALUE_BYTES:
                assert entry[name_of + b"_truncated_bytes"] == str(len(value)).encode(), name
    for name, fields in BAD_IDS:
        entry = dead[entry_of[name]]
        assert entry[b"code"] == b"invalid_request" and entry[b"id"] == fields[b"id"], name
    for job_id in good:
        check_stream(client, job_id)
    assert group_pending(client) == 0
    assert client.xlen(KEYS.jobs) == 0
    outside = [k for k in client.scan_iter() if not k.startswith(b"qw:")]
    assert outside == []


def test_bad_job_error_names_the_field(redis_url: str) -> None:
    client = redis.Redis.from_url(redis_url)
    with thread_worker(redis_url, "mixed") as w:
        client.xadd(KEYS.jobs, {"id": "bad-1", "prompt": "x", "top_k": "-3"})
        client.xadd(KEYS.jobs, {"id": "ok-1", "prompt": "x", "max_tokens": "4"})
        got = wait_terminal(client, ["bad-1", "ok-1"], timeout=10)
        assert isinstance(got["bad-1"], ErrorEvent) and "top_k" in got["bad-1"].message
        assert w.stop() == 0
    check_stream(client, "ok-1")
