"""SentencePiece GGUF tokenizers (tokenizer.ggml.model "llama": Llama 2, Mistral v0.1, TinyLlama).

The fixtures are made here: a tiny SentencePiece model (BPE and unigram) trained with the
`sentencepiece` trainer, written with `gguf`'s writer into a GGUF with random Llama weights, the
way llama.cpp's converter writes a SentencePiece vocabulary. Two references on the same file:
SentencePiece itself (ids of text without special tokens, BPE model), and transformers'
`AutoTokenizer.from_pretrained(folder, gguf_file=...)`. transformers' GGUF conversion splits with a
`Metaspace` pre-tokenizer, which prepends no "▁" after a special token or before a leading space,
unlike SentencePiece, llama.cpp and the Llama 2 / Mistral tokenizer.json files; so the reference is
its tokenizer with the Llama 2 tokenizer.json prefix rule put in (what transformers' own phi3 GGUF
builder does), and `test_transformers_as_converted` pins where the unchanged one differs.
"""

from __future__ import annotations

import functools
import io
import random
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import gguf
import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from qworker.model.tokenizer.sentencepiece import SPACE
from qworker.model.tokenizer.tokenizer import REPLACEMENT_CHAR, Tokenizer
from tests.detok_check import assert_stream_exact, stream

USER_TOKEN = "<|tool|>"  # a user-defined piece: matched whole in text, not special
TURNS = ["<start_of_turn>", "<end_of_turn>"]  # Gemma's, user-defined pieces of its vocabulary
LLAMA2_TEMPLATE = (
    "{% if messages[0]['role'] == 'system' %}{% set loop_messages = messages[1:] %}"
    "{% set system_message = messages[0]['content'] %}{% else %}"
    "{% set loop_messages = messages %}{% set system_message = false %}{% endif %}"
    "{% for message in loop_messages %}"
    "{% if (message['role'] == 'user') != (loop.index0 % 2 == 0) %}"
    "{{ raise_exception('Conversation roles must alternate user/assistant/user/assistant/...') }}"
    "{% endif %}"
    "{% if loop.index0 == 0 and system_message != false %}"
    "{% set content = '<<SYS>>\\n' + system_message + '\\n<</SYS>>\\n\\n' + message['content'] %}"
    "{% else %}{% set content = message['content'] %}{% endif %}"
    "{% if message['role'] == 'user' %}{{ bos_token + '[INST] ' + content.strip() + ' [/INST]' }}"
    "{% elif message['role'] == 'assistant' %}{{ ' ' + content.strip() + ' ' + eos_token }}"
    "{% endif %}{% endfor %}"
)
MISTRAL_TEMPLATE = (
    "{{ bos_token }}{% for message in messages %}"
    "{% if (message['role'] == 'user') != (loop.index0 % 2 == 0) %}"
    "{{ raise_exception('Conversation roles must alternate user/assistant/user/assistant/...') }}"
    "{% endif %}{% if message['role'] == 'user' %}{{ '[INST] ' + message['content'] + ' [/INST]' }}"
    "{% elif message['role'] == 'assistant' %}{{ message['content'] + eos_token}}"
    "{% else %}{{ raise_exception('Only user and assistant roles are supported!') }}"
    "{% endif %}{% endfor %}"
)
ZEPHYR_TEMPLATE = (  # TinyLlama-1.1B-Chat
    "{% for message in messages %}\n{% if message['role'] == 'user' %}\n"
    "{{ '<|user|>\n' + message['content'] + eos_token }}\n"
    "{% elif message['role'] == 'system' %}\n"
    "{{ '<|system|>\n' + message['content'] + eos_token }}\n"
    "{% elif message['role'] == 'assistant' %}\n"
    "{{ '<|assistant|>\n'  + message['content'] + eos_token }}\n{% endif %}\n"
    "{% if loop.last and add_generation_prompt %}\n{{ '<|assistant|>' }}\n{% endif %}\n"
    "{% endfor %}"
)

