"""Tokenizer, chat template and incremental detokenizer for streaming text.

`Tokenizer` wraps a `tokenizers.Tokenizer` built either from a Hugging Face folder
(`tokenizer.json` + `tokenizer_config.json`) or from the metadata of a GGUF file, and renders chat
templates the way transformers does. `IncrementalDetokenizer` turns a stream of token ids into text
deltas whose concatenation is exactly the full decode.
"""

from __future__ import annotations

import json
import re
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from datetime import datetime
from functools import cached_property
from pathlib import Path
from typing import Any

import tokenizers
from tokenizers import AddedToken, Regex, decoders, models, pre_tokenizers, processors

from qworker.model.errors import ModelInputError
from qworker.model.tokenizer.sentencepiece import sentencepiece_bpe

REPLACEMENT_CHAR = "\ufffd"
Message = dict[str, Any]


NO_CHAT_TEMPLATE = ("the model has no chat template (a base model): it completes plain text "
                    "(a `prompt`, or `qworker generate --raw`), not `messages`")


class TokenizerError(ModelInputError):
    """A tokenizer could not be built or used; the message names the file and the problem."""


# Split patterns for `tokenizer.ggml.pre` values whose vocabulary was learned on something other
# than GPT-2's split. Types not listed (gpt2, smollm, ...) use ByteLevel's own GPT-2 split.
_LLAMA3_SPLIT = (
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}"
    r"| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+"
)
_QWEN2_SPLIT = (
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}"
    r"| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+"
)
GGUF_PRE_TOKENIZER_SPLITS = {
    "llama-bpe": _LLAMA3_SPLIT,
    "llama3": _LLAMA3_SPLIT,
    "llama-v3": _LLAMA3_SPLIT,
    "smaug-bpe": _LLAMA3_SPLIT,
    "qwen2": _QWEN2_SPLIT,
    "deepseek-r1-qwen": _QWEN2_SPLIT,
}
_GGUF_UNKNOWN, _GGUF_CONTROL, _GGUF_USER_DEFINED = 2, 3, 4  # llama.cpp token types
_GGUF_TOKENIZER_MODELS = ("gpt2", "llama")  # byte-level BPE, SentencePiece
_BYTE_PIECE = re.compile(r"<0x[0-9A-F]{2}>")  # SentencePiece's byte-fallback tokens
_SPECIAL_NAMES = ("bos", "eos", "unk", "pad")
_GGUF_SPECIAL_KEYS = {"bos": "bos", "eos": "eos", "unk": "unknown", "pad": "padding"}


def _byte_alphabet() -> dict[int, str]:
    """GPT-2's byte -> printable character table, which byte-level vocabularies are spelled in."""
    keep = [*range(0x21, 0x7F), *range(0xA1, 0xAD), *range(0xAE, 0x100)]
    table = {b: chr(b) for b in keep}
    spare = (chr(0x100 + n) for n in range(256))
    return {b: table.get(b) or next(spare) for b in range(256)}


def _byte_level_spelling(token: str, alphabet: frozenset[str], table: dict[int, str]) -> str:
    if set(token) <= alphabet:
        return token
    return "".join(table[b] for b in token.encode("utf-8"))


