"""The native kernels over GGUF blocks against gguf's own dequantization, then a float64 matmul:
random blocks of every kept format, several token counts, odd widths."""

from __future__ import annotations

import gguf
import numpy as np
import pytest
import torch

from qworker.model.kernels import kernel_choice, native
from qworker.model.kernels import quant_interleave as interleave
from qworker.model.kernels.quant_linear import QuantLinear
from qworker.model.kernels.quant_weight import INT8_DOT_TYPES, INT16_DOT_TYPES, QuantWeight
from qworker.model.layers.embedding import quant_lookup
from tests.quant_fixtures import KEPT, random_blocks

pytestmark = pytest.mark.skipif(native.library() is None, reason="no native kernels built")


def _activations_quantized(x: np.ndarray, top: int) -> np.ndarray:
    """An integer kernel's view of x: per 32-block, q = round(x / d), d = max|x| / top (127 for
    8 bits, 32767 for 16)."""
    blocks = x.reshape(x.shape[0], -1, 32).astype(np.float32)
    d = np.abs(blocks).max(axis=-1, keepdims=True) / np.float32(top)
    q = np.round(blocks * np.where(d > 0, np.float32(1) / np.where(d > 0, d, 1), 0))
    return (q * d).reshape(x.shape)


@pytest.mark.parametrize("kind", KEPT, ids=lambda k: k.name)
@pytest.mark.parametrize("rows", [1, 3, 17, 64, 200])
def test_quantized_matmul_matches_dequantize_then_matmul(kind: gguf.GGMLQuantizationType,
                                                         rows: int) -> None:
    rng = np.random.default_rng(rows + int(kind))
    elems = gguf.GGML_QUANT_SIZES[kind][0]
    cols, outputs = (3 * elems if elems == 32 else 2 * elems), 37  # odd widths
    raw = random_blocks(kind, outputs, cols, rng)
    w = gguf.quants.dequantize(raw, kind).astype(np.float64)
    x = rng.standard_normal((rows, cols)).astype(np.float32)
    x[-1, 32:64] = 0  # a block of zeros: its scale is 0
    layer = QuantLinear(QuantWeight.of(kind.name, torch.from_numpy(raw), cols), None)
    wide, narrow = kind.name in INT16_DOT_TYPES, kind.name in INT8_DOT_TYPES
    assert layer.kernels() == (("int16", "dequant") if wide else ("dequant",))
    assert set(layer.runnable()) == set(layer.kernels()) | ({"int8"} if narrow else set())
    plain = x.astype(np.float64) @ w.T
    scale = np.abs(plain).max()
    got = layer.run("dequant", torch.from_numpy(x)).double().numpy()
    np.testing.assert_allclose(got, plain, atol=1e-5 * scale, rtol=0)
    integer = [("int16", 32767, 1e-4)] * wide + [("int8", 127, 0.03)] * narrow
    for kernel, top, error in integer:  # each within float32's rounding of its own view of x,
        want = _activations_quantized(x, top).astype(np.float64) @ w.T  # and that near float's
        got = layer.run(kernel, torch.from_numpy(x)).double().numpy()
        np.testing.assert_allclose(got, want, atol=1e-5 * scale, rtol=0)
        assert np.abs(got - plain).max() < error * scale, kernel


@pytest.mark.parametrize("kind", KEPT, ids=lambda k: k.name)
def test_quantized_embedding_rows_are_the_dequantized_rows(
        kind: gguf.GGMLQuantizationType) -> None:
    rng = np.random.default_rng(int(kind))
    raw = random_blocks(kind, 50, 256, rng)
    lookup = quant_lookup(QuantWeight.of(kind.name, torch.from_numpy(raw), 256), torch.float32)
    ids = torch.tensor([[0, 49, 7], [7, 3, 3]])
    want = torch.from_numpy(gguf.quants.dequantize(raw, kind))[ids]
    assert torch.equal(lookup(ids), want)


