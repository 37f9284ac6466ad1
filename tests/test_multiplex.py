"""The shared multiplexed reader: many output streams in one XREAD a turn, each taken by the
client's rule (a repeated token index skipped, nothing after the first terminal event), with or
without decoded responses; an entry outside the protocol ends its job as `bad_event`, unless it is
a token entry."""

from __future__ import annotations

import pytest
import redis

from qworker_client.multiplex import BAD_EVENT, Multiplexer
from qworker_client.protocol import DoneEvent, ErrorEvent, Keys, TokenEvent, event_to_fields
from qworker_client.result import OutputEvent

KEYS = Keys("mx")


def done(text: str) -> DoneEvent:
    return DoneEvent(text=text, finish_reason="stop", prompt_tokens=1, completion_tokens=2,
                     queue_ms=0, ttft_ms=1, total_ms=2)


def write(client: redis.Redis, job_id: str, *events: OutputEvent | dict[str, str]) -> None:
    for event in events:
        client.xadd(KEYS.out(job_id), event if isinstance(event, dict) else event_to_fields(event))


def read_all(reader: Multiplexer, turns: int = 10) -> list[tuple[str, OutputEvent]]:
    got: list[tuple[str, OutputEvent]] = []
    for _ in range(turns):
        if not reader:
            break
        got += reader.read()
    return got


def token(i: int, text: str) -> TokenEvent:
    return TokenEvent(i=i, token_id=100 + i, text=text)


@pytest.mark.parametrize("decode", [True, False])
def test_many_streams_each_by_the_clients_rule(redis_url: str, decode: bool) -> None:
    client = redis.Redis.from_url(redis_url, decode_responses=decode)
    # "a" rolls back: indices 1 and 2 again, then a second done; "b" ends with an error
    write(client, "a", token(0, "x"), token(1, "y"), token(2, "z"), token(1, "y"),
          token(2, "z"), done("xyz"), token(3, "!"), done("xyz!"))
    write(client, "b", token(0, "q"), ErrorEvent(code="boom", message="it broke"))
    write(client, "c", token(0, "open"))  # not ended: still followed
    reader = Multiplexer(client, KEYS, block_ms=50)
    for job_id in "abc":
        reader.follow(job_id)
    got = reader.read()
    by_job = {job: [e for j, e in got if j == job] for job in "abc"}
    assert [e.i for e in by_job["a"] if isinstance(e, TokenEvent)] == [0, 1, 2]
    assert [type(e) for e in by_job["a"]][-1] is DoneEvent and len(by_job["a"]) == 4
    assert by_job["a"][-1] == done("xyz")
    assert by_job["b"] == [token(0, "q"), ErrorEvent(code="boom", message="it broke")]
    assert by_job["c"] == [token(0, "open")]
    assert list(reader.open) == ["c"] and len(reader) == 1
    assert reader.read() == []  # blocks block_ms: nothing new
    write(client, "c", token(1, " more"), done("open more"))
    assert [e for _, e in read_all(reader)] == [token(1, " more"), done("open more")]
    assert not reader


def test_an_entry_outside_the_protocol(redis_url: str) -> None:
    client = redis.Redis.from_url(redis_url, decode_responses=True)
    write(client, "t", {"type": "token", "i": "zero"}, token(0, "ok"), done("ok"))
    write(client, "d", token(0, "a"), {"type": "done", "text": "no counts"}, done("a"))
    reader = Multiplexer(client, KEYS, block_ms=50)
    reader.follow("t")
    reader.follow("d")
    got = read_all(reader)
    assert [e for j, e in got if j == "t"] == [token(0, "ok"), done("ok")]
    ended = [e for j, e in got if j == "d"]
    assert ended[0] == token(0, "a") and len(ended) == 2
    assert isinstance(ended[1], ErrorEvent) and ended[1].code == BAD_EVENT
    assert "unreadable output event" in ended[1].message
    assert not reader


def test_a_stream_followed_from_an_entry_id(redis_url: str) -> None:
    client = redis.Redis.from_url(redis_url, decode_responses=True)
    write(client, "r", token(0, "a"))
    entries = client.xrange(KEYS.out("r"))
    assert entries
    first = str(entries[0][0])
    write(client, "r", token(1, "b"), done("ab"))
    reader = Multiplexer(client, KEYS, block_ms=50)
    reader.follow("r", last_id=first)
    assert [e for _, e in read_all(reader)] == [token(1, "b"), done("ab")]


@pytest.mark.parametrize("decode", [True, False])
def test_an_output_key_of_the_wrong_type_ends_its_job_only(redis_url: str, decode: bool) -> None:
    client = redis.Redis.from_url(redis_url, decode_responses=decode)
    for job_id in "abcde":
        write(client, job_id, token(0, job_id))
    client.delete(KEYS.out("b"), KEYS.out("d"))
    client.set(KEYS.out("b"), "not a stream")
    client.hset(KEYS.out("d"), "not", "a stream either")
    reader = Multiplexer(client, KEYS, block_ms=50)
    for job_id in "abcde":
        reader.follow(job_id)
    got = reader.read()
    failed = {j: e for j, e in got if isinstance(e, ErrorEvent)}
    assert set(failed) == {"b", "d"}
    assert all(e.code == BAD_EVENT and "WRONGTYPE" in e.message for e in failed.values())
    assert [(j, e) for j, e in got if j not in failed] == [(j, token(0, j)) for j in "ace"]
    assert sorted(reader.open) == ["a", "c", "e"]
    for job_id in "ace":
        write(client, job_id, done(job_id))
    assert sorted(j for j, _ in read_all(reader)) == ["a", "c", "e"] and not reader
