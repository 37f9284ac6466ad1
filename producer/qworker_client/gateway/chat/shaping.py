"""OpenAI response bodies and stream chunks, from what a job's output stream says."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from qworker_client.gateway.chat import logprobs
from qworker_client.gateway.chat.translate import Kind
from qworker_client.protocol import DoneEvent, TokenLogprob


@dataclass(frozen=True)
class Shape:
    """What every chunk and body of one response carries."""

    kind: Kind
    response_id: str
    model: str
    created: int
    logprobs: bool = False  # the request asked for logprobs: choices carry them

    @property
    def object(self) -> str:
        return "chat.completion" if self.kind == "chat" else "text_completion"

    @property
    def chunk_object(self) -> str:
        return "chat.completion.chunk" if self.kind == "chat" else "text_completion"

    def head(self, obj: str) -> dict[str, Any]:
        return {"id": self.response_id, "object": obj, "created": self.created,
                "model": self.model}


def usage(prompt_tokens: int, completion_tokens: int) -> dict[str, int]:
    return {"prompt_tokens": prompt_tokens, "completion_tokens": completion_tokens,
            "total_tokens": prompt_tokens + completion_tokens}


def body(shape: Shape, done: list[DoneEvent], prompt_tokens: int,
         entries: list[list[TokenLogprob]] | None = None) -> dict[str, Any]:
    """The whole (non-streamed) response: `done[i]` is choice i (`entries[i]` its logprobs)."""
    choices = [_final_choice(shape, i, d, choice_logprobs(shape, entries[i]) if entries else None)
               for i, d in enumerate(done)]
    completion = sum(d.completion_tokens for d in done)
    return {**shape.head(shape.object), "choices": choices,
            "usage": usage(prompt_tokens, completion)}


def choice_logprobs(shape: Shape, entries: list[TokenLogprob], offset: int = 0
                    ) -> dict[str, Any] | None:
    """A choice's `logprobs` object (None when the request did not ask for them)."""
    if not shape.logprobs:
        return None
    return logprobs.chat(entries) if shape.kind == "chat" else logprobs.completion(entries, offset)


def _final_choice(shape: Shape, index: int, done: DoneEvent,
                  choice_lp: dict[str, Any] | None) -> dict[str, Any]:
    choice: dict[str, Any] = {"index": index}
    if shape.kind == "chat":
        choice["message"] = message(done)
    else:
        choice["text"] = done.text
    choice.update(logprobs=choice_lp, finish_reason=done.finish_reason)
    return choice


def message(done: DoneEvent) -> dict[str, Any]:
    """The assistant message of a finished chat choice: with calls, its content is null where it
    said nothing else (as OpenAI's); a thinking model's thinking as `reasoning_content` (vLLM's,
    DeepSeek's name)."""
    calls = [c.model_dump() for c in done.tool_calls or ()]
    content = None if calls and not done.text.strip() else done.text
    out: dict[str, Any] = {"role": "assistant", "content": content}
    if calls:
        out["tool_calls"] = calls
    if done.reasoning is not None:
        out["reasoning_content"] = done.reasoning
    return out


def rich_chunk(shape: Shape, index: int, text: str, first: bool,
               choice_lp: dict[str, Any] | None, reasoning: str | None,
               tool_calls: list[dict[str, Any]] | None) -> dict[str, Any]:
    """A chunk with thinking or call deltas beside (or instead of) new text."""
    chunk = _chunk(shape, index, text or None, None, first, choice_lp)
    if shape.kind == "chat":
        delta = chunk["choices"][0]["delta"]
        if reasoning:
            delta["reasoning_content"] = reasoning
        if tool_calls:
            delta["tool_calls"] = tool_calls
    return chunk


def text_chunk(shape: Shape, index: int, text: str, first: bool,
               choice_lp: dict[str, Any] | None = None) -> dict[str, Any]:
    """A chunk with new text; a chat stream's first chunk of a choice also names the role."""
    return _chunk(shape, index, text, None, first, choice_lp)


def finish_chunk(shape: Shape, index: int, finish_reason: str) -> dict[str, Any]:
    return _chunk(shape, index, None, finish_reason, False)


def usage_chunk(shape: Shape, prompt_tokens: int, completion_tokens: int) -> dict[str, Any]:
    """`stream_options.include_usage`: the last chunk, without choices."""
    return {**shape.head(shape.chunk_object), "choices": [],
            "usage": usage(prompt_tokens, completion_tokens)}


def _chunk(shape: Shape, index: int, text: str | None, finish_reason: str | None,
           first: bool, choice_lp: dict[str, Any] | None = None) -> dict[str, Any]:
    choice: dict[str, Any] = {"index": index}
    if shape.kind == "chat":
        delta: dict[str, Any] = {"role": "assistant"} if first else {}
        if text is not None:
            delta["content"] = text
        choice["delta"] = delta
    else:
        choice["text"] = text or ""
    choice.update(logprobs=choice_lp, finish_reason=finish_reason)
    return {**shape.head(shape.chunk_object), "choices": [choice]}
