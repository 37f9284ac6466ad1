"""A worker with its default configuration, on the default model, ends every prompt at and around
each boundary its engine has `done`, with all its tokens: one token, a KV block - 1, 0, + 1, the
step budget and prefill chunk - 1, 0, + 1 (together every shape of step one prompt gives: a last
chunk of each size, and a full chunk that samples nothing), then two budgets, four and one token,
eight budgets (more chunks, further positions). Its engine is built as `qworker serve --model
smollm2` builds it (weights released to the chosen kernels' packs). A real worker process through
Redis, on the measured choice, runs every length alone and each shape of step beside running
decodes; here in this process each kernel family this CPU runs (forced as QWORKER_KERNELS forces
it) runs each shape of step alone and beside running decodes. Longer prompts cost seconds each on
2 vCPUs; max_model_len - 1 goes through the gateway (test_gateway_real_model.py)."""

from __future__ import annotations

import json
import random
from pathlib import Path

import pytest
import redis

from qworker.cli import build_parser
from qworker.commands.serve import build_engine, engine_config
from qworker.engine.config import EngineConfig
from qworker.engine.engine import Engine
from qworker.engine.request import Request, SamplingParams
from qworker.model.kernels import native_build as nb
from qworker.model.kernels.linear import Linear
from qworker.model.kernels.quant_linear import QuantLinear
from qworker_client.protocol import DoneEvent
from tests.model_harness import kernel_family, skip_unless_runnable
from tests.service_harness import (
    KEYS,
    check_stream,
    events,
    spawn_worker,
    submit,
    wait_for,
    wait_terminal,
)
from tests.worker_process import stop_gracefully

SERVE = ["serve", "--redis-url", "redis://unused:1/0", "--model", "smollm2"]
MAX_TOKENS = 2
DECODERS = 2  # running decodes beside the prompts sent all at once
ID_RANGE = (100, 40_000)  # plain tokens of SmolLM2's vocabulary


def worker_config() -> EngineConfig:
    return engine_config(build_parser().parse_args(SERVE))


def boundaries(config: EngineConfig) -> list[int]:
    """Prompt lengths at and around every boundary of an engine so configured, short of its
    context (1, 127, 128, 129, 511, 512, 513, 1024, 2049 and 4096 with the defaults)."""
    budget = config.max_batched_tokens
    around = [n + d for n in (config.block_size, budget, config.prefill_chunk) for d in (-1, 0, 1)]
    return sorted({1, *around, 2 * budget, 4 * budget + 1, 8 * budget})


def step_shapes(config: EngineConfig) -> list[int]:
    """Of those, the lengths that give every shape of step one prompt can give."""
    longest = max(config.max_batched_tokens, config.prefill_chunk, config.block_size) + 1
    return [n for n in boundaries(config) if n <= longest]


def prompt(rng: random.Random, n: int) -> list[int]:
    return [rng.randrange(*ID_RANGE) for _ in range(n)]


def expected_tokens(n: int, max_seq_len: int) -> int:
    return min(MAX_TOKENS, max_seq_len - n)


# ------------------------------------------------------------------ in this process


def run_until_ended(engine: Engine, requests: list[Request]) -> dict[str, tuple[int, str | None]]:
    """Adds `requests` and steps until each has ended: its token count and its finish reason
    (or error). The engine's other requests must not end meanwhile."""
    for request in requests:
        engine.add(request)
    tokens = {r.request_id: 0 for r in requests}
    ended: dict[str, tuple[int, str | None]] = {}
    while len(ended) < len(requests):
        for out in engine.step():
            assert out.request_id in tokens or not out.finished, (out.request_id, out.error)
            if out.request_id in tokens:
                tokens[out.request_id] += len(out.new_token_ids)
                if out.finished:
                    ended[out.request_id] = (tokens[out.request_id],
                                             out.error or out.finish_reason)
    return ended


def greedy(n_tokens: int) -> SamplingParams:
    return SamplingParams(max_tokens=n_tokens, temperature=0.0, ignore_eos=True)


