"""Where the per-matmul kernel choice takes decode steps off the decode graph, whole steps are
weighed both ways and the faster kept; a cached verdict is checked at start and timed again where
it loses. Step times come through the timer seam (the steps themselves run for real), so nothing
here depends on this machine's speed."""

from __future__ import annotations

import json
from collections.abc import Callable
from pathlib import Path

import pytest
import torch

from qworker.model import step_choice
from qworker.model.decoder import DecoderModel
from qworker.model.kernels import kernel_choice
from qworker.model.kernels.kernel_choice import BUCKETS, GRAPH_KINDS
from qworker.model.kernels.linear import Linear
from qworker.model.kv_cache import KVCache
from qworker.model.tokenizer.tokenizer import Tokenizer
from tests.engine_fixtures import tiny_engine, tiny_model

VOCAB = 128  # 16-column blocks: the LM head runs the native GEMM
MAX_ROWS, DECODE_ROWS = 64, 8  # decode buckets 1 and 8
StepTimer = Callable[[str, int, Callable[[], object]], float]


def _model() -> DecoderModel:
    model = tiny_model(VOCAB, dtype=torch.float32, seed=2)
    kinds = model.layers[0].mlp.down_proj.kernels()
    if not {"native", "onednn"} <= set(kinds):
        # float32 has a native GEMM at every ISA level: only a tree without its built kernels
        # (`make kernels`) has nothing to weigh the graph against
        pytest.skip(f"no native GEMM built here, nothing to weigh oneDNN against: {kinds}")
    return model


def _is_down(layer: kernel_choice.Layer) -> bool:
    return layer.in_features == 64  # tiny_model's intermediate size


@pytest.fixture
def noisy_choice(monkeypatch: pytest.MonkeyPatch) -> None:
    """Kernel timings of a noisy moment: oneDNN far the fastest for the down projection at
    every bucket (so the graph margin cannot keep the graph), the native GEMM for the rest; on a
    quiet machine, so the choice is cached."""
    def measure(layer: kernel_choice.Layer, max_rows: int,
                timer: kernel_choice.Timer = kernel_choice.one_call
                ) -> dict[str, list[float | None]]:
        def time(kind: str) -> float:
            if _is_down(layer):
                return 1.0 if kind == "onednn" else 100.0
            return 1.0 if kind in GRAPH_KINDS else 2.0
        return {kind: [time(kind) if rows <= max(max_rows, 1) else None for rows in BUCKETS]
                for kind in layer.kernels()}
    monkeypatch.setattr(kernel_choice, "measure", measure)
    monkeypatch.setattr(kernel_choice, "machine_load", lambda: 0.0)


class FakeSteps:
    """A step timer: runs the step, checks it is the way it is named, and says `seconds[way]`."""

    def __init__(self, model: DecoderModel, graph: float, matmuls: float) -> None:
        self.model = model
        self.seconds = {step_choice.GRAPH: graph, step_choice.MATMULS: matmuls}
        self.calls: list[tuple[str, int]] = []

    def __call__(self, way: str, rows: int, run: Callable[[], object]) -> float:
        on_graph = all(m.kind_for(rows) in GRAPH_KINDS for m in self.model.modules()
                       if isinstance(m, Linear))
        assert on_graph == (way == step_choice.GRAPH), (way, rows)
        run()
        self.calls.append((way, rows))
        return self.seconds[way]


def _start(tmp_path: Path, graph: float, matmuls: float,
           load: float = 0.0) -> tuple[DecoderModel, FakeSteps]:
    """A fresh model readied on the cache in tmp_path, whole steps timed as given."""
    model = _model()
    cache = KVCache.allocate(model.config, 32, 4, model.dtype, model.device)
    steps = FakeSteps(model, graph, matmuls)
    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(kernel_choice, "machine_load", lambda: load)
        model.choose_kernels(MAX_ROWS, DECODE_ROWS, tmp_path, cache, steps)
    return model, steps


