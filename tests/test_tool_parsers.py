"""Tool-call and thinking parsers on outputs as models write them: each format's recorded
outputs, streamed in random splits, parse as the whole does; malformed and truncated calls end
without an exception."""

from __future__ import annotations

import json

from hypothesis import given, settings
from hypothesis import strategies as st

from qworker.engine.output import OutputParser
from qworker.engine.reasoning import ThinkSplitter
from qworker.engine.request import ToolCalling
from qworker.engine.tool_calls import (
    HERMES,
    LLAMA3_JSON,
    MISTRAL,
    ToolCallParser,
    ToolFormat,
    format_of_template,
)

WEATHER = {"name": "get_weather", "parameters": {"type": "object"}}

# (format, output as the model wrote it, text, [(name, arguments as JSON)])
RECORDED: list[tuple[ToolFormat, str, str, list[tuple[str, dict]]]] = [
    # Qwen2.5 / Qwen3 / Hermes: two parallel calls, text before
    (HERMES, 'Let me look.\n<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris", '
             '"unit": "c"}}\n</tool_call>\n<tool_call>\n{"name": "get_time", "arguments": '
             '{"tz": "Europe/Paris"}}\n</tool_call>',
     "Let me look.\n\n", [("get_weather", {"city": "Paris", "unit": "c"}),
                          ("get_time", {"tz": "Europe/Paris"})]),
    # strings holding braces, quotes, escapes and the close marker itself; unicode
    (HERMES, '<tool_call>\n{"name": "echo", "arguments": {"s": "a}\\"{</tool_call>\\\\", '
             '"n": [1, {"x": "é"}]}}\n</tool_call>',
     "", [("echo", {"s": 'a}"{</tool_call>\\', "n": [1, {"x": "é"}]})]),
    # arguments before the name: given whole when the call closes
    (HERMES, '<tool_call>\n{"arguments": {"q": 1}, "name": "search"}\n</tool_call>done',
     "done", [("search", {"q": 1})]),
    # Llama 3.1 / 3.2 JSON tool calls: the output is the call, `parameters`
    (LLAMA3_JSON, '{"name": "get_weather", "parameters": {"city": "Oslo"}}',
     "", [("get_weather", {"city": "Oslo"})]),
    (LLAMA3_JSON, '<|python_tag|>{"name": "a", "parameters": {}}; {"name": "b", "parameters": '
                  '{"k": [true, null]}}',
     "", [("a", {}), ("b", {"k": [True, None]})]),
    (LLAMA3_JSON, 'The answer is {"not": "a call"} here', 'The answer is {"not": "a call"} here',
     []),
    # Mistral: [TOOL_CALLS] and a list
    (MISTRAL, '[TOOL_CALLS][{"name": "get_weather", "arguments": {"city": "Rome"}}, {"name": '
              '"get_time", "arguments": {"tz": "CET"}}]',
     "", [("get_weather", {"city": "Rome"}), ("get_time", {"tz": "CET"})]),
    (MISTRAL, "No tools needed: 2 + 2 = 4.", "No tools needed: 2 + 2 = 4.", []),
]

MALFORMED = [
    (HERMES, "<tool_call>not json at all</tool_call> after"),
    (HERMES, '<tool_call>\n{"name": "f", "arguments": {"a": [1, 2'),  # cut short
    (HERMES, '<tool_call>\n{"name": "f", "arguments": {"a": 1}</tool_call>'),  # a brace missing
    (HERMES, "<tool_ca"),
    (HERMES, '<tool_call>\n{"name": 3, "arguments": {}}\n</tool_call>'),
    (MISTRAL, '[TOOL_CALLS][{"name": "f", "arguments": {"a": "unterminated'),
    (LLAMA3_JSON, '{"name": "f", "parameters": {"a": }}'),
    (LLAMA3_JSON, "{{{{{{"),
]


def parse(fmt: ToolFormat, pieces: list[str]) -> tuple[str, list[dict], list[dict]]:
    """Text, final calls, and the calls rebuilt from the streamed deltas."""
    parser = ToolCallParser(fmt, "req-1")
    text, deltas = "", []
    for piece in [*pieces, None]:
        parsed = parser.finish() if piece is None else parser.feed(piece)
        text += parsed.text
        deltas += parsed.tool_calls
    return text, parser.calls, rebuilt(deltas)


