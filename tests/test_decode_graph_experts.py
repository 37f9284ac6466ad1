"""Routed experts (Qwen3-MoE, Mixtral) in the decode graph: the router, the routing (softmax, top
k, weights normalized), and each chosen expert's gated MLP over just its rows at the kernels of
its own row count, as the layer-by-layer path runs them: the same logits bit for bit, dense and
kept in GGUF blocks, on every kernel family this CPU runs, and the same greedy tokens."""

from __future__ import annotations

import random
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

import gguf
import pytest
import torch

from qworker.model.arch import ARCHITECTURES
from qworker.model.decoder import DecoderModel, load_model
from qworker.model.kernels import native
from qworker.model.kernels import native_build as nb
from qworker.model.kernels.quant_linear import QuantLinear
from qworker.model.layers.experts import RoutedExperts
from tests import quant_fixtures
from tests.model_harness import Step, greedy, kernel_family, run_schedule
from tests.test_decode_graph import VOCAB, _assert_same, _layer_by_layer, random_model

LEVELS = [level.name for level in nb.LEVELS]  # every native build level: amx, avx512_bf16, ...
Q = gguf.GGMLQuantizationType


@contextmanager
def native_level(name: str) -> Iterator[None]:
    """The native build of exactly this level in this process (its family forced, better levels
    of the family hidden); skips the test where this CPU cannot run it."""
    runnable = nb.runnable_levels()
    if name not in {level.name for level in runnable}:
        pytest.skip(f"this CPU ({nb.cpu_model()}) cannot run the {name} kernels; absent hardware")
    family = next(f for f, levels in nb.FAMILIES.items() if name in levels)
    below = [level for level in runnable if level.name == name]
    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(nb, "runnable_levels", lambda flags=None: below)
        with kernel_family(family):
            assert native.status().level == name
            yield



def _twelve_decodes(model: DecoderModel, vocab: int) -> tuple[list[list[int]], list[Step]]:
    """12 sequences prefilled, then 3 decode steps of 12 rows: 24 choices of 8 experts (48 of 16
    in the GGUFs), so experts see 1 or 2 rows (bucket 1) and 3 or more (bucket 8)."""
    rng = random.Random(7)
    sequences = [[rng.randrange(vocab) for _ in range(n + 3)] for n in range(5, 17)]
    schedule: list[Step] = [[(i, len(s) - 3) for i, s in enumerate(sequences)]]
    schedule += [[(i, 1) for i in range(len(sequences))] for _ in range(3)]
    return sequences, schedule


@pytest.mark.parametrize("level", LEVELS)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("name", ["qwen3_moe", "mixtral"])
def test_dense_experts_run_in_the_graph_bit_for_bit(
        name: str, dtype: torch.dtype, level: str, graph_calls: list[int]) -> None:
    with native_level(level):
        model = random_model(ARCHITECTURES[name], dtype)
        assert model.decode_graph.refused is None
        sequences, schedule = _twelve_decodes(model, VOCAB)
        got = run_schedule(model, sequences, schedule, block_size=4)
        # (8 experts: the router's pack padded to 16 columns; a level without a bfloat16 GEMM
        # runs no bfloat16 model's decodes in the graph)
        served = native.gemm_serves(torch.zeros(16, 64, dtype=dtype))
        assert graph_calls == [12] * 3 * served
        _assert_same(got, _layer_by_layer(model, sequences, schedule))


@pytest.fixture(scope="module")
def moe_ggufs(tmp_path_factory: pytest.TempPathFactory) -> Iterator[dict[Q, Path]]:
    """Tiny Qwen3-MoE GGUFs of 16 experts (top 4; a float32 router), their experts' 3-D tensors
    in Q4_0 or Q4_K blocks."""
    folder = tmp_path_factory.mktemp("moe")
    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(quant_fixtures, "EXPERTS", dict(count=16, per_token=4))
        yield {kind: quant_fixtures.write_tiny_gguf(folder / f"{kind.name}.gguf", kind, seed=2,
                                                    arch="qwen3moe")
               for kind in (Q.Q4_0, Q.Q4_K)}


