"""SentencePiece vocabularies of GGUFs (`tokenizer.ggml.model` = "llama") as a `tokenizers` BPE.

Llama 2, Mistral v0.1 and TinyLlama GGUFs carry their SentencePiece model as a token list with one
score per token and no merges. llama.cpp tokenizes them by merging, among adjacent pieces, the pair
whose joined piece scores highest, falling back to `<0xNN>` byte tokens for characters outside the
vocabulary. A `tokenizers` BPE whose merges are ranked by the joined piece's score does the same;
this is how transformers converts both a `tokenizer.model` and such a GGUF, and these merges are
transformers' `generate_merges` ordering, so the vocabulary and merges match its converter.

Spaces are written "▁", and each stretch of text between special tokens gets one "▁" in front (when
the file's `tokenizer.ggml.add_space_prefix` is not false), as llama.cpp and SentencePiece do and as
the Llama 2 / Mistral `tokenizer.json` files do with a `Prepend` normalizer. transformers' GGUF path
uses a `Metaspace` pre-tokenizer instead, which prepends nothing to text after a special token or to
text that already starts with a space; see docs/engine.md.
"""

from __future__ import annotations

from collections.abc import Sequence

import tokenizers
from tokenizers import decoders, models, normalizers

SPACE = "\u2581"  # "▁", SentencePiece's spelling of a space


def sentencepiece_bpe(
    tokens: Sequence[str],
    scores: Sequence[float],
    merges: Sequence[tuple[str, str]] | None = None,
    unk_token: str | None = None,
    add_space_prefix: bool = True,
) -> tokenizers.Tokenizer:
    """The tokenizer of a SentencePiece vocabulary; `merges` from the file, else from `scores`."""
    assert len(tokens) == len(scores), (len(tokens), len(scores))
    vocab = {token: index for index, token in enumerate(tokens)}
    pairs = list(merges) if merges is not None else merges_from_scores(tokens, scores)
    model = models.BPE(
        vocab=vocab, merges=pairs, unk_token=unk_token, fuse_unk=True, byte_fallback=True
    )
    backend = tokenizers.Tokenizer(model)
    spaces = normalizers.Replace(" ", SPACE)
    backend.normalizer = (
        normalizers.Sequence([normalizers.Prepend(SPACE), spaces]) if add_space_prefix else spaces
    )
    steps = [decoders.Replace(SPACE, " "), decoders.ByteFallback(), decoders.Fuse()]
    if add_space_prefix:  # the prefix added to the text's start comes off its decode
        steps.append(decoders.Strip(content=" ", left=1, right=0))
    backend.decoder = decoders.Sequence(steps)
    return backend


def merges_from_scores(tokens: Sequence[str], scores: Sequence[float]) -> list[tuple[str, str]]:
    """Every split of a piece into two pieces of the vocabulary, best joined score first.

    Ties go to the longer left then the longer right piece, then to vocabulary order; a piece's
    own splits are ordered by their pieces' ids (transformers' `generate_merges`, so that both
    build the same BPE).
    """
    ids = {token: index for index, token in enumerate(tokens)}
    score_of = dict(zip(tokens, scores, strict=True))
    ranked: list[tuple[str, str, float]] = []
    for piece, score in score_of.items():
        splits = [(piece[:cut], piece[cut:]) for cut in range(1, len(piece))]
        known = [(left, right) for left, right in splits if left in ids and right in ids]
        known.sort(key=lambda pair: (ids[pair[0]], ids[pair[1]]))
        ranked.extend((left, right, score) for left, right in known)
    ranked.sort(key=lambda m: (m[2], len(m[0]), len(m[1])), reverse=True)  # stable
    return [(left, right) for left, right, _ in ranked]
