"""The benchmarks' real-shape GGUFs (benchmarks/real_shapes.py): every shape, shrunk to a few
small layers, in every file type, is a file our loader reads both kept in its blocks and expanded,
with llama.cpp's Q4_K_M type mix, and a forward pass gives finite logits."""

from __future__ import annotations

from dataclasses import replace
from pathlib import Path

import pytest
import torch

from benchmarks import real_shapes as rs
from qworker.model.batch import SequenceInput, build_batch
from qworker.model.decoder import load_model
from qworker.model.kv_cache import KVCache
from qworker.model.loading.gguf_file import GGUFFile
from qworker.model.tokenizer.tokenizer import Tokenizer

SMALL = dict(layers=8, vocab=512, hidden=256, inter=512, heads=4, kv_heads=2, head_dim=64)


def logits(path: Path, weights: str) -> torch.Tensor:
    model = load_model(path, dtype=torch.float32, weights=weights)
    cache = KVCache.allocate(model.config, 2, 16, torch.float32, "cpu")
    step = build_batch([SequenceInput(list(range(3, 20)), 0, [0, 1], need_logits=True)], 16)
    with torch.inference_mode():
        return model(step, cache)


@pytest.mark.parametrize("file_type", rs.FILE_TYPES)
@pytest.mark.parametrize("name", sorted(rs.SHAPES))
def test_each_shape_in_each_file_type_loads_and_runs(name: str, file_type: str,
                                                     tmp_path: Path) -> None:
    shape = replace(rs.SHAPES[name], **SMALL)
    path = rs.write(tmp_path / "m.gguf", shape, file_type)
    types = {t.name: t.tensor_type.name for t in GGUFFile(path).tensors}
    assert types == {n: rs.tensor_type(file_type, n, shape).name for n in rs.matrices(shape)} | {
        n: "F32" for n in (*rs.vectors(shape), *rs.routers(shape))}
    if file_type == "Q4_K_M":  # the head, and attn_v / ffn_down of layers 0, 3, 6 and 7 (of 8)
        six = {n for n, t in types.items() if t == "Q6_K"}
        down = "ffn_down_exps" if shape.experts else "ffn_down"
        assert six == {"output.weight" if not shape.tied else "token_embd.weight"} | {
            f"blk.{i}.{m}.weight" for i in (0, 3, 6, 7) for m in ("attn_v", down)}
    assert Tokenizer.load(path).encode("tu") == [3]  # a vocabulary the engine loads
    kept = logits(path, "dense" if file_type == "BF16" else "quantized")
    expanded = logits(path, "dense")
    assert kept.shape == (1, shape.vocab) and torch.isfinite(kept).all()
    # kept blocks multiply int8-quantized activations (as llama.cpp does): near, not equal
    assert ((kept - expanded).norm() / expanded.norm()).item() < 0.01
