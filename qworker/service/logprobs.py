"""The engine's logprobs as wire entries, with each token's own text when the job asks for it."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from qworker.engine.request import TokenLogprobs
from qworker_client.protocol import TokenLogprob, TopLogprob

TokenText = Callable[[int], str]


def wire_logprobs(entries: list[TokenLogprobs], text: TokenText | None) -> list[TokenLogprob]:
    """One wire entry per position; `top_logprobs` only where alternatives were asked for."""
    return [TokenLogprob(token_id=e.token_id, logprob=e.logprob,
                         token=text(e.token_id) if text else None,
                         top_logprobs=[TopLogprob(token_id=t, logprob=lp,
                                                  token=text(t) if text else None)
                                       for t, lp in e.top] or None)
            for e in entries]


def token_text(tokenizer: Any) -> TokenText:
    """A token's own text, decoded alone (a token that is part of a UTF-8 character shows as
    U+FFFD, as in vLLM)."""
    decode = tokenizer.decode
    return lambda token_id: str(decode([token_id]))
