"""Continuous batching is invisible: every request gives exactly what it gives alone."""

from __future__ import annotations

import random

import pytest

from qworker.engine.engine import Engine
from qworker.engine.request import Request, SamplingParams
from qworker.model.decoder import DecoderModel
from qworker.model.tokenizer.tokenizer import Tokenizer
from tests.engine_fixtures import tiny_engine, tiny_model


@pytest.fixture(scope="module")
def model(smollm2_tokenizer: Tokenizer) -> DecoderModel:
    return tiny_model(smollm2_tokenizer.vocab_size)


def random_requests(count: int, seed: int) -> list[tuple[int, Request]]:
    """(arrival step, request) pairs with random lengths and greedy or seeded sampling."""
    rng = random.Random(seed)
    out = []
    for i in range(count):
        params = SamplingParams(
            max_tokens=rng.randint(1, 24),
            temperature=rng.choice([0.0, 0.7, 1.0, 1.3]),
            top_k=rng.choice([0, 0, 20]),
            top_p=rng.choice([1.0, 0.9]),
            min_p=rng.choice([0.0, 0.05]),
            repetition_penalty=rng.choice([1.0, 1.2]),
            seed=rng.randrange(2**32),
            ignore_eos=rng.random() < 0.5,
        )
        prompt = [rng.randrange(32, 49152) for _ in range(rng.randint(1, 60))]
        out.append((rng.randint(0, 30), Request(f"r{i}", prompt, params)))
    return out


def run(engine: Engine, arrivals: list[tuple[int, Request]]) -> dict[str, tuple[list[int], str]]:
    """Adds requests at their arrival steps; returns tokens and text deltas of each."""
    pending = sorted(arrivals, key=lambda a: a[0])
    results: dict[str, tuple[list[int], str]] = {}
    step = 0
    while pending or engine.has_unfinished():
        while pending and pending[0][0] <= step:
            engine.add(pending.pop(0)[1])
        for out in engine.step():
            tokens, text = results.get(out.request_id, ([], ""))
            assert out.first_index == len(tokens), "token indices must be contiguous"
            results[out.request_id] = (tokens + out.new_token_ids, text + out.text_delta)
            if out.finished:
                assert out.text == results[out.request_id][1], "joined deltas != final text"
        engine.blocks.check(engine.scheduler.running + engine.scheduler.waiting)
        step += 1
    assert engine.blocks.num_free == engine.blocks.num_blocks, "blocks leaked"
    return results


@pytest.fixture(scope="module")
def workload() -> list[tuple[int, Request]]:
    return random_requests(40, seed=7)


@pytest.fixture(scope="module")
def alone(smollm2_tokenizer: Tokenizer, model: DecoderModel,
          workload: list[tuple[int, Request]]) -> dict[str, tuple[list[int], str]]:
    results = {}
    for _, request in workload:
        engine = tiny_engine(smollm2_tokenizer, model, max_num_seqs=1)
        results.update(run(engine, [(0, request)]))
    return results


SETTINGS = [
    dict(max_num_seqs=8, max_batched_tokens=64, prefill_chunk=32, block_size=4),
    dict(max_num_seqs=40, max_batched_tokens=512, prefill_chunk=512, block_size=16),
    dict(max_num_seqs=16, max_batched_tokens=16, prefill_chunk=5, block_size=1),
    dict(max_num_seqs=3, max_batched_tokens=7, prefill_chunk=7, block_size=8),
    # prefill paced beside decodes: budgets follow measured step times
    dict(max_num_seqs=8, max_batched_tokens=64, prefill_chunk=32, block_size=4, decode_stretch=1.5),
]


@pytest.mark.parametrize("settings", SETTINGS, ids=lambda s: "-".join(map(str, s.values())))
def test_batched_equals_alone(smollm2_tokenizer: Tokenizer, model: DecoderModel,
                              workload: list[tuple[int, Request]],
                              alone: dict[str, tuple[list[int], str]],
                              settings: dict[str, float]) -> None:
    engine = tiny_engine(smollm2_tokenizer, model, **settings)
    assert run(engine, workload) == alone


def test_preemption_keeps_results(smollm2_tokenizer: Tokenizer, model: DecoderModel,
                                  workload: list[tuple[int, Request]],
                                  alone: dict[str, tuple[list[int], str]]) -> None:
    # 24 blocks of 4 tokens: the longest request (60 + 24 tokens) just fits alone
    engine = tiny_engine(smollm2_tokenizer, model, num_blocks=24, block_size=4, max_num_seqs=12)
    assert run(engine, workload) == alone
    assert engine.num_preemptions > 0, "the cache was meant to be small enough to preempt"


def test_resumed_request_continues_exactly(smollm2_tokenizer: Tokenizer, model: DecoderModel,
                                           workload: list[tuple[int, Request]],
                                           alone: dict[str, tuple[list[int], str]]) -> None:
    """A request handed back with its streamed tokens continues where it stopped."""
    for _, request in workload[:10]:
        tokens, text = alone[request.request_id]
        cut = len(tokens) // 2
        engine = tiny_engine(smollm2_tokenizer, model)
        resumed = Request(request.request_id, request.prompt_token_ids, request.params,
                          output_token_ids=tokens[:cut])
        engine.add(resumed)
        rest: list[int] = []
        while engine.has_unfinished():
            for out in engine.step():
                assert out.first_index == cut + len(rest)
                rest += out.new_token_ids
                final = out.text
        assert tokens[:cut] + rest == tokens
        assert final == text


def test_warm_up_leaves_no_trace(smollm2_tokenizer: Tokenizer, model: DecoderModel,
                                 workload: list[tuple[int, Request]],
                                 alone: dict[str, tuple[list[int], str]]) -> None:
    engine = tiny_engine(smollm2_tokenizer, model, block_size=4)
    engine.runner.warm_up()  # writes block 0, which requests then own
    assert run(engine, workload) == alone