PLAIN_TEXTS = [  # no special tokens in them
    "Hello, world! The quick brown fox jumps over the lazy dog.",
    "  two leading spaces, two  inner  and trailing  ",
    "def f(n):\n\treturn n * 12345 + 0.5\n\n\n",
    "中文测试：你好，世界！日本語のテキスト、한국어",  # mostly unseen: byte fallback
    "emoji 🤖🎉👩‍👩‍👧 and é, ñ, ß, Ω — “quotes” …",
    "digits 3.14159 2026-12-01 ０１２",
    "",
    " ",
    "\n",
    SPACE + " a literal ▁ in the text",
]
SPECIAL_TEXTS = [
    "<s>[INST] Hi there [/INST] Hello</s>",
    f"call {USER_TOKEN}search{USER_TOKEN} now",
    "<unk> and </s><s> back to back",
]
CHATS: list[list[dict[str, Any]]] = [
    [{"role": "user", "content": "Hi there"}],
    [
        {"role": "user", "content": "2+2?"},
        {"role": "assistant", "content": "4"},
        {"role": "user", "content": "Und auf Deutsch? 🤔"},
    ],
]


# ---------------------------------------------------------------------------------------------
# fixtures: a SentencePiece model trained here, written into a tiny Llama GGUF


def corpus() -> list[str]:
    rng = random.Random(0)
    text = (
        "the quick brown fox jumps over lazy dog hello world token stream queue worker model "
        "llama engine cache block paged attention prefill decode über café naïve Ωmega 中文 你好 "
        "return def int float print 0 1 2 3 4 5 6 7 8 9 , . ! ? ( ) : - \" '"
    )
    words = text.split(" ")
    return [" ".join(rng.choice(words) for _ in range(rng.randint(3, 14))) for _ in range(400)]


def train(model_type: str) -> Any:
    import sentencepiece as spm

    model = io.BytesIO()
    spm.SentencePieceTrainer.train(
        sentence_iterator=iter(corpus()), model_writer=model, model_type=model_type,
        vocab_size={"bpe": 420, "unigram": 350}[model_type], byte_fallback=True,
        character_coverage=1.0, split_digits=True,
        normalization_rule_name="identity", remove_extra_whitespaces=False,  # as Llama's
        user_defined_symbols=[USER_TOKEN], unk_id=0, bos_id=1, eos_id=2, pad_id=-1,
        minloglevel=2, num_threads=1,
    )
    return spm.SentencePieceProcessor(model_proto=model.getvalue())


def token_type(sp: Any, i: int) -> int:
    """llama.cpp's converter's token types: 1 normal, 2 unknown, 3 control, 4 user, 6 byte."""
    if sp.is_unknown(i):
        return 2
    if sp.is_control(i):
        return 3
    if sp.is_byte(i):
        return 6
    return 4 if sp.id_to_piece(i) in (USER_TOKEN, *TURNS) else 1


HIDDEN, HEADS, KV_HEADS, FFN, LAYERS = 32, 4, 2, 48, 2


def write_gguf(path: Path, sp: Any, template: str | None = LLAMA2_TEMPLATE, **flags: bool) -> Path:
    """A tiny random-weight Llama with `sp`'s vocabulary; flags: add_bos / add_eos /
    add_space_prefix (absent when not given)."""
    n = sp.get_piece_size()
    writer = gguf.GGUFWriter(path, "llama")
    writer.add_context_length(256)
    writer.add_embedding_length(HIDDEN)
    writer.add_block_count(LAYERS)
    writer.add_feed_forward_length(FFN)
    writer.add_head_count(HEADS)
    writer.add_head_count_kv(KV_HEADS)
    writer.add_layer_norm_rms_eps(1e-5)
    writer.add_tokenizer_model("llama")
    writer.add_token_list([sp.id_to_piece(i) for i in range(n)])
    writer.add_token_scores([sp.get_score(i) for i in range(n)])
    writer.add_token_types([token_type(sp, i) for i in range(n)])
    writer.add_unk_token_id(0)
    writer.add_bos_token_id(1)
    writer.add_eos_token_id(2)
    if "add_bos" in flags:
        writer.add_add_bos_token(flags["add_bos"])
    if "add_eos" in flags:
        writer.add_add_eos_token(flags["add_eos"])
    if "add_space_prefix" in flags:
        writer.add_add_space_prefix(flags["add_space_prefix"])
    if template is not None:
        writer.add_chat_template(template)
    rng = np.random.default_rng(0)
    kv = HIDDEN // HEADS * KV_HEADS
    shapes = {"token_embd.weight": (n, HIDDEN), "output_norm.weight": (HIDDEN,)}
    for b in range(LAYERS):
        shapes |= {
            f"blk.{b}.attn_norm.weight": (HIDDEN,), f"blk.{b}.ffn_norm.weight": (HIDDEN,),
            f"blk.{b}.attn_q.weight": (HIDDEN, HIDDEN), f"blk.{b}.attn_k.weight": (kv, HIDDEN),
            f"blk.{b}.attn_v.weight": (kv, HIDDEN), f"blk.{b}.attn_output.weight": (HIDDEN, HIDDEN),
            f"blk.{b}.ffn_gate.weight": (FFN, HIDDEN), f"blk.{b}.ffn_up.weight": (FFN, HIDDEN),
            f"blk.{b}.ffn_down.weight": (HIDDEN, FFN),
        }
    for name, shape in shapes.items():
        scale = 1.0 if len(shape) == 1 or name == "token_embd.weight" else 0.3
        tensor = rng.normal(0, scale, shape) + (1.0 if len(shape) == 1 else 0.0)
        writer.add_tensor(name, tensor.astype(np.float32))
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return path