def test_a_fused_layer_of_two_formats_writes_each_segment_s_columns() -> None:
    rng = np.random.default_rng(5)
    a, b = random_blocks(gguf.GGMLQuantizationType.Q4_K, 5, 256, rng), random_blocks(
        gguf.GGMLQuantizationType.Q6_K, 9, 256, rng)
    fused = QuantWeight.cat([QuantWeight.of("Q4_K", torch.from_numpy(a), 256),
                             QuantWeight.of("Q6_K", torch.from_numpy(b), 256)])
    assert fused.shape == (14, 256) and fused.type_names == ("Q4_K", "Q6_K")
    bias = torch.randn(14)
    layer = QuantLinear(fused, bias)
    x = torch.randn(3, 256)
    want = x.double() @ fused.dequantize().double().T + bias.double()
    assert layer.kernels() == ("int16", "dequant")
    for kind, tol in (("int16", 1e-4), ("dequant", 1e-6)):  # of the outputs' range
        error = (layer.run(kind, x).double() - want).abs().max()
        assert error <= tol * want.abs().max(), kind


def test_the_kernel_per_bucket_is_the_measured_fastest() -> None:
    raw = random_blocks(gguf.GGMLQuantizationType.Q4_0, 24, 64, np.random.default_rng(1))
    layer = QuantLinear(QuantWeight.of("Q4_0", torch.from_numpy(raw), 64), None)
    assert layer.kernels() == ("int16", "dequant")  # 24 rows: no whole 16-row groups for x8

    def timer(kind: str, rows: int, run: object) -> float:  # int16 wins below 32 rows
        return {"int16": 1.0, "dequant": 2.0}[kind] if rows < 32 else {"int16": 3.0,
                                                                        "dequant": 2.0}[kind]

    chosen = kernel_choice.choose([(layer, 512)], None, timer)
    assert chosen == {"24x64:Q4_0": ("int16", "int16", "dequant", "dequant", "dequant")}
    assert layer.kind_for(1) == "int16" and layer.kind_for(300) == "dequant"


X8_KINDS = (gguf.GGMLQuantizationType.Q4_0, gguf.GGMLQuantizationType.Q4_1,
            gguf.GGMLQuantizationType.Q5_0, gguf.GGMLQuantizationType.Q8_0,
            gguf.GGMLQuantizationType.Q4_K, gguf.GGMLQuantizationType.Q6_K)


def x8_columns(kind: gguf.GGMLQuantizationType) -> int:
    """3 blocks (K-quants: 2 of 256 values, 16 sub-blocks)."""
    return 3 * 32 if gguf.GGML_QUANT_SIZES[kind][0] == 32 else 2 * 256


@pytest.mark.parametrize("kind", X8_KINDS, ids=lambda k: k.name)
def test_the_x8_layout_is_as_compact_and_gives_the_file_s_rows_back(
        kind: gguf.GGMLQuantizationType) -> None:
    cols = x8_columns(kind)
    raw = torch.from_numpy(random_blocks(kind, 48, cols, np.random.default_rng(int(kind))))
    x8 = interleave.to_x8(int(kind), raw)
    assert x8.shape == raw.shape and not torch.equal(x8, raw)
    assert torch.equal(interleave.from_x8(int(kind), x8), raw)
    weight = QuantWeight.of(kind.name, raw, cols)
    assert torch.equal(weight.to_x8().dequantize(), weight.dequantize())
    ids = torch.tensor([0, 47, 9, 9, 21])  # a tied embedding's rows, read from the x8 bytes
    assert torch.equal(quant_lookup(weight.to_x8(), torch.float32)(ids), weight.dequantize()[ids])


