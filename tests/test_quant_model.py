"""A GGUF of each kept format loads with its matrices still in their blocks, holds about the
file's bytes, and computes what the same file dequantized to float32 computes."""

from __future__ import annotations

from pathlib import Path

import gguf
import pytest
import torch

from qworker.model.batch import SequenceInput, build_batch
from qworker.model.decoder import DecoderModel, load_model
from qworker.model.kernels import kernel_choice, native
from qworker.model.kernels.quant_interleave import X8_TYPES
from qworker.model.kernels.quant_linear import QuantLinear
from qworker.model.kernels.quant_weight import QuantWeight
from qworker.model.kv_cache import KVCache
from qworker.model.layers.experts import RoutedExperts
from qworker.model.loading import gguf_checkpoint, weights_auto
from qworker.model.loading.checkpoint import load_checkpoint
from qworker.model.loading.gguf_checkpoint import is_quantized_file
from tests.gguf_writer import write_gguf
from tests.model_harness import Step, run_schedule
from tests.quant_fixtures import KEPT, SIZES, write_tiny_gguf
from tests.test_model_reference import OF_ARCHITECTURE, hf_model

pytestmark = pytest.mark.skipif(native.library() is None, reason="no native kernels built")


def _logits(model: DecoderModel, tokens: list[int]) -> torch.Tensor:
    cache = KVCache.allocate(model.config, 4, 16, model.dtype, model.device)
    batch = build_batch([SequenceInput(tokens, 0, [0, 1], need_logits=True)], 16, model.device)
    return model(batch, cache)


@pytest.mark.parametrize("arch", ["llama", "qwen2"])  # qwen2: biases on q, k and v
@pytest.mark.parametrize("kind", KEPT, ids=lambda k: k.name)
def test_kept_quantized_matches_the_dequantized_model(tmp_path: Path,
                                                      kind: gguf.GGMLQuantizationType,
                                                      arch: str) -> None:
    path = write_tiny_gguf(tmp_path / f"{kind.name}.gguf", kind, seed=int(kind), arch=arch)
    assert is_quantized_file(path)
    _, tensors = load_checkpoint(path, keep_quantized=True)
    assert isinstance(tensors["model.layers.0.mlp.down_proj.weight"], QuantWeight)
    quant = load_model(path, weights="quantized")
    dense = load_model(path, weights="float32")
    linears = [m for m in quant.modules() if isinstance(m, QuantLinear)]
    assert len(linears) == 5 and quant.lm_head in linears  # 4 projections + the tied head
    assert quant.embed_tokens.quant is quant.lm_head.quant  # one copy for both
    qkv = quant.layers[0].self_attn.qkv_proj
    assert (qkv.bias is not None) == (arch == "qwen2")
    file_bytes = path.stat().st_size
    assert quant.weight_bytes() <= file_bytes < dense.weight_bytes()
    if int(kind) in X8_TYPES:  # the x8 layout: measured on a copy, not kept
        assert all("int16x8" in m.kernels() for m in linears)
    tokens = [5, 9, 1, 33, 60, 2, 17]
    want = _logits(dense, tokens)
    every = {(k,) * 5 for m in linears for k in m.runnable()}
    for kinds in sorted(every, key=lambda k: k[0].endswith("x8")):  # x8 repacks: last
        if all(kinds[0] in m.runnable() for m in linears):
            for m in linears:
                m.set_choice(kinds)
            got = _logits(quant, tokens)
            tol = {"int8": 0.05, "int16": 5e-4, "int16x8": 5e-4}.get(kinds[0], 1e-4)  # 8- / 16-bit
            scale = want.abs().max().item()
            assert (got - want).abs().max().item() <= tol * scale, kinds


Q = gguf.GGMLQuantizationType
# per kernel_choice bucket (1, 8, 32, ...): the steps below fall in the first two (1 and 3-10 rows)
CHOICES = {"mixed": ("int8", "int16", "int16", "int16", "int16"),
           "k-mixed": ("int16", "dequant", "dequant", "dequant", "dequant"),
           "x8": ("int16x8", "dequantx8", "dequantx8", "dequantx8", "dequantx8"),
           "bf16-x8": ("int16x8", "bf16x8", "bf16x8", "bf16x8", "bf16x8"),  # bfloat16 models
           "int8-x8": ("int16x8", "int8x8", "int8x8", "int8x8", "int8x8")}  # and VNNI