def transformers_tokenizer(path: Path, prefix_rule: bool = True) -> Any:
    from tokenizers import normalizers
    from transformers import AutoTokenizer

    hf = AutoTokenizer.from_pretrained(path.parent, gguf_file=path.name)
    if prefix_rule:  # Llama 2's tokenizer.json: "▁" before each stretch between special tokens
        backend = hf.backend_tokenizer
        backend.normalizer = normalizers.Sequence(
            [normalizers.Prepend(SPACE), normalizers.Replace(" ", SPACE)]
        )
        backend.pre_tokenizer = None
    return hf


@dataclass
class Fixture:
    kind: str
    path: Path
    sp: Any  # sentencepiece.SentencePieceProcessor
    ours: Tokenizer
    hf: Any  # transformers' tokenizer of the same file, with the prefix rule


@pytest.fixture(scope="module")
def make(tmp_path_factory: pytest.TempPathFactory) -> Callable[[str], Fixture]:
    @functools.cache
    def made(kind: str) -> Fixture:
        sp = train(kind)
        path = write_gguf(tmp_path_factory.mktemp(kind) / "tiny.gguf", sp)
        return Fixture(kind, path, sp, Tokenizer.load(path), transformers_tokenizer(path))

    return made


@pytest.fixture(scope="module", params=["bpe", "unigram"])
def spm(request: pytest.FixtureRequest, make: Callable[[str], Fixture]) -> Fixture:
    return make(request.param)


@pytest.fixture(scope="module")
def bpe(make: Callable[[str], Fixture]) -> Fixture:
    return make("bpe")


# ---------------------------------------------------------------------------------------------
# encode / decode


@pytest.mark.parametrize("text", PLAIN_TEXTS + SPECIAL_TEXTS)
def test_encode_decode_match_transformers(spm: Fixture, text: str) -> None:
    ids = spm.ours.encode(text)
    assert ids == spm.hf.encode(text, add_special_tokens=False)
    for skip in (False, True):
        assert spm.ours.decode(ids, skip) == spm.hf.decode(ids, skip_special_tokens=skip)
    if text in PLAIN_TEXTS:  # a "▁" in the text reads back as a space, as in SentencePiece
        assert spm.ours.decode(ids) == text.replace(SPACE, " ")


@pytest.mark.parametrize("text", PLAIN_TEXTS)
def test_bpe_encode_matches_sentencepiece(bpe: Fixture, text: str) -> None:
    # llama.cpp (and so we) merge by score for unigram models too; SentencePiece's own unigram
    # search may cut differently, so only the BPE model is compared
    assert bpe.ours.encode(text) == bpe.sp.encode(text)


def test_byte_fallback_and_special_tokens(spm: Fixture) -> None:
    ids = spm.ours.encode("a漢")  # not in the corpus
    assert [spm.ours.backend.id_to_token(i) for i in ids[-3:]] == ["<0xE6>", "<0xBC>", "<0xA2>"]
    assert spm.sp.piece_to_id(USER_TOKEN) in spm.ours.encode(f"x{USER_TOKEN}y")
    assert spm.ours.encode("</s><s><unk>") == [2, 1, 0]
    assert spm.ours.decode([1, *spm.ours.encode("Hi"), 2], skip_special_tokens=True) == "Hi"


