"""Structured output: a constrained sequence's grammar matcher, and the token masks it gives the
next sampling (llguidance; see docs/engine.md, "Structured output", for why this library).

Torch-free, as the rest of the core: masks are numpy arrays, one value per vocabulary id. A
request's constraint is compiled at `EngineCore.add` (`Grammars.matcher`), so an invalid schema,
regex or grammar is a `RequestRejectedError` (`invalid_request`) before the request takes anything,
never a failed step. The matcher then follows every token the sequence gets, replayed ones
included, and a step computes the masks of its constrained rows (`MaskFuture`, in a thread that
runs beside the forward: llguidance releases the GIL).

llguidance is imported only when a constrained request arrives: a worker without it runs every
other request, and refuses constrained ones with a message that says so.
"""

from __future__ import annotations

import functools
import json
import re
from collections.abc import Sequence
from concurrent.futures import Future, ThreadPoolExecutor, wait
from typing import TYPE_CHECKING, Any

from qworker.engine.request import RequestRejectedError, StructuredOutputs

if TYPE_CHECKING:
    import numpy as np
    from llguidance._lib import JsonCompileOptions  # a TypedDict of the stubs alone

INVALID_REQUEST = "invalid_request"
# the library's own limits on what one grammar may cost (its defaults are generous: a hostile
# schema could make one mask take seconds); a grammar past them fails to compile, at add
_MAX_GRAMMAR_SIZE = 500_000
_MAX_LEXER_STATES = 100_000
_STEP_LEXER_FUEL = 200_000
_GBNF_RULE = re.compile(r"::=")


def grammar_text(so: StructuredOutputs) -> str:
    """The llguidance grammar (its JSON form) of one constraint."""
    from llguidance import LLMatcher
    from llguidance.gbnf_to_lark import any_to_lark

    # compact JSON (`,` and `:` with no whitespace): a small model given free whitespace may
    # spend its tokens on newlines and indentation
    options: JsonCompileOptions = {"whitespace_flexible": False}
    if so.json is not None:
        return LLMatcher.grammar_from_json_schema(so.json, defaults=options)
    if so.json_object:
        return LLMatcher.grammar_from_json_schema('{"type": "object"}', defaults=options)
    if so.regex is not None:
        return LLMatcher.grammar_from_regex(so.regex)
    if so.choice is not None:
        # each choice a Lark string literal (JSON escapes), matched exactly
        alternatives = " | ".join(json.dumps(c, ensure_ascii=False) for c in so.choice)
        return LLMatcher.grammar_from_lark(f"start: {alternatives}")
    assert so.grammar is not None, "a StructuredOutputs holds exactly one constraint"
    lark = any_to_lark(so.grammar) if _GBNF_RULE.search(so.grammar) else so.grammar
    return LLMatcher.grammar_from_lark(lark)


class Matcher:
    """One sequence's place in its grammar."""

    def __init__(self, ll: Any, vocab_size: int) -> None:
        self._ll = ll
        self.vocab_size = vocab_size
        self.words = (vocab_size + 31) // 32  # int32 words of one bitmask row

    def advance(self, token: int) -> bool:
        """Follows a generated token; False (and an error state) when the grammar refuses it."""
        return bool(self._ll.consume_token(token))

    def valid_prefix(self, tokens: list[int]) -> int:
        """How many of `tokens`, from the first, the grammar allows in a row from here (nothing
        changes): a speculative draft is cut there."""
        return int(self._ll.validate_tokens(tokens)) if tokens else 0

    def rollback(self, num_tokens: int) -> None:
        """Takes back the last `num_tokens` tokens it followed."""
        if num_tokens:
            taken_back = self._ll.rollback(num_tokens)
            assert taken_back is not False and not self._ll.is_error(), self.error

    @property
    def done(self) -> bool:
        """The grammar is complete and allows nothing more (EOS at most)."""
        return bool(self._ll.is_stopped())

    @property
    def error(self) -> str:
        return str(self._ll.get_error())

    def fill(self, row: np.ndarray) -> None:
        """Writes the bitmask of the tokens allowed next (bit j of word w: token 32w + j)."""
        assert row.dtype.name == "int32" and row.shape == (self.words,) and row.flags.c_contiguous
        self._ll.unsafe_compute_mask_ptr(row.ctypes.data, self.words * 4)


def _bitmasks(matchers: Sequence[Matcher], drafts: Sequence[list[int]] | None = None
              ) -> np.ndarray:
    """[rows, words] int32: bit j of word w says whether token 32w + j is allowed. One row per
    matcher, and with `drafts` (a speculative draft each, valid in its grammar) one more per
    draft token: the mask after the draft's first 1, 2, ... tokens (followed, then taken back)."""
    import numpy as np

    assert matchers
    drafts = drafts or [[] for _ in matchers]
    bits = np.empty((sum(1 + len(d) for d in drafts), matchers[0].words), dtype=np.int32)
    row = 0
    for matcher, draft in zip(matchers, drafts, strict=True):
        for i in range(len(draft) + 1):
            if i:
                assert matcher.advance(draft[i - 1]), "a draft its grammar refuses"
            matcher.fill(bits[row])
            row += 1
        matcher.rollback(len(draft))
    return bits


def allowed_masks(matchers: Sequence[Matcher]) -> np.ndarray:
    """[len(matchers), vocab] bools: which tokens each matcher allows next."""
    import numpy as np

    # little-endian words: byte 4w + k holds tokens 32w + 8k ... 32w + 8k + 7, lowest bit first
    unpacked = np.unpackbits(_bitmasks(matchers).view(np.uint8), axis=1,
                             count=matchers[0].vocab_size, bitorder="little")
    return unpacked.view(np.bool_)


