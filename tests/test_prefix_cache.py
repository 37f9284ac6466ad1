"""Prefix caching: a run that reuses cached prefix blocks gives the tokens of a run without the
cache (greedy and seeded; across preemption and a requeue to a second engine), salts keep tenants
apart, and the pool evicts parked blocks least recently used first."""

from __future__ import annotations

from dataclasses import replace
from pathlib import Path

import pytest
import torch

from qworker.engine.block_manager import BlockManager
from qworker.engine.byte_tokenizer import ByteDetokenizer
from qworker.engine.config import EngineConfig
from qworker.engine.core import EngineCore
from qworker.engine.engine import Engine
from qworker.engine.prefix_cache import block_hash
from qworker.engine.request import Request, SamplingParams, StepOutput
from qworker.engine.scheduler import ScheduledStep
from qworker.engine.sequence import Sequence
from qworker.engine.simulated import SimOptions, SimulatedEngine, run_offline
from qworker.engine.text import TextStream
from qworker.model.decoder import DecoderModel, load_model
from qworker.model.tokenizer.tokenizer import Tokenizer
from tests.engine_fixtures import tiny_engine, tiny_model

PREFIX = [(5 * i + 3) % 200 + 1 for i in range(40)]


def requests(n: int, seeded: bool, salt: str | None = None) -> list[Request]:
    """n prompts sharing PREFIX, each with its own suffix of 3..3+n tokens."""
    params = [SamplingParams(max_tokens=8, temperature=0.8 if seeded else 0.0,
                             seed=k if seeded else None, ignore_eos=True) for k in range(n)]
    return [Request(f"r{k}", PREFIX + [(11 * k + j) % 200 + 1 for j in range(3 + k)], params[k],
                    cache_salt=salt) for k in range(n)]


def tokens(engine: EngineCore, reqs: list[Request]) -> dict[str, list[int]]:
    """Runs `reqs` (a preempted one re-added with what it streamed, as the worker does)."""
    return {rid: r.token_ids for rid, r in run_offline(engine, reqs).items()}


def sequence(token_ids: list[int], salt: str | None = None) -> Sequence:
    return Sequence("s", token_ids, len(token_ids), SamplingParams(), 0, 0, 0,
                    TextStream(ByteDetokenizer()), cache_salt=salt)


def test_block_hashes_chain_tokens_and_salt() -> None:
    a = block_hash(None, [1, 2], None)
    assert a == block_hash(None, [1, 2], None) != block_hash(None, [1, 3], None)
    assert a != block_hash(None, [1, 2], "t") != block_hash(None, [1, 2], "u")
    assert block_hash(a, [3, 4], None) != block_hash(block_hash(None, [9], None), [3, 4], None)


def test_parked_blocks_are_reused_then_evicted_least_recent_first() -> None:
    blocks = BlockManager(num_blocks=4, block_size=2, prefix_caching=True)
    first, second = sequence([1, 2, 3, 4, 5]), sequence([1, 2, 3, 4, 9])
    blocks.grow(first, 5)
    first.num_computed = 5
    blocks.commit(first)  # blocks 0 and 1 complete and cached, 2 is the partial one
    assert blocks.cached_prefix(second) == first.block_table[:2]
    blocks.release(first)  # parked: 1 then 0 (tail first); 2 plain free
    blocks.check([])
    assert (blocks.num_free, blocks.num_cached) == (4, 2)
    prefix = blocks.cached_prefix(second)
    assert blocks.admission_cost(prefix, 5) == 3  # one new block, two parked ones taken back
    blocks.share(second, prefix)
    blocks.grow(second, 5)
    blocks.check([second])
    assert second.num_computed == 4 and second.block_table[:2] == prefix
    blocks.release(second)
    third = sequence([7] * 7)
    blocks.grow(third, 7)  # plain blocks first (2 and 3), then the tail block 1, then 0
    assert third.block_table[:2] == [2, 3] and set(third.block_table[2:]) == {0, 1}
    assert blocks.num_cached == 0
    blocks.check([third])


def sim(**config: object) -> SimulatedEngine:
    settings: dict[str, object] = dict(model="sim", block_size=8, num_blocks=64,
                                       max_num_seqs=4, prefill_chunk=16, max_batched_tokens=32)
    return SimulatedEngine(EngineConfig(**{**settings, **config}),  # type: ignore[arg-type]
                           SimOptions(step_ms=0))


def record(engine: EngineCore) -> tuple[list[int], list[ScheduledStep]]:
    """Counts the tokens each forward computes, and keeps each step's schedule."""
    computed: list[int] = []
    steps: list[ScheduledStep] = []
    run, schedule = engine.runner.run, engine.scheduler.schedule

    def counting_run(work: list[tuple[Sequence, int]]) -> dict[Sequence, int]:
        computed.append(sum(n for _, n in work))
        return run(work)

    def keeping_schedule(budget: int | None = None) -> ScheduledStep:
        steps.append(schedule(budget))
        return steps[-1]

    engine.runner.run = counting_run  # type: ignore[method-assign]
    engine.scheduler.schedule = keeping_schedule  # type: ignore[method-assign]
    return computed, steps


