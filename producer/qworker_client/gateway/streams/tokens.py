"""A token entry of an output stream, read without pydantic: what the gateway does most.

`parse_event` (a pydantic union over every event type) costs several µs per entry; a token entry
as workers write it (exactly `type`, `i`, `token_id` and `text`) whose numbers are plain decimal
digits is taken here instead, to the same values. Anything else (another event, a missing or
extra field, a number pydantic would have to judge) returns None and goes through `parse_event`.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

from qworker_client.protocol import TokenLogprob

_MAX_DIGITS = 18  # within int64: no question of bounds


class Text:
    """A token event as the gateway passes it on: its index and its new text, and the logprob
    entries of a job that asked for them (a plain class: a NamedTuple or a dataclass takes twice
    as long to make)."""

    __slots__ = ("i", "logprobs", "reasoning", "text", "tool_calls")

    def __init__(self, i: int, text: str, logprobs: list[TokenLogprob] | None = None,
                 reasoning: str | None = None,
                 tool_calls: list[dict[str, Any]] | None = None) -> None:
        self.i = i
        self.text = text
        self.logprobs = logprobs
        self.reasoning = reasoning  # a thinking model's new thinking
        self.tool_calls = tool_calls  # delta.tool_calls, as OpenAI streams them

    @property
    def rich(self) -> bool:
        """It carries more than text: thinking or call deltas (its own chunk shape)."""
        return self.reasoning is not None or self.tool_calls is not None

    def __eq__(self, other: object) -> bool:
        return isinstance(other, Text) and (
            self.i, self.text, self.logprobs, self.reasoning, self.tool_calls) == (
            other.i, other.text, other.logprobs, other.reasoning, other.tool_calls)

    def __repr__(self) -> str:
        return (f"Text({self.i!r}, {self.text!r}, {self.logprobs!r}, {self.reasoning!r}, "
                f"{self.tool_calls!r})")


def plain_token(fields: Mapping[str, str]) -> Text | None:
    """The token of a plain token entry (as read with decode_responses), else None."""
    if len(fields) != 4 or fields.get("type") != "token":
        return None
    try:
        i, token_id, text = fields["i"], fields["token_id"], fields["text"]
    except KeyError:
        return None
    return _token(i, token_id, text)


def plain_token_listed(fields: Sequence[object]) -> Text | None:
    """`plain_token` of an entry's fields as XREAD lists them (field, value, ...), in the order
    workers write them (type, i, token_id, text); any other order or entry gives None."""
    if (len(fields) != 8 or fields[1] != "token" or fields[0] != "type" or fields[2] != "i"
            or fields[4] != "token_id" or fields[6] != "text"):
        return None
    i, token_id, text = fields[3], fields[5], fields[7]
    # `_token`'s checks, inline: this runs for every token the gateway streams
    if (type(i) is str and type(token_id) is str and type(text) is str
            and len(i) <= _MAX_DIGITS and len(token_id) <= _MAX_DIGITS
            and i.isdigit() and token_id.isdigit() and i.isascii() and token_id.isascii()):
        return Text(int(i), text)
    return None


def _token(i: object, token_id: object, text: object) -> Text | None:
    if (type(i) is str and type(token_id) is str and type(text) is str
            and len(i) <= _MAX_DIGITS and len(token_id) <= _MAX_DIGITS
            and i.isdigit() and token_id.isdigit() and i.isascii() and token_id.isascii()):
        return Text(int(i), text)
    return None