@dataclass
class Tokenizer:
    backend: tokenizers.Tokenizer = field(repr=False)
    chat_template: str | None = field(default=None, repr=False)
    special_tokens: dict[str, str] = field(default_factory=dict)  # bos_token, eos_token, ...
    extra_eos_token_ids: tuple[int, ...] = ()
    source: str = ""

    # ---- construction --------------------------------------------------------------------

    @classmethod
    def load(cls, path: str | Path) -> Tokenizer:
        """From a `.gguf` file, a folder with `tokenizer.json`, or a folder with one `.gguf`."""
        path = Path(path)
        if path.is_file() and path.suffix.lower() == ".gguf":
            return cls.from_gguf(path)
        if path.is_dir() and (path / "tokenizer.json").is_file():
            return cls.from_folder(path)
        ggufs = sorted(path.glob("*.gguf")) if path.is_dir() else []
        if len(ggufs) == 1:
            return cls.from_gguf(ggufs[0])
        raise TokenizerError(f"{path}: no tokenizer.json or single .gguf file to build a tokenizer")

    @classmethod
    def from_folder(cls, path: str | Path) -> Tokenizer:
        folder = Path(path)
        try:
            backend = tokenizers.Tokenizer.from_file(str(folder / "tokenizer.json"))
        except Exception as exc:  # tokenizers raises plain Exception subclasses
            raise TokenizerError(f"{folder / 'tokenizer.json'}: cannot load: {exc}") from exc
        config = _read_optional_json(folder / "special_tokens_map.json")
        config |= _read_optional_json(folder / "tokenizer_config.json")
        special = {
            f"{name}_token": text
            for name in _SPECIAL_NAMES
            if (text := _token_text(config.get(f"{name}_token"))) is not None
        }
        template_file = folder / "chat_template.jinja"
        template = (
            template_file.read_text(encoding="utf-8")
            if template_file.is_file()
            else _pick_template(config.get("chat_template"))
        )
        generation = _read_optional_json(folder / "generation_config.json")
        eos = generation.get("eos_token_id")
        extra_eos = tuple(eos) if isinstance(eos, list) else (() if eos is None else (eos,))
        return cls(backend, template, special, extra_eos, str(folder))

    @classmethod
    def from_gguf(cls, path: str | Path) -> Tokenizer:
        """Build the tokenizer a GGUF file describes in its metadata: byte-level BPE ("gpt2") or
        SentencePiece ("llama")."""
        from qworker.model.loading.gguf_checkpoint import gguf_eos_token_ids, gguf_value, open_gguf
        from qworker.model.loading.tensors import LoaderError

        path = Path(path)
        try:
            reader = open_gguf(path)
        except LoaderError as exc:
            raise TokenizerError(str(exc)) from exc

        def value(key: str, default: Any = None) -> Any:
            return gguf_value(reader, f"tokenizer.ggml.{key}", default)

        kind = value("model")
        if kind not in _GGUF_TOKENIZER_MODELS:
            raise TokenizerError(
                f"{path}: tokenizer.ggml.model is {kind!r}; supported: byte-level BPE ('gpt2') "
                "and SentencePiece ('llama')"
            )
        tokens: list[str] = value("tokens") or []
        types: list[int] = value("token_type") or [1] * len(tokens)
        if not tokens or len(types) != len(tokens):
            raise TokenizerError(f"{path}: {len(tokens)} tokens but {len(types)} token types")
        special = {
            f"{name}_token": tokens[token_id]
            for name, key in _GGUF_SPECIAL_KEYS.items()
            if (token_id := value(f"{key}_token_id")) is not None and 0 <= token_id < len(tokens)
        }
        if kind == "gpt2":
            backend = _byte_level_bpe(tokens, value("merges") or [], value("pre"))
        else:
            backend = _sentencepiece(path, tokens, value, special.get("unk_token"))
        _add_gguf_special_tokens(backend, tokens, types, byte_level=kind == "gpt2")
        # llama.cpp adds BOS to a SentencePiece vocabulary that does not say otherwise.
        add_bos = value("add_bos_token", kind == "llama") and "bos_token" in special
        add_eos = value("add_eos_token", False) and "eos_token" in special
        if add_bos or add_eos:
            backend.post_processor = _bos_eos_processor(
                (special["bos_token"], value("bos_token_id")) if add_bos else None,
                (special["eos_token"], value("eos_token_id")) if add_eos else None,
            )
        template = gguf_value(reader, "tokenizer.chat_template")
        return cls(backend, template, special, gguf_eos_token_ids(reader), str(path))

    # ---- properties ----------------------------------------------------------------------

    @property
    def vocab_size(self) -> int:
        return self.backend.get_vocab_size(with_added_tokens=True)

    @property
    def bos_token_id(self) -> int | None:
        bos = self.special_tokens.get("bos_token")
        return None if bos is None else self.backend.token_to_id(bos)

    @property
    def eos_token_ids(self) -> tuple[int, ...]:
        eos = self.special_tokens.get("eos_token")
        first = () if eos is None else (self.backend.token_to_id(eos),)
        return tuple(dict.fromkeys(i for i in (*first, *self.extra_eos_token_ids) if i is not None))

    def token_to_id(self, token: str) -> int | None:
        return self.backend.token_to_id(token)

    @cached_property
    def byte_fallback_ids(self) -> frozenset[int]:
        """The `<0xNN>` tokens, where a ByteFallback decoder reads them (SentencePiece). It decodes
        a run of them as a whole: its text if the bytes are valid UTF-8, else one U+FFFD each."""
        decoder = json.loads(self.backend.to_str()).get("decoder")
        if '"ByteFallback"' not in json.dumps(decoder):
            return frozenset()
        vocab = self.backend.get_vocab(with_added_tokens=False)
        return frozenset(i for token, i in vocab.items() if _BYTE_PIECE.fullmatch(token))

    # ---- encode / decode -----------------------------------------------------------------

    def encode(self, text: str, add_special_tokens: bool = False) -> list[int]:
        return self.backend.encode(text, add_special_tokens=add_special_tokens).ids

    def decode(self, ids: Sequence[int], skip_special_tokens: bool = False) -> str:
        return self.backend.decode(list(ids), skip_special_tokens=skip_special_tokens)

    # ---- chat ----------------------------------------------------------------------------

    def apply_chat_template(
        self, messages: list[Message], add_generation_prompt: bool = True, **kwargs: Any
    ) -> str:
        """Render `messages` with the model's chat template, as transformers does."""
        if self._compiled_template is None:
            raise TokenizerError(f"{self.source}: {NO_CHAT_TEMPLATE}")
        return self._compiled_template.render(
            messages=messages,
            add_generation_prompt=add_generation_prompt,
            **(self.special_tokens | kwargs),
        )

    @property
    def has_chat_template(self) -> bool:
        return self.chat_template is not None

    def encode_chat(self, messages: list[Message], add_generation_prompt: bool = True) -> list[int]:
        # The template writes its own special tokens, so none are added on top.
        return self.encode(self.apply_chat_template(messages, add_generation_prompt))

    @cached_property
    def _compiled_template(self) -> Any:
        return None if self.chat_template is None else _compile_template(self.chat_template)