def _graph_runs(model: DecoderModel) -> bool:
    return model.kernel_report()["decode_graph"].startswith("runs decode steps of 1-8 rows")


def _cached_winners(tmp_path: Path) -> dict[str, str]:
    [path] = tmp_path.glob("steps-*.json")
    return {rows: entry["winner"] for rows, entry in json.loads(path.read_text()).items()}


def test_a_noisy_cached_choice_that_takes_the_graph_off_is_outweighed_by_whole_steps(
        tmp_path: Path, noisy_choice: None, graph_calls: list[int]) -> None:
    model, steps = _start(tmp_path, graph=1.0, matmuls=1.3)
    assert [kind for kind in model.layers[0].mlp.down_proj.choice or ()][:2] == ["native"] * 2
    assert _graph_runs(model), model.kernel_report()["decode_graph"]
    assert _cached_winners(tmp_path) == {"1": "graph", "8": "graph"}
    assert {rows for _, rows in steps.calls} == {1, 8}
    assert graph_calls, "the graph's way ran the decode graph"
    # the next start reads the cached kernel choice (still noisy) and the cached verdict
    again, checked = _start(tmp_path, graph=1.0, matmuls=1.3)
    assert _graph_runs(again)
    assert len(checked.calls) == 2 * step_choice.CHECK_PAIRS * 2  # two buckets, checked only


def test_where_steps_are_faster_off_the_graph_the_picks_stay_and_the_report_says_why(
        tmp_path: Path, noisy_choice: None) -> None:
    model, _ = _start(tmp_path, graph=1.3, matmuls=1.0)
    report = model.kernel_report()["decode_graph"]
    assert report.startswith("off at 1, 8 rows"), report
    assert "; weighed by whole steps: matmuls at 1 rows (measured: 0.77x" in report
    assert _cached_winners(tmp_path) == {"1": "matmuls", "8": "matmuls"}
    assert model.layers[0].mlp.down_proj.kind_for(8) == "onednn"


def test_a_cached_winner_that_loses_its_check_is_timed_again_and_the_cache_rewritten(
        tmp_path: Path, noisy_choice: None) -> None:
    _start(tmp_path, graph=1.3, matmuls=1.0)  # cached: off the graph
    model, steps = _start(tmp_path, graph=1.0, matmuls=1.2)  # now the graph is 17% faster
    assert _graph_runs(model)
    assert _cached_winners(tmp_path) == {"1": "graph", "8": "graph"}
    per_bucket = 2 * (step_choice.CHECK_PAIRS + step_choice.MEASURE_PAIRS)
    assert len(steps.calls) == 2 * per_bucket
    assert all(v.source == "re-measured" for v in model.step_verdicts.values())


def test_steps_off_the_graph_must_be_clearly_faster_to_be_kept(
        tmp_path: Path, noisy_choice: None) -> None:
    model, _ = _start(tmp_path, graph=1.0, matmuls=0.96)  # 4% faster off it: a tie, the graph
    assert _graph_runs(model)
    assert _cached_winners(tmp_path) == {"1": "graph", "8": "graph"}


def test_a_cached_winner_within_the_check_s_margin_is_kept(
        tmp_path: Path, noisy_choice: None) -> None:
    _start(tmp_path, graph=1.3, matmuls=1.0)
    model, steps = _start(tmp_path, graph=1.0, matmuls=1.05)  # 5%: within noise, kept
    assert not _graph_runs(model)
    assert _cached_winners(tmp_path) == {"1": "matmuls", "8": "matmuls"}
    assert len(steps.calls) == 2 * 2 * step_choice.CHECK_PAIRS
    assert model.step_verdicts[8].describe() == (
        "matmuls at 8 rows (cached, checked: 0.77x the other way's step time, 1.05x at its check)")


