"""The prepacked linear layer computes what F.linear does, and follows in-place weight changes."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from qworker.model.linear import Linear, packing_available


def test_packing_is_available_on_this_cpu() -> None:
    assert packing_available()


@pytest.mark.parametrize(("dtype", "tol"), [(torch.bfloat16, 0.0), (torch.float32, 1e-5),
                                            (torch.float64, 0.0)])
@pytest.mark.parametrize("bias", [True, False])
@pytest.mark.parametrize("rows", [1, 5, 130])
def test_packed_linear_matches_f_linear(dtype: torch.dtype, tol: float, bias: bool,
                                        rows: int) -> None:
    torch.manual_seed(rows)
    layer = Linear(96, 200, bias=bias).to(dtype).requires_grad_(False)
    x = torch.randn(rows, 96).to(dtype)
    with torch.inference_mode():
        torch.testing.assert_close(layer(x), F.linear(x, layer.weight, layer.bias), atol=tol,
                                   rtol=tol)
        assert (layer._packed is not None) == (dtype != torch.float64)


def test_an_in_place_weight_change_is_seen() -> None:
    layer = Linear(32, 16, bias=False).to(torch.bfloat16).requires_grad_(False)
    x = torch.randn(3, 32).to(torch.bfloat16)
    with torch.inference_mode():
        before = layer(x)
        layer.weight.mul_(2)
        after = layer(x)
    torch.testing.assert_close(after, 2 * before)
