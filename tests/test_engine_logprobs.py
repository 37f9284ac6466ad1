"""Logprobs through the engine: raw-logit log_softmax of each sampled token and of the prompt,
whatever the chunking, batching, sampling settings and preemptions; nothing computed unasked."""

from __future__ import annotations

import random

import pytest
import torch

from qworker.engine import logprobs as logprobs_module
from qworker.engine import runner as runner_module
from qworker.engine.config import EngineConfig
from qworker.engine.engine import Engine
from qworker.engine.request import (
    Request,
    RequestRejectedError,
    SamplingParams,
    StepOutput,
    TokenLogprobs,
)
from qworker.engine.simulated import SimulatedEngine
from qworker.model.batch import SequenceInput, build_batch
from qworker.model.decoder import DecoderModel
from qworker.model.kv_cache import KVCache
from qworker.model.tokenizer.tokenizer import Tokenizer
from tests.engine_fixtures import tiny_engine, tiny_model

VOCAB = 512


@pytest.fixture(scope="module")
def model() -> DecoderModel:
    return tiny_model(VOCAB, dtype=torch.float32)


def one_shot_logprobs(model: DecoderModel, tokens: list[int]) -> torch.Tensor:
    """log_softmax at every position of `tokens`, computed in one unchunked forward."""
    cache = KVCache.allocate(model.config, -(-len(tokens) // 4) + 1, 4, model.dtype, model.device)
    table = list(range(1, -(-len(tokens) // 4) + 1))
    batch = build_batch([SequenceInput(tokens, 0, table, all_logits=True)], 4, model.device)
    return torch.log_softmax(model(batch, cache).float(), dim=-1)


def run_all(engine: Engine | SimulatedEngine,
            requests: list[Request]) -> dict[str, list[StepOutput]]:
    outputs: dict[str, list[StepOutput]] = {r.request_id: [] for r in requests}
    for request in requests:
        engine.add(request)
    while engine.has_unfinished():
        for out in engine.step():
            outputs[out.request_id].append(out)
    return outputs


def requests(seed: int) -> list[Request]:
    rng = random.Random(seed)
    out = []
    for i in range(8):
        params = SamplingParams(
            max_tokens=rng.randint(1, 10), temperature=rng.choice([0.0, 0.8, 1.5]),
            repetition_penalty=rng.choice([1.0, 1.3]), top_k=rng.choice([0, 5]),
            seed=rng.randrange(2**32), ignore_eos=True,
            logprobs=rng.choice([None, 0, 3, 20]), prompt_logprobs=rng.choice([None, 0, 2]),
        )
        prompt = [rng.randrange(VOCAB) for _ in range(rng.randint(1, 40))]
        out.append(Request(f"r{i}", prompt, params))
    return out


@pytest.mark.parametrize("seed", [0, 1])
def test_logprobs_are_the_raw_log_softmax_at_each_position(tokenizer_free_engine: Engine,
                                                           model: DecoderModel, seed: int) -> None:
    reqs = requests(seed)
    outputs = run_all(tokenizer_free_engine, reqs)
    for request in reqs:
        outs, p = outputs[request.request_id], request.params
        generated = [t for out in outs for t in out.new_token_ids]
        expected = one_shot_logprobs(model, request.prompt_token_ids + generated)
        prompt_len = len(request.prompt_token_ids)
        given = [e for out in outs for e in out.logprobs or []]
        prompt_given = [e for out in outs for e in out.prompt_logprobs or []]
        if p.logprobs is None:
            assert not given
        else:
            assert [e.token_id for e in given] == generated
            for i, entry in enumerate(given):
                check_entry(entry, expected[prompt_len - 1 + i], p.logprobs)
        if p.prompt_logprobs is None:
            assert all(out.prompt_logprobs is None for out in outs)
        else:
            assert outs[0].prompt_logprobs is not None, "prompt logprobs come with the first token"
            assert [e.token_id for e in prompt_given] == request.prompt_token_ids[1:]
            for pos, entry in enumerate(prompt_given):
                check_entry(entry, expected[pos], p.prompt_logprobs)


def check_entry(entry: object, row: torch.Tensor, k: int) -> None:
    assert isinstance(entry, TokenLogprobs)
    assert abs(entry.logprob - row[entry.token_id].item()) < 1e-4
    assert len(entry.top) == k
    values, _ = row.topk(k) if k else (torch.empty(0), None)
    assert [v for _, v in entry.top] == pytest.approx(values.tolist(), abs=1e-4)
    for token_id, value in entry.top:
        assert abs(row[token_id].item() - value) < 1e-4


@pytest.mark.parametrize("path", ["native", "torch"])
@pytest.mark.parametrize(("vocab", "k"), [(3000, 7), (300, 20)])  # k above and below the chunks
def test_token_logprobs_are_log_softmax_with_ties_best_first_lower_id_first(
        path: str, vocab: int, k: int) -> None:
    if path == "native" and logprobs_module.native.library() is None:
        pytest.fail(f"no native kernels here: {logprobs_module.native.status().reason}")
    gen = torch.Generator().manual_seed(vocab)
    logits = torch.randn(6, vocab, generator=gen) * 4
    logits[1, [9, 2500 % vocab, 40]] = logits[1].max() + 1  # a three-way tie at the top
    logits[4] = 0.5  # all equal
    rows, tokens = [5, 1, 4, 2], [3, 40, vocab - 1, 0]
    tops = [k, k, 3, 0]
    got = logprobs_module.token_logprobs(logits, rows, tokens, tops,
                                         native_kernel=path == "native")
    exact = torch.log_softmax(logits.double(), dim=-1)
    for entry, row, token, top in zip(got, rows, tokens, tops, strict=True):
        assert entry.token_id == token
        assert abs(entry.logprob - exact[row, token].item()) < 1e-5
        best = sorted(range(vocab), key=lambda i: (-logits[row, i].item(), i))[:top]
        if path == "native":  # the kernel's order; torch's topk may order equal values otherwise
            assert [i for i, _ in entry.top] == best
        assert [v for _, v in entry.top] == pytest.approx(exact[row, best].tolist(), abs=1e-5)
        assert all(abs(v - exact[row, i].item()) < 1e-5 for i, v in entry.top)


@pytest.fixture
def tokenizer_free_engine(smollm2_tokenizer: Tokenizer, model: DecoderModel) -> Engine:
    # prefill in chunks of 7 beside decodes: prompt logprobs are collected across chunks
    return tiny_engine(smollm2_tokenizer, model, prefill_chunk=7, max_batched_tokens=20,
                       max_num_seqs=4)


def test_prompt_logprobs_survive_a_preemption(smollm2_tokenizer: Tokenizer,
                                              model: DecoderModel) -> None:
    # a pool so small that sequences preempt each other mid-prefill and recompute
    engine = tiny_engine(smollm2_tokenizer, model, num_blocks=14, prefill_chunk=6,
                         max_batched_tokens=12, max_num_seqs=3)
    rng = random.Random(3)
    reqs = [Request(f"p{i}", [rng.randrange(VOCAB) for _ in range(18)],
                    SamplingParams(max_tokens=8, temperature=0.0, ignore_eos=True,
                                   prompt_logprobs=1, logprobs=1)) for i in range(3)]
    outputs = run_all(engine, reqs)
    assert engine.num_preemptions > 0, "the test needs a preemption"
    for request in reqs:
        outs = outputs[request.request_id]
        generated = [t for out in outs for t in out.new_token_ids]
        expected = one_shot_logprobs(model, request.prompt_token_ids + generated)
        prompt_given = [e for out in outs for e in out.prompt_logprobs or []]
        assert [e.token_id for e in prompt_given] == request.prompt_token_ids[1:]
        for pos, entry in enumerate(prompt_given):
            check_entry(entry, expected[pos], 1)


def test_no_logprobs_are_computed_when_no_row_asks(smollm2_tokenizer: Tokenizer,
                                                   model: DecoderModel,
                                                   monkeypatch: pytest.MonkeyPatch) -> None:
    calls: list[int] = []
    original = runner_module.token_logprobs

    def counting(logits: torch.Tensor, rows: list[int], token_ids: list[int],
                 top: list[int]) -> list[TokenLogprobs]:
        calls.append(len(rows))
        return original(logits, rows, token_ids, top)

    monkeypatch.setattr(runner_module, "token_logprobs", counting)
    engine = tiny_engine(smollm2_tokenizer, model)
    plain = [Request(r.request_id, r.prompt_token_ids,
                     SamplingParams(max_tokens=r.params.max_tokens, temperature=0.0))
             for r in requests(0)]
    outs = run_all(engine, plain)
    assert not calls
    assert all(o.logprobs is None and o.prompt_logprobs is None for v in outs.values() for o in v)
    asking = Request("one", [1, 2, 3], SamplingParams(max_tokens=2, temperature=0.0, logprobs=0))
    run_all(engine, [asking, *plain[:2]])
    assert calls == [1, 1], "only the row that asks, once per step"


@pytest.mark.parametrize("field", ["logprobs", "prompt_logprobs"])
@pytest.mark.parametrize("value", [-1, 21])
def test_out_of_range_logprobs_are_refused(field: str, value: int) -> None:
    engine = SimulatedEngine(EngineConfig())
    with pytest.raises(RequestRejectedError, match=f"{field} must be in 0..20"):
        engine.add(Request("x", [65], SamplingParams(**{field: value})))  # type: ignore[arg-type]


def test_simulated_logprobs_are_deterministic_and_survive_a_resume() -> None:
    params = SamplingParams(max_tokens=12, seed=5, logprobs=3, prompt_logprobs=2, ignore_eos=True)
    prompt = list(b"hello, simulated world")
    whole = run_all(SimulatedEngine(EngineConfig(prefill_chunk=5)), [Request("a", prompt, params)])
    again = run_all(SimulatedEngine(EngineConfig()), [Request("a", prompt, params)])
    entries = [e for out in whole["a"] for e in out.logprobs or []]
    assert entries == [e for out in again["a"] for e in out.logprobs or []]
    assert [e.token_id for e in entries] == [t for out in whole["a"] for t in out.new_token_ids]
    assert all(len(e.top) == 3 and e.top[0] == (e.token_id, e.logprob) for e in entries)
    assert all(e.top[0][1] > e.top[1][1] > e.top[2][1] for e in entries)
    first = whole["a"][0].prompt_logprobs
    assert first is not None and [e.token_id for e in first] == prompt[1:]
    assert first == again["a"][0].prompt_logprobs
    # resumed after 4 tokens: the rest carry the same logprobs, the prompt's are not sent again
    done = [t for out in whole["a"] for t in out.new_token_ids][:4]
    resumed = run_all(SimulatedEngine(EngineConfig()), [Request("a", prompt, params, done)])
    assert [e for out in resumed["a"] for e in out.logprobs or []] == entries[4:]
    assert all(out.prompt_logprobs is None for out in resumed["a"])


def test_a_cached_prefix_is_not_skipped_for_prompt_logprobs() -> None:
    engine = SimulatedEngine(EngineConfig(block_size=4, prefix_caching=True))
    prompt = list(b"a prompt of several full blocks, cached by the first run")
    params = SamplingParams(max_tokens=2, seed=1, ignore_eos=True)
    run_all(engine, [Request("warm", prompt, params)])  # its full blocks stay cached
    scoring = SamplingParams(max_tokens=2, seed=1, ignore_eos=True, prompt_logprobs=1)
    again = run_all(engine, [Request("score", prompt, scoring)])["score"]
    fresh = run_all(SimulatedEngine(EngineConfig(block_size=4)),
                    [Request("score", prompt, scoring)])["score"]
    assert again[0].prompt_logprobs is not None
    assert [e.token_id for e in again[0].prompt_logprobs] == prompt[1:]
    assert again[0].prompt_logprobs == fresh[0].prompt_logprobs
    hit = run_all(engine, [Request("plain", prompt, params)])  # a plain job does use the cache
    assert hit["plain"] and engine.stats()["prefix_cache_hits"] > 0