def check_boundaries(engine: Engine, lengths: list[int], seed: int) -> None:
    """Each length alone, then all at once beside running decodes."""
    rng = random.Random(seed)
    want = {n: (expected_tokens(n, engine.max_seq_len), "length") for n in lengths}
    alone = {n: run_until_ended(engine, [Request(f"alone-{n}", prompt(rng, n),
                                                 greedy(MAX_TOKENS))])[f"alone-{n}"]
             for n in lengths}
    assert alone == want
    decoders = [f"decode-{k}" for k in range(DECODERS)]
    for name in decoders:
        engine.add(Request(name, prompt(rng, 5), greedy(engine.max_seq_len)))
    while not engine.scheduler.has_decodes():
        engine.step()
    beside = run_until_ended(engine, [Request(f"beside-{n}", prompt(rng, n), greedy(MAX_TOKENS))
                                      for n in lengths])  # the decodes run all along
    assert {n: beside[f"beside-{n}"] for n in lengths} == want
    for name in decoders:
        engine.abort(name)


@pytest.mark.parametrize("family", ["torch", *nb.FAMILIES])
def test_each_kernel_family_ends_every_boundary_prompt(family: str) -> None:
    skip_unless_runnable(family)
    with kernel_family(family):
        engine = build_engine(build_parser().parse_args(SERVE))
        assert isinstance(engine, Engine)
        model = engine.runner.model
        assert any(m.released for m in model.modules() if isinstance(m, Linear)) or any(
            isinstance(m, QuantLinear) for m in model.modules())  # prepared: one copy of each
        check_boundaries(engine, step_shapes(engine.config), seed=len(family))


# ------------------------------------------------------------------ a worker process


def submit_prompt(client: redis.Redis, job_id: str, ids: list[int], max_tokens: int) -> str:
    return submit(client, job_id, prompt_token_ids=json.dumps(ids), max_tokens=max_tokens,
                  temperature=0, ignore_eos=True)


def test_a_default_worker_process_ends_every_boundary_prompt(redis_url: str,
                                                             tmp_path: Path) -> None:
    config = worker_config()
    lengths, shapes = boundaries(config), step_shapes(config)  # far from the context: MAX_TOKENS
    rng = random.Random(5)
    client = redis.Redis.from_url(redis_url)
    log = tmp_path / "worker.log"
    proc = spawn_worker(redis_url, "defaults", *SERVE[3:], log_path=log)
    try:
        wait_for(lambda: proc.poll() is not None or client.exists(KEYS.worker("defaults")),
                 timeout=300, what="the worker to start")
        assert proc.poll() is None, log.read_text()[-2000:]
        for n in lengths:
            wait_terminal(client, [submit_prompt(client, f"alone-{n}", prompt(rng, n),
                                                 MAX_TOKENS)], timeout=300)
        decoders = [submit_prompt(client, f"decode-{k}", prompt(rng, 5), 4000)
                    for k in range(DECODERS)]
        wait_for(lambda: all(client.xlen(KEYS.out(d)) for d in decoders), timeout=120,
                 what="the decodes to run")
        beside = [submit_prompt(client, f"beside-{n}", prompt(rng, n), MAX_TOKENS)
                  for n in shapes]
        wait_terminal(client, beside, timeout=300)
        for d in decoders:
            assert not isinstance(events(client, d)[-1], DoneEvent), f"{d} ended early"
            client.set(KEYS.cancel(d), 1, ex=60)
        wait_terminal(client, decoders, timeout=120)
        for scenario, sent in (("alone", lengths), ("beside", shapes)):
            got = {n: check_stream(client, f"{scenario}-{n}") for n in sent}
            assert {n: (d.completion_tokens, d.finish_reason) for n, d in got.items()} == {
                n: (MAX_TOKENS, "length") for n in sent}, scenario
    finally:
        stop_gracefully(proc)
        client.close()