def test_properties(spm: Fixture) -> None:
    assert spm.ours.vocab_size == len(spm.hf) == spm.sp.get_piece_size()
    assert spm.ours.bos_token_id == spm.hf.bos_token_id == 1
    assert spm.ours.eos_token_ids == (spm.hf.eos_token_id,) == (2,)
    want = {"bos_token": "<s>", "eos_token": "</s>", "unk_token": "<unk>"}
    assert spm.ours.special_tokens == want
    # no add_bos_token in the file: llama.cpp and transformers add BOS to a SentencePiece vocab
    for text in ("hi", "  x", ""):
        ids = spm.ours.encode(text, add_special_tokens=True)
        assert ids == spm.hf(text)["input_ids"] == [1, *spm.ours.encode(text)]


@pytest.mark.parametrize("flags", [dict(add_bos=False), dict(add_bos=True, add_eos=True)])
def test_bos_eos_flags(spm: Fixture, tmp_path: Path, flags: dict[str, bool]) -> None:
    path = write_gguf(tmp_path / "flags.gguf", spm.sp, **flags)
    ours, hf = Tokenizer.load(path), transformers_tokenizer(path)
    for text in ("hi there", ""):
        want = [1] * flags["add_bos"] + spm.ours.encode(text) + [2] * flags.get("add_eos", False)
        assert ours.encode(text, add_special_tokens=True) == hf(text)["input_ids"] == want


def test_no_space_prefix(spm: Fixture, tmp_path: Path) -> None:
    # tokenizer.ggml.add_space_prefix = false (llama.cpp honours it; transformers ignores it)
    ours = Tokenizer.load(write_gguf(tmp_path / "bare.gguf", spm.sp, add_space_prefix=False))
    assert not any(ours.backend.id_to_token(i).startswith(SPACE) for i in ours.encode("quick"))
    assert ours.encode(" quick fox") == spm.ours.encode("quick fox")
    for text in PLAIN_TEXTS:
        assert ours.decode(ours.encode(text)) == text.replace(SPACE, " ")
    assert_stream_exact(ours, ours.encode(" ".join(PLAIN_TEXTS)))


def test_transformers_as_converted(spm: Fixture) -> None:
    """transformers' GGUF tokenizer unchanged: the same ids, except one "▁" fewer where text
    starts with a space (or "▁") and none after a special token."""
    plain = transformers_tokenizer(spm.path, prefix_rule=False)
    for text in PLAIN_TEXTS:
        if not text[:1].isspace() and not text.startswith(SPACE):
            assert spm.ours.encode(text) == plain.encode(text, add_special_tokens=False)
    def spelling(ids: list[int]) -> str:
        return "".join(spm.ours.backend.id_to_token(i) for i in ids)

    assert spelling(spm.ours.encode("  x")) == spelling(spm.sp.encode("  x")) == SPACE * 3 + "x"
    assert spelling(plain.encode("  x", add_special_tokens=False)) == SPACE * 2 + "x"
    assert plain.decode(plain.encode("  x", add_special_tokens=False)) == " x"  # a space lost
    after = spm.ours.encode("<s>hello")
    assert spm.ours.backend.id_to_token(after[1]).startswith(SPACE)
    assert not plain.convert_ids_to_tokens(plain.encode("<s>hello"))[2].startswith(SPACE)


# ---------------------------------------------------------------------------------------------
# chat templates


@pytest.mark.parametrize("template", ["file", MISTRAL_TEMPLATE, ZEPHYR_TEMPLATE])
@pytest.mark.parametrize("messages", CHATS)
def test_chat_templates_match_transformers(
    spm: Fixture, template: str, messages: list[dict[str, Any]]
) -> None:
    ours = spm.ours
    if template == "file":
        assert ours.chat_template == spm.hf.chat_template == LLAMA2_TEMPLATE
    else:
        ours = Tokenizer(ours.backend, template, ours.special_tokens, source="test")
    kwargs = {} if template == "file" else {"chat_template": template}
    want = spm.hf.apply_chat_template(messages, tokenize=False, add_generation_prompt=True,
                                      **kwargs)
    assert ours.apply_chat_template(messages) == want
    assert ours.encode_chat(messages) == spm.hf.encode(want, add_special_tokens=False)
    if template != ZEPHYR_TEMPLATE:  # "<s>[INST]": SentencePiece's "▁" after the special token
        first, second = ours.encode_chat(messages)[:2]
        assert first == 1 and ours.backend.id_to_token(second).startswith(SPACE)


