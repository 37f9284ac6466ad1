"""qworker.model.tokenizer against transformers' own tokenizer for the default model's GGUF."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from qworker.model.tokenizer.tokenizer import (
    IncrementalDetokenizer,
    Tokenizer,
    TokenizerError,
)
from tests.detok_check import assert_stream_exact, stream

TEXTS = [
    "Hello, world! The quick brown fox jumps over the lazy dog.",
    "def fib(n: int) -> int:\n    return n if n < 2 else fib(n - 1) + fib(n - 2)\n",
    "    indented\tand\t\ttabbed   spaces   \n\n\n  trailing  ",
    "中文测试：你好，世界！日本語のテキスト、한국어 텍스트",
    "emoji 🤖🎉👩‍👩‍👧‍👦 flags 🇫🇷🇯🇵 and é, ñ, ß, Ω",
    "<|im_start|>user\nWhat is 12345 + 67890?<|im_end|>\n<|im_start|>assistant\n",
    "<|endoftext|><repo_name>qworker<file_sep>README.md",
    "It's 3.14159 — “quotes”, ‘single’, ellipsis… and don't we'll",
    "",
    " ",
    "\n",
]

CHATS: list[list[dict[str, Any]]] = [
    [{"role": "user", "content": "Hi there"}],
    [
        {"role": "system", "content": "You are terse."},
        {"role": "user", "content": "2+2?"},
        {"role": "assistant", "content": "4"},
        {"role": "user", "content": "Und auf Deutsch? 🤔"},
    ],
    [{"role": "user", "content": "  leading and trailing  \n"}],
]


@pytest.fixture(scope="module")
def hf(smollm2_path: Path) -> Any:
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(smollm2_path.parent, gguf_file=smollm2_path.name)


@pytest.fixture(scope="module")
def tok(smollm2_tokenizer: Tokenizer) -> Tokenizer:
    return smollm2_tokenizer


# ---------------------------------------------------------------------------------------------
# encode / decode / chat template, against transformers


@pytest.mark.parametrize("text", TEXTS)
def test_encode_decode_match_transformers(tok: Tokenizer, hf: Any, text: str) -> None:
    ids = tok.encode(text)
    assert ids == hf.encode(text, add_special_tokens=False)
    assert tok.decode(ids) == hf.decode(ids) == text
    assert tok.decode(ids, skip_special_tokens=True) == hf.decode(ids, skip_special_tokens=True)


def test_special_tokens_stay_whole(tok: Tokenizer) -> None:
    assert tok.encode("<|im_start|>user<|im_end|>") == [1, *tok.encode("user"), 2]
    assert tok.decode([1, 2, 0], skip_special_tokens=True) == ""


def test_properties(tok: Tokenizer, hf: Any) -> None:
    assert tok.vocab_size == len(hf) == 49152
    assert tok.bos_token_id == hf.bos_token_id == 1
    assert tok.eos_token_ids[0] == hf.eos_token_id == 2  # <|im_end|>
    assert tok.eos_token_ids == (2, 0)  # <|endoftext|> ends generation too, as in llama.cpp
    assert tok.encode("hi", add_special_tokens=True) == hf("hi")["input_ids"]


@pytest.mark.parametrize("messages", CHATS)
@pytest.mark.parametrize("add_generation_prompt", [True, False])
def test_chat_template_matches_transformers(
    tok: Tokenizer, hf: Any, messages: list[dict[str, Any]], add_generation_prompt: bool
) -> None:
    want = hf.apply_chat_template(
        messages, tokenize=False, add_generation_prompt=add_generation_prompt
    )
    assert tok.apply_chat_template(messages, add_generation_prompt) == want
    ids = tok.encode_chat(messages, add_generation_prompt)
    assert ids == hf.encode(want, add_special_tokens=False)


def test_chat_template_raise_exception_and_missing_template(tok: Tokenizer) -> None:
    from jinja2 import TemplateError

    strict = Tokenizer(tok.backend, "{{ raise_exception('no ' + bos_token) }}", tok.special_tokens)
    with pytest.raises(TemplateError, match=r"no <\|im_start\|>"):
        strict.apply_chat_template([])
    with pytest.raises(TokenizerError, match="no chat template"):
        Tokenizer(tok.backend).apply_chat_template([])


def test_tokenizer_from_folder(tmp_path: Path, tok: Tokenizer, hf: Any) -> None:
    hf.save_pretrained(tmp_path)
    folder = Tokenizer.load(tmp_path)
    for text in TEXTS:
        assert folder.encode(text) == tok.encode(text)
        assert folder.decode(tok.encode(text)) == text
    for messages in CHATS:
        assert folder.apply_chat_template(messages) == tok.apply_chat_template(messages)
    assert folder.eos_token_ids[0] == 2 and folder.bos_token_id == 1
    assert folder.vocab_size == tok.vocab_size


def test_load_chooses_by_path(smollm2_path: Path, tmp_path: Path) -> None:
    with pytest.raises(TokenizerError, match="no tokenizer.json or single .gguf"):
        Tokenizer.load(tmp_path)
    (tmp_path / "a.gguf").write_bytes(b"not a gguf")
    with pytest.raises(TokenizerError, match="a.gguf: not a readable GGUF file"):
        Tokenizer.load(tmp_path)


# ---------------------------------------------------------------------------------------------
# incremental detokenizer


@pytest.mark.parametrize("skip", [False, True])
def test_detokenizer_texts(tok: Tokenizer, skip: bool) -> None:
    for text in TEXTS:
        assert_stream_exact(tok, tok.encode(text), skip)


def byte_tokens(tok: Tokenizer) -> dict[int, int]:
    """byte -> id of its single-byte token: sequences of them split characters anywhere."""
    from qworker.model.tokenizer.tokenizer import _byte_alphabet

    ids = {b: tok.token_to_id(c) for b, c in _byte_alphabet().items()}
    return {b: i for b, i in ids.items() if i is not None}  # bytes never seen in UTF-8 are absent


def test_split_character_is_held_back(tok: Tokenizer) -> None:
    by_byte = byte_tokens(tok)
    ids = [by_byte[b] for b in "a🤖b".encode()]
    assert stream(tok, ids) == ["a", "", "", "", "🤖", "b", ""]


@settings(max_examples=300, deadline=None)
@given(data=st.data(), skip=st.booleans())
def test_detokenizer_random_ids(tok: Tokenizer, data: st.DataObject, skip: bool) -> None:
    ids = data.draw(
        st.lists(
            st.one_of(
                st.integers(0, tok.vocab_size - 1),
                st.sampled_from(sorted(byte_tokens(tok).values())),
            ),
            max_size=40,
        )
    )
    assert_stream_exact(tok, ids, skip)


def test_detokenizer_window_stays_small(tok: Tokenizer) -> None:
    sizes: list[int] = []

    class Counting(Tokenizer):
        def decode(self, ids: Any, skip_special_tokens: bool = False) -> str:
            sizes.append(len(ids))
            return super().decode(ids, skip_special_tokens)

    counting = Counting(tok.backend, tok.chat_template, tok.special_tokens)
    ids = tok.encode(" ".join(TEXTS) * 20)
    assert len(ids) > 1000
    assert "".join(stream(counting, ids)) == tok.decode(ids)
    assert max(sizes) <= 8


@pytest.mark.parametrize("cut", [0, 1, 5, 17, 40])
def test_prime_then_continue(tok: Tokenizer, cut: int) -> None:
    by_byte = byte_tokens(tok)
    ids = tok.encode(TEXTS[4]) + [by_byte[b] for b in "ç漢🤖".encode()] + tok.encode(" end")
    fresh = stream(tok, ids)
    detok = IncrementalDetokenizer(tok)
    assert detok.prime(ids[:cut]) == "".join(fresh[:cut])
    rest = [detok.add(i) for i in ids[cut:]] + [detok.flush()]
    assert rest == fresh[cut:]
