"""`/v1/responses` through the official `openai` SDK on a simulated worker: create, stream (the
SDK's event types, each `sequence_number` once, in order), retrieve (whole, and as a stream from
any event), background and cancel, delete, input items, `previous_response_id` chains and their
bound, owners; and a scripted worker whose tokens carry `reasoning` and whose `done` event
carries `tool_calls`, read back as `reasoning` and `function_call` items and their events."""

from __future__ import annotations

import json
import threading
from collections.abc import Iterator
from typing import Any

import httpx2
import openai
import pytest
import redis
from openai import OpenAI

from qworker_client.gateway.responses import items, request, tool_fields
from qworker_client.gateway.responses.events import ResponseEvents
from qworker_client.gateway.responses.record import MAX_CHAIN_DEPTH, StoredResponse
from qworker_client.protocol import Keys
from tests.gateway_harness import gateway, live_worker
from tests.service_harness import KEYS, sim_engine, wait_for

SIM = "sim"
ALICE, BOB = "sk-alice-0123456789", "sk-bob-9876543210"


@pytest.fixture
def base_url(redis_url: str) -> Iterator[str]:
    with live_worker(redis_url, "resp-sim", sim_engine("sim:step_ms=5")), \
            gateway(redis_url) as url:
        yield url


@pytest.fixture
def sdk(base_url: str) -> Iterator[OpenAI]:
    with OpenAI(base_url=f"{base_url}/v1", api_key="unused", max_retries=0, timeout=60) as c:
        yield c


def test_create_stream_and_retrieve_agree(sdk: OpenAI) -> None:
    whole = sdk.responses.create(model=SIM, input="hello there", instructions="be brief",
                                 max_output_tokens=12)
    assert (whole.status, whole.object, whole.instructions) == ("incomplete", "response",
                                                                "be brief")
    assert whole.incomplete_details is not None
    assert whole.incomplete_details.reason == "max_output_tokens"
    assert whole.usage is not None and whole.usage.output_tokens == 12
    assert whole.output_text and whole.output[0].type == "message"
    assert sdk.responses.retrieve(whole.id).model_dump() == whole.model_dump()

    events = list(sdk.responses.create(model=SIM, input="hello there", max_output_tokens=8,
                                       stream=True))
    kinds = [e.type for e in events]
    assert kinds[:4] == ["response.created", "response.in_progress",
                         "response.output_item.added", "response.content_part.added"]
    assert kinds[-4:] == ["response.output_text.done", "response.content_part.done",
                          "response.output_item.done", "response.incomplete"]
    assert [e.sequence_number for e in events] == list(range(len(events)))
    deltas = "".join(e.delta for e in events if e.type == "response.output_text.delta")
    last = events[-1].response  # type: ignore[union-attr]
    assert deltas == last.output_text != "" and kinds.count("response.output_text.delta") == 8

    with sdk.responses.stream(model=SIM, input="hello there", max_output_tokens=8) as helper:
        seen = [e for e in helper if e.type == "response.output_text.delta"]
    # the SDK's own accumulator of the items and their parts
    assert seen[-1].snapshot == "".join(e.delta for e in seen) != ""

    # the same events again, from any one on, by the stream's retrieve
    again = list(sdk.responses.retrieve(last.id, stream=True, starting_after=5))
    assert [e.model_dump() for e in again] == [e.model_dump() for e in events[6:]]
    assert sdk.responses.retrieve(last.id).output_text == deltas


def test_a_response_outlives_its_job_s_output_stream(sdk: OpenAI, redis_url: str) -> None:
    """Once ended, the record keeps the output: its stream then is its end alone."""
    whole = sdk.responses.create(model=SIM, input="keep", max_output_tokens=3)
    redis.Redis.from_url(redis_url).delete(KEYS.out("resp-" + whole.id.removeprefix("resp_")))
    assert sdk.responses.retrieve(whole.id).model_dump() == whole.model_dump()
    events = list(sdk.responses.retrieve(whole.id, stream=True))
    assert [e.type for e in events] == ["response.created", "response.in_progress",
                                        "response.incomplete"]
    assert events[-1].response.output_text == whole.output_text  # type: ignore[union-attr]