@pytest.mark.parametrize("kind", X8_KINDS, ids=lambda k: k.name)
@pytest.mark.parametrize("rows", [1, 3, 5, 17, 64])
def test_x8_kernels_match_dequantize_then_matmul(kind: gguf.GGMLQuantizationType,
                                                 rows: int) -> None:
    rng = np.random.default_rng(7 * rows + int(kind))
    cols, outputs = x8_columns(kind), 48  # 6 groups of 8, 3 panels of 16
    raw = random_blocks(kind, outputs, cols, rng)
    w = gguf.quants.dequantize(raw, kind).astype(np.float64)  # of the file's layout
    x = rng.standard_normal((rows, cols)).astype(np.float32)
    x[-1, 32:64] = 0
    layer = QuantLinear(QuantWeight.of(kind.name, torch.from_numpy(raw), cols), None)
    assert layer.kernels() == ("int16", "dequant", "int16x8", "dequantx8")
    plain = x.astype(np.float64) @ w.T
    scale = np.abs(plain).max()
    got = layer.run("dequantx8", torch.from_numpy(x)).double().numpy()
    np.testing.assert_allclose(got, plain, atol=1e-5 * scale, rtol=0)
    want = _activations_quantized(x, 32767).astype(np.float64) @ w.T
    got = layer.run("int16x8", torch.from_numpy(x)).double().numpy()
    np.testing.assert_allclose(got, want, atol=1e-5 * scale, rtol=0)
    assert np.abs(got - plain).max() < 1e-4 * scale
    same = layer.run("int16", torch.from_numpy(x)).double().numpy()  # the file layout's dot
    np.testing.assert_allclose(got, same, atol=1e-5 * scale, rtol=0)


def _bf16(a: np.ndarray) -> np.ndarray:
    return torch.from_numpy(np.ascontiguousarray(a, dtype=np.float32)).bfloat16().double().numpy()


@pytest.mark.parametrize("kind", X8_KINDS, ids=lambda k: k.name)
@pytest.mark.parametrize(("rows", "outputs"), [(1, 48), (9, 32), (17, 16), (64, 80)])
def test_bf16_panels_compute_the_file_expanded_to_bfloat16(kind: gguf.GGMLQuantizationType,
                                                          rows: int, outputs: int) -> None:
    """bf16x8: the weights and activations each rounded to bfloat16 once, the products summed in
    float (48-row panels, the last of 16 or 32 rows where the outputs leave one)."""
    rng = np.random.default_rng(11 * rows + outputs + int(kind))
    cols = x8_columns(kind)
    raw = random_blocks(kind, outputs, cols, rng)
    w = gguf.quants.dequantize(raw, kind)
    x = rng.standard_normal((rows, cols)).astype(np.float32)
    weight = QuantWeight.of(kind.name, torch.from_numpy(raw), cols)
    assert "bf16x8" not in QuantLinear(weight, None).kernels()  # a float32 model keeps float32
    layer = QuantLinear(weight, None, torch.bfloat16)
    if not native.bf16_panels():  # an AVX2 or plain AVX-512 build has no bfloat16 dot
        assert "bf16x8" not in layer.kernels()
        return
    assert "bf16x8" in layer.kernels()
    want = _bf16(x) @ _bf16(w).T
    got = layer.run("bf16x8", torch.from_numpy(x)).double().numpy()
    np.testing.assert_allclose(got, want, atol=1e-5 * np.abs(want).max(), rtol=0)


K_QUANTS = (gguf.GGMLQuantizationType.Q4_K, gguf.GGMLQuantizationType.Q6_K)


@pytest.mark.parametrize("kind", K_QUANTS, ids=lambda k: k.name)
@pytest.mark.parametrize(("rows", "outputs"), [(1, 48), (3, 16), (5, 32), (17, 80), (64, 112)])
def test_int8_panels_compute_the_file_on_8_bit_activations(kind: gguf.GGMLQuantizationType,
                                                          rows: int, outputs: int) -> None:
    """int8x8: the K-quant's own values against the activations quantized per 32-block to 8
    bits, exact in the integers, the scales applied in float (panels of 48 / 32 rows, the last
    narrower where the outputs leave one)."""
    rng = np.random.default_rng(13 * rows + outputs + int(kind))
    cols = x8_columns(kind)
    raw = random_blocks(kind, outputs, cols, rng)
    w = gguf.quants.dequantize(raw, kind).astype(np.float64)
    x = rng.standard_normal((rows, cols)).astype(np.float32)
    x[-1, 32:64] = 0  # a block of zeros: its scale is 0
    x[0, :32] *= 100  # a block of outliers: its own scale
    weight = QuantWeight.of(kind.name, torch.from_numpy(raw), cols)
    assert "int8x8" not in QuantLinear(weight, None).kernels()  # a float32 model keeps float32
    layer = QuantLinear(weight, None, torch.bfloat16)
    if not native.bf16_panels():
        assert "int8x8" not in layer.kernels()
        return
    assert layer.kernels()[-1] == "int8x8"
    want = _activations_quantized(x, 127).astype(np.float64) @ w.T
    got = layer.run("int8x8", torch.from_numpy(x)).double().numpy()
    np.testing.assert_allclose(got, want, atol=1e-5 * np.abs(want).max(), rtol=0)


