"""The XADD fields of the events the loop publishes: `event_to_fields`, with token events encoded
by hand. A token event is the one written per generated token, on the loop's thread: the generic
path walks every model field and, with logprobs, dumps each alternative through pydantic (about
0.1-0.2 ms a token with top 5 on this 2-vCPU machine). The fields are the same, byte for byte
(tests/test_event_fields.py compares them)."""

from __future__ import annotations

import json
import math

from qworker_client.protocol import AnyEvent, TokenEvent, TopLogprob, event_to_fields


def event_fields(event: AnyEvent) -> dict[str, str]:
    """The fields `event_to_fields(event)` gives, in its order."""
    if not isinstance(event, TokenEvent):
        return event_to_fields(event)
    fields = {"type": "token", "i": str(event.i), "token_id": str(event.token_id),
              "text": event.text}
    if event.logprob is not None:
        fields["logprob"] = repr(event.logprob)
    if event.top_logprobs is not None:
        fields["top_logprobs"] = "[" + ",".join(map(_top_json, event.top_logprobs)) + "]"
    if event.token is not None:
        fields["token"] = event.token
    if event.reasoning is not None:
        fields["reasoning"] = event.reasoning
    if event.tool_calls is not None:
        fields["tool_calls"] = json.dumps(event.tool_calls, ensure_ascii=False,
                                          separators=(",", ":"))
    return fields


def _top_json(top: TopLogprob) -> str:
    text = "" if top.token is None else ',"token":' + json.dumps(top.token, ensure_ascii=False)
    return f'{{"token_id":{top.token_id},"logprob":{_json_float(top.logprob)}{text}}}'


def _json_float(value: float) -> str:
    return repr(value) if math.isfinite(value) else json.dumps(value)