def mask_biases(matchers: Sequence[Matcher], drafts: Sequence[list[int]] | None = None
                ) -> np.ndarray:
    """[rows, vocab] float32 (rows as `_bitmasks`): 0 where a token is allowed next, -inf
    elsewhere. Added to the logits, one vectorised pass (a bool masked_fill of 64 x 49k logits
    took 5x as long)."""
    import numpy as np

    bytes_ = _bitmasks(matchers, drafts).view(np.uint8)
    # each byte's 8 tokens at once: a table of 256 rows of 8 biases
    biases = np.take(_byte_biases(), bytes_, axis=0).reshape(len(bytes_), -1)
    return biases[:, : matchers[0].vocab_size]


@functools.cache
def _byte_biases() -> np.ndarray:
    import numpy as np

    bits = np.unpackbits(np.arange(256, dtype=np.uint8)[:, None], axis=1, bitorder="little")
    return np.where(bits == 1, np.float32(0.0), np.float32(-np.inf)).astype(np.float32)


class MaskFuture:
    """The masks of one step's constrained rows (as `mask_biases`, speculative drafts' rows
    included), computed in a worker thread while the caller runs the forward; `result()` joins
    it (nobody touches the matchers meanwhile)."""

    _pool: ThreadPoolExecutor | None = None

    def __init__(self, matchers: Sequence[Matcher], drafts: Sequence[list[int]] | None = None
                 ) -> None:
        if MaskFuture._pool is None:
            MaskFuture._pool = ThreadPoolExecutor(1, thread_name_prefix="qworker-masks")
        self._future: Future[np.ndarray] = MaskFuture._pool.submit(mask_biases, matchers, drafts)

    def result(self) -> np.ndarray:
        return self._future.result()

    def join(self) -> None:
        """Waits for it to end, whatever it gave (a failed forward's masks: the matchers are
        the caller's again)."""
        wait([self._future])


class Grammars:
    """Compiles constraints into matchers for one vocabulary. The library's view of the
    tokenizer (about 0.5 s to build for a 49k vocabulary) is built on the first constrained
    request and kept."""

    def __init__(self, tokenizer: Any, vocab_size: int, eos_token_ids: tuple[int, ...]) -> None:
        self._tokenizer = tokenizer
        self.vocab_size = vocab_size
        self.eos_token_ids = eos_token_ids
        self._ll_tokenizer: Any = None

    def matcher(self, so: StructuredOutputs) -> Matcher:
        """A fresh matcher at the grammar's start; RequestRejectedError if it does not compile."""
        try:
            from llguidance import LLMatcher, LLParserLimits
        except ImportError:
            raise RequestRejectedError(
                INVALID_REQUEST, "structured_outputs: this worker has no llguidance "
                                 "(pip install 'qworker-llm[worker]')") from None
        tokenizer = self._library_tokenizer()
        try:
            grammar = grammar_text(so)
        except ValueError as exc:
            raise _rejected(str(exc)) from None
        limits = LLParserLimits(max_grammar_size=_MAX_GRAMMAR_SIZE,
                                max_lexer_states=_MAX_LEXER_STATES,
                                step_lexer_fuel=_STEP_LEXER_FUEL)
        problem = LLMatcher.validate_grammar(grammar, tokenizer, limits=limits)
        if problem:
            raise _rejected(problem)
        ll = LLMatcher(tokenizer, grammar, log_level=0, limits=limits)
        if ll.is_error():
            raise _rejected(ll.get_error())
        return Matcher(ll, self.vocab_size)

    def _library_tokenizer(self) -> Any:
        if self._ll_tokenizer is None:
            self._ll_tokenizer = _build_tokenizer(self._tokenizer, self.vocab_size,
                                                  self.eos_token_ids)
        return self._ll_tokenizer


def _rejected(problem: str) -> RequestRejectedError:
    first = problem.strip().splitlines()[0] if problem.strip() else "invalid"
    return RequestRejectedError(INVALID_REQUEST, f"structured_outputs: {first[:300]}")


class _ByteTokens:
    """A token-per-byte vocabulary (the simulated engine's) as llguidance's TokenizerWrapper
    wants it; EOS is a special token."""

    bos_token_id = None

    def __init__(self, vocab_size: int, eos_token_id: int) -> None:
        self.eos_token_id = eos_token_id
        self.special_token_ids = [eos_token_id]
        self.tokens = [b"\xff[EOS]" if i == eos_token_id else bytes([i]) for i in range(vocab_size)]

    def __call__(self, text: bytes) -> list[int]:
        return list(text)


def _build_tokenizer(tokenizer: Any, vocab_size: int, eos_token_ids: tuple[int, ...]) -> Any:
    from llguidance import LLTokenizer, TokenizerWrapper

    eos = list(eos_token_ids)
    backend = getattr(tokenizer, "backend", None)  # a Hugging Face `tokenizers.Tokenizer`
    if backend is not None:
        return LLTokenizer(backend.to_str(), n_vocab=vocab_size, eos_token=eos)
    if getattr(tokenizer, "vocab_size", None) == 256 and vocab_size == 256:  # bytes
        return LLTokenizer(TokenizerWrapper(_ByteTokens(vocab_size, eos[0])), n_vocab=vocab_size,
                           eos_token=eos)
    raise RequestRejectedError(INVALID_REQUEST, "structured_outputs: not supported for this "
                                                "model's tokenizer")