def test_chat_template_raises(spm: Fixture) -> None:
    from jinja2 import TemplateError

    bad = [{"role": "user", "content": "a"}, {"role": "user", "content": "b"}]
    with pytest.raises(TemplateError, match="must alternate"):
        spm.ours.apply_chat_template(bad)
    with pytest.raises(TemplateError, match="must alternate"):
        spm.hf.apply_chat_template(bad, tokenize=False)


# ---------------------------------------------------------------------------------------------
# Gemma 3: no space prefix, <bos>, turns marked by user-defined pieces, its chat template

GEMMA3_TEMPLATE = (  # google/gemma-3-*-it's, text parts only
    "{{ bos_token }}"
    "{%- if messages[0]['role'] == 'system' -%}"
    "{%- set first_user_prefix = messages[0]['content'] + '\n\n' -%}"
    "{%- set loop_messages = messages[1:] -%}"
    "{%- else -%}{%- set first_user_prefix = '' -%}{%- set loop_messages = messages -%}"
    "{%- endif -%}"
    "{%- for message in loop_messages -%}"
    "{%- if (message['role'] == 'user') != (loop.index0 % 2 == 0) -%}"
    "{{ raise_exception('Conversation roles must alternate user/assistant/user/assistant/...') }}"
    "{%- endif -%}"
    "{%- if (message['role'] == 'assistant') -%}{%- set role = 'model' -%}"
    "{%- else -%}{%- set role = message['role'] -%}{%- endif -%}"
    "{{ '<start_of_turn>' + role + '\n' + (first_user_prefix if loop.first else '') }}"
    "{{ message['content'] | trim }}"
    "{{ '<end_of_turn>\n' }}"
    "{%- endfor -%}"
    "{%- if add_generation_prompt -%}{{ '<start_of_turn>model\n' }}{%- endif -%}"
)


def test_a_gemma3_vocabulary_tokenizes_as_sentencepiece_and_ends_a_turn(tmp_path: Path) -> None:
    """As llama.cpp's converter writes Gemma 3: `add_space_prefix` false, BOS added, the turn
    markers user-defined pieces (matched whole; `<end_of_turn>` ends generation)."""
    import sentencepiece as spm_lib

    from qworker.model.loading.gguf_checkpoint import gguf_eos_token_ids, open_gguf

    model = io.BytesIO()
    spm_lib.SentencePieceTrainer.train(
        sentence_iterator=iter(corpus()), model_writer=model, model_type="bpe", vocab_size=420,
        byte_fallback=True, character_coverage=1.0, split_digits=True,
        normalization_rule_name="identity", remove_extra_whitespaces=False,
        add_dummy_prefix=False, user_defined_symbols=TURNS, unk_id=0, bos_id=1, eos_id=2,
        pad_id=-1, bos_piece="<bos>", eos_piece="<eos>", minloglevel=2, num_threads=1,
    )
    sp = spm_lib.SentencePieceProcessor(model_proto=model.getvalue())
    path = write_gguf(tmp_path / "gemma.gguf", sp, GEMMA3_TEMPLATE, add_bos=True,
                      add_space_prefix=False)
    ours = Tokenizer.load(path)
    for text in PLAIN_TEXTS:
        assert ours.encode(text) == sp.encode(text)
        assert ours.decode(ours.encode(text)) == text.replace(SPACE, " ")
    assert ours.encode("hi", add_special_tokens=True) == [sp.bos_id(), *sp.encode("hi")]
    for messages in CHATS:
        text = ours.apply_chat_template(messages)
        assert text.startswith("<bos><start_of_turn>user\n") and text.endswith("model\n")
        assert ours.encode_chat(messages) == [sp.bos_id(), *sp.encode(text[len("<bos>"):])]
    end = sp.piece_to_id("<end_of_turn>")
    assert ours.encode("<end_of_turn>") == [end]
    assert end in gguf_eos_token_ids(open_gguf(path))


# ---------------------------------------------------------------------------------------------
# streaming


