"""Every kernel family this CPU can run, forced with QWORKER_KERNELS in a process of its own,
computes what the torch path computes: the GEMM, and the real model's teacher-forced logits
(a prefill, then decode steps through the decode graph). A family the CPU cannot run is skipped
with the reason. The installed build loads in a process whose home is unwritable and which has
no compiler."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from qworker.model.kernels import native_build as nb
from tests.model_harness import RUNNABLE_FAMILIES, skip_unless_runnable

ROOT = Path(__file__).resolve().parent.parent

# teacher-forced logits of the real model in float32 and bfloat16, written to argv[1] (a .pt
# file): a 40-token prefill, then 12 single-token decode steps of the same tokens (the graph's path)
PROBE = r"""
import sys, torch
from qworker.model.kernels import native
from qworker.model.loading.hub import resolve_model
from qworker.model.decoder import load_model
from tests.model_harness import run_schedule
tokens = [1, 504, 3458, 282, 4649, 314, 4447, 30, 378, 3458, 282, 4649, 314] * 4
schedule = [[(0, 40)]] + [[(0, 1)] for _ in range(12)]
out = {"level": native.status().level}
for dtype in (torch.float32, torch.bfloat16):
    model = load_model(resolve_model("smollm2"), dtype=dtype)
    rows = run_schedule(model, [tokens], schedule, block_size=16)
    out[str(dtype)] = torch.stack([r[2].float() for r in rows])
torch.save(out, sys.argv[1])
"""


def _probe(family: str, out: Path) -> dict[str, object]:
    env = {**os.environ, "QWORKER_KERNELS": family}
    subprocess.run([sys.executable, "-c", PROBE, str(out)], cwd=ROOT, env=env, check=True,
                   timeout=600)
    return torch.load(out)


@pytest.fixture(scope="module")
def torch_logits(tmp_path_factory: pytest.TempPathFactory) -> dict[str, object]:
    return _probe("torch", tmp_path_factory.mktemp("torch") / "torch.pt")


@pytest.mark.parametrize("family", list(nb.FAMILIES))
def test_each_family_gives_the_torch_paths_logits_on_the_real_model(
        family: str, torch_logits: dict[str, torch.Tensor], tmp_path: Path) -> None:
    skip_unless_runnable(family)
    got = _probe(family, tmp_path / "out.pt")
    assert got["level"] in nb.FAMILIES[family]
    exact = torch_logits[str(torch.float32)]
    f32 = got[str(torch.float32)]
    assert isinstance(f32, torch.Tensor) and f32.shape == exact.shape
    assert (f32 - exact).abs().max() < 2e-3
    # bfloat16 rounds at every layer: the family may be as far from float32 as torch's own
    # bfloat16 path is (+25%), and its greedy picks agree with torch's but at near-ties
    bf16, torch_bf16 = got[str(torch.bfloat16)], torch_logits[str(torch.bfloat16)]
    assert isinstance(bf16, torch.Tensor)
    ours, theirs = (bf16 - exact).abs().mean(), (torch_bf16 - exact).abs().mean()
    assert ours <= 1.25 * theirs, (ours, theirs)
    top2 = exact.topk(2, dim=-1).values
    tie = (top2[:, 0] - top2[:, 1]) < 2 * (bf16 - exact).abs().max(dim=-1).values
    assert bool(((bf16.argmax(-1) == torch_bf16.argmax(-1)) | tie).all())


def test_the_installed_build_runs_without_a_compiler_or_a_writable_home(tmp_path: Path) -> None:
    assert nb.installed_library(nb.runnable_levels()[0]) is not None, (
        "no install-time build for these sources: run `make install`")
    blocker = tmp_path / "not-a-folder"
    blocker.write_text("")
    env = {**os.environ, "QWORKER_HOME": str(blocker / "home"), "CXX": "no-such-compiler",
           "PATH": str(Path(sys.executable).parent), "QWORKER_KERNELS": "auto"}
    code = ("from qworker.model.kernels import native; s = native.status(); "
            "import json; print(json.dumps([s.level, s.origin, s.reason]))")
    done = subprocess.run([sys.executable, "-c", code], cwd=ROOT, env=env, check=True,
                          capture_output=True, text=True, timeout=120)
    level, origin, reason = json.loads(done.stdout.strip().splitlines()[-1])
    assert (level, origin, reason) == (nb.runnable_levels()[0].name, "installed", "")


def test_without_any_build_the_reason_is_reported(tmp_path: Path) -> None:
    blocker = tmp_path / "not-a-folder"
    blocker.write_text("")
    env = {**os.environ, "QWORKER_HOME": str(blocker / "home"), "CXX": "no-such-compiler",
           "PATH": str(Path(sys.executable).parent)}
    code = ("from qworker.model.kernels import native, native_build as nb; "
            "nb.INSTALLED = nb.INSTALLED / 'gone'; "
            "s = native.status(); print(s.level, '|', s.reason)")
    done = subprocess.run([sys.executable, "-c", code], cwd=ROOT, env=env, check=True,
                          capture_output=True, text=True, timeout=120)
    level, _, reason = done.stdout.strip().splitlines()[-1].partition(" | ")
    assert level == "None" and "no C++ compiler" in reason
    assert "native_kernels_missing" in done.stdout + done.stderr  # logged loudly


def test_a_forced_family_the_cpu_cannot_run_says_so(tmp_path: Path) -> None:
    missing = [f for f in nb.FAMILIES if f not in RUNNABLE_FAMILIES]
    if not missing:
        pytest.skip(f"this CPU ({nb.cpu_model()}) runs every native family")
    env = {**os.environ, "QWORKER_KERNELS": missing[0]}
    code = ("from qworker.model.kernels import native; s = native.status(); "
            "print(s.level, '|', s.reason)")
    done = subprocess.run([sys.executable, "-c", code], cwd=ROOT, env=env, check=True,
                          capture_output=True, text=True, timeout=120)
    assert done.stdout.strip() == f"None | this CPU runs no native kernel level of {missing[0]}"