def rebuilt(deltas: list[dict]) -> list[dict]:
    """OpenAI's client-side accumulation of delta.tool_calls (as the SDK's helpers do)."""
    calls: dict[int, dict] = {}
    for d in deltas:
        call = calls.setdefault(d["index"], {"function": {"name": "", "arguments": ""}})
        if "id" in d:
            assert d["function"]["arguments"] == "" or d["function"]["arguments"], d
            call["id"], call["type"] = d["id"], d["type"]
            call["function"]["name"] = d["function"]["name"]
        call["function"]["arguments"] += d["function"].get("arguments", "")
    return [calls[i] for i in sorted(calls)]


def splits(text: str, cuts: list[int]) -> list[str]:
    points = sorted({c % (len(text) + 1) for c in cuts})
    return [text[a:b] for a, b in zip([0, *points], [*points, len(text)], strict=True)]


def test_recorded_outputs_parse_to_their_calls() -> None:
    for fmt, output, text, calls in RECORDED:
        got_text, got_calls, streamed = parse(fmt, [output])
        assert got_text == text, output
        assert [(c["function"]["name"], json.loads(c["function"]["arguments"]))
                for c in got_calls] == calls, output
        assert [c["id"] for c in got_calls] == [c["id"] for c in streamed]
        assert len({c["id"] for c in got_calls}) == len(got_calls)


@settings(max_examples=150, deadline=None)
@given(st.integers(0, len(RECORDED) + len(MALFORMED) - 1), st.lists(st.integers(0, 400),
                                                                     max_size=40))
def test_a_stream_parses_as_the_whole(which: int, cuts: list[int]) -> None:
    fmt, output = (RECORDED[which][:2] if which < len(RECORDED)
                   else MALFORMED[which - len(RECORDED)])
    whole = parse(fmt, [output])
    streamed = parse(fmt, splits(output, cuts))
    assert streamed[:2] == whole[:2]
    # the deltas, accumulated as a client does, are the final calls
    assert streamed[2] == [{k: v for k, v in c.items()} for c in whole[1]]


def test_malformed_and_truncated_calls_end_without_an_exception() -> None:
    text, calls, _ = parse(HERMES, [MALFORMED[0][1]])
    assert calls == [] and text == MALFORMED[0][1]  # no call in it: it was text
    _, calls, _ = parse(HERMES, [MALFORMED[1][1]])  # cut short: the arguments it had
    assert [c["function"] for c in calls] == [{"name": "f", "arguments": '{"a": [1, 2'}]
    assert parse(HERMES, ["<tool_ca"])[0] == "<tool_ca"


def test_the_format_comes_from_the_template() -> None:
    assert format_of_template("{{ '<tool_call>' }}") is HERMES
    assert format_of_template("[TOOL_CALLS] {{ tools }}") is MISTRAL
    assert format_of_template("<|start_header_id|>{{ tools }} parameters") is LLAMA3_JSON
    assert format_of_template(None) is HERMES  # the generic fallback writes Hermes' words


THOUGHT = "<think>\nThe user wants 2+2. <b>four</b> </thin k>\n</think>\n\nIt is 4."


@settings(max_examples=100, deadline=None)
@given(st.lists(st.integers(0, 200), max_size=30), st.booleans())
def test_thinking_splits_off_the_answer_in_any_split(cuts: list[int], from_start: bool) -> None:
    output = THOUGHT.removeprefix("<think>") if from_start else THOUGHT
    splitter = ThinkSplitter(inside=from_start)
    text = reasoning = ""
    for piece in splits(output, cuts):
        part = splitter.feed(piece)
        text, reasoning = text + part.text, reasoning + part.reasoning
    end = splitter.finish()
    assert text + end.text == "It is 4."
    assert reasoning + end.reasoning == "\nThe user wants 2+2. <b>four</b> </thin k>\n"


def test_a_model_that_does_not_open_thinking_answers() -> None:
    splitter = ThinkSplitter(inside=False)
    assert splitter.feed("  <thi").text == ""
    assert splitter.feed("s is text").text == "  <this is text"


def test_calls_inside_thinking_are_not_calls() -> None:
    parser = OutputParser("r", HERMES, ToolCalling((WEATHER,)), thinks=True,
                          thinking_from_start=False, max_reasoning_tokens=None)
    out = parser.feed('<think>maybe <tool_call>{"name": "x", "arguments": {}}</tool_call>'
                      '</think><tool_call>\n{"name": "get_weather", "arguments": {}}\n'
                      '</tool_call>')
    parser.finish()
    assert "<tool_call>" in parser.reasoning and out.text == ""
    assert [c["function"]["name"] for c in parser.tool_calls] == ["get_weather"]