@pytest.mark.parametrize(("kind", "others", "choice"), [
    (Q.Q4_1, {"attn_v": Q.Q8_0, "ffn_up": Q.Q5_0}, "mixed"),  # fused layers of two formats
    (Q.Q4_K, {"attn_v": Q.Q6_K}, "k-mixed"),  # K-quants: int16 or dequant, no int8
    (Q.Q4_1, {"attn_v": Q.Q8_0, "ffn_down": Q.Q4_0}, "x8"),  # repacked in groups of 8 rows
    (Q.Q4_K, {"attn_v": Q.Q6_K}, "x8"),  # K-quants too
    (Q.Q4_K, {"attn_v": Q.Q6_K, "ffn_up": Q.Q8_0}, "bf16-x8"),  # bfloat16 panels
    (Q.Q4_K, {"attn_v": Q.Q6_K, "ffn_up": Q.Q8_0}, "int8-x8"),  # 8-bit activations (Q8_0: bf16)
], ids=["int16-and-int8", "k-quants", "x8", "k-quants-x8", "bf16-panels", "int8-panels"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=str)
def test_the_decode_graph_runs_kept_layers_bit_for_bit_as_the_layer_path(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch, kind: Q, others: dict[str, Q],
        choice: str, dtype: torch.dtype) -> None:
    path = write_tiny_gguf(tmp_path / "q.gguf", kind, seed=7, tied=False, others=others,
                           arch="qwen2")  # q/k/v biases, float32 in the file
    model = load_model(path, dtype=dtype, weights="quantized")
    linears = [m for m in model.modules() if isinstance(m, QuantLinear)]
    assert len(linears) == 5 and len(model.layers[0].self_attn.qkv_proj.quant.segments) == (
        2 if others else 1)
    if choice in ("bf16-x8", "int8-x8") and not (dtype == torch.bfloat16
                                                 and native.bf16_panels()):
        assert all(CHOICES[choice][1] not in m.runnable() for m in linears)  # float32's, or no
        return  # such dot
    for m in linears:
        m.set_choice(CHOICES[choice])
    assert all(m.quant.is_x8 for m in linears) == choice.endswith("x8")
    qkv = model.layers[0].self_attn.qkv_proj  # Qwen2's bias, added after the kernel, in the
    assert qkv.bias is not None and qkv.bias.dtype == dtype  # model's dtype, as the graph reads it
    calls: list[int] = []
    real = native.decode_step
    monkeypatch.setattr(native, "decode_step",
                        lambda x, *a: calls.append(x.shape[0]) or real(x, *a))
    lengths = [5, 9, 14, 6, 11, 20, 7, 8, 12, 10]  # ten rows: above the threads' private rows
    sequences = [[(7 * i + j) % SIZES["vocab"] for j in range(n + 3)]
                 for i, n in enumerate(lengths)]
    schedule: list[Step] = [[(i, n) for i, n in enumerate(lengths)]]
    schedule += [[(i, 1) for i in range(10)]] * 2 + [[(0, 1), (4, 1), (9, 1)], [(3, 1)]]
    got = run_schedule(model, sequences, schedule, block_size=4)
    assert calls == [10, 10, 3, 1]
    model.decode_graph.enabled = False
    want = run_schedule(model, sequences, schedule, block_size=4)
    assert calls == [10, 10, 3, 1]
    for (seq, pos, a), (_, _, b) in zip(got, want, strict=True):
        assert torch.equal(a, b), f"seq {seq} pos {pos}: {(a - b).abs().max()}"


def test_an_untied_head_is_its_own_quantized_layer(tmp_path: Path) -> None:
    path = write_tiny_gguf(tmp_path / "q.gguf", gguf.GGMLQuantizationType.Q4_K, tied=False)
    quant = load_model(path, weights="quantized")
    assert isinstance(quant.lm_head, QuantLinear) and quant.embed_tokens.quant is not None
    assert quant.lm_head.quant is not quant.embed_tokens.quant
    dense = load_model(path, weights="float32")
    tokens = list(range(SIZES["vocab"] - 9, SIZES["vocab"]))
    want = _logits(dense, tokens)  # the head, like the layers, on int16 (16-bit activations)
    assert quant.lm_head.kind_for(9) == "int16"
    assert (_logits(quant, tokens) - want).abs().max() <= 5e-4 * want.abs().max()


def test_the_weights_kept_and_their_bytes_are_reported(tmp_path: Path) -> None:
    from prometheus_client import generate_latest

    from qworker.service.metrics import Metrics

    path = write_tiny_gguf(tmp_path / "q.gguf", gguf.GGMLQuantizationType.Q8_0)
    model = load_model(path, weights="quantized")
    report = model.kernel_report()
    assert report["weights"] == "quantized (Q8_0)"
    assert int(report["weight_bytes"]) == model.weight_bytes()
    assert report["linear 64x256:Q8_0"].startswith("int16")  # the tied LM head (or int16x8)
    metrics = Metrics()
    metrics.set_kernels(report)
    text = generate_latest(metrics.registry).decode()
    assert f"qworker_weight_bytes {float(model.weight_bytes())}" in text
    assert 'qworker_kernel{kernel="quantized (Q8_0)",op="weights"} 1.0' in text
    assert load_model(path, weights="float32").kernel_report()["weights"] == "float32"


def test_auto_keeps_the_blocks_where_every_batch_runs_as_fast_or_expanding_costs_too_much(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(weights_auto, "head_seconds", lambda f, d: (1.0, 1.0))  # a tie: kept
    path = write_tiny_gguf(tmp_path / "q.gguf", Q.Q4_K, others={"ffn_down": Q.Q6_K})
    sample = weights_auto.sample_tensor(path)
    assert (sample.tensor_type.name, tuple(sample.shape)) == ("Q4_K", (256, 256))  # most bytes
    kept, expanded = weights_auto.bucket_seconds(sample, torch.float32)
    assert len(kept) == len(expanded) == 5 and min(kept + expanded) > 0
    monkeypatch.setattr(kernel_choice, "machine_load", lambda: 0.5)
    faster_one_row = ([1.0, 1.0, 1.0, 2.0, 2.0], [2.0, 1.0, 1.0, 1.0, 1.0])  # a full batch loses
    cases = [(([1.0] * 5, [2.0] * 5), True), (([2.0] * 5, [1.0] * 5), False),
             (([1.04] * 5, [1.0] * 5), True), (faster_one_row, False)]
    for times, keeps in cases:
        monkeypatch.setattr(weights_auto, "bucket_seconds", lambda f, d, t=times: t)
        assert isinstance(load_model(path, weights="auto").lm_head, QuantLinear) == keeps
    monkeypatch.setattr(kernel_choice, "machine_load", lambda: 1.5)  # too busy to time: fits
    assert not isinstance(load_model(path, weights="auto").lm_head, QuantLinear)
    expanded_bytes = gguf_checkpoint.expanded_bytes(path, 4)
    assert expanded_bytes > path.stat().st_size
    growth = expanded_bytes - path.stat().st_size
    monkeypatch.setattr(weights_auto, "EXPANSION_ALLOWANCE", growth)  # at the allowance: timed
    assert not isinstance(load_model(path, weights="auto").lm_head, QuantLinear)
    monkeypatch.setattr(weights_auto, "EXPANSION_ALLOWANCE", growth - 1)  # past it: kept
    assert isinstance(load_model(path, weights="auto").lm_head, QuantLinear)  # though slower
    monkeypatch.setattr(weights_auto, "EXPANSION_ALLOWANCE", growth)
    monkeypatch.setattr(weights_auto, "available_memory", lambda: 3 * expanded_bytes)  # 2x > half
    assert isinstance(load_model(path, weights="auto").lm_head, QuantLinear)  # though slower
    monkeypatch.setattr(weights_auto, "EXPANSION_ALLOWANCE", 0)  # float64 asks for its own sums
    assert not isinstance(load_model(path, weights="auto", dtype=torch.float64).lm_head,
                          QuantLinear)


def test_auto_times_once_and_a_restart_reads_the_timing(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    path = write_tiny_gguf(tmp_path / "q.gguf", Q.Q4_K, others={"ffn_down": Q.Q6_K})
    cache = tmp_path / "kernels"
    timed: list[Path] = []
    monkeypatch.setattr(weights_auto, "head_seconds", lambda f, d: (1.0, 1.0))  # a tie: kept
    monkeypatch.setattr(weights_auto, "bucket_seconds",
                        lambda f, d: timed.append(f) or ([1.0] * 5, [2.0] * 5))
    monkeypatch.setattr(kernel_choice, "machine_load", lambda: 1.5)  # busy, nothing cached
    assert not isinstance(load_model(path, weights="auto", cache_dir=cache).lm_head, QuantLinear)
    assert not timed and not cache.exists()  # nothing timed, nothing written
    monkeypatch.setattr(kernel_choice, "machine_load", lambda: 0.5)
    assert isinstance(load_model(path, weights="auto", cache_dir=cache).lm_head, QuantLinear)
    assert len(timed) == 1 and len(list(cache.glob("weights-*.json"))) == 2  # and the head's
    monkeypatch.setattr(kernel_choice, "machine_load", lambda: 1.5)  # busy again: the cache
    assert isinstance(load_model(path, weights="auto", cache_dir=cache).lm_head, QuantLinear)
    assert len(timed) == 1
    assert not isinstance(load_model(path, weights="auto", dtype=torch.bfloat16,
                                     cache_dir=cache).lm_head, QuantLinear)  # bf16: not timed


@pytest.mark.parametrize("tied", [True, False])
def test_auto_expands_a_head_measured_slower_kept_and_keeps_the_layers(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch, tied: bool) -> None:
    path = write_tiny_gguf(tmp_path / "q.gguf", Q.Q8_0, tied=tied)
    head = weights_auto.head_tensor(path)
    assert head is not None and head.name == ("token_embd.weight" if tied else "output.weight")
    kept_s, expanded_s = weights_auto.head_seconds(head, torch.float32)  # really timed
    assert kept_s > 0 and expanded_s > 0
    monkeypatch.setattr(kernel_choice, "machine_load", lambda: 0.5)
    monkeypatch.setattr(weights_auto, "bucket_seconds", lambda f, d, r=512: ([1.0] * 5,
                                                                             [2.0] * 5))
    cache = tmp_path / "kernels"
    timed: list[str] = []
    monkeypatch.setattr(weights_auto, "head_seconds",
                        lambda f, d: timed.append(f.name) or (2.0, 1.0))  # the head loses kept
    model = load_model(path, weights="auto", cache_dir=cache)
    assert not isinstance(model.lm_head, QuantLinear)  # the head expanded
    assert isinstance(model.layers[0].mlp.down_proj, QuantLinear)  # the layers kept
    assert (model.embed_tokens.quant is None) == tied  # a tied head's embedding is it
    kept = load_model(path, weights="quantized")
    tokens = list(range(SIZES["vocab"] - 9, SIZES["vocab"]))
    want = _logits(kept, tokens)
    assert (_logits(model, tokens) - want).abs().max() <= 5e-4 * want.abs().max()
    assert load_model(path, weights="auto", cache_dir=cache).lm_head is not None
    assert timed == [head.name]  # timed once: the restart read the cache
    monkeypatch.setattr(weights_auto, "head_seconds", lambda f, d: (1.04, 1.0))  # within TIE
    assert isinstance(load_model(path, weights="auto").lm_head, QuantLinear)
    monkeypatch.setattr(weights_auto, "head_seconds", lambda f, d: (2.0, 1.0))
    monkeypatch.setattr(weights_auto, "EXPANSION_ALLOWANCE", 0)  # past the allowance: kept
    assert isinstance(load_model(path, weights="auto").lm_head, QuantLinear)


def test_a_tied_embedding_reads_the_repacked_head(tmp_path: Path,
                                                  monkeypatch: pytest.MonkeyPatch) -> None:
    from qworker.model.kernels import kernel_choice

    path = write_tiny_gguf(tmp_path / "q.gguf", Q.Q4_1, seed=3)
    model = load_model(path, weights="quantized")
    dense = load_model(path, weights="float32")

    def measured(layer: QuantLinear, rows: int, timer: object = None) -> dict:
        return {k: [1.0 if k == "int16x8" else 2.0] * len(kernel_choice.BUCKETS)
                for k in layer.kernels()}

    monkeypatch.setattr(kernel_choice, "measure", measured)  # x8 wins everywhere
    model.choose_kernels(8, 1, None)
    linears = [m for m in model.modules() if isinstance(m, QuantLinear)]
    assert all(m.quant.is_x8 and m.choice == ("int16x8",) * 5 for m in linears)
    assert model.embed_tokens.quant is model.lm_head.quant  # one copy, in the x8 layout
    assert model.weight_bytes() <= path.stat().st_size
    tokens = [5, 9, 1, 33, 60, 2, 17]
    want = _logits(dense, tokens)
    assert (_logits(model, tokens) - want).abs().max() <= 5e-4 * want.abs().max()


@pytest.mark.parametrize("kind", [Q.Q8_0, Q.Q4_0], ids=lambda k: k.name)
@pytest.mark.parametrize("arch", sorted(OF_ARCHITECTURE))
def test_every_architecture_kept_quantized_computes_its_file_expanded(
        tmp_path: Path, arch: str, kind: Q, monkeypatch: pytest.MonkeyPatch) -> None:
    """A GGUF of each architecture (fused q/k/v and gate/up, q/k norms, biases as the family has
    them, routed experts' 3-D tensors as one kept matrix per expert) kept in its blocks: logits
    those of the file expanded to float32, and its decode steps through the graph (where it runs
    the family) bit for bit as layer by layer."""
    original = hf_model(OF_ARCHITECTURE[arch], seed=3)
    state = {k: v for k, v in original.state_dict().items()
             if not (k == "lm_head.weight" and original.config.tie_word_embeddings)}
    routers = {name: Q.F32 for name in state if name.endswith(".mlp.gate.weight")}  # as llama.cpp
    path = write_gguf(tmp_path / "m.gguf", original.config, state, qtype=kind, types=routers)
    quant = load_model(path, weights="quantized")
    assert all(isinstance(m.self_attn.qkv_proj, QuantLinear) for m in quant.layers)
    experts = [e for m in quant.modules() if isinstance(m, RoutedExperts) for e in m.experts]
    routed = quant.config.experts
    assert len(experts) == (0 if routed is None else routed.count * sum(
        routed.sparse(i) for i in range(quant.config.num_layers)))
    assert all(isinstance(e.gate_up_proj, QuantLinear) and isinstance(e.down_proj, QuantLinear)
               for e in experts)  # each expert its own matrices of the file's 3-D tensors
    assert quant.weight_bytes() <= path.stat().st_size  # experts: views of one copy of the bytes
    dense = load_model(path, weights="float32")
    tokens = [5, 9, 1, 33, 60, 2, 17, 40, 41, 7]
    want = _logits(dense, tokens)
    assert (_logits(quant, tokens) - want).abs().max() <= 5e-4 * want.abs().max()
    calls: list[int] = []
    real = native.decode_step
    monkeypatch.setattr(native, "decode_step",
                        lambda x, *a: calls.append(x.shape[0]) or real(x, *a))
    sequences = [tokens, tokens[::-1] + [3, 4]]
    schedule: list[Step] = [[(0, 6), (1, 8)]] + [[(0, 1), (1, 1)] for _ in range(4)]
    got = run_schedule(quant, sequences, schedule, block_size=4)
    assert calls == ([] if quant.decode_graph.refused else [2] * 4)  # experts: layer by layer
    quant.decode_graph.enabled = False
    for (seq, pos, a), (_, _, b) in zip(got, run_schedule(quant, sequences, schedule, 4),
                                        strict=True):
        assert torch.equal(a, b), f"seq {seq} pos {pos}: {(a - b).abs().max()}"
