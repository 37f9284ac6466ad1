"""Kernels chosen by measurement: the selection logic on injected timings, the choice applied to
layers and cached on disk, and the decode graph serving only the buckets chosen native."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F

from qworker.model import kernel_choice, native
from qworker.model.kernel_choice import BUCKETS, bucket, fastest
from qworker.model.linear import Linear

NATIVE_HERE = native.library() is not None


def test_rows_go_to_the_nearest_bucket_on_a_log_scale() -> None:
    assert [bucket(r) for r in (1, 2, 3, 8, 16, 17, 32, 64, 65, 128, 256, 257, 512, 4096)] == [
        0, 0, 1, 1, 1, 2, 2, 2, 3, 3, 3, 4, 4, 4]


def test_the_fastest_kernel_wins_each_bucket() -> None:
    timings = {"native": [1.0, 2.0, 5.0, 9.0, None], "onednn": [2.0, 1.5, 4.0, 10.0, None]}
    # the last bucket was not measured (steps never get that large): it keeps the one below
    assert fastest(timings) == ("native", "onednn", "onednn", "native", "native")


def test_a_kernel_that_cannot_run_a_bucket_is_not_chosen_there() -> None:
    assert fastest({"a": [None, 1.0, 1.0, 1.0, 1.0], "b": [3.0, 2.0, 2.0, 2.0, 2.0]}) == (
        "b", "a", "a", "a", "a")


def _layers(kinds: tuple[str, ...], count: int = 3) -> list[Linear]:
    layers = [Linear(32, 48).requires_grad_(False) for _ in range(count)]
    for layer in layers:
        layer.kernels = lambda kinds=kinds: kinds  # type: ignore[method-assign]
    return layers


def test_layers_of_one_shape_share_one_measurement_and_the_choice_is_cached(
        tmp_path: Path) -> None:
    layers = _layers(("onednn", "plain"))
    calls: list[int] = []

    def timer(kind: str, rows: int, run: object) -> float:  # "plain" wins from 32 rows on
        calls.append(rows)
        return 1.0 if (kind == "plain") == (rows < 32) else 0.5

    chosen = kernel_choice.choose([(layer, 512) for layer in layers], tmp_path, timer)
    rounds = kernel_choice.ROUNDS
    assert len(calls) == 2 * len(BUCKETS) * rounds  # one shape, two kinds, every bucket
    assert all(layer.choice == chosen["48x32:float32"] for layer in layers)
    assert chosen["48x32:float32"] == ("onednn", "onednn", "plain", "plain", "plain")
    [cached] = tmp_path.glob("kernels-*.json")
    assert json.loads(cached.read_text()) == {"48x32:float32": list(chosen["48x32:float32"])}
    again = _layers(("onednn", "plain"))
    assert kernel_choice.choose([(layer, 512) for layer in again], tmp_path, timer) == chosen
    assert len(calls) == 2 * len(BUCKETS) * rounds  # read back, not measured again


def test_buckets_beyond_the_largest_step_are_not_measured(tmp_path: Path) -> None:
    layer = _layers(("onednn", "plain"), count=1)[0]
    measured = kernel_choice.measure(layer, 8, lambda kind, rows, run: 1.0)
    assert measured == {k: [1.0, 1.0, None, None, None] for k in ("onednn", "plain")}


def test_short_calls_are_timed_more_often_up_to_a_bound() -> None:
    layer = _layers(("onednn", "plain"), count=1)[0]
    calls: dict[float, int] = {}

    def timer(kind: str, rows: int, run: object) -> float:  # 1 ms at one row, 0.1 us at 8
        seconds = 1e-3 if rows == 1 else 1e-7
        calls[seconds] = calls.get(seconds, 0) + 1
        return seconds

    kernel_choice.measure(layer, 8, timer)
    per_kind = {s: n // 2 for s, n in calls.items()}
    assert abs(per_kind[1e-3] - kernel_choice.MEASURE_S / 1e-3) <= 1  # float sums
    assert per_kind[1e-7] == kernel_choice.MAX_ROUNDS


def test_a_cached_choice_of_a_kernel_no_longer_offered_is_measured_again(
        tmp_path: Path) -> None:
    old = _layers(("onednn", "plain"), count=1)
    chosen = kernel_choice.choose([(old[0], 1)], tmp_path, lambda kind, rows, run: 1.0)
    assert chosen == {"48x32:float32": ("onednn",) * len(BUCKETS)}
    now = _layers(("native", "plain"), count=1)  # "onednn" gone (as int8 for quantized layers)
    again = kernel_choice.choose([(now[0], 1)], tmp_path, lambda kind, rows, run: 1.0)
    assert again == {"48x32:float32": ("native",) * len(BUCKETS)}


def test_a_layer_with_one_kernel_is_not_measured(tmp_path: Path) -> None:
    layer = _layers(("plain",), count=1)[0]
    assert kernel_choice.choose([(layer, 512)], tmp_path, lambda kind, rows, run: 1 / 0) == {}
    assert layer.choice is None


def test_an_unwritable_cache_only_costs_a_new_measurement(tmp_path: Path) -> None:
    blocker = tmp_path / "file"
    blocker.write_text("")
    layer = _layers(("onednn", "plain"), count=1)[0]
    chosen = kernel_choice.choose([(layer, 1)], blocker / "kernels",
                                  lambda kind, rows, run: 1.0)
    assert chosen == {"48x32:float32": ("onednn",) * len(BUCKETS)}


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_each_chosen_kernel_computes_the_layer(dtype: torch.dtype) -> None:
    layer = Linear(64, 48).to(dtype).requires_grad_(False)
    kinds = layer.kernels()
    assert "native" in kinds or not NATIVE_HERE
    x = torch.randn(9, 64).to(dtype)
    want = F.linear(x.float(), layer.weight.float(), layer.bias.float())
    for kind in kinds:
        layer.set_choice((kind,) * len(BUCKETS))
        with torch.inference_mode():
            got = layer(x).float()
        torch.testing.assert_close(got, want, atol=5e-2, rtol=2e-2)
        assert layer.kind_for(9) == kind


def test_a_measured_model_chooses_for_every_linear_layer(tmp_path: Path) -> None:
    from tests.engine_fixtures import tiny_model

    model = tiny_model(128, dtype=torch.float32, seed=1)
    chosen = model.choose_kernels(64, 8, tmp_path)
    linears = [m for m in model.modules() if isinstance(m, Linear)]
    if NATIVE_HERE:  # a choice to make: every layer has one
        assert chosen and all(layer.choice is not None for layer in linears)
    for layer in linears:
        assert layer.choice is None or set(layer.choice) <= set(layer.kernels())
