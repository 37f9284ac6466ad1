"""A checkpoint's own sampling defaults: what a job that sets no temperature, top_p, top_k, min_p
or repetition_penalty samples with (docs/protocol.md, "Sampling defaults").

Read, as vLLM's `--generation-config auto` does, from a Hugging Face folder's
`generation_config.json` (only where it samples: `do_sample` not false), or from a GGUF's
`general.sampling.*` metadata (llama.cpp's keys); a known model whose file says nothing takes
what its model card recommends (hub.py). Whatever is not found falls back to the engine's
documented defaults (`SamplingParams`: vLLM's neutral ones, temperature 1.0, top_p 1.0).
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from qworker.model.loading.hub import known_sampling

# the job fields a model may give a default for: their type, and the range a job's value has
# (protocol.Job's bounds; a lower bound in parentheses is excluded)
MODEL_DEFAULTED: dict[str, tuple[type, float, float, bool]] = {
    "temperature": (float, 0.0, 5.0, True), "top_p": (float, 0.0, 1.0, False),
    "top_k": (int, 0, 1_000_000, True), "min_p": (float, 0.0, 1.0, True),
    "repetition_penalty": (float, 0.0, 10.0, False)}
_HF_KEYS = {name: name for name in MODEL_DEFAULTED}
_GGUF_KEYS = {"temperature": "general.sampling.temp", "top_p": "general.sampling.top_p",
              "top_k": "general.sampling.top_k", "min_p": "general.sampling.min_p",
              "repetition_penalty": "general.sampling.penalty_repeat"}

SamplingDefaults = dict[str, float | int]


def sampling_defaults(path: str | Path) -> SamplingDefaults:
    """The sampling defaults the checkpoint at `path` states (a folder or a `.gguf` file), else
    those of the known model it is; {} when neither says anything. A value out of its field's
    range is left out (the job's own bounds apply to what a model says, too)."""
    path = Path(path)
    found = _from_file(path)
    return found or known_sampling(path)


def _from_file(path: Path) -> SamplingDefaults:
    if path.is_dir() and (path / "config.json").is_file():
        return _hf_defaults(path / "generation_config.json")
    ggufs = [path] if path.is_file() else sorted(path.glob("*.gguf"))
    return _gguf_defaults(ggufs[0]) if len(ggufs) == 1 else {}


def _hf_defaults(file: Path) -> SamplingDefaults:
    try:
        config = json.loads(file.read_text(encoding="utf-8"))
    except (OSError, ValueError):
        return {}
    if not isinstance(config, dict) or config.get("do_sample") is False:
        return {}  # greedy by default there; a job keeps the engine's defaults
    return _checked({name: config.get(key) for name, key in _HF_KEYS.items()})


def _gguf_defaults(file: Path) -> SamplingDefaults:
    from qworker.model.loading.gguf_checkpoint import gguf_value, open_gguf
    from qworker.model.loading.tensors import LoaderError

    try:
        reader = open_gguf(file)
    except LoaderError:
        return {}  # the loader says what is wrong with the file
    values = {name: gguf_value(reader, key) for name, key in _GGUF_KEYS.items()}
    return _checked({name: _float32_digits(v) for name, v in values.items()})


def _float32_digits(value: Any) -> Any:
    """A float32 as the decimal it was written from (0.7, not 0.699999988079071)."""
    return float(f"{value:.7g}") if isinstance(value, float) else value


def _checked(values: dict[str, Any]) -> SamplingDefaults:
    """The values of the right kind and in the range a job's field has (a model's word is
    bounded as a job's is)."""
    out: SamplingDefaults = {}
    for name, value in values.items():
        kind, low, high, low_included = MODEL_DEFAULTED[name]
        if isinstance(value, bool) or not isinstance(value, int | float):
            continue
        if kind is int and value != int(value):
            continue
        above = value >= low if low_included else value > low
        if above and value <= high:
            out[name] = kind(value)
    return out
