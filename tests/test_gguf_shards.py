"""A GGUF split in shards (llama.cpp's gguf-split: `m-00001-of-00003.gguf`) loads by any shard's
name as the one file it was, and a set with a shard missing or out of place is one clear line."""

from __future__ import annotations

from pathlib import Path

import gguf
import pytest
import torch

from qworker.model.batch import SequenceInput, build_batch
from qworker.model.decoder import load_model
from qworker.model.kv_cache import KVCache
from qworker.model.loading.tensors import LoaderError
from qworker.model.tokenizer.tokenizer import Tokenizer
from tests.quant_fixtures import write_tiny_gguf

Q = gguf.GGMLQuantizationType


def logits(path: Path, weights: str) -> torch.Tensor:
    model = load_model(path, weights=weights)
    cache = KVCache.allocate(model.config, 1, 16, torch.float32, "cpu")
    step = build_batch([SequenceInput([5, 9, 1, 33, 60], 0, [0], need_logits=True)], 16)
    with torch.inference_mode():
        return model(step, cache)


@pytest.fixture(scope="module")
def files(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, list[Path]]:
    whole = write_tiny_gguf(tmp_path_factory.mktemp("whole") / "m.gguf", Q.Q8_0, seed=3)
    first = write_tiny_gguf(tmp_path_factory.mktemp("split") / "m.gguf", Q.Q8_0, seed=3,
                            shard_tensors=4)
    return whole, sorted(first.parent.glob("m-*-of-*.gguf"))


@pytest.mark.parametrize("weights", ["quantized", "float32"])
def test_a_split_gguf_loads_by_any_shard_as_the_whole_file(
        files: tuple[Path, list[Path]], weights: str) -> None:
    whole, shards = files
    assert len(shards) == 3 and shards[0].name == "m-00001-of-00003.gguf"
    want = logits(whole, weights)
    for shard in (shards[0], shards[2]):
        assert torch.equal(logits(shard, weights), want)
    assert Tokenizer.load(shards[1]).encode("t5") == Tokenizer.load(whole).encode("t5")


def test_a_missing_or_misplaced_shard_is_one_line(files: tuple[Path, list[Path]],
                                                  tmp_path: Path) -> None:
    _, shards = files
    (tmp_path / shards[0].name).write_bytes(shards[0].read_bytes())
    (tmp_path / shards[2].name).write_bytes(shards[2].read_bytes())
    with pytest.raises(LoaderError, match="missing shard m-00002-of-00003.gguf"):
        load_model(tmp_path / shards[0].name)
    (tmp_path / shards[1].name).write_bytes(shards[2].read_bytes())  # shard 3 in 2's place
    with pytest.raises(LoaderError, match="does not say it is shard 2 of 3"):
        load_model(tmp_path / shards[0].name)