@pytest.mark.parametrize("seeded", [False, True])
def test_requests_that_arrive_together_compute_their_shared_prefix_once(seeded: bool) -> None:
    """6 requests queued at once, room for 4: the first computes the 5 blocks of PREFIX (3
    chunks), the others wait for each block in flight and start from all 5."""
    off, on = sim(prefix_caching=False), sim()
    (computed_off, _), (computed_on, steps) = record(off), record(on)
    assert tokens(on, requests(6, seeded)) == tokens(off, requests(6, seeded))
    stats = on.stats()
    assert stats["prefix_cache_hits"] == 5 * 40
    assert sum(computed_on) == sum(computed_off) - 5 * 40
    assert [len(step.held) for step in steps[:4]] == [3, 3, 3, 0]  # a slot each, then admitted
    queries = sum(len(r.prompt_token_ids) for r in requests(6, seeded))
    assert stats["prefix_cache_queries"] == queries
    assert "prefix_cache_hits" not in off.stats()


def test_a_waiter_goes_on_alone_when_its_writer_is_aborted() -> None:
    engine = sim()
    computed, steps = record(engine)
    writer, waiter = requests(2, False)
    engine.add(writer)
    engine.add(waiter)
    engine.step()
    assert [seq.request_id for seq in steps[0].held] == [waiter.request_id]
    assert [seq.request_id for seq, _ in steps[0].work] == [writer.request_id]
    engine.abort(writer.request_id)  # its first 2 blocks were complete: they stay cached
    engine.step()
    assert [seq.request_id for seq, _ in steps[1].work] == [waiter.request_id]
    assert computed == [16, 16] and engine.stats()["prefix_cache_hits"] == 16
    streamed = [token for out in steps_until_done(engine) for token in out.new_token_ids]
    assert streamed == tokens(sim(prefix_caching=False), [waiter])[waiter.request_id]


def steps_until_done(engine: EngineCore) -> list[StepOutput]:
    outputs = []
    while engine.has_unfinished():
        outputs += engine.step()
    return outputs


def test_a_waiter_goes_on_alone_when_its_writer_is_preempted() -> None:
    """A 7-block pool: a decoding job's new block leaves too few for the writer's last chunk,
    so the writer (the newest running) is handed back while the other waits for its block 4.
    The waiter starts from the writer's 4 complete blocks once the pool has room."""
    engine = sim(num_blocks=7, watermark=0.0, max_num_seqs=3, requeue_preempted=True)
    decoding = Request("decoding", [9] * 7, SamplingParams(max_tokens=12, ignore_eos=True))
    writer, waiter = requests(2, False)
    computed, steps = record(engine)
    alone = tokens(sim(prefix_caching=False), [waiter])
    got = tokens(engine, [decoding, writer, waiter])
    handed_back = next(k for k, step in enumerate(steps) if step.preempted)
    assert [seq.request_id for seq in steps[handed_back].preempted] == [writer.request_id]
    assert handed_back > 0 and all(step.held and step.held[0].request_id == waiter.request_id
                                   for step in steps[:handed_back])
    assert got[waiter.request_id] == alone[waiter.request_id]
    assert engine.stats()["prefix_cache_hits"] >= 32
    engine.blocks.check([])


def test_a_salt_keeps_its_blocks_apart() -> None:
    engine = sim(max_num_seqs=1)
    first, = requests(1, False, salt="tenant-a")
    tokens(engine, [first])
    for salt, hits in (("tenant-b", 0), (None, 0), ("tenant-a", 40)):
        before = engine.stats()["prefix_cache_hits"]
        tokens(engine, [replace(first, request_id=f"again-{salt}", cache_salt=salt)])
        assert engine.stats()["prefix_cache_hits"] - before == hits, salt


@pytest.fixture(scope="module")
def model() -> DecoderModel:
    return tiny_model(256)


@pytest.mark.parametrize("seeded", [False, True])
def test_tiny_model_across_preemption_equals_no_cache(smollm2_tokenizer: Tokenizer,
                                                      model: DecoderModel, seeded: bool) -> None:
    """A pool of 20 blocks of 4 for 6 sequences of 51-56 tokens: they preempt each other and come
    back through their own cached blocks (float64: the same tokens, exactly)."""
    def engine(caching: bool) -> Engine:
        return tiny_engine(smollm2_tokenizer, model, num_blocks=20, block_size=4, max_num_seqs=6,
                           prefill_chunk=16, requeue_preempted=True, prefix_caching=caching)
    off, on = engine(False), engine(True)
    _, steps = record(on)
    assert tokens(on, requests(6, seeded)) == tokens(off, requests(6, seeded))
    assert on.num_preemptions > 0 and on.stats()["prefix_cache_hits"] > 0
    assert any(step.held for step in steps)  # they also waited for each other's blocks
    on.blocks.check([])


