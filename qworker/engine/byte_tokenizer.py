"""The simulated engine's tokenizer: a token is a byte (vocabulary 256, id 0 ends generation)."""

from __future__ import annotations

import codecs
from collections.abc import Iterable, Mapping
from typing import Any

VOCAB_SIZE = 256
EOS_TOKEN_ID = 0


class ByteTokenizer:
    """Round-trips any UTF-8 text. Chat messages render as `<role>: <content>\\n` lines followed
    by `assistant: `."""

    vocab_size = VOCAB_SIZE
    eos_token_id = EOS_TOKEN_ID
    eos_token_ids = (EOS_TOKEN_ID,)
    has_chat_template = True

    def encode(self, text: str, add_special_tokens: bool = False) -> list[int]:
        return list(text.encode("utf-8"))

    def apply_chat_template(self, messages: Iterable[Mapping[str, Any]]) -> str:
        lines = [f"{m['role']}: {m['content']}\n" for m in messages]
        return "".join(lines) + "assistant: "

    def encode_chat(self, messages: Iterable[Mapping[str, Any]]) -> list[int]:
        return self.encode(self.apply_chat_template(messages))

    def decode(self, ids: Iterable[int]) -> str:
        return bytes(ids).decode("utf-8", errors="replace")


class ByteDetokenizer:
    """Bytes in, text out; a character split across tokens comes out with its last byte."""

    def __init__(self) -> None:
        self._decoder = codecs.getincrementaldecoder("utf-8")(errors="replace")

    def add(self, token_id: int) -> str:
        return self._decoder.decode(bytes((token_id,)))

    def flush(self) -> str:
        return self._decoder.decode(b"", final=True)  # an unfinished character: U+FFFD