def test_background_cancel_delete_and_input_items(sdk: OpenAI, base_url: str) -> None:
    long = sdk.responses.create(model=SIM, input=[{"role": "user", "content": "go on"}],
                                background=True, max_output_tokens=2000)
    assert (long.status, long.background) == ("queued", True)
    wait_for(lambda: sdk.responses.retrieve(long.id).output_text, what="some text")
    cancelled = sdk.responses.cancel(long.id)
    assert cancelled.status == "cancelled"
    ended = wait_for(lambda: (r := sdk.responses.retrieve(long.id)).completed_at and r)
    assert ended.status == "cancelled" and ended.usage is not None
    assert 0 < ended.usage.output_tokens < 2000

    listed = sdk.responses.input_items.list(long.id)
    assert [(i.type, i.role) for i in listed.data] == [("message", "user")]  # type: ignore[union-attr]
    three = sdk.responses.create(model=SIM, max_output_tokens=2, input=[
        {"role": "user", "content": word} for word in ("a", "b", "c")])
    page = sdk.responses.input_items.list(three.id, order="asc", limit=2)
    assert [i.content[0].text for i in page.data] == ["a", "b"] and page.has_more  # type: ignore[union-attr]
    rest = sdk.responses.input_items.list(three.id, order="asc", after=page.data[-1].id)
    assert [i.content[0].text for i in rest.data] == ["c"] and not rest.has_more  # type: ignore[union-attr]
    newest = sdk.responses.input_items.list(three.id, limit=1).data
    assert [i.content[0].text for i in newest] == ["c"]  # type: ignore[union-attr]

    short = sdk.responses.create(model=SIM, input="x", max_output_tokens=2)
    with pytest.raises(openai.BadRequestError, match="only a background response"):
        sdk.responses.cancel(short.id)
    sdk.responses.delete(short.id)
    with pytest.raises(openai.NotFoundError):
        sdk.responses.retrieve(short.id)

    unstored = sdk.responses.create(model=SIM, input="x", max_output_tokens=2, store=False)
    assert unstored.status == "incomplete"
    with pytest.raises(openai.NotFoundError):
        sdk.responses.retrieve(unstored.id)
    refused = httpx2.post(f"{base_url}/v1/responses", json={
        "model": SIM, "input": "x", "background": True, "store": False})
    assert refused.status_code == 400 and "must be stored" in refused.text


def test_a_streamed_response_whose_client_leaves_is_cancelled(base_url: str,
                                                               redis_url: str) -> None:
    body = {"model": SIM, "input": "long", "max_output_tokens": 5000, "stream": True}
    with httpx2.stream("POST", f"{base_url}/v1/responses", json=body, timeout=30) as streamed:
        job_id = streamed.headers["x-qworker-job-id"]
        lines = streamed.iter_lines()
        while "response.output_text.delta" not in next(lines):
            pass
    r = redis.Redis.from_url(redis_url, decode_responses=True)

    def last_event() -> dict[str, str]:
        entries = r.xrevrange(KEYS.out(job_id), count=1)
        return entries[0][1] if entries else {}

    ended = wait_for(lambda: last_event().get("type") == "done" and last_event())
    assert ended["finish_reason"] == "cancelled" and int(ended["completion_tokens"]) < 5000


def test_previous_response_id_chains_the_conversation(sdk: OpenAI, redis_url: str) -> None:
    first = sdk.responses.create(model=SIM, input="one", instructions="sys", max_output_tokens=4)
    second = sdk.responses.create(model=SIM, input="two", previous_response_id=first.id,
                                  max_output_tokens=4)
    assert second.previous_response_id == first.id and second.instructions is None
    r = redis.Redis.from_url(redis_url)
    kept = StoredResponse.from_json(r.get(KEYS.response(second.id)) or b"")
    assert kept.history == [  # the first's instructions are not carried on
        {"role": "user", "content": "one"},
        {"role": "assistant", "content": first.output_text}]
    assert first.usage is not None and second.usage is not None
    assert second.usage.input_tokens > first.usage.input_tokens + first.usage.output_tokens
    deep = kept
    deep.depth = MAX_CHAIN_DEPTH
    r.set(KEYS.response(second.id), deep.to_json())
    with pytest.raises(openai.BadRequestError, match=f"at most {MAX_CHAIN_DEPTH} responses"):
        sdk.responses.create(model=SIM, input="three", previous_response_id=second.id)
    with pytest.raises(openai.NotFoundError):
        sdk.responses.create(model=SIM, input="x", previous_response_id="resp_nothing")


def test_a_response_is_seen_only_by_its_key_s_owner(redis_url: str) -> None:
    with live_worker(redis_url, "resp-owners", sim_engine("sim:step_ms=2")), \
            gateway(redis_url, api_keys=(ALICE, BOB)) as url, \
            OpenAI(base_url=f"{url}/v1", api_key=ALICE, max_retries=0) as alice, \
            OpenAI(base_url=f"{url}/v1", api_key=BOB, max_retries=0) as bob:
        mine = alice.responses.create(model=SIM, input="mine", max_output_tokens=3)
        assert alice.responses.retrieve(mine.id).id == mine.id
        for call in (lambda: bob.responses.retrieve(mine.id),
                     lambda: bob.responses.delete(mine.id),
                     lambda: bob.responses.input_items.list(mine.id),
                     lambda: bob.responses.create(model=SIM, input="x",
                                                  previous_response_id=mine.id)):
            with pytest.raises(openai.NotFoundError):
                call()
        assert alice.responses.retrieve(mine.id).id == mine.id  # bob's delete did nothing