@pytest.mark.parametrize("skip", [False, True])
def test_detokenizer_texts(spm: Fixture, skip: bool) -> None:
    for text in PLAIN_TEXTS + SPECIAL_TEXTS:
        assert_stream_exact(spm.ours, spm.ours.encode(text, add_special_tokens=True), skip)


def test_split_character_is_held_back(spm: Fixture) -> None:
    ids = spm.ours.encode("a🤖 b")
    pieces = [spm.ours.backend.id_to_token(i) for i in ids]
    at = pieces.index("<0xF0>")
    assert pieces[at : at + 4] == ["<0xF0>", "<0x9F>", "<0xA4>", "<0x96>"]
    deltas = stream(spm.ours, ids)  # a run of byte tokens comes out with the token after it
    assert deltas[at : at + 4] == ["", "", "", ""] and deltas[at + 4].startswith("🤖")
    assert "".join(deltas) == "a🤖 b"


def test_invalid_byte_run(spm: Fixture) -> None:
    # "A" then a stray continuation byte: the whole run decodes as two U+FFFD, so the "A" that
    # was a whole character alone must not have been streamed before the run ended
    byte = {b: spm.ours.token_to_id(f"<0x{b:02X}>") for b in (0x41, 0x80)}
    ids = [*spm.ours.encode("x"), byte[0x41], byte[0x80], *spm.ours.encode("y")]
    assert spm.ours.decode(ids) == "x" + REPLACEMENT_CHAR * 2 + " y"
    assert_stream_exact(spm.ours, ids)
    ending = [*spm.ours.encode("x"), byte[0x41], byte[0x80]]
    assert stream(spm.ours, ending)[-3:] == ["", "", REPLACEMENT_CHAR * 2]  # flush() gives it


@settings(max_examples=200, deadline=None)
@given(data=st.data(), skip=st.booleans())
def test_detokenizer_random_ids(spm: Fixture, data: st.DataObject, skip: bool) -> None:
    ids = data.draw(st.lists(st.integers(0, spm.ours.vocab_size - 1), max_size=30))
    assert_stream_exact(spm.ours, ids, skip)


# ---------------------------------------------------------------------------------------------
# the whole model


def test_tiny_llama_generates_like_transformers(bpe: Fixture) -> None:
    import torch
    from transformers import AutoModelForCausalLM

    from qworker.engine.request import SamplingParams
    from qworker.model.decoder import load_model
    from tests.engine_fixtures import tiny_engine

    engine = tiny_engine(bpe.ours, load_model(bpe.path, dtype=torch.float32))
    prompt = bpe.ours.encode_chat(CHATS[0])
    [done] = engine.generate([prompt], SamplingParams(max_tokens=8, temperature=0.0,
                                                      ignore_eos=True))
    hf = AutoModelForCausalLM.from_pretrained(bpe.path.parent, gguf_file=bpe.path.name,
                                              dtype=torch.float32)
    want = hf.generate(torch.tensor([prompt]), max_new_tokens=8, do_sample=False,
                       min_new_tokens=8)[0, len(prompt):].tolist()
    assert done.token_ids == want
    assert done.text == bpe.ours.decode(want)  # the end of the text too (flushed)


def test_the_worker_gives_a_plain_prompt_its_bos_and_a_chat_none_on_top(
        bpe: Fixture, redis_url: str) -> None:
    import torch

    from qworker.model.decoder import load_model
    from qworker_client import Producer
    from tests.engine_fixtures import tiny_engine
    from tests.service_harness import thread_worker

    engine = tiny_engine(bpe.ours, load_model(bpe.path, dtype=torch.float32))
    text, chat = "hello world", CHATS[0]
    with thread_worker(redis_url, "spm", engine) as w, Producer(redis_url) as producer:
        plain = producer.submit(prompt=text, max_tokens=1).result(timeout=60)
        templated = producer.submit(messages=chat, max_tokens=1).result(timeout=60)
        assert w.stop() == 0
    with_bos = bpe.ours.encode(text, add_special_tokens=True)
    assert with_bos[0] == bpe.ours.bos_token_id and with_bos[1:] == bpe.ours.encode(text)
    assert plain.usage.prompt_tokens == len(with_bos)
    chat_ids = bpe.ours.encode_chat(chat)
    assert chat_ids.count(bpe.ours.bos_token_id) == 1  # the template's own
    assert templated.usage.prompt_tokens == len(chat_ids)
