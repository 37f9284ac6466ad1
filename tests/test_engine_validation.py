"""The engine's front door (qworker/engine/validation.py): every request is checked against the
model at `add`, on the real engine (a tiny random model over SmolLM2's tokenizer) and on the
simulated one, and a text too long for any tokenization is refused before tokenizing."""

from __future__ import annotations

import math
import time

import pytest
import torch

from qworker.engine.config import EngineConfig
from qworker.engine.engine import Engine
from qworker.engine.request import Request, RequestRejectedError, SamplingParams
from qworker.engine.sampler import SampleRow, sample
from qworker.engine.simulated import SimulatedEngine
from qworker.engine.validation import max_token_chars
from qworker.model.decoder import DecoderModel
from qworker.model.tokenizer.tokenizer import Tokenizer
from tests.engine_fixtures import tiny_engine, tiny_model

VOCAB = 49152  # SmolLM2's


@pytest.fixture(scope="module")
def model(smollm2_tokenizer: Tokenizer) -> DecoderModel:
    return tiny_model(smollm2_tokenizer.vocab_size)


@pytest.fixture
def real(smollm2_tokenizer: Tokenizer, model: DecoderModel) -> Engine:
    return tiny_engine(smollm2_tokenizer, model, max_model_len=128)


@pytest.fixture
def sim() -> SimulatedEngine:
    return SimulatedEngine.from_config(EngineConfig(model="sim:step_ms=0,max_model_len=128"))


def vocab_of(engine: Engine | SimulatedEngine) -> int:
    return engine.limits.vocab_size


def bad_requests(vocab: int) -> list[tuple[Request, str, str]]:
    """(request, code, what its message must say)"""
    greedy = SamplingParams(max_tokens=4, temperature=0.0)
    return [
        (Request("over", [5, 6, 7, vocab], greedy), "invalid_request",
         f"prompt_token_ids[3] = {vocab} is outside the vocabulary (0..{vocab - 1})"),
        (Request("huge", [99999999], greedy), "invalid_request",
         "prompt_token_ids[0] = 99999999 is outside"),
        (Request("negative", [5, -1], greedy), "invalid_request", "prompt_token_ids[1] = -1"),
        (Request("stop", [5], SamplingParams(max_tokens=4, min_tokens=2,
                                             stop_token_ids=(7, vocab + 3))),
         "invalid_request", f"stop_token_ids[1] = {vocab + 3} is outside"),
        (Request("readback", [5], greedy, output_token_ids=[6, vocab]), "invalid_request",
         f"output_token_ids[1] = {vocab} is outside"),
        (Request("empty", [], greedy), "invalid_request", "the prompt is empty"),
        (Request("nan", [5], SamplingParams(temperature=math.nan)), "invalid_request",
         "temperature must be a finite number >= 0"),
        (Request("top_p", [5], SamplingParams(top_p=0.0, min_p=2.0)), "invalid_request",
         "top_p must be in (0, 1]; min_p must be in [0, 1]"),
        (Request("penalty", [5], SamplingParams(repetition_penalty=0.0)), "invalid_request",
         "repetition_penalty must be a finite number > 0"),
        (Request("empty-stop", [5], SamplingParams(stop=("",))), "invalid_request",
         "stop strings must not be empty"),
        (Request("long", [5] * 128, greedy), "prompt_too_long", "does not fit"),
        (Request("long-resume", [5] * 100, greedy, output_token_ids=[6] * 28),
         "prompt_too_long", "(+28 already generated) does not fit"),
    ]


@pytest.mark.parametrize("kind", ["real", "sim"])
def test_every_bad_request_is_refused_at_add_and_takes_nothing(
        kind: str, request: pytest.FixtureRequest) -> None:
    engine = request.getfixturevalue(kind)
    free = engine.free_slots()
    for req, code, says in bad_requests(vocab_of(engine)):
        with pytest.raises(RequestRejectedError) as info:
            engine.add(req)
        assert info.value.code == code, req.request_id
        assert says in str(info.value), (req.request_id, str(info.value))
        assert not engine.has_unfinished() and engine.free_slots() == free, req.request_id