def test_bad_bodies_are_one_line_400s(base_url: str) -> None:
    for body, param in [({"model": SIM}, "input"), ({"model": SIM, "input": []}, "input"),
                        ({"model": SIM, "input": [{"type": "image"}]}, "input[0]"),
                        ({"model": SIM, "input": "x", "tools": [{"type": "web_search"}]},
                         "tools[0]"),
                        ({"model": SIM, "input": ["x"] * 1025}, "input"),
                        ({"model": SIM, "input": "x", "text": {"format": {"type": "xml"}}},
                         "text.format"),
                        ({"model": SIM, "input": "x", "stream": "yes"}, "stream"),
                        ({"model": SIM, "input": "x", "text": {"format": {
                            "type": "json_schema"}}}, "text.format")]:
        reply = httpx2.post(f"{base_url}/v1/responses", json=body)
        assert (reply.status_code, reply.json()["error"]["param"]) == (400, param), body


def test_tools_and_function_call_items_become_the_wire_s_chat_fields() -> None:
    """The contract with the tool fields on the wire (docs/protocol.md): flat function tools as
    chat-style ones, a named choice chat-style, function calls given back as an assistant
    message with `tool_calls`, their outputs as `tool` messages."""
    body = request.parse_create({
        "model": "m", "instructions": "sys", "parallel_tool_calls": False,
        "tools": [{"type": "function", "name": "weather", "description": "d",
                   "parameters": {"type": "object"}, "strict": True}],
        "tool_choice": {"type": "function", "name": "weather"},
        "input": [{"role": "user", "content": [{"type": "input_text", "text": "rain?"}]},
                  {"type": "function_call", "call_id": "c1", "name": "weather",
                   "arguments": "{}"},
                  {"type": "function_call_output", "call_id": "c1", "output": "wet"}]})
    assert json.loads(body.job["tools"]) == [{"type": "function", "function": {
        "name": "weather", "description": "d", "parameters": {"type": "object"},
        "strict": True}}]
    assert json.loads(body.job["tool_choice"]) == {"type": "function",
                                                   "function": {"name": "weather"}}
    assert body.job["parallel_tool_calls"] is False
    assert body.messages([]) == [
        {"role": "system", "content": "sys"}, {"role": "user", "content": "rain?"},
        {"role": "assistant", "content": "", "tool_calls": [
            {"id": "c1", "type": "function",
             "function": {"name": "weather", "arguments": "{}"}}]},
        {"role": "tool", "tool_call_id": "c1", "content": "wet"}]
    assert "tools" not in request.parse_create({"model": "m", "input": "x"}).job
    schema = {"type": "object", "properties": {"a": {"type": "integer"}}}
    constrained = request.parse_create({"model": "m", "input": "x", "text": {"format": {
        "type": "json_schema", "name": "n", "schema": schema, "strict": True}}})
    assert constrained.job["structured_outputs"] == {"json": schema}
    with pytest.raises(Exception, match="not in `tools`"):
        tool_fields.chat_tool_choice({"type": "function", "name": "other"}, ["weather"])
    # an output's function calls, chained on, join the assistant message before them
    output = [items.input_items([{"role": "assistant", "content": "let me look"}])[0],
              {"type": "function_call", "call_id": "c2", "name": "w", "arguments": "{}"}]
    assert items.messages(output)[0]["tool_calls"][0]["id"] == "c2"


CALLS = [{"id": "call_a", "type": "function",
          "function": {"name": "weather", "arguments": '{"city": "Paris"}'}},
         {"id": "call_b", "type": "function",
          "function": {"name": "time", "arguments": '{"zone": "CET"}'}}]