def test_on_a_busy_machine_a_verdict_serves_but_is_neither_cached_nor_checked(
        tmp_path: Path, noisy_choice: None) -> None:
    model, _ = _start(tmp_path, graph=1.0, matmuls=1.3, load=4.0)
    assert _graph_runs(model)
    assert not list(tmp_path.glob("steps-*.json"))
    _start(tmp_path, graph=1.3, matmuls=1.0)  # quiet: cached off the graph
    busy, steps = _start(tmp_path, graph=1.0, matmuls=2.0, load=4.0)
    assert not _graph_runs(busy) and not steps.calls
    assert _cached_winners(tmp_path) == {"1": "matmuls", "8": "matmuls"}


def test_steps_the_picks_already_run_on_the_graph_are_not_weighed(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(kernel_choice, "measure", lambda layer, rows, timer=None: {
        kind: [1.0 if kind in GRAPH_KINDS else 2.0] * len(BUCKETS) for kind in layer.kernels()})
    model, steps = _start(tmp_path, graph=1.0, matmuls=1.0)
    assert _graph_runs(model) and not steps.calls and not model.step_verdicts


def test_an_engine_readied_on_a_noisy_cached_choice_runs_its_decode_steps_on_the_graph(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch, noisy_choice: None,
        smollm2_tokenizer: Tokenizer) -> None:
    monkeypatch.setenv("QWORKER_HOME", str(tmp_path))
    engine = tiny_engine(smollm2_tokenizer, _model())
    engine.warm_up(step_timer=lambda way, rows, run: {"graph": 1.0, "matmuls": 1.5}[way])
    report = engine.runner.kernel_report()["decode_graph"]
    assert report == ("runs decode steps of 1-8 rows; weighed by whole steps: graph at 1 rows "
                      "(measured: 0.67x the other way's step time), graph at 8 rows (measured: "
                      "0.67x the other way's step time)")
    assert _cached_winners(tmp_path / "kernels") == {"1": "graph", "8": "graph"}



def test_a_model_of_two_kv_groups_is_weighed_on_both_its_pools(
        monkeypatch: pytest.MonkeyPatch, graph_calls: list[int]) -> None:
    from qworker.model.arch import ARCHITECTURES
    from tests.test_decode_graph import random_model

    monkeypatch.setattr(kernel_choice, "machine_load", lambda: 0.0)
    model = random_model(ARCHITECTURES["gemma3"], torch.float32)
    linears = [m for m in model.modules() if isinstance(m, Linear)]
    if not all({"native", "onednn"} <= set(m.kernels()) for m in linears):
        pytest.skip("no native GEMM built here (`make kernels`), nothing to weigh oneDNN against")
    for layer in linears:
        layer.set_choice(("native",) + ("onednn",) * (len(BUCKETS) - 1))
    model.decode_rows = 8
    cache = KVCache.allocate(model.config, 32, 4, model.dtype, model.device, window_blocks=16)
    assert cache.num_groups == 2
    verdicts = step_choice.weigh(model, cache, None, FakeSteps(model, graph=1.0, matmuls=1.5))
    assert [(rows, v.winner) for rows, v in verdicts.items()] == [(8, "graph")]
    assert 8 in graph_calls and all(m.kind_for(8) == "native" for m in linears)


def test_a_layer_with_no_choice_and_no_graph_kernel_leaves_nothing_to_weigh(
        monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(kernel_choice, "machine_load", lambda: 0.0)
    model = _model()
    for layer in model.modules():
        if isinstance(layer, Linear):
            layer.set_choice(("native",) + ("onednn",) * (len(BUCKETS) - 1))
    model.lm_head.choice = None
    monkeypatch.setattr(model.lm_head, "kernels", lambda: ("onednn",))  # as a 120-word vocabulary
    model.decode_rows = 8
    cache = KVCache.allocate(model.config, 32, 4, model.dtype, model.device)
    steps = FakeSteps(model, graph=1.0, matmuls=2.0)
    assert step_choice.weigh(model, cache, None, steps) == {} and not steps.calls
