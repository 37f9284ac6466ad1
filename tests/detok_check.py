"""Streaming detokenization checks shared by the byte-level and SentencePiece tokenizer tests."""

from __future__ import annotations

from qworker.model.tokenizer.tokenizer import REPLACEMENT_CHAR, IncrementalDetokenizer, Tokenizer


def stream(tok: Tokenizer, ids: list[int], skip: bool = False) -> list[str]:
    """The deltas an incremental detokenizer gives for ids, then its flush."""
    detok = IncrementalDetokenizer(tok, skip_special_tokens=skip)
    return [detok.add(i) for i in ids] + [detok.flush()]


def assert_stream_exact(tok: Tokenizer, ids: list[int], skip: bool = False) -> None:
    """The deltas join to the whole decode, and none shows a replacement character it lacks."""
    deltas = stream(tok, ids, skip)
    full = tok.decode(ids, skip_special_tokens=skip)
    assert "".join(deltas) == full
    if REPLACEMENT_CHAR not in full:
        assert not any(REPLACEMENT_CHAR in d for d in deltas)
