"""The SSE frames of one choice of a streamed response, text chunks rendered from a template.

A text chunk differs from the choice's previous one only in its text and its event id, so its
JSON is rendered once around a marker, and each token's frame is that prefix, the text as a
JSON string, and the suffix: the same bytes as `sse.frame(shaping.text_chunk(...))`, without
building a dict and encoding it per token. The rarer frames (a chat choice's first chunk, with
its role; the finish chunk) are built as dicts.
"""

from __future__ import annotations

from json.encoder import encode_basestring

from qworker_client.gateway.chat import logprobs, shaping
from qworker_client.gateway.chat.shaping import Shape
from qworker_client.gateway.streams.sse import frame
from qworker_client.gateway.streams.tokens import Text
from qworker_client.protocol import TokenLogprob

_MARK = "\x00text\x00"
# a str as `sse.frame` (json.dumps, ensure_ascii=False) writes it, without JSONEncoder's
# Python-level dispatch
_encode = encode_basestring


class ChoiceFrames:
    def __init__(self, shape: Shape, index: int, tagged: bool) -> None:
        """`tagged`: event ids as `<index>/<entry id>` (several choices in one stream)."""
        self.shape = shape
        self.index = index
        self._tag = f"{index}/" if tagged else ""
        data = frame(shaping.text_chunk(shape, index, _MARK, False))
        # the text is the chunk's last string: nothing a client chose comes after it
        head, mark, tail = data.rpartition(_encode(_MARK))
        assert mark, "the text chunk lost its text"
        self._head = "\n" + head
        self._tail = tail
        self._chat = shape.kind == "chat"
        self._offset = 0  # characters of the choice's token texts so far (completions' logprobs)

    def event_id(self, entry_id: str) -> str:
        return self._tag + entry_id

    def text(self, entry_id: str, i: int, text: str) -> str | None:
        """The frame of token `i`'s new text; None when there is nothing to send (its text is
        held back, and it is not a chat choice's first chunk, which names the role)."""
        if i == 0 and self._chat:
            return frame(shaping.text_chunk(self.shape, self.index, text, True),
                         self.event_id(entry_id))
        if not text:
            return None
        return f"id: {self._tag}{entry_id}{self._head}{_encode(text)}{self._tail}"

    def logprob_text(self, entry_id: str, i: int, text: str, entries: list[TokenLogprob]) -> str:
        """The frame of tokens with their logprobs: sent even while the text is held back."""
        choice_lp = shaping.choice_logprobs(self.shape, entries, self._offset)
        self._offset += logprobs.text_length(entries)
        first = i == 0 and self.shape.kind == "chat"
        return frame(shaping.text_chunk(self.shape, self.index, text, first, choice_lp),
                     self.event_id(entry_id))

    def rich(self, entry_id: str, token: Text) -> str:
        """The frame of a token with thinking or call deltas (as OpenAI and vLLM stream them:
        `reasoning_content`, `tool_calls`)."""
        choice_lp = (shaping.choice_logprobs(self.shape, token.logprobs, self._offset)
                     if token.logprobs is not None else None)
        if token.logprobs is not None:
            self._offset += logprobs.text_length(token.logprobs)
        first = token.i == 0 and self._chat
        return frame(shaping.rich_chunk(self.shape, self.index, token.text, first, choice_lp,
                                        token.reasoning, token.tool_calls),
                     self.event_id(entry_id))

    def finish(self, entry_id: str, finish_reason: str) -> str:
        return frame(shaping.finish_chunk(self.shape, self.index, finish_reason),
                     self.event_id(entry_id))