def test_a_job_requeued_to_a_second_engine_reuses_its_cache(smollm2_tokenizer: Tokenizer,
                                                           model: DecoderModel) -> None:
    """Half of a job's tokens on one engine, the rest on another that has the prefix cached from
    other jobs: the job's tokens are those of an uninterrupted run without the cache."""
    first, *others = requests(3, seeded=True)
    alone = tokens(tiny_engine(smollm2_tokenizer, model, prefix_caching=False), [first])
    a, b = (tiny_engine(smollm2_tokenizer, model) for _ in range(2))
    half = tokens(a, [replace(first, params=replace(first.params, max_tokens=4))])[first.request_id]
    tokens(b, others)
    hits = b.stats()["prefix_cache_hits"]
    resumed = tokens(b, [replace(first, output_token_ids=half)])
    assert resumed == alone
    assert b.stats()["prefix_cache_hits"] - hits == 40


def test_smollm2_shared_prefix_equals_no_cache(smollm2_path: Path,
                                               smollm2_tokenizer: Tokenizer) -> None:
    """The real model in float32: 6 prompts sharing a 40-token prefix, greedy, token for token
    the texts of a run without the cache; the later ones read the prefix from shared blocks."""
    model = load_model(smollm2_path, dtype=torch.float32)
    prefix = smollm2_tokenizer.encode("You are a careful assistant. Answer in one short sentence, "
                                      "plainly, without any preamble, lists or markdown at all, "
                                      "and never repeat the question. Be kind, be brief, be "
                                      "right; if you do not know, say so.")[:40]
    assert len(prefix) == 40
    questions = ["What is the capital of France?", "Why is the sky blue?", "Name a prime.",
                 "What is 2 + 2?", "Who wrote Hamlet?", "What do bees make?"]
    prompts = [prefix + smollm2_tokenizer.encode(" " + q) for q in questions]
    params = SamplingParams(max_tokens=4, temperature=0.0)

    def run(caching: bool) -> tuple[list[list[int]], dict[str, int]]:
        config = EngineConfig(num_blocks=64, block_size=16, max_num_seqs=3, prefill_chunk=64,
                              max_batched_tokens=192, prefix_caching=caching)
        engine = Engine(model, smollm2_tokenizer, config)
        return [c.token_ids for c in engine.generate(prompts, params)], engine.stats()

    (cached, stats), (plain, _) = run(True), run(False)
    assert cached == plain
    assert stats["prefix_cache_hits"] >= 3 * 32  # the last 3 start from 2 shared blocks each


# ------------------------------------------------------------------ the wire field cache_salt


def test_cache_salt_on_the_wire_the_cli_and_the_gateway() -> None:
    import argparse

    from qworker_client.commands.submit import add_param_args, add_prompt_args, job_spec
    from qworker_client.gateway.chat.translate import translate
    from qworker_client.protocol import JobValidationError, parse_job_fields

    assert parse_job_fields({"prompt": "x", "cache_salt": "t-1"}, "1-0").cache_salt == "t-1"
    for bad in ("", "s" * 257):
        with pytest.raises(JobValidationError, match="cache_salt"):
            parse_job_fields({"prompt": "x", "cache_salt": bad}, "1-0")
    parser = argparse.ArgumentParser()
    parser.add_argument("prompt")
    add_prompt_args(parser)
    add_param_args(parser)
    assert job_spec(parser.parse_args(["hi", "--cache-salt", "t-2"]))["cache_salt"] == "t-2"
    body = {"model": "m", "messages": [{"role": "user", "content": "hi"}], "cache_salt": "t-3"}
    assert translate("chat", body, 4).choices[0].spec["cache_salt"] == "t-3"


def test_a_worker_gives_the_engine_each_jobs_salt(redis_url: str) -> None:
    import redis

    from tests.service_harness import sim_engine, submit, thread_worker, wait_terminal

    client = redis.Redis.from_url(redis_url)
    engine = sim_engine("sim:step_ms=0,block_size=8")
    prompt = "a system prompt that several jobs share, then a question"
    with thread_worker(redis_url, "salted", engine=engine):
        hits = []
        for k, salt in enumerate(["a", "b", None, "a"]):
            submit(client, f"salt-{k}", prompt=prompt, max_tokens=2,
                   **({"cache_salt": salt} if salt else {}))
            wait_terminal(client, [f"salt-{k}"])
            hits.append(engine.stats()["prefix_cache_hits"])
    client.close()
    assert hits == [0, 0, 0, (len(prompt) - 1) // 8 * 8]
