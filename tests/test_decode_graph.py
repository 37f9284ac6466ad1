"""The decode graph (layers, final norm and LM head of a decode-only step in one native call) gives
the layer-by-layer path's results bit for bit for every supported architecture, takes only the
steps it serves, refuses (once, loudly) a declaration it does not run, and follows weights changed
in place."""

from __future__ import annotations

import random
from collections.abc import Callable
from dataclasses import replace

import pytest
import torch
from structlog.testing import capture_logs

from qworker.model import decode_graph
from qworker.model.arch import ARCHITECTURES
from qworker.model.arch.architecture import Architecture
from qworker.model.config import Experts, LayerAttention, ModelConfig
from qworker.model.decode_graph import refusal
from qworker.model.decoder import DecoderModel
from tests.engine_fixtures import tiny_model
from tests.model_harness import Step, kernel_family, run_schedule

VOCAB = 128  # the native GEMM takes 16-column blocks: 120 would decline (tested below)
EXPERTS = Experts(count=8, per_token=2, intermediate_size=32, normalize=True,
                  dense_layers=frozenset({1}))  # for a declaration with experts


def random_model(arch: Architecture, dtype: torch.dtype, seed: int = 3,
                 activation: str | None = None,
                 layer_attention: tuple[LayerAttention, ...] | None = None) -> DecoderModel:
    """A model of `arch` with every feature its declaration has (biases where its checkpoints have
    them, Gemma 3's local and global layers), random weights, and a head size the attention
    kernel vectorises."""
    torch.manual_seed(seed)
    gemma = arch.name == "gemma3"  # its local layers and its own attention scale
    if layer_attention is None:
        layer_attention = GEMMA3_LAYERS if gemma else ()
    config = ModelConfig(
        vocab_size=VOCAB, hidden_size=64, intermediate_size=96, num_layers=3, num_heads=3,
        num_kv_heads=1, head_dim=64, arch=arch, max_position_embeddings=512,
        tie_word_embeddings=arch.tied_embeddings, attention_bias=arch.qkv_bias,
        activation=activation or arch.activation, layer_attention=layer_attention,
        experts=EXPERTS if arch.experts else None, query_pre_attn_scalar=48 if gemma else None,
    )
    model = DecoderModel(config, dtype=dtype)
    with torch.no_grad():
        for p in model.parameters():
            p.normal_(0, 0.5)
    return model


# local layers on their own base, windows shorter than the tests' sequences
GEMMA3_LAYERS = (LayerAttention(8, 10000.0), LayerAttention(), LayerAttention(8, 10000.0))
# what the graph does not run of each architecture it refuses (their decodes go layer by layer)
REFUSED: dict[str, str] = {}

MODELS: dict[str, Callable[[torch.dtype], DecoderModel]] = {
    "tiny": lambda dtype: tiny_model(VOCAB, dtype=dtype, seed=4),
    "biased": lambda dtype: random_model(replace(ARCHITECTURES["llama"], qkv_bias=True), dtype),
}



def _layer_by_layer(model: DecoderModel, sequences: list[list[int]],
                    schedule: list[Step]) -> list[tuple[int, int, torch.Tensor]]:
    model.decode_graph.enabled = False
    try:
        return run_schedule(model, sequences, schedule, block_size=4)
    finally:
        model.decode_graph.enabled = True


