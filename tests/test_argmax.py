"""Greedy sampling's native argmax (csrc/argmax.cpp) against torch's `max(dim).indices`, on every
kernel family this CPU runs: random rows, ties everywhere (the first maximum wins), rows of
-inf, strided rows, widths that leave a tail, and the sampler's greedy choice through it."""

from __future__ import annotations

import pytest
import torch

from qworker.engine.request import SamplingParams
from qworker.engine.sampler import SampleRow, sample
from qworker.model.kernels import native
from tests.model_harness import RUNNABLE_FAMILIES, kernel_family

NATIVE = [f for f in RUNNABLE_FAMILIES if f != "torch"]


@pytest.mark.parametrize("family", NATIVE)
@pytest.mark.parametrize(("rows", "cols"), [(1, 151936), (3, 49152), (5, 100003), (2, 7)])
def test_the_first_maximum_of_each_row(family: str, rows: int, cols: int) -> None:
    torch.manual_seed(cols)
    x = torch.randn(rows, cols)
    with kernel_family(family):
        assert torch.equal(native.argmax(x), x.max(dim=-1).indices)
        x[:, 1::3] = x.amax(dim=-1, keepdim=True)  # ties: the lowest index wins
        assert torch.equal(native.argmax(x), x.max(dim=-1).indices)
        x[-1, -1] = x.max() + 1  # a maximum in the tail past the lanes
        assert torch.equal(native.argmax(x), x.max(dim=-1).indices)


@pytest.mark.parametrize("family", NATIVE)
def test_rows_of_minus_infinity_and_strided_rows(family: str) -> None:
    with kernel_family(family):
        assert native.argmax(torch.full((2, 100), float("-inf"))).tolist() == [0, 0]
        wide = torch.randn(4, 3000)
        x = wide[:, 1000:2500]  # rows 3000 floats apart
        assert torch.equal(native.argmax(x), x.max(dim=-1).indices)
        assert native.argmax(x.to(torch.bfloat16)) is None  # torch's then


def test_the_sampler_chooses_greedy_tokens_by_it() -> None:
    torch.manual_seed(0)
    logits = torch.randn(3, 5000)
    rows = [SampleRow(SamplingParams(temperature=0.0), seed=0, index=0, token_ids=[1],
                      num_prompt_tokens=1, banned=()) for _ in range(3)]
    assert sample(logits, rows) == logits.max(dim=-1).indices.tolist()