@pytest.mark.parametrize("kind", ["real", "sim"])
def test_the_edges_of_the_vocabulary_and_context_still_run(
        kind: str, request: pytest.FixtureRequest) -> None:
    engine = request.getfixturevalue(kind)
    last = vocab_of(engine) - 1
    params = SamplingParams(max_tokens=3, temperature=0.0, min_tokens=2, stop_token_ids=(last,))
    engine.add(Request("edges", [0, last], params))
    engine.add(Request("longest", [5] * 126, SamplingParams(max_tokens=8, temperature=0.0)))
    outputs = []
    while engine.has_unfinished():
        outputs += engine.step()
    finished = {o.request_id: o for o in outputs if o.finished}
    assert set(finished) == {"edges", "longest"}
    assert finished["longest"].finish_reason == "length"  # reached max_model_len after 2 tokens
    assert sum(len(o.new_token_ids) for o in outputs if o.request_id == "longest") == 2


def test_real_engine_vocabulary_is_the_embeddings(real: Engine, model: DecoderModel) -> None:
    assert real.limits.vocab_size == model.embed_tokens.weight.shape[0] == VOCAB


def test_text_bound_for_smollm2_is_its_longest_token(smollm2_tokenizer: Tokenizer) -> None:
    chars = max_token_chars(smollm2_tokenizer)
    vocab = smollm2_tokenizer.backend.get_vocab(with_added_tokens=True)
    assert chars == max(len(t) for t in vocab) == 81
    # the bound holds: no text of ours has more characters per token than that
    texts = ["x" * 5000, " " * 5000, "\n" + " " * 4000, "#" * 3000, "é" * 1000 + "<|im_start|>",
             "=" * 2000, "word " * 800]
    for text in texts:
        assert len(text) <= chars * len(smollm2_tokenizer.encode(text)), text[:20]


def test_a_text_that_cannot_fit_is_refused_without_tokenizing(
        real: Engine, sim: SimulatedEngine, smollm2_tokenizer: Tokenizer) -> None:
    most = (real.max_seq_len - 1) * 81
    real.check_prompt_text("x" * most)  # might fit: left to the tokenizer
    started = time.perf_counter()
    for engine in (real, sim):
        with pytest.raises(RequestRejectedError) as info:
            engine.check_prompt_text("x" * 1_000_000)
        assert info.value.code == "prompt_too_long"
        assert "1000000 characters does not fit" in str(info.value)
    assert time.perf_counter() - started < 0.5
    with pytest.raises(RequestRejectedError):
        real.check_prompt_text("x" * (most + 1))
    with pytest.raises(RequestRejectedError, match="characters does not fit"):
        real.generate(["x" * 1_000_000])  # the offline API checks before it tokenizes too
    sim.check_prompt_text("x" * 127)
    with pytest.raises(RequestRejectedError):
        sim.check_prompt_text("x" * 128)


def test_tokenizer_without_a_sure_bound_is_not_bounded(smollm2_tokenizer: Tokenizer) -> None:
    from tokenizers import normalizers, pre_tokenizers

    class Wrapped:
        def __init__(self, backend: object) -> None:
            self.backend = backend

    backend = smollm2_tokenizer.backend
    clone = type(backend).from_str(backend.to_str())
    clone.normalizer = normalizers.Strip()  # drops characters: no token bound is sure
    assert max_token_chars(Wrapped(clone)) is None
    split = type(backend).from_str(backend.to_str())
    split.pre_tokenizer = pre_tokenizers.Sequence([
        pre_tokenizers.Split(" ", behavior="removed"), pre_tokenizers.ByteLevel()])
    assert max_token_chars(Wrapped(split)) is None  # a million spaces would be no token at all
    split.pre_tokenizer = pre_tokenizers.Sequence([
        pre_tokenizers.Split(" ", behavior="isolated"), pre_tokenizers.ByteLevel()])
    assert max_token_chars(Wrapped(split)) == 81
    assert max_token_chars(object()) is None


@pytest.mark.parametrize("temperature", [1e-300, 5e-324, 1e-30, 1e-8])
def test_a_tiny_temperature_samples_the_greedy_token(temperature: float) -> None:
    torch.manual_seed(1)
    logits = torch.randn(4, 1000) * 3
    rows = [SampleRow(SamplingParams(temperature=temperature), seed, 0, [1], 1, ())
            for seed in range(4)]
    assert sample(logits, rows) == logits.argmax(dim=-1).tolist()
    banned = [SampleRow(SamplingParams(temperature=temperature), 0, 0, [1], 1,
                        (int(logits[0].argmax()),))]
    assert sample(logits[:1], banned) == [int(logits[0].topk(2).indices[1])]
