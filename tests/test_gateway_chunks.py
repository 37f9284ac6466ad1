"""The gateway's per-token fast paths give what the general ones give: a text chunk's frame from
its template (`chunks.ChoiceFrames`) is byte for byte the frame of the chunk built as a dict, and
a plain token entry read without pydantic (`tokens.plain_token`) is the event `parse_event`
reads; any entry it is not sure of is left to `parse_event`, and the reader takes both as
`OutputState` does."""

from __future__ import annotations

import asyncio
import json

import pytest
import redis
import redis.asyncio

from qworker_client.gateway.chat import shaping
from qworker_client.gateway.chat.chunks import ChoiceFrames
from qworker_client.gateway.chat.shaping import Shape
from qworker_client.gateway.streams.hub import Hub
from qworker_client.gateway.streams.reader import OutputReader
from qworker_client.gateway.streams.sse import frame
from qworker_client.gateway.streams.tokens import Text, plain_token, plain_token_listed
from qworker_client.protocol import DoneEvent, Keys, TokenEvent, parse_event
from qworker_client.result import START_ID

TEXTS = ["hello", " world", 'quote " and \\ back', "line\nbreak\ttab", "\x00\x1f ctl",
         "é ü 漢字 🙂", "\u2028\u2029", "\x00text\x00", "}]}"]
SHAPES = [Shape("chat", "chatcmpl-abc", "sim", 1_700_000_000),
          Shape("completion", "cmpl-xyz", 'a "model" \x00text\x00', 7)]


@pytest.mark.parametrize("shape", SHAPES, ids=["chat", "completion"])
@pytest.mark.parametrize("tagged", [False, True])
@pytest.mark.parametrize("text", TEXTS)
def test_a_text_frame_is_the_dict_chunk_framed(shape: Shape, tagged: bool, text: str) -> None:
    choice = ChoiceFrames(shape, 3, tagged)
    want_id = "3/1700-5" if tagged else "1700-5"
    assert choice.text("1700-5", 4, text) == frame(shaping.text_chunk(shape, 3, text, False),
                                                   want_id)
    body = choice.text("1700-5", 4, text)
    assert body is not None
    data = json.loads(body.split("data: ", 1)[1])
    delta = data["choices"][0]["delta"]["content"] if shape.kind == "chat" else (
        data["choices"][0]["text"])
    assert delta == text and data["model"] == shape.model


def test_a_chat_choices_first_chunk_names_the_role_even_without_text() -> None:
    shape = SHAPES[0]
    choice = ChoiceFrames(shape, 0, False)
    assert choice.text("1-0", 0, "") == frame(shaping.text_chunk(shape, 0, "", True), "1-0")
    assert '"role":"assistant"' in (choice.text("1-0", 0, "hi") or "")


def test_held_back_text_sends_nothing_past_the_first_chunk() -> None:
    assert ChoiceFrames(SHAPES[0], 0, False).text("1-1", 1, "") is None
    assert ChoiceFrames(SHAPES[1], 0, False).text("1-0", 0, "") is None


def test_the_finish_frame_is_the_dict_chunk_framed() -> None:
    for shape in SHAPES:
        assert ChoiceFrames(shape, 1, True).finish("5-0", "length") == frame(
            shaping.finish_chunk(shape, 1, "length"), "1/5-0")


@pytest.mark.parametrize("fields", [
    {"type": "token", "i": "0", "token_id": "17", "text": "hi"},
    {"type": "token", "i": "12", "token_id": "0", "text": ""},
    {"type": "token", "i": "007", "token_id": "1", "text": "漢"},
])
def test_a_plain_token_entry_reads_as_parse_event_reads_it(fields: dict[str, str]) -> None:
    event = parse_event(fields)
    assert isinstance(event, TokenEvent)
    assert plain_token(fields) == Text(event.i, event.text)
    assert plain_token_listed(listed(fields)) == Text(event.i, event.text)


def listed(fields: dict[str, str]) -> list[str]:
    """The fields as an XREAD reply lists them."""
    return [part for pair in fields.items() for part in pair]


def test_a_plain_token_listed_in_another_order_is_left_to_the_rest() -> None:
    assert plain_token_listed(["i", "0", "type", "token", "token_id", "1", "text", "x"]) is None


@pytest.mark.parametrize("fields", [
    {"type": "done", "finish_reason": "stop", "text": "", "prompt_tokens": "1",
     "completion_tokens": "0"},
    {"type": "token", "i": "-1", "token_id": "1", "text": "x"},
    {"type": "token", "i": "+1", "token_id": "1", "text": "x"},
    {"type": "token", "i": " 1", "token_id": "1", "text": "x"},
    {"type": "token", "i": "١", "token_id": "1", "text": "x"},  # a digit, not an ASCII one
    {"type": "token", "i": "1", "token_id": "", "text": "x"},
    {"type": "token", "i": "1", "text": "x"},
    {"type": "token", "i": "3", "token_id": "9"},  # valid, but not as workers write it
    {"type": "token", "i": "1", "token_id": "1", "text": "x", "extra": "y"},
    {"type": "token", "i": "9" * 40, "token_id": "1", "text": "x"},
])
def test_anything_else_is_left_to_parse_event(fields: dict[str, str]) -> None:
    assert plain_token(fields) is None
    assert plain_token_listed(listed(fields)) is None


@pytest.mark.parametrize("protocol", [2, 3])
def test_the_reader_takes_plain_and_other_entries_as_output_state_does(redis_url: str,
                                                                      protocol: int) -> None:
    """Plain token entries (fast path), one written otherwise (pydantic), a token index seen
    before (skipped), the end, and what follows it (ignored); over RESP2 and RESP3 replies."""
    keys = Keys("fast")
    sync = redis.Redis.from_url(redis_url, decode_responses=True)
    out = keys.out("j1")
    for fields in [
        {"type": "token", "i": "0", "token_id": "5", "text": "a"},
        {"type": "token", "i": "1", "token_id": "6"},  # no text field: parse_event's
        {"type": "token", "i": "0", "token_id": "5", "text": "a"},  # seen: skipped
        {"type": "token", "i": "2", "token_id": "7", "text": "c"},
        {"type": "done", "finish_reason": "length", "text": "ac", "prompt_tokens": "2",
         "completion_tokens": "3"},
        {"type": "token", "i": "3", "token_id": "8", "text": "late"},
    ]:
        sync.xadd(out, fields)

    async def read() -> list[object]:
        client = redis.asyncio.Redis.from_url(redis_url, decode_responses=True,
                                              protocol=protocol)
        hub = Hub(client, keys)
        try:
            reader = OutputReader(hub, {"j1": START_ID})
            return [event async for _, _, event in reader.events()]
        finally:
            await hub.close()
            await client.aclose()

    events = asyncio.run(read())
    assert events[:3] == [Text(0, "a"), Text(1, ""), Text(2, "c")]
    assert len(events) == 4 and isinstance(events[3], DoneEvent)
    assert events[3].completion_tokens == 3