def test_int8_panels_leave_other_formats_to_bf16_panels() -> None:
    """A fused layer of Q4_K and Q8_0: int8x8 runs the Q4_K segment on 8-bit activations and the
    Q8_0 one as bf16x8; a layer with no K-quant has no int8x8 to choose."""
    rng = np.random.default_rng(6)
    a = random_blocks(gguf.GGMLQuantizationType.Q4_K, 32, 256, rng)
    b = random_blocks(gguf.GGMLQuantizationType.Q8_0, 16, 256, rng)
    plain = QuantWeight.of("Q8_0", torch.from_numpy(b), 256)
    assert "int8x8" not in QuantLinear(plain, None, torch.bfloat16).kernels()
    fused = QuantWeight.cat([QuantWeight.of("Q4_K", torch.from_numpy(a), 256), plain])
    layer = QuantLinear(fused, None, torch.bfloat16)
    if not native.bf16_panels():
        return
    x = torch.randn(9, 256)
    got = layer.run("int8x8", x).double().numpy()
    wa = gguf.quants.dequantize(a, gguf.GGMLQuantizationType.Q4_K).astype(np.float64)
    want_a = _activations_quantized(x.numpy(), 127).astype(np.float64) @ wa.T
    want_b = layer.run("bf16x8", x).double().numpy()[:, 32:]
    np.testing.assert_allclose(got[:, :32], want_a, atol=1e-5 * np.abs(want_a).max(), rtol=0)
    np.testing.assert_array_equal(got[:, 32:], want_b)


def test_choosing_an_x8_kernel_repacks_the_weight_once_for_every_bucket() -> None:
    kind = gguf.GGMLQuantizationType.Q4_1
    raw = torch.from_numpy(random_blocks(kind, 32, 64, np.random.default_rng(3)))
    weight = QuantWeight.of("Q4_1", raw, 64)
    layer = QuantLinear(weight, None)
    x = torch.randn(2, 64)
    before = layer.run("int16", x)

    def timer(kind: str, rows: int, run: object) -> float:  # x8 wins at 1 row, dequant at 128
        return {"int16": 2.0, "dequant": 3.0 if rows < 128 else 1.0, "int16x8": 1.5,
                "dequantx8": 2.5}[kind]

    chosen = kernel_choice.choose([(layer, 128)], None, timer)
    assert chosen == {"32x64:Q4_1": ("int16x8",) * 3 + ("dequant",) * 2}
    assert layer.choice == ("int16x8",) * 3 + ("dequantx8",) * 2  # dequant's twin, x8 bytes
    assert layer.quant.is_x8 and layer.quant.nbytes == weight.nbytes and layer._trial is None
    assert layer.kernels() == ("int16x8", "dequantx8") == layer.runnable()
    torch.testing.assert_close(layer(x), before, atol=1e-5, rtol=0)
    lookup = quant_lookup(layer.quant, torch.float32)  # a tied embedding's rows, from x8
    ids = torch.tensor([0, 31, 9, 9])
    assert torch.equal(lookup(ids), weight.dequantize()[ids])


def test_without_an_x8_win_the_file_layout_stays() -> None:
    raw = random_blocks(gguf.GGMLQuantizationType.Q8_0, 16, 32, np.random.default_rng(4))
    layer = QuantLinear(QuantWeight.of("Q8_0", torch.from_numpy(raw), 32), None)
    kernel_choice.choose([(layer, 8)], None,
                         lambda kind, rows, run: 1.0 if kind == "int16" else 2.0)
    assert not layer.quant.is_x8 and layer._trial is None and set(layer.choice) == {"int16"}
