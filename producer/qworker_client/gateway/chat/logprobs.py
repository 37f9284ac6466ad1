"""OpenAI's logprobs shapes, from the entries workers write (job fields `logprobs` and
`logprobs_text`: each entry carries its token's own text, the gateway having no tokenizer).

Chat: `{"content": [{token, logprob, bytes, top_logprobs: [{token, logprob, bytes}]}],
"refusal": null}`. Completions: `{tokens, token_logprobs, top_logprobs: [{token: logprob}],
text_offset}`, offsets counted in characters from the start of the choice's text.
"""

from __future__ import annotations

from typing import Any

from qworker_client.protocol import TokenLogprob, TopLogprob


def chat(entries: list[TokenLogprob]) -> dict[str, Any]:
    return {"content": [{**_token(e), "top_logprobs": [_token(t) for t in e.top_logprobs or ()]}
                        for e in entries], "refusal": None}


def completion(entries: list[TokenLogprob], offset: int = 0) -> dict[str, Any]:
    """`offset`: characters of the choice's text before the first entry's token."""
    offsets = []
    for e in entries:
        offsets.append(offset)
        offset += len(_text(e))
    return {"tokens": [_text(e) for e in entries],
            "token_logprobs": [e.logprob for e in entries],
            "top_logprobs": [{_text(t): t.logprob for t in e.top_logprobs or ()}
                             for e in entries],
            "text_offset": offsets}


def text_length(entries: list[TokenLogprob]) -> int:
    return sum(len(_text(e)) for e in entries)


def _token(entry: TopLogprob) -> dict[str, Any]:
    text = _text(entry)
    return {"token": text, "logprob": entry.logprob, "bytes": list(text.encode("utf-8"))}


def _text(entry: TopLogprob) -> str:
    return entry.token if entry.token is not None else ""
