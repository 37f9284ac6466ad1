"""The prepacked linear layer computes what F.linear does, and follows in-place weight changes."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from qworker.model import native
from qworker.model.linear import Linear, packing_available


def test_packing_is_available_on_this_cpu() -> None:
    assert packing_available()


# bfloat16: one rounding apart at most (a few rows take the native kernel, which sums in another
# order); float32 sums in another order too
@pytest.mark.parametrize(("dtype", "tol"), [(torch.bfloat16, 1e-2), (torch.float32, 1e-5),
                                            (torch.float64, 0.0)])
@pytest.mark.parametrize("bias", [True, False])
@pytest.mark.parametrize("rows", [1, 5, 8, 9, 130])
def test_packed_linear_matches_f_linear(dtype: torch.dtype, tol: float, bias: bool,
                                        rows: int) -> None:
    torch.manual_seed(rows)
    layer = Linear(96, 200, bias=bias).to(dtype).requires_grad_(False)  # 96: one odd 32-chunk
    x = torch.randn(rows, 96).to(dtype)
    with torch.inference_mode():
        torch.testing.assert_close(layer(x), F.linear(x, layer.weight, layer.bias), atol=tol,
                                   rtol=tol)
        small = dtype == torch.bfloat16 and rows <= 8  # served by the native kernel, not oneDNN
        assert (layer._packed is not None) == (dtype != torch.float64 and not small)


def test_an_in_place_weight_change_is_seen() -> None:
    layer = Linear(32, 16, bias=False).to(torch.bfloat16).requires_grad_(False)
    x = torch.randn(3, 32).to(torch.bfloat16)
    with torch.inference_mode():
        before = layer(x)
        layer.weight.mul_(2)
        after = layer(x)
    torch.testing.assert_close(after, 2 * before)


@pytest.mark.parametrize("width", [64, 96, 576])
@pytest.mark.parametrize("rows", [1, 3, 8])
def test_small_matmul_matches_f_linear(width: int, rows: int) -> None:
    gen = torch.Generator().manual_seed(width + rows)
    x = torch.randn(rows, width, generator=gen).to(torch.bfloat16)
    weight = torch.randn(130, width, generator=gen).to(torch.bfloat16)
    bias = torch.randn(130, generator=gen).to(torch.bfloat16)
    got = native.small_matmul(x, weight, bias)
    assert got is not None
    torch.testing.assert_close(got, F.linear(x, weight, bias), atol=2e-2, rtol=1e-2)


def test_small_matmul_declines_what_it_does_not_serve() -> None:
    weight = torch.zeros(4, 40, dtype=torch.bfloat16)
    assert native.small_matmul(torch.zeros(1, 40, dtype=torch.bfloat16), weight, None) is None
    wide = torch.zeros(4, 64, dtype=torch.bfloat16)
    assert native.small_matmul(torch.zeros(9, 64, dtype=torch.bfloat16), wide, None) is None
    assert native.small_matmul(torch.zeros(1, 64), wide.float(), None) is None