# --------------------------------------------------------------------------------------------
# helpers


def _read_optional_json(file: Path) -> dict[str, Any]:
    if not file.is_file():
        return {}
    try:
        data = json.loads(file.read_text(encoding="utf-8"))
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as exc:
        raise TokenizerError(f"{file}: cannot read JSON: {exc}") from exc
    return data if isinstance(data, dict) else {}


def _token_text(value: Any) -> str | None:
    """A special token as tokenizer_config.json writes it: a string or an AddedToken dict."""
    if isinstance(value, dict):
        value = value.get("content")
    return value if isinstance(value, str) else None


def _pick_template(value: Any) -> str | None:
    """tokenizer_config.json's chat_template: a string, or a list of named templates."""
    if isinstance(value, list):
        named = {t.get("name"): t.get("template") for t in value if isinstance(t, dict)}
        return named.get("default")
    return value if isinstance(value, str) else None


def _byte_level_bpe(tokens: list[str], merges: list[str], pre: str | None) -> tokenizers.Tokenizer:
    table = _byte_alphabet()
    alphabet = frozenset(table.values())
    vocab = {_byte_level_spelling(t, alphabet, table): i for i, t in enumerate(tokens)}
    pairs = [_merge_pair(m) for m in merges]
    backend = tokenizers.Tokenizer(models.BPE(vocab=vocab, merges=pairs))
    split = GGUF_PRE_TOKENIZER_SPLITS.get(pre or "")
    if split is None:
        backend.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True)
    else:
        backend.pre_tokenizer = pre_tokenizers.Sequence(
            [
                pre_tokenizers.Split(Regex(split), behavior="isolated"),
                pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False),
            ]
        )
    backend.decoder = decoders.ByteLevel()
    return backend


def _sentencepiece(
    path: Path, tokens: list[str], value: Callable[..., Any], unk: str | None
) -> tokenizers.Tokenizer:
    scores: list[float] | None = value("scores")
    if scores is None or len(scores) != len(tokens):
        count = "no" if scores is None else len(scores)
        raise TokenizerError(f"{path}: {len(tokens)} tokens but {count} tokenizer.ggml.scores")
    merges = value("merges")
    pairs = None if merges is None else [_merge_pair(m) for m in merges]
    return sentencepiece_bpe(tokens, scores, pairs, unk, bool(value("add_space_prefix", True)))


def _merge_pair(merge: str) -> tuple[str, str]:
    left, sep, right = merge.partition(" ")
    if not sep:
        raise TokenizerError(f"tokenizer.ggml.merges: {merge!r} is not two tokens and a space")
    return left, right


def _bos_eos_processor(
    bos: tuple[str, int] | None, eos: tuple[str, int] | None
) -> processors.TemplateProcessing:
    """Add BOS before and / or EOS after each sequence, as transformers' add_bos/eos_token do."""
    start, end = f"{bos[0]} " if bos else "", f" {eos[0]}" if eos else ""
    return processors.TemplateProcessing(
        single=f"{start}$A{end}",
        pair=f"{start}$A{end} {start}$B{end}",
        special_tokens=[t for t in (bos, eos) if t is not None],
    )