def _assert_same(got: list[tuple[int, int, torch.Tensor]],
                 want: list[tuple[int, int, torch.Tensor]]) -> None:
    assert len(got) == len(want)
    for (seq, pos, a), (_, _, b) in zip(got, want, strict=True):
        assert torch.equal(a, b), f"seq {seq} pos {pos}: {(a - b).abs().max()}"


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("name", list(MODELS))
def test_the_graph_gives_the_layer_paths_logits_bit_for_bit(
    name: str, dtype: torch.dtype, graph_calls: list[int]) -> None:
    model = MODELS[name](dtype)
    rng = random.Random(1)
    sequences = [[rng.randrange(VOCAB) for _ in range(n)] for n in (30, 20, 50)]
    schedule: list[Step] = [[(0, 20), (1, 11), (2, 40)]]  # prefills: layer by layer
    schedule += [[(0, 1), (1, 1), (2, 1)] for _ in range(6)]  # decodes: the graph
    got = run_schedule(model, sequences, schedule, block_size=4)
    assert graph_calls == [3] * 6
    _assert_same(got, _layer_by_layer(model, sequences, schedule))


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("name", sorted(ARCHITECTURES))
def test_every_supported_architecture_runs_its_decodes_in_the_graph_bit_for_bit(
        name: str, dtype: torch.dtype, graph_calls: list[int]) -> None:
    """...or, where the graph refuses it (REFUSED, with its reasons), layer by layer."""
    with capture_logs() as logs:
        model = random_model(ARCHITECTURES[name], dtype)
    assert model.decode_graph.refused == REFUSED.get(name)
    assert [e["event"] for e in logs] == ["decode_graph_refused"] * (name in REFUSED)
    rng = random.Random(5)
    sequences = [[rng.randrange(VOCAB) for _ in range(n)] for n in (17, 26)]
    schedule: list[Step] = [[(0, 12), (1, 20)]] + [[(0, 1), (1, 1)] for _ in range(5)]
    got = run_schedule(model, sequences, schedule, block_size=4)
    assert graph_calls == ([] if name in REFUSED else [2] * 5)
    _assert_same(got, _layer_by_layer(model, sequences, schedule))


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_a_windowed_models_decodes_run_in_the_graph_past_the_window_bit_for_bit(
        dtype: torch.dtype, graph_calls: list[int]) -> None:
    """The graph hands each layer's window to the decode attention kernel, as the layers do:
    steps whose contexts outgrow the window (8) run in it too, the layer path's logits bit for
    bit, and in float32 the torch path's (which masks by the window) within 1e-4."""
    model = random_model(ARCHITECTURES["mistral"], dtype, layer_attention=(LayerAttention(8),) * 3)
    assert model.decode_graph.refused is None
    rng = random.Random(8)
    sequences = [[rng.randrange(VOCAB) for _ in range(n)] for n in (10, 11)]
    schedule: list[Step] = [[(0, 5), (1, 6)]] + [[(0, 1), (1, 1)] for _ in range(5)]
    got = run_schedule(model, sequences, schedule, block_size=4)
    assert graph_calls == [2] * 5  # contexts 6 and 7 up to 10 and 11
    _assert_same(got, _layer_by_layer(model, sequences, schedule))
    if dtype == torch.float32:
        with kernel_family("torch"):
            want = run_schedule(model, sequences, schedule, block_size=4)
        for (seq, pos, a), (_, _, b) in zip(got, want, strict=True):
            torch.testing.assert_close(a, b, atol=1e-4, rtol=1e-4, msg=f"seq {seq} pos {pos}")


def test_a_declaration_the_graph_does_not_run_is_refused_once_and_runs_layer_by_layer(
        graph_calls: list[int], monkeypatch: pytest.MonkeyPatch) -> None:
    arch = ARCHITECTURES["llama"]
    assert refusal(ModelConfig(VOCAB, 64, 96, 1, 2, 2, 32, arch=arch)) is None
    monkeypatch.setattr(decode_graph, "ACTIVATIONS", {"silu": 0})  # a graph of SiLU alone
    with capture_logs() as logs:
        model = random_model(arch, torch.float32, activation="gelu_tanh")
    assert model.decode_graph.refused == "llama: activation gelu_tanh"
    assert [e["event"] for e in logs] == ["decode_graph_refused"]
    rng = random.Random(6)
    sequences = [[rng.randrange(VOCAB) for _ in range(n)] for n in (12, 17)]
    schedule: list[Step] = [[(0, 9), (1, 14)]] + [[(0, 1), (1, 1)] for _ in range(3)]
    with capture_logs() as logs:
        got = run_schedule(model, sequences, schedule, block_size=4)
    assert graph_calls == [] and logs == []  # said once, at the model's making
    with kernel_family("torch"):
        want = run_schedule(model, sequences, schedule, block_size=4)
    for (seq, pos, a), (_, _, b) in zip(got, want, strict=True):
        torch.testing.assert_close(a, b, atol=1e-4, rtol=1e-4, msg=f"seq {seq} pos {pos}")
    routed = replace(arch, experts=True)  # routed experts run in the graph
    assert refusal(ModelConfig(VOCAB, 64, 96, 1, 2, 2, 32, arch=routed, experts=EXPERTS)) is None


