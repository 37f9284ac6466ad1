"""The engine's logprobs as wire entries, with each token's own text when the job asks for it."""

from __future__ import annotations

from collections.abc import Callable

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
