"""Kernels chosen by measurement: the selection logic on injected timings, the choice applied to
layers and cached on disk, and the decode graph serving only the buckets chosen native."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F

from qworker.model.kernels import kernel_choice, native
from qworker.model.kernels.kernel_choice import BUCKETS, bucket, fastest
from qworker.model.kernels.linear import Linear

NATIVE_HERE = native.library() is not None
MACHINE_LOAD = kernel_choice.machine_load  # the real one, before the fixture replaces it


@pytest.fixture(autouse=True)
def _quiet_machine(monkeypatch: pytest.MonkeyPatch) -> None:
    """The machine's load as choose() reads it: none, unless a test says (a shared one's is);
    and no choice left unsaved by an earlier test (each test is a fresh process)."""
    monkeypatch.setattr(kernel_choice, "machine_load", lambda: 0.0)
    monkeypatch.setattr(kernel_choice, "_unsaved", {})


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


def test_a_measured_model_chooses_for_every_linear_layer(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    from tests.engine_fixtures import tiny_model

    # two rounds a bucket: on a loaded 2-vCPU machine every timed call took a 4 ms scheduler
    # slice or two, and the default ~25 rounds made this test 4 s of measuring
    monkeypatch.setattr(kernel_choice, "ROUNDS", 2)
    monkeypatch.setattr(kernel_choice, "MEASURE_S", 0.0)
    model = tiny_model(128, dtype=torch.float32, seed=1)
    chosen = model.choose_kernels(64, 8, tmp_path)
    linears = [m for m in model.modules() if isinstance(m, Linear)]
    if NATIVE_HERE:  # a choice to make: every layer has one
        assert chosen and all(layer.choice is not None for layer in linears)
    for layer in linears:
        assert layer.choice is None or set(layer.choice) <= set(layer.kernels())


def test_a_kernel_s_time_is_its_least_round_and_its_halves_the_least_of_each() -> None:
    t = kernel_choice.Seconds([3.0, 1.0, 2.0, 1.5, 9.0, 8.0, 7.0, 6.0])
    assert t == 1.0
    assert t.halves == (2.0, 1.0)  # rounds 0, 2, 4, 6 and 1, 3, 5, 7


def test_a_winner_not_faster_in_both_halves_of_the_rounds_is_undecided() -> None:
    # a's rounds all took two scheduler slices (8 ms), b's only in the even rounds: a 21% gap,
    # but in the even half b is no faster
    a = kernel_choice.Seconds([8e-3] * 8)
    b = kernel_choice.Seconds([8e-3, 6.6e-3] * 4)
    assert kernel_choice.undecided({"a": [a], "b": [b]}) == [0]
    steady = kernel_choice.Seconds([6.6e-3, 6.7e-3] * 4)  # faster in every round
    assert kernel_choice.undecided({"a": [a], "b": [steady]}) == []


def test_the_kernels_take_turns_round_by_round() -> None:
    layer = _layers(("onednn", "plain"), count=1)[0]
    order: list[str] = []

    def timer(kind: str, rows: int, run: object) -> float:
        order.append(kind)
        return 1.0

    kernel_choice.measure(layer, 1, timer)
    assert order == ["onednn", "plain"] * kernel_choice.ROUNDS


def _busy(quiet: dict[str, float], slowed_every: dict[str, int]) -> kernel_choice.Timer:
    """A timer of a shared machine: a kernel's call takes 4x its quiet time but every
    `slowed_every[kind]`-th round."""
    seen: dict[str, int] = {}

    def timer(kind: str, rows: int, run: object) -> float:
        seen[kind] = seen.get(kind, 0) + 1
        return quiet[kind] * (1 if seen[kind] % slowed_every[kind] == 0 else 4)
    return timer


def test_interference_does_not_make_the_slower_kernel_win() -> None:
    layer = _layers(("native", "onednn"), count=1)[0]
    # native 2x faster quiet, but most of its rounds are slowed: its median is onednn's
    timer = _busy({"native": 1e-3, "onednn": 2e-3}, {"native": 5, "onednn": 2})
    timings = kernel_choice.measure(layer, 1, timer)
    assert fastest(timings)[0] == "native"
    assert timings["native"][0] == 1e-3 and timings["onednn"][0] == 2e-3


@pytest.mark.parametrize(("native_every", "onednn_every"), [
    (1, 1),  # quiet
    (5, 1),  # most of native's rounds 4x: far above the 5% gap
])
def test_kernels_this_close_are_as_good_as_each_other_however_noisy(
        native_every: int, onednn_every: int) -> None:
    layer = _layers(("native", "onednn"), count=1)[0]
    timer = _busy({"native": 1.05e-3, "onednn": 1e-3},
                  {"native": native_every, "onednn": onednn_every})
    timings = kernel_choice.measure(layer, 8, timer)
    assert fastest(timings) == ("onednn",) * len(BUCKETS)
    assert kernel_choice.undecided(timings) == []


def test_a_wide_gap_is_told_even_on_a_busy_machine() -> None:
    busy = kernel_choice.Seconds([1.0, 3.0, 3.0, 4.0, 4.0, 4.0, 4.0])  # most rounds 3-4x
    assert kernel_choice.undecided({"a": [busy], "b": [kernel_choice.Seconds([3.5])]}) == []
    assert kernel_choice.undecided({"a": [busy], "b": [kernel_choice.Seconds([1.05])]}) == []


def test_a_noisy_choice_serves_this_process_but_is_not_cached(tmp_path: Path) -> None:
    from structlog.testing import capture_logs

    # native's odd rounds 4x: 1.3x faster than onednn in one half, slower in the other
    noisy = _busy({"native": 1e-3, "onednn": 1.3e-3}, {"native": 2, "onednn": 1})
    layers = _layers(("native", "onednn"), count=2)
    with capture_logs() as logs:
        chosen = kernel_choice.choose([(layer, 8) for layer in layers], tmp_path, noisy)
    assert all(layer.choice == chosen["48x32:float32"] for layer in layers)
    assert not list(tmp_path.glob("kernels-*.json"))
    [warning] = [e for e in logs if e["event"] == "kernel_choice_too_noisy_not_cached"]
    assert warning["rows_by_shape"] == {"48x32:float32": [1, 8]}

    def unused(kind: str, rows: int, run: object) -> float:
        raise AssertionError("measured again in the same process")

    again = _layers(("native", "onednn"), count=2)  # another engine of this process
    assert kernel_choice.choose([(layer, 8) for layer in again], tmp_path, unused) == chosen
    kernel_choice._unsaved.clear()  # a new process
    quiet = _busy({"native": 1e-3, "onednn": 2e-3}, {"native": 1, "onednn": 1})
    later = _layers(("native", "onednn"), count=2)  # a later start, quieter: measured and kept
    assert kernel_choice.choose([(layer, 8) for layer in later], tmp_path, quiet)[
        "48x32:float32"] == ("native",) * len(BUCKETS)
    assert len(list(tmp_path.glob("kernels-*.json"))) == 1


def _timings(one_row: dict[str, float]) -> dict[str, list[float | None]]:
    return {kind: [t, t, t, t, t] for kind, t in one_row.items()}


@pytest.mark.parametrize(("slower", "kept"), [(0.9, "native"), (1.1, "onednn")])
def test_at_one_row_the_graph_s_kernels_are_kept_where_they_cost_little_more(
        slower: float, kept: str) -> None:
    onednn = 1 / (1 + slower * kernel_choice.GRAPH_MARGIN)  # native this much slower
    timings = {"a": _timings({"native": 1.0, "onednn": onednn}),
               "b": _timings({"int16": 1.0, "torch": 2.0})}  # int16: a quantized layer's
    chosen = {key: fastest(t) for key, t in timings.items()}
    assert chosen["a"] == ("onednn",) * len(BUCKETS)
    kept_choice = kernel_choice.keep_graph_kernels(chosen, timings, {"a": 1, "b": 0})
    assert kept_choice["a"] == (kept,) + ("onednn",) * 4  # only the one-row bucket
    assert kept_choice["b"] == chosen["b"]


def test_the_graph_margin_is_the_model_s_not_each_shape_s() -> None:
    # a small shape 40% slower on native, a large one 2% slower: the model's matmuls 5% slower
    timings = {"small": _timings({"native": 1.4, "onednn": 1.0}),
               "large": _timings({"native": 10.2, "onednn": 10.0})}
    chosen = {key: fastest(t) for key, t in timings.items()}
    kept = kernel_choice.keep_graph_kernels(chosen, timings, {"small": 1, "large": 30})
    assert kept["small"][0] == kept["large"][0] == "native"
    alone = kernel_choice.keep_graph_kernels(chosen, timings, {"small": 30, "large": 1})
    assert alone == chosen


def test_a_shape_the_graph_cannot_run_leaves_the_choice_as_measured() -> None:
    timings = {"a": _timings({"native": 1.05, "onednn": 1.0}),
               "b": _timings({"onednn": 1.0, "plain": 2.0})}
    chosen = {key: fastest(t) for key, t in timings.items()}
    assert kernel_choice.keep_graph_kernels(chosen, timings, {"a": 1, "b": 1}) == chosen


def test_on_a_busy_machine_no_choice_is_cached(tmp_path: Path,
                                               monkeypatch: pytest.MonkeyPatch) -> None:
    from structlog.testing import capture_logs

    # 4 ms slices in every round: the timings agree, only the load tells
    timer = _busy({"native": 1e-3, "onednn": 2e-3}, {"native": 1, "onednn": 1})
    monkeypatch.setattr(kernel_choice, "machine_load", lambda: 1.5)  # 3 runnable on 2 CPUs
    layers = _layers(("native", "onednn"), count=1)
    with capture_logs() as logs:
        assert kernel_choice.choose([(layers[0], 8)], tmp_path, timer) == {
            "48x32:float32": ("native",) * len(BUCKETS)}
    assert not list(tmp_path.glob("kernels-*.json"))
    [warning] = [e for e in logs if e["event"] == "kernel_choice_too_noisy_not_cached"]
    assert warning["rows_by_shape"] == {} and warning["load_per_cpu"] == 1.5


def test_the_load_is_the_machine_s_per_cpu() -> None:
    import os

    assert abs(MACHINE_LOAD() - os.getloadavg()[0] / (os.cpu_count() or 1)) < 0.5


def test_every_bucket_a_decode_step_takes_keeps_the_graph_s_kernels() -> None:
    """The noisy choice that cost a quarter of workload v1: oneDNN a little faster for one shape
    from 8 rows on took every batched decode step off the graph. Up to the batch's most rows the
    graph's kernels stay; above them (prefill chunks only) the fastest."""
    timings = {"down": {"native": [1.0, 1.0, 1.0, 1.0, 1.0], "onednn": [1.1, 0.9, 0.9, 0.9, 0.9]},
               "up": _timings({"native": 1.0, "onednn": 1.5})}
    chosen = {key: fastest(t) for key, t in timings.items()}
    assert chosen["down"] == ("native",) + ("onednn",) * 4
    kept = kernel_choice.keep_graph_kernels(chosen, timings, {"down": 1, "up": 1}, graph_rows=64)
    assert kept["down"] == ("native",) * 3 + ("onednn",) * 2  # 1, 8, 32 rows: decode steps
    assert kept["up"] == chosen["up"]
    assert kernel_choice.keep_graph_kernels(chosen, timings, {"down": 1, "up": 1}) == chosen


@pytest.mark.skipif(native.library() is None, reason="no native build: no decode graph")
def test_the_model_reports_which_decode_steps_the_graph_runs() -> None:
    from tests.engine_fixtures import tiny_model

    model = tiny_model(64, dtype=torch.float32)
    for layer in model.modules():
        if isinstance(layer, Linear):
            layer.set_choice(("native",) * len(BUCKETS))
    model.decode_rows = 64
    assert model.kernel_report()["decode_graph"] == "runs decode steps of 1-64 rows"
    down = next(m for m in model.modules() if isinstance(m, Linear) and m is not model.lm_head)
    down.set_choice(("native",) + ("onednn",) * 4)
    assert model.kernel_report()["decode_graph"] == (
        "off at 8, 32 rows (a layer's kernel it does not run)")