def test_decodes_in_several_groups_and_out_of_length_order(
    graph_calls: list[int],
) -> None:
    # 12 decodes whose lengths span 2..90 tokens make several length groups; given longest
    # first, their rows are not consecutive within a group
    model = tiny_model(VOCAB, dtype=torch.bfloat16, seed=6)
    rng = random.Random(2)
    lengths = [90, 2, 70, 5, 55, 9, 40, 14, 30, 20, 60, 3]
    sequences = [[rng.randrange(VOCAB) for _ in range(n + 3)] for n in lengths]
    schedule: list[Step] = [[(i, n) for i, n in enumerate(lengths)]]
    schedule += [[(i, 1) for i in range(len(lengths))] for _ in range(3)]
    got = run_schedule(model, sequences, schedule, block_size=4)
    assert graph_calls == [len(lengths)] * 3
    _assert_same(got, _layer_by_layer(model, sequences, schedule))


def test_steps_with_a_prefill_and_models_it_does_not_serve_go_layer_by_layer(
    graph_calls: list[int],
) -> None:
    sequences = [list(range(10)), list(range(20, 30))]
    schedule: list[Step] = [[(0, 6)], [(0, 1), (1, 5)], [(0, 1), (1, 4)]]
    run_schedule(tiny_model(VOCAB, dtype=torch.float32), sequences, schedule, block_size=4)
    assert graph_calls == []  # every step carried a prefill chunk
    decodes: list[Step] = [[(0, 5), (1, 5)], [(0, 1), (1, 1)]]
    run_schedule(tiny_model(VOCAB, dtype=torch.float64), sequences, decodes, block_size=4)
    assert graph_calls == []  # no native GEMM for float64
    run_schedule(tiny_model(120, dtype=torch.float32), sequences, decodes, block_size=4)
    assert graph_calls == []  # an LM head of 120 columns: not in whole 16-column blocks
    run_schedule(tiny_model(VOCAB, dtype=torch.float32), sequences, decodes, block_size=4)
    assert graph_calls == [2]


def test_a_weight_changed_in_place_is_followed(
    graph_calls: list[int],
) -> None:
    model = tiny_model(VOCAB, dtype=torch.float32, seed=8)
    sequences = [list(range(3, 20)), list(range(40, 52))]
    schedule: list[Step] = [[(0, 10), (1, 10)], [(0, 1), (1, 1)], [(0, 1), (1, 1)]]
    before = run_schedule(model, sequences, schedule, block_size=4)
    with torch.no_grad():
        model.layers[1].mlp.down_proj.weight.mul_(3)
        model.layers[0].input_layernorm.weight.add_(0.5)
    after = run_schedule(model, sequences, schedule, block_size=4)
    assert graph_calls == [2] * 4
    assert not torch.equal(before[-1][2], after[-1][2])
    _assert_same(after, _layer_by_layer(model, sequences, schedule))


def test_the_graph_serves_only_buckets_whose_layers_were_chosen_native(
    graph_calls: list[int],
) -> None:
    from qworker.model.kernels.kernel_choice import BUCKETS
    from qworker.model.kernels.linear import Linear

    model = tiny_model(VOCAB, dtype=torch.float32, seed=5)
    sequences = [list(range(3, 20)), list(range(40, 52))]
    schedule: list[Step] = [[(0, 10), (1, 10)], [(0, 1), (1, 1)], [(0, 1), (1, 1)]]
    want = run_schedule(model, sequences, schedule, block_size=4)
    other = "onednn" if "onednn" in model.lm_head.kernels() else "plain"
    for layer in model.modules():  # two rows fall in bucket 0: chosen oneDNN there, native above
        if isinstance(layer, Linear):
            layer.set_choice((other,) + ("native",) * (len(BUCKETS) - 1))
    model.decode_graph.reset()
    got = run_schedule(model, sequences, schedule, block_size=4)
    assert graph_calls == [2, 2]  # the first run's two decode steps; none in the second
    for (_, _, a), (_, _, b) in zip(got, want, strict=True):
        torch.testing.assert_close(a, b, atol=1e-4, rtol=1e-4)
