"""Tool calls out of generated text: the formats model families write them in, and a streaming
parser that turns text deltas into the answer's text and OpenAI's `delta.tool_calls`.

The parser reads characters one at a time and keeps no lookahead beyond a possible marker, so the
parse of a stream, however it is split, is the parse of the whole text (tests/test_tool_parsers.py
holds it to that). A call's `arguments` are the model's own JSON text, streamed as it comes once
the call's name is known (`{"name": ..., "arguments": {` in that order, as every template shows
and the call grammar writes); a call written in another order is given whole when it closes.
Nothing here raises on bad text: a region that yields no call is given back as text, a call cut
short keeps the arguments it had (finish_reason `length` says so).
"""

from __future__ import annotations

import hashlib
import json
import re
from dataclasses import dataclass, field
from typing import Any

ToolCallDelta = dict[str, Any]  # OpenAI's streamed shape: index, and id/type/name first
ToolCall = dict[str, Any]  # {"id", "type": "function", "function": {"name", "arguments"}}


@dataclass(frozen=True)
class ToolFormat:
    """How one family writes calls: a region opened by `open`, holding JSON call objects (each
    `{"name": ..., <args_key>: {...}}`, separated by whitespace, `,`, `;` or a list's brackets),
    ended by `close` or, without one, by the end of the output."""

    name: str
    open: str
    close: str | None
    args_key: str = "arguments"
    json_at_start: bool = False  # an output that begins with `{` is a call region (Llama 3.x)

    def render_call(self, name: str, arguments: str) -> str:
        """A call as the model writes it (the generic template renders history with it)."""
        body = f'{{"name": {json.dumps(name, ensure_ascii=False)}, "{self.args_key}": {arguments}}}'
        return f"{self.open}\n{body}\n{self.close}" if self.close else f"{self.open}[{body}]"


HERMES = ToolFormat("hermes", "<tool_call>", "</tool_call>")
LLAMA3_JSON = ToolFormat("llama3_json", "<|python_tag|>", None, "parameters", json_at_start=True)
MISTRAL = ToolFormat("mistral", "[TOOL_CALLS]", None)
FORMATS = {f.name: f for f in (HERMES, LLAMA3_JSON, MISTRAL)}
PARSER_CHOICES = ("auto", *FORMATS)


def format_of_template(template: str | None) -> ToolFormat:
    """The format a chat template teaches its model; Hermes where it names none (the generic
    fallback renders tools in Hermes' words, docs/engine.md "Tool calls")."""
    text = template or ""
    if "[TOOL_CALLS]" in text:
        return MISTRAL
    if "<tool_call>" in text:
        return HERMES
    if "<|python_tag|>" in text or ("<|start_header_id|>" in text and "parameters" in text
                                    and "tools" in text):
        return LLAMA3_JSON
    return HERMES


def call_id(request_id: str, index: int) -> str:
    """The same id for the same call of the same request on every run (a resumed job)."""
    digest = hashlib.sha256(f"{request_id}\0{index}".encode()).hexdigest()[:24]
    return f"call_{digest}"


_HEADER = re.compile(r'\{\s*"name"\s*:\s*("(?:[^"\\]|\\.)*")\s*,\s*"(?:arguments|parameters)"'
                     r'\s*:\s*\{$')
_SEPARATORS = " \t\r\n,;[]"


@dataclass
class _Call:
    """One call object being read: its raw text, where its arguments start, its JSON depth."""

    index: int
    raw: str = ""
    depth: int = 0
    in_string: bool = False
    escaped: bool = False
    name: str | None = None  # known once the header is read (then its arguments stream)
    arguments: str = ""
    args_open: bool = False


@dataclass
class Parsed:
    """What one piece of text made final."""

    text: str = ""
    tool_calls: list[ToolCallDelta] = field(default_factory=list)


