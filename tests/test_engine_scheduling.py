"""Scheduler properties under random arrivals, lengths and aborts (the model is stubbed out)."""

from __future__ import annotations

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from qworker.engine.engine import Engine
from qworker.engine.request import Request, RequestRejectedError, SamplingParams
from qworker.engine.sequence import Sequence
from qworker.model.decoder import DecoderModel
from qworker.model.tokenizer.tokenizer import Tokenizer
from tests.engine_fixtures import blocks_computed_twice, tiny_engine, tiny_model


@pytest.fixture(scope="module")
def model(smollm2_tokenizer: Tokenizer) -> DecoderModel:
    return tiny_model(smollm2_tokenizer.vocab_size)


def stub_runner(engine: Engine) -> list[str]:
    """Replace the forward pass: every sequence that reaches its end samples token 100. Returns
    the list where it notes the blocks that two sequences of one step compute."""
    twice: list[str] = []

    def run(work: list[tuple[Sequence, int]]) -> dict[Sequence, int]:
        twice.extend(blocks_computed_twice(work, engine.config.block_size))
        return {seq: 100 for seq, n in work if seq.num_computed + n == len(seq.token_ids)}
    engine.runner.run = run  # type: ignore[method-assign]
    return twice


request_strategy = st.tuples(
    st.integers(0, 20),  # arrival step
    st.integers(1, 70),  # prompt length
    st.integers(1, 30),  # max_tokens
    st.one_of(st.none(), st.integers(0, 40)),  # abort at this step, or never
)


@settings(max_examples=60, deadline=None,
          suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(
    requests=st.lists(request_strategy, min_size=1, max_size=25),
    max_num_seqs=st.integers(1, 10),
    max_batched_tokens=st.integers(1, 64),
    prefill_chunk=st.integers(1, 64),
    block_size=st.sampled_from([1, 2, 4, 16]),
    num_blocks=st.integers(8, 80),
)
def test_scheduler_invariants(smollm2_tokenizer: Tokenizer, model: DecoderModel,
                              requests: list[tuple[int, int, int, int | None]], max_num_seqs: int,
                              max_batched_tokens: int, prefill_chunk: int, block_size: int,
                              num_blocks: int) -> None:
    engine = tiny_engine(smollm2_tokenizer, model, max_num_seqs=max_num_seqs,
                         max_batched_tokens=max_batched_tokens, prefill_chunk=prefill_chunk,
                         block_size=block_size, num_blocks=num_blocks)
    twice = stub_runner(engine)
    expected: dict[str, int] = {}
    produced: dict[str, int] = {}
    aborted: set[str] = set()
    pending = sorted(enumerate(requests), key=lambda r: r[1][0])
    step = 0
    while pending or engine.has_unfinished():
        assert step < 5000, "no progress"
        while pending and pending[0][1][0] <= step:
            i, (_, prompt_len, max_tokens, _) = pending.pop(0)
            # equal prompts: every one shares its prefix's cached blocks (a third under a salt)
            request = Request(f"r{i}", [7] * prompt_len,
                              SamplingParams(max_tokens=max_tokens, ignore_eos=True),
                              cache_salt="t" if i % 3 == 0 else None)
            try:
                engine.add(request)
            except RequestRejectedError:
                assert prompt_len + 1 > min(num_blocks * block_size, 512)
                continue
            expected[request.request_id] = min(max_tokens, engine.max_seq_len - prompt_len)
        for i, (_, _, _, abort_at) in enumerate(requests):
            if abort_at == step and f"r{i}" in expected and f"r{i}" not in aborted:
                engine.abort(f"r{i}")
                aborted.add(f"r{i}")
                assert all(s.request_id != f"r{i}" for s in engine.scheduler.running)
        decoding = [seq for seq in engine.scheduler.running if not seq.is_prefill]
        for out in engine.step():
            assert out.request_id not in aborted, "an aborted request appeared in a step"
            produced[out.request_id] = produced.get(out.request_id, 0) + len(out.new_token_ids)
        scheduled = engine.last_schedule
        assert scheduled.prefill_tokens <= max_batched_tokens
        assert len(engine.scheduler.running) <= max_num_seqs
        advanced = {id(seq) for seq, _ in scheduled.work} | {id(s) for s in scheduled.preempted}
        assert all(id(seq) in advanced for seq in decoding), "a decoding sequence stalled"
        engine.blocks.check(engine.scheduler.running + engine.scheduler.waiting)
        assert not twice, twice
        step += 1
    assert engine.blocks.num_free == num_blocks, "blocks leaked"
    for rid, count in expected.items():
        if rid not in aborted:
            assert produced.get(rid, 0) == count, rid


def test_prompt_that_cannot_fit_is_refused_before_taking_blocks(
        smollm2_tokenizer: Tokenizer, model: DecoderModel) -> None:
    engine = tiny_engine(smollm2_tokenizer, model, num_blocks=10, block_size=4,
                         max_model_len=100)
    for length in (40, 100, 1000):  # past the cache (40 tokens), max_model_len, both
        with pytest.raises(RequestRejectedError, match="does not fit") as info:
            engine.add(Request("too-long", [5] * length))
        assert info.value.code == "prompt_too_long"
        assert engine.blocks.num_free == 10 and not engine.has_unfinished()
    engine.add(Request("fits", [5] * 39, SamplingParams(max_tokens=3)))
    assert engine.has_unfinished()
