"""Stop strings, held-back text, multi-byte characters and min_tokens, as documented."""

from __future__ import annotations

import pytest
import torch

from qworker.engine.engine import Engine
from qworker.engine.request import Request, SamplingParams
from qworker.engine.sampler import SampleRow, sample
from qworker.engine.sequence import Sequence
from qworker.engine.text import TextStream
from qworker.model.tokenizer.tokenizer import IncrementalDetokenizer, Tokenizer
from tests.engine_fixtures import tiny_engine, tiny_model


class Pieces:
    """A detokenizer whose token i is the string pieces[i]."""

    def __init__(self, pieces: list[str]) -> None:
        self.pieces = pieces

    def add(self, token_id: int) -> str:
        return self.pieces[token_id]

    def flush(self) -> str:
        return ""


def stream(pieces: list[str], stop: tuple[str, ...]) -> tuple[list[str], TextStream]:
    text = TextStream(Pieces(pieces), stop)
    deltas = []
    for token in range(len(pieces)):
        deltas.append(text.add(token))
        if text.stopped:
            break
    else:
        deltas.append(text.flush())
    return deltas, text


def test_stop_string_straddling_tokens_is_held_back_then_cut() -> None:
    deltas, text = stream(["Hello", " wor", "ld", " EN", "D", " more"], stop=("END",))
    assert text.stopped and text.final_text == "Hello world "
    assert deltas[:3] == ["Hello", " wor", "ld"]
    assert deltas[3] == " "  # "EN" could begin "END": held back
    assert "".join(deltas) == text.final_text


def test_held_back_text_that_was_not_a_stop_is_released() -> None:
    deltas, text = stream(["a <", "|e", "x", "!"], stop=("<|end|>",))
    assert not text.stopped
    assert deltas == ["a ", "", "<|ex", "!", ""]
    assert "".join(deltas) == text.final_text == "a <|ex!"


class Holding(Pieces):
    """A detokenizer that holds every piece back until flush() (as a byte-fallback run)."""

    held = ""

    def add(self, token_id: int) -> str:
        self.held += self.pieces[token_id]
        return ""

    def flush(self) -> str:
        held, self.held = self.held, ""
        return held


@pytest.mark.parametrize(("stop", "final"), [((), "abc"), (("bc",), "a")])
def test_flush_releases_what_the_detokenizer_held(stop: tuple[str, ...], final: str) -> None:
    text = TextStream(Holding(["a", "b", "c"]), stop)
    assert [text.add(t) for t in range(3)] == ["", "", ""]
    assert text.flush() == final == text.final_text  # a stop string in it still cuts it
    assert text.stopped == bool(stop)


def test_earliest_of_several_stop_strings_wins() -> None:
    _, text = stream(["xx", "yzzy"], stop=("zz", "xy"))
    assert text.final_text == "x"


def test_multibyte_characters_are_never_split(smollm2_tokenizer: Tokenizer) -> None:
    text = "日本語のテキスト 🎉🚀 ok ünïcödé"
    ids = smollm2_tokenizer.encode(text)
    stream_ = TextStream(IncrementalDetokenizer(smollm2_tokenizer), stop=("🚀",))
    deltas = [stream_.add(t) for t in ids if not stream_.stopped]
    assert all("\ufffd" not in d for d in deltas)
    assert stream_.stopped and stream_.final_text == "日本語のテキスト 🎉"
    assert "".join(deltas) == stream_.final_text


def scripted(engine: Engine, script: list[int]) -> None:
    """Replace the forward pass: the i-th generated token of every request is script[i]."""
    def run(work: list[tuple[Sequence, int]]) -> dict[Sequence, int]:
        return {seq: script[seq.num_output_tokens] for seq, n in work
                if seq.num_computed + n == len(seq.token_ids)}
    engine.runner.run = run  # type: ignore[method-assign]


@pytest.fixture(scope="module")
def engine_factory(smollm2_tokenizer: Tokenizer):  # noqa: ANN201
    model = tiny_model(smollm2_tokenizer.vocab_size)
    return lambda: tiny_engine(smollm2_tokenizer, model)


