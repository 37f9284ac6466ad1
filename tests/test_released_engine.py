"""An engine readied as a worker readies it (kernels chosen, weights released to their packs) runs
every step its scheduler gives: over random configurations (step budget, prefill chunk,
max_num_seqs, block size) and random prompts, on a tiny model of every weight format (float32,
bfloat16, kept in GGUF blocks; a Qwen3-MoE, whose experts each see any row count of a step, kept
or expanded) under every kernel family this CPU runs, every request ends with
all its tokens; and every linear layer then runs any row count, from none to well past the
largest step (speculative rows). The measurement's timings are drawn (any kernel may win any
bucket); the rest of the choice, and the release, are the worker's own code."""

from __future__ import annotations

import random
import tempfile
from collections.abc import Callable
from pathlib import Path

import gguf
import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from qworker.engine.config import EngineConfig
from qworker.engine.engine import Engine
from qworker.engine.request import Request, SamplingParams
from qworker.model.decoder import DecoderModel, load_model
from qworker.model.kernels import kernel_choice
from qworker.model.kernels.linear import Linear
from qworker.model.kernels.quant_linear import QuantLinear
from qworker.model.tokenizer.tokenizer import Tokenizer
from tests.engine_fixtures import tiny_model
from tests.model_harness import RUNNABLE_FAMILIES, kernel_family
from tests.quant_fixtures import write_tiny_gguf

FORMATS = ("float32", "bfloat16", "Q4_0", "Q4_K",  # Q4_0: the x8 layouts too; Q4_K: K-quants
           "moe-Q4_0", "moe-float32")  # a Qwen3-MoE: experts kept, or expanded to packs
Q = gguf.GGMLQuantizationType
MAX_TOKENS = 3
Measure = Callable[..., dict[str, list[float | None]]]


@pytest.fixture(scope="module")
def gguf_files(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    folder = tmp_path_factory.mktemp("gguf")
    files = {name: write_tiny_gguf(folder / f"{name}.gguf", Q[name], seed=1)
             for name in FORMATS if name.startswith("Q")}
    files["moe"] = write_tiny_gguf(folder / "moe.gguf", Q.Q4_0, seed=1, arch="qwen3moe")
    return files


def model_of(weight_format: str, files: dict[str, Path]) -> DecoderModel:
    if weight_format in files:  # kept in its blocks where native kernels run, else expanded
        return load_model(files[weight_format], weights="quantized")
    if weight_format.startswith("moe-"):  # each expert sees 0..n of a step's rows
        weights = weight_format.removeprefix("moe-")
        return load_model(files["moe"], weights="quantized" if weights == "Q4_0" else weights)
    return tiny_model(256, dtype=getattr(torch, weight_format), seed=2)


def drawn_measure(seed: int) -> Measure:
    """kernel_choice.measure, each call's time drawn from `seed` (per shape, kernel, rows)."""
    real = kernel_choice.measure

    def measure(layer: Linear | QuantLinear, max_rows: int,
                _timer: kernel_choice.Timer) -> dict[str, list[float | None]]:
        key = kernel_choice.shape_key(layer)
        return real(layer, max_rows,
                    lambda kind, rows, _run: random.Random(f"{seed}{key}{kind}{rows}").random())

    return measure


def prepared(model: DecoderModel, tokenizer: Tokenizer, config: EngineConfig, seed: int) -> Engine:
    """The engine as `Engine.from_config` readies it, over a home of its own (no cached choice
    read or written) and with drawn timings."""
    engine = Engine(model, tokenizer, config)
    with tempfile.TemporaryDirectory() as home, pytest.MonkeyPatch.context() as patch:
        patch.setenv("QWORKER_HOME", home)
        patch.setattr(kernel_choice, "measure", drawn_measure(seed))
        engine.prepare()
    return engine


def run_all(engine: Engine, prompts: list[tuple[int, list[int]]]) -> dict[str, tuple[int, str]]:
    """Adds each (arrival step, prompt) at its step; steps until all have ended: tokens and
    finish reason (or error) of each."""
    tokens: dict[str, int] = {}
    ended: dict[str, tuple[int, str]] = {}
    step = 0
    while len(ended) < len(prompts):
        assert step < 5000, "no progress"
        for k, (arrival, ids) in enumerate(prompts):
            if arrival == step:
                engine.add(Request(f"r{k}", ids, SamplingParams(
                    max_tokens=MAX_TOKENS, temperature=0.0, ignore_eos=True)))
        for out in engine.step():
            assert not out.preempted, "the pool is sized for every request at once"
            tokens[out.request_id] = tokens.get(out.request_id, 0) + len(out.new_token_ids)
            if out.finished:
                ended[out.request_id] = (tokens[out.request_id],
                                         out.error or out.finish_reason or "")
        step += 1
    return ended


@settings(max_examples=60, deadline=None,
          suppress_health_check=[HealthCheck.function_scoped_fixture, HealthCheck.too_slow])
@given(family=st.sampled_from(RUNNABLE_FAMILIES), weight_format=st.sampled_from(FORMATS),
       max_batched_tokens=st.integers(1, 80), prefill_chunk=st.integers(1, 80),
       max_num_seqs=st.integers(1, 6), block_size=st.sampled_from([1, 3, 4, 16, 128]),
       prompts=st.lists(st.tuples(st.integers(0, 8), st.integers(1, 100)), min_size=1,
                        max_size=4),
       extra_rows=st.lists(st.integers(0, 1200), min_size=1, max_size=4),
       seed=st.integers(0, 2**16))
def test_a_released_engine_runs_every_step_and_row_count(
        smollm2_tokenizer: Tokenizer, gguf_files: dict[str, Path], family: str,
        weight_format: str, max_batched_tokens: int, prefill_chunk: int, max_num_seqs: int,
        block_size: int, prompts: list[tuple[int, int]], extra_rows: list[int],
        seed: int) -> None:
    rng = random.Random(seed)
    with kernel_family(family):
        model = model_of(weight_format, gguf_files)
        vocab = model.config.vocab_size
        blocks = sum(-(-(n + MAX_TOKENS) // block_size) for _, n in prompts) + 1
        config = EngineConfig(model="tiny", max_batched_tokens=max_batched_tokens,
                              prefill_chunk=prefill_chunk, max_num_seqs=max_num_seqs,
                              block_size=block_size, num_blocks=blocks, requeue_preempted=True)
        engine = prepared(model, smollm2_tokenizer, config, seed)
        ended = run_all(engine, [(at, [rng.randrange(3, vocab) for _ in range(n)])
                                 for at, n in prompts])
        assert ended == {f"r{k}": (MAX_TOKENS, "length") for k in range(len(prompts))}
        largest = max_batched_tokens + max_num_seqs
        for layer in {m for m in model.modules() if isinstance(m, Linear | QuantLinear)}:
            for rows in {0, 1, largest, *extra_rows}:
                x = torch.randn(rows, layer.in_features).to(model.dtype)
                assert layer(x).shape == (rows, layer.out_features)