class ToolCallParser:
    def __init__(self, fmt: ToolFormat, request_id: str) -> None:
        self.fmt = fmt
        self.request_id = request_id
        self.calls: list[ToolCall] = []
        self._pending = ""  # outside a region: text that may still be the start of a marker
        self._in_region = False
        self._region = ""  # the region's raw text since its marker (given back if no call)
        self._opener = ""  # the text that opened it
        self._region_calls = 0
        self._call: _Call | None = None
        self._seen_text = False  # any text before: Llama's `{` opens a region only at the start
        self._out: Parsed = Parsed()

    # ---- feeding ------------------------------------------------------------------------

    def feed(self, text: str) -> Parsed:
        self._out = Parsed()
        for char in text:
            if self._in_region:
                self._region_char(char)
            else:
                self._pending += char
                self._scan_pending()
        return self._out

    def finish(self) -> Parsed:
        """The output ended: held-back text is final; a region still open ends here."""
        self._out = Parsed()
        if self._in_region:
            self._end_region(closed=False)
        else:
            self._text(self._pending)
            self._pending = ""
        return self._out

    @property
    def in_call(self) -> bool:
        return self._in_region

    @property
    def opener(self) -> str:
        """The text that opened the region now open (its marker, or Llama's leading space)."""
        return self._opener

    @property
    def region(self) -> str:
        return self._region

    # ---- outside a region ---------------------------------------------------------------

    def _scan_pending(self) -> None:
        fmt, pending = self.fmt, self._pending
        if fmt.json_at_start and not self._seen_text:
            stripped = pending.lstrip()
            if not stripped:
                return
            if stripped.startswith("{"):
                self._pending = ""
                self._enter_region(pending[: len(pending) - len(stripped)])
                self._region_char("{")
                return
        if pending.endswith(fmt.open):
            self._text(pending[: -len(fmt.open)])
            self._pending = ""
            self._enter_region(fmt.open)
            return
        keep = partial_suffix(pending, fmt.open)
        self._text(pending[: len(pending) - keep])
        self._pending = pending[len(pending) - keep:]

    def _text(self, text: str) -> None:
        if text:
            self._seen_text = True
            self._out.text += text

    def _enter_region(self, opener: str) -> None:
        self._in_region, self._region, self._region_calls = True, "", 0
        self._opener = opener

    # ---- inside a region ----------------------------------------------------------------

    def _region_char(self, char: str) -> None:
        self._region += char
        call, close = self._call, self.fmt.close
        if close is not None and self._region.endswith(close) and not (call and call.in_string):
            self._end_region(closed=True)  # a call still open here was cut short
            return
        if call is not None:
            self._call_char(call, char)
        elif char == "{":
            self._call = _Call(len(self.calls))
            self._call_char(self._call, char)
        # separators and stray characters between calls are not text

    def _call_char(self, call: _Call, char: str) -> None:
        call.raw += char
        if call.in_string:
            if call.escaped:
                call.escaped = False
            elif char == "\\":
                call.escaped = True
            elif char == '"':
                call.in_string = False
        elif char == '"':
            call.in_string = True
        elif char in "{[":
            call.depth += 1
            if call.depth == 2 and call.name is None and not call.arguments:
                self._header(call)
        elif char in "}]":
            call.depth -= 1
        if call.args_open:
            self._argument(call, char)
            if call.depth == 1 and not call.in_string and char in "}]":
                call.args_open = False
        if call.depth == 0 and not call.in_string:
            self._end_call(call)

    def _header(self, call: _Call) -> None:
        match = _HEADER.fullmatch(call.raw)
        if match is None:
            return
        try:
            name = json.loads(match.group(1))
        except ValueError:
            return
        call.name, call.args_open = name, True
        self._emit_header(call.index, name)

    def _emit_header(self, index: int, name: str) -> None:
        self._out.tool_calls.append({"index": index, "id": call_id(self.request_id, index),
                                     "type": "function",
                                     "function": {"name": name, "arguments": ""}})

    def _argument(self, call: _Call, char: str) -> None:
        call.arguments += char
        deltas = self._out.tool_calls
        if deltas and deltas[-1]["index"] == call.index and "id" not in deltas[-1]:
            deltas[-1]["function"]["arguments"] += char
        else:
            deltas.append({"index": call.index, "function": {"arguments": char}})

    def _end_call(self, call: _Call) -> None:
        self._call = None
        if call.name is None:  # not streamed: given whole, if it is a call at all
            found = _call_of(call.raw)
            if found is None:
                return
            call.name, call.arguments = found
            self._emit_header(call.index, call.name)
            self._out.tool_calls[-1]["function"]["arguments"] = call.arguments
        self._add_call(call)

    def _add_call(self, call: _Call) -> None:
        self._region_calls += 1
        self.calls.append({"id": call_id(self.request_id, call.index), "type": "function",
                           "function": {"name": call.name, "arguments": call.arguments}})

    def _end_region(self, closed: bool) -> None:
        call = self._call
        if call is not None and call.name is not None:  # cut short: keeps what it had
            self._call = None
            self._add_call(call)
        self._call = None
        if self._region_calls == 0:  # no call in it: it was text after all
            self._text(self._opener + self._region)
        self._in_region = False
        self._region = ""
        if not closed:
            self._text(self._pending)
            self._pending = ""


def partial_suffix(text: str, marker: str) -> int:
    """The length of the longest end of `text` that `marker` starts with (not all of it)."""
    for size in range(min(len(marker) - 1, len(text)), 0, -1):
        if marker.startswith(text[-size:]):
            return size
    return 0


def _call_of(raw: str) -> tuple[str, str] | None:
    """A whole call object's name and arguments (as JSON text), or None when it is not one."""
    try:
        obj = json.loads(raw)
    except ValueError:
        return None
    if not isinstance(obj, dict) or not isinstance(obj.get("name"), str):
        return None
    args = obj.get("arguments", obj.get("parameters", {}))
    if isinstance(args, str):
        return obj["name"], args
    return obj["name"], json.dumps(args, ensure_ascii=False)