def finish(engine: Engine, request: Request) -> tuple[list[int], str, str]:
    engine.add(request)
    tokens, text = [], ""
    while engine.has_unfinished():
        for out in engine.step():
            tokens += out.new_token_ids
            text += out.text_delta
            if out.finished:
                assert out.text == text
                return tokens, text, out.finish_reason or ""
    raise AssertionError("never finished")


def test_stop_strings_only_count_from_min_tokens(smollm2_tokenizer: Tokenizer,
                                                 engine_factory) -> None:  # noqa: ANN001
    ids = smollm2_tokenizer.encode(" stop here and stop there and more")
    params = SamplingParams(max_tokens=len(ids), stop=("stop",), min_tokens=3)
    engine = engine_factory()
    scripted(engine, ids)
    _, text, reason = finish(engine, Request("a", [1, 2, 3], params))
    assert reason == "stop" and text == " stop here and "


def test_eos_is_banned_before_min_tokens_and_its_text_is_not_shown(
        smollm2_tokenizer: Tokenizer) -> None:
    eos = smollm2_tokenizer.eos_token_ids[0]
    logits = torch.zeros(2, smollm2_tokenizer.vocab_size)
    logits[:, eos] = 10.0
    logits[:, 42] = 5.0
    rows = [SampleRow(SamplingParams(temperature=0.0), 0, 0, [1], 1, banned=(eos,)),
            SampleRow(SamplingParams(temperature=0.0), 0, 0, [1], 1, banned=())]
    assert sample(logits, rows) == [42, eos]


def test_eos_and_stop_token_ids_end_with_stop(smollm2_tokenizer: Tokenizer,
                                              engine_factory) -> None:  # noqa: ANN001
    eos = smollm2_tokenizer.eos_token_ids[0]
    hello = smollm2_tokenizer.encode("Hello there")
    engine = engine_factory()
    scripted(engine, hello + [eos, 5, 6])
    tokens, text, reason = finish(engine, Request("e", [1], SamplingParams(max_tokens=10)))
    assert (tokens, text, reason) == (hello + [eos], "Hello there", "stop")
    engine = engine_factory()
    scripted(engine, hello + [eos, 5, 6])
    tokens, _, reason = finish(engine, Request("i", [1], SamplingParams(max_tokens=4,
                                                                         ignore_eos=True)))
    assert (tokens, reason) == (hello + [eos, 5], "length")
    engine = engine_factory()
    scripted(engine, hello + [eos, 5, 6])
    tokens, _, reason = finish(engine, Request("s", [1], SamplingParams(
        max_tokens=10, stop_token_ids=(hello[1],))))
    assert (tokens, reason) == (hello[:2], "stop")


def test_a_rows_draw_does_not_depend_on_its_batch_mates() -> None:
    """Top-k / top-p rows in the batch must not change how a plain row is sampled."""
    torch.manual_seed(0)
    logits = torch.randn(3, 500) * 2
    plain = SamplingParams(temperature=1.0)
    mates = [SamplingParams(temperature=0.8, top_k=5), SamplingParams(top_p=0.5, min_p=0.1)]
    for seed in range(200):
        alone = sample(logits[:1], [SampleRow(plain, seed, 0, [1], 1, ())])
        rows = [SampleRow(p, seed, 0, [1], 1, ()) for p in (plain, *mates)]
        together = sample(logits, rows)
        assert together[0] == alone[0], seed
        assert together[1] in logits[1].topk(5).indices.tolist()


def test_top_p_keeps_the_smallest_set_reaching_p() -> None:
    probs = torch.tensor([[0.5, 0.05, 0.3, 0.15]])
    logits = probs.log()
    row = SamplingParams(temperature=1.0, top_p=0.8)
    drawn = {sample(logits, [SampleRow(row, seed, 0, [1], 1, ())])[0] for seed in range(300)}
    assert drawn == {0, 2}  # 0.5 + 0.3 reaches 0.8: 0.15 and 0.05 are cut
