"""The engine's front door: checks a request against what the model can run, before it takes
anything.

Shared by the real and the simulated engine, and torch-free. A request that passes cannot make a
step raise through its own inputs: every token id (prompt, tokens already generated, stop ids) is
a row of the model's embedding, the prompt fits the context and the KV cache, and every sampling
setting is inside its domain. A failure is a `RequestRejectedError` whose message says what and why.
"""

from __future__ import annotations

import json
import math
import weakref
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

from qworker.engine.request import MAX_LOGPROBS, Request, RequestRejectedError, SamplingParams

INVALID_REQUEST = "invalid_request"
PROMPT_TOO_LONG = "prompt_too_long"


@dataclass(frozen=True)
class ModelLimits:
    vocab_size: int  # token ids are 0 .. vocab_size - 1 (the rows of the model's embedding)
    max_model_len: int  # the model's context, as configured
    cache_tokens: int  # tokens the whole KV cache holds
    max_token_chars: int | None = None  # most characters one token stands for; None: unknown

    @property
    def max_seq_len(self) -> int:
        """Prompt plus generated tokens that one sequence may hold."""
        return min(self.max_model_len, self.cache_tokens)


def check_request(request: Request, limits: ModelLimits) -> None:
    if not request.prompt_token_ids:
        raise RequestRejectedError(INVALID_REQUEST, "the prompt is empty")
    _check_length(request, limits)
    _check_ids("prompt_token_ids", request.prompt_token_ids, limits.vocab_size)
    _check_ids("output_token_ids", request.output_token_ids, limits.vocab_size)
    _check_ids("stop_token_ids", request.params.stop_token_ids, limits.vocab_size)
    _check_params(request.params)


def check_prompt_chars(chars: int, limits: ModelLimits) -> None:
    """Rejects, without tokenizing, a text too long to fit even if every token held as many
    characters as the longest token does. Sound: the text's tokens are then more than the
    engine can hold, so tokenizing it would only reach the same `prompt_too_long`."""
    if limits.max_token_chars is None:
        return
    tokens = limits.max_seq_len - 1
    if chars > tokens * limits.max_token_chars:
        raise RequestRejectedError(
            PROMPT_TOO_LONG,
            f"prompt of {chars} characters does not fit: this engine holds at most {tokens} "
            f"prompt tokens, and no token of this model stands for more than "
            f"{limits.max_token_chars} characters",
        )


def max_token_chars(tokenizer: Any) -> int | None:
    """The most characters of input text one token can stand for, where that is certain.

    A byte-level BPE without a normalizer maps text onto its tokens losslessly: a stretch of text
    between added tokens is the concatenation of its tokens' bytes (each spelled as one character
    per byte in the vocabulary), and a character is at least one byte; an added token matches its
    own content. So no token covers more characters than the longest vocabulary string. For any
    other tokenizer (a normalizer may drop characters, an unknown-token model may cover a whole
    word with one token) there is no such bound: None.
    """
    backend = getattr(tokenizer, "backend", None)
    if backend is None:
        return None
    pre = backend.pre_tokenizer
    pre = json.loads(pre.__getstate__()) if pre is not None else None
    if backend.normalizer is not None or type(backend.model).__name__ != "BPE" \
            or not _keeps_every_byte(pre) or '"ByteLevel"' not in json.dumps(pre):
        return None
    return _longest_token(backend, backend.get_vocab_size(with_added_tokens=True))


# by tokenizer and vocabulary size (added tokens change it): every engine asks, and reading a
# 49k-token vocabulary takes 0.1-0.2 s
_longest: weakref.WeakKeyDictionary[Any, tuple[int, int]] = weakref.WeakKeyDictionary()


def _longest_token(backend: Any, size: int) -> int:
    known = _longest.get(backend)
    if known is None or known[0] != size:
        known = _longest[backend] = (
            size, max(len(token) for token in backend.get_vocab(with_added_tokens=True)))
    return known[1]


def _keeps_every_byte(pre: Any) -> bool:
    """Pre-tokenizers that only cut text into pieces, dropping nothing (a `Removed` split or a
    whitespace split would drop characters, and with them any bound)."""
    if pre is None:
        return True
    kind = pre.get("type")
    if kind == "Sequence":
        return all(_keeps_every_byte(p) for p in pre.get("pretokenizers", []))
    if kind == "Split":
        return pre.get("behavior") != "Removed"
    return kind in ("ByteLevel", "Digits", "Punctuation")


def _check_length(request: Request, limits: ModelLimits) -> None:
    prompt, generated = len(request.prompt_token_ids), len(request.output_token_ids)
    if prompt + generated >= limits.max_seq_len:
        already = f" (+{generated} already generated)" if generated else ""
        raise RequestRejectedError(
            PROMPT_TOO_LONG,
            f"prompt of {prompt} tokens{already} does not fit: this engine holds at most "
            f"{limits.max_seq_len - 1} prompt tokens (max_model_len {limits.max_model_len}, "
            f"KV cache {limits.cache_tokens} tokens)",
        )


def _check_ids(name: str, ids: Sequence[int], vocab_size: int) -> None:
    if not ids or (min(ids) >= 0 and max(ids) < vocab_size):
        return
    k, bad = next((k, t) for k, t in enumerate(ids) if not 0 <= t < vocab_size)
    raise RequestRejectedError(
        INVALID_REQUEST,
        f"{name}[{k}] = {bad} is outside the vocabulary (0..{vocab_size - 1})",
    )


def _check_params(p: SamplingParams) -> None:
    problems = [
        ("max_tokens must be >= 1", p.max_tokens >= 1),
        ("min_tokens must be >= 0", p.min_tokens >= 0),
        ("temperature must be a finite number >= 0", math.isfinite(p.temperature)
         and p.temperature >= 0),
        ("top_p must be in (0, 1]", 0 < p.top_p <= 1),
        ("top_k must be >= 0", p.top_k >= 0),
        ("min_p must be in [0, 1]", 0 <= p.min_p <= 1),
        ("repetition_penalty must be a finite number > 0", math.isfinite(p.repetition_penalty)
         and p.repetition_penalty > 0),
        ("presence_penalty must be finite", math.isfinite(p.presence_penalty)),
        ("frequency_penalty must be finite", math.isfinite(p.frequency_penalty)),
        ("stop strings must not be empty", all(p.stop)),
        (f"logprobs must be in 0..{MAX_LOGPROBS}", _logprobs_ok(p.logprobs)),
        (f"prompt_logprobs must be in 0..{MAX_LOGPROBS}", _logprobs_ok(p.prompt_logprobs)),
    ]
    failed = [what for what, ok in problems if not ok]
    if failed:
        raise RequestRejectedError(INVALID_REQUEST, "; ".join(failed))


def _logprobs_ok(k: int | None) -> bool:
    return k is None or 0 <= k <= MAX_LOGPROBS