def _add_gguf_special_tokens(
    backend: tokenizers.Tokenizer, tokens: list[str], types: list[int], byte_level: bool
) -> None:
    """Match control, unknown and user-defined tokens whole in text, as llama.cpp does."""
    alphabet = frozenset(_byte_alphabet().values())
    # A control token spelled outside the byte alphabet of a byte-level vocabulary is a converter
    # mislabel; adding it would grow the vocabulary past the model's embedding.
    control = [
        AddedToken(t, special=True, normalized=False)
        for t, kind in zip(tokens, types, strict=True)
        if kind == _GGUF_CONTROL or (kind == _GGUF_UNKNOWN and not byte_level)
        if not byte_level or set(t) <= alphabet
    ]
    vocab = backend.get_vocab()
    user = [
        AddedToken(t, special=False, normalized=False)
        for t, kind in zip(tokens, types, strict=True)
        if kind == _GGUF_USER_DEFINED and t in vocab
    ]
    backend.add_special_tokens(control)
    backend.add_tokens(user)


def _compile_template(source: str) -> Any:
    from jinja2 import TemplateError
    from jinja2.ext import loopcontrols
    from jinja2.sandbox import ImmutableSandboxedEnvironment

    def raise_exception(message: str) -> None:
        raise TemplateError(message)

    def tojson(
        value: Any, ensure_ascii: bool = False, indent: int | None = None, **kwargs: Any
    ) -> str:
        # Jinja's own tojson escapes HTML characters, which chat templates do not want.
        return json.dumps(value, ensure_ascii=ensure_ascii, indent=indent, **kwargs)

    env = ImmutableSandboxedEnvironment(
        trim_blocks=True, lstrip_blocks=True, extensions=[loopcontrols]
    )
    env.filters["tojson"] = tojson
    env.globals["raise_exception"] = raise_exception
    env.globals["strftime_now"] = lambda fmt: datetime.now().strftime(fmt)
    return env.from_string(source)


# --------------------------------------------------------------------------------------------
# streaming


class IncrementalDetokenizer:
    """Turns token ids, one at a time, into text deltas.

    The deltas joined (plus `flush()` at the end) equal `tokenizer.decode(all_ids)`. Text that ends
    in an incomplete UTF-8 character (decoded as U+FFFD) is held back until a later token completes
    it; so is a run of byte-fallback tokens until it ends (a later byte of the run can turn all of
    it into U+FFFD). Each step decodes only the window from `_prefix` to the end, where
    `_prefix.._read` is text already emitted (kept so decoders that treat a sequence's first token
    specially see the same context twice), so the cost per token does not grow with the sequence.
    """

    def __init__(self, tokenizer: Tokenizer, skip_special_tokens: bool = False) -> None:
        self.tokenizer = tokenizer
        self.skip_special_tokens = skip_special_tokens
        self._held_ids = _run_ids(tokenizer, skip_special_tokens)
        self.ids: list[int] = []
        self._prefix = 0  # start of the decode window
        self._read = 0  # ids[:_read] are fully emitted

    def _decode(self, start: int, stop: int | None = None) -> str:
        return self.tokenizer.decode(self.ids[start:stop], self.skip_special_tokens)

    def add(self, token_id: int) -> str:
        """Append one id; return the text it makes final (empty while a character is split)."""
        self.ids.append(token_id)
        if token_id in self._held_ids:  # a byte run is decoded when it has ended
            return ""
        emitted = self._decode(self._prefix, self._read)
        text = self._decode(self._prefix)
        if text.endswith(REPLACEMENT_CHAR) or not text.startswith(emitted):
            return ""
        if len(text) == len(emitted):
            self._read = len(self.ids)  # the ids added nothing (e.g. skipped special tokens)
            return ""
        self._prefix, self._read = self._read, len(self.ids)
        return text[len(emitted) :]

    def prime(self, ids: Sequence[int]) -> str:
        """Feed ids already streamed (a resumed request) and return the text they emitted."""
        return "".join(self.add(i) for i in ids)

    def flush(self) -> str:
        """At the end of the stream: whatever is still held back (an unfinished character)."""
        emitted = self._decode(self._prefix, self._read)
        text = self._decode(self._prefix)
        self._read = len(self.ids)
        return text[len(emitted) :] if text.startswith(emitted) else ""


def _run_ids(tokenizer: Tokenizer, skip_special_tokens: bool) -> frozenset[int]:
    """Ids that do not end a run of byte-fallback tokens: those tokens, and special tokens where
    they are skipped (the decoder sees the bytes on either side of one as a single run)."""
    held = tokenizer.byte_fallback_ids
    if not held or not skip_special_tokens:
        return held
    added = tokenizer.backend.get_added_tokens_decoder()
    return held | {i for i, token in added.items() if token.special}