def test_tool_calls_of_the_done_event_are_function_call_items(redis_url: str) -> None:
    """A scripted worker answers each job as docs/protocol.md says a worker with tools does:
    tokens that think (`reasoning`), tokens of text, then `done` with `tool_calls` and
    `finish_reason` tool_calls: a reasoning item, a message, two function calls."""
    r = redis.Redis.from_url(redis_url, decode_responses=True)
    r.set(KEYS.worker("scripted"), '{"model": "tooly"}', ex=60)
    stop = threading.Event()
    worker = threading.Thread(target=_scripted_worker, args=(r, KEYS, stop), daemon=True)
    with gateway(redis_url) as url, OpenAI(base_url=f"{url}/v1", api_key="u",
                                           max_retries=0, timeout=30) as sdk:
        waiting = sdk.responses.create(model="tooly", input="later", background=True)
        assert sdk.responses.retrieve(waiting.id).status == "queued"  # no worker took it yet
        worker.start()
        try:
            whole = sdk.responses.create(model="tooly", input="weather and time?")
            events = list(sdk.responses.create(model="tooly", input="again", stream=True))
            answered = wait_for(lambda: (got := sdk.responses.retrieve(waiting.id)).completed_at
                                and got)
        finally:
            stop.set()
            worker.join(10)
    assert answered.status == "completed" and len(answered.output) == 4
    assert whole.status == "completed"
    assert [o.type for o in whole.output] == ["reasoning", "message", "function_call",
                                              "function_call"]
    assert whole.output_text == "Checking."
    thought = whole.output[0]
    assert thought.type == "reasoning" and thought.content is not None
    assert [c.text for c in thought.content] == ["they want two tools"]
    assert whole.usage is not None and whole.usage.output_tokens_details.reasoning_tokens == 2
    calls = [(o.call_id, o.name, o.arguments, o.status) for o in whole.output[2:]]  # type: ignore[union-attr]
    assert calls == [("call_a", "weather", '{"city": "Paris"}', "completed"),
                     ("call_b", "time", '{"zone": "CET"}', "completed")]

    kinds = [e.type for e in events]
    assert kinds[-12:] == ["response.output_text.done", "response.content_part.done",
                           "response.output_item.done",
                           *["response.output_item.added",
                             "response.function_call_arguments.delta",
                             "response.function_call_arguments.done",
                             "response.output_item.done"] * 2, "response.completed"]
    deltas = [e for e in events if e.type == "response.function_call_arguments.delta"]
    assert [(e.output_index, e.delta) for e in deltas] == [  # type: ignore[union-attr]
        (2, '{"city": "Paris"}'), (3, '{"zone": "CET"}')]
    added = [e.item for e in events if e.type == "response.output_item.added"]  # type: ignore[union-attr]
    assert [(i.type, getattr(i, "arguments", None)) for i in added] == [
        ("reasoning", None), ("message", None), ("function_call", ""), ("function_call", "")]
    assert kinds[2:9] == ["response.output_item.added", "response.content_part.added",
                          "response.reasoning_text.delta", "response.reasoning_text.delta",
                          "response.reasoning_text.done", "response.content_part.done",
                          "response.output_item.done"]
    assert [e.sequence_number for e in events] == list(range(len(events)))


def _scripted_worker(r: redis.Redis, keys: Keys, stop: threading.Event) -> None:
    stream, last = keys.jobs_of("tooly"), "0-0"
    while not stop.is_set():
        reply: Any = r.xread({stream: last}, block=100)
        for _, entries in reply or []:
            for entry_id, job in entries:
                last, out = entry_id, keys.out(job["id"])
                r.xadd(out, {"type": "token", "i": "0", "token_id": "7", "text": "",
                             "reasoning": "they want"})
                r.xadd(out, {"type": "token", "i": "1", "token_id": "8", "text": "",
                             "reasoning": " two tools"})
                r.xadd(out, {"type": "token", "i": "2", "token_id": "1", "text": "Check"})
                r.xadd(out, {"type": "token", "i": "1", "token_id": "8", "text": "",
                             "reasoning": " two tools"})  # a rollback's repeat: skipped
                r.xadd(out, {"type": "token", "i": "3", "token_id": "2", "text": "ing."})
                r.xadd(out, {"type": "done", "finish_reason": "tool_calls",
                             "text": "Checking.", "prompt_tokens": "5",
                             "completion_tokens": "9", "tool_calls": json.dumps(CALLS)})



def test_an_unreadable_event_fails_the_response() -> None:
    stored = StoredResponse(id="resp_x", job_id="resp-x", created_at=0, model="m", request={},
                            input=[], history=[])
    events = ResponseEvents(stored)
    events.start()
    events.entry("1-0", {"type": "token", "i": "0", "token_id": "1", "text": "a"})
    last = events.entry("2-0", {"type": "done", "finish_reason": "sideways", "text": "a"})
    assert [e["type"] for e in last] == ["response.failed"]
    assert events.final is not None and events.final.status == "failed"
    assert events.state.error is not None and events.state.error.code == "bad_event"
    assert events.entry("3-0", {"type": "token", "i": "1", "token_id": "1", "text": "b"}) == []