def _alternate_expert_kernels(model: DecoderModel) -> None:
    """Each kept expert runs int16 at one bucket and dequant at the next: a graph that ran an
    expert at the step's bucket, not its own row count's, would differ."""
    for layer in model.layers:
        if isinstance(layer.mlp, RoutedExperts):
            for lin in layer.mlp.experts.modules():
                if isinstance(lin, QuantLinear):
                    lin.choice = ("int16", "dequant", "int16", "dequant", "int16")


@pytest.mark.parametrize("level", LEVELS)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("kind", [Q.Q4_0, Q.Q4_K])
def test_kept_quantized_experts_run_in_the_graph_bit_for_bit(
        kind: Q, dtype: torch.dtype, level: str, moe_ggufs: dict[Q, Path],
        graph_calls: list[int]) -> None:
    with native_level(level):
        model = load_model(moe_ggufs[kind], dtype=dtype, weights="quantized")
        experts = [m for m in model.modules() if isinstance(m, RoutedExperts)]
        assert experts and all(isinstance(e.experts[0].gate_up_proj, QuantLinear)
                               for e in experts)
        _alternate_expert_kernels(model)
        sequences, schedule = _twelve_decodes(model, model.config.vocab_size)
        got = run_schedule(model, sequences, schedule, block_size=4)
        served = native.gemm_serves(torch.zeros(16, 64, dtype=dtype))  # the float router's
        assert graph_calls == [12] * 3 * served
        _assert_same(got, _layer_by_layer(model, sequences, schedule))


@pytest.mark.parametrize("name", ["qwen3_moe", "mixtral"])
def test_greedy_tokens_are_the_layer_paths(name: str, graph_calls: list[int]) -> None:
    model = random_model(ARCHITECTURES[name], torch.bfloat16, seed=9)
    prompt = list(range(3, 15))
    got = greedy(model, prompt, 40)
    assert graph_calls == [1] * 39  # every decode step, one row
    model.decode_graph.enabled = False
    assert got == greedy(model, prompt, 40)


def test_the_routing_takes_the_lower_expert_of_a_tie_and_is_torchs_elsewhere() -> None:
    logits = torch.tensor([[1.0, 2.0, 2.0, 0.5, 2.0]])
    chosen, weights = native.route(logits, 2, normalize=False)
    assert chosen.tolist() == [[1, 2]]
    probs = torch.softmax(logits, dim=-1)
    torch.testing.assert_close(weights, probs[:, [1, 2]])
    torch.manual_seed(0)
    logits = torch.randn(64, 16)
    for normalize in (False, True):
        chosen, weights = native.route(logits, 4, normalize)
        want, want_chosen = torch.topk(torch.softmax(logits, dim=-1), 4, dim=-1)
        if normalize:
            want /= want.sum(dim=-1, keepdim=True)
        assert torch.equal(chosen, want_chosen)
        torch.testing.assert_close(weights, want, atol=1e-6, rtol=1e-6)


def test_a_router_of_8_columns_runs_the_native_gemm_on_a_padded_pack() -> None:
    model = random_model(ARCHITECTURES["mixtral"], torch.float32)
    router = next(m for m in model.modules() if isinstance(m, RoutedExperts)).gate
    assert router.out_features == 8 and router.padded_width == 16
    assert router.kind_for(1) == "native"
    x = torch.randn(3, router.in_features)
    out = router(x)
    assert out.shape == (3, 8)
    torch.testing.assert_close(out, x @ router.weight.T, atol=1e-5, rtol=1e-5)


def test_the_graph_watches_only_the_live_modules_that_hold_weights(
        moe_ggufs: dict[Q, Path]) -> None:
    """The experts kept in blocks replaced the loaded Linear layers and hold no parameter: the
    versions read each step are the live model's weights only (the replaced layers, walked each
    step, were 2.3 ms of a 13.5 ms MoE token), and an in-place change to one still rebuilds the
    tables."""
    model = load_model(moe_ggufs[Q.Q4_K], dtype=torch.float32, weights="quantized")
    graph = model.decode_graph
    sequences, schedule = _twelve_decodes(model, model.config.vocab_size)
    run_schedule(model, sequences, schedule, block_size=4)
    live = {id(p) for p in model.parameters()}
    watched = [p for m in graph._owners or () for p in m._parameters.values() if p is not None]
    assert watched and {id(p) for p in watched} <= live
    before = graph._tables
    assert before is not None
    with torch.no_grad():
        model.norm.weight.mul_(1.0)  # in place: a new version
    assert graph._current(before.cache) is not before
