"""Our GGUF parser reads what `gguf.GGUFReader` reads (metadata of every value type, tensors of
element and block types), and refuses malformed bytes with a clear error instead of reading past
the end of the file."""

from __future__ import annotations

from pathlib import Path

import gguf
import numpy as np
import pytest

from qworker.model.loading.gguf_checkpoint import open_gguf
from qworker.model.loading.gguf_file import GGUFFile, GGUFFormatError
from qworker.model.loading.tensors import LoaderError


def _write(path: Path) -> Path:
    rng = np.random.default_rng(0)
    writer = gguf.GGUFWriter(path, "llama")
    writer.add_uint8("t.u8", 7)
    writer.add_int8("t.i8", -7)
    writer.add_uint16("t.u16", 65000)
    writer.add_int16("t.i16", -32000)
    writer.add_uint32("t.u32", 4_000_000_000)
    writer.add_int32("t.i32", -2_000_000_000)
    writer.add_uint64("t.u64", 2**63 + 5)
    writer.add_int64("t.i64", -(2**62))
    writer.add_float32("t.f32", 0.1)
    writer.add_float64("t.f64", 0.1)
    writer.add_bool("t.bool", True)
    writer.add_string("t.str", "héllo ▁ world")
    writer.add_array("t.ints", [1, -2, 3])
    writer.add_array("t.floats", [0.5, -1.25])
    writer.add_array("t.strs", ["a", "", "ü▁", "<|im_end|>"])
    writer.add_tensor("f32", rng.standard_normal((3, 5)).astype(np.float32))
    writer.add_tensor("f16", rng.standard_normal((2, 8)).astype(np.float16))
    rows = rng.standard_normal((4, 64)).astype(np.float32)
    for kind in (gguf.GGMLQuantizationType.Q8_0, gguf.GGMLQuantizationType.Q4_0):
        writer.add_tensor(kind.name, gguf.quants.quantize(rows, kind), raw_dtype=kind)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return path


def test_metadata_and_tensors_equal_gguf_s_reader(tmp_path: Path) -> None:
    path = _write(tmp_path / "all.gguf")
    ours, theirs = GGUFFile(path), gguf.GGUFReader(path)
    keys = [k for k in theirs.fields if not k.startswith("GGUF.")]
    assert sorted(ours.metadata) == sorted(keys)
    for key in keys:
        assert ours.get(key) == theirs.fields[key].contents(), key
    assert ours.get("t.strs") == ["a", "", "ü▁", "<|im_end|>"]
    assert ours.get("t.u64") == 2**63 + 5 and ours.get("absent", 3) == 3
    assert [t.name for t in ours.tensors] == [t.name for t in theirs.tensors]
    for mine, ref in zip(ours.tensors, theirs.tensors, strict=True):
        assert (mine.tensor_type, mine.shape, mine.n_elements, mine.n_bytes) == (
            ref.tensor_type, tuple(int(d) for d in ref.shape), ref.n_elements, ref.n_bytes)
        assert mine.data.dtype == ref.data.dtype and mine.data.shape == ref.data.shape
        assert np.array_equal(mine.data, ref.data), mine.name


@pytest.mark.parametrize("cut", [3, 20, 200, -40])
def test_a_truncated_file_is_refused(tmp_path: Path, cut: int) -> None:
    data = _write(tmp_path / "all.gguf").read_bytes()
    bad = tmp_path / "bad.gguf"
    bad.write_bytes(data[:cut])
    with pytest.raises(GGUFFormatError, match="truncated|magic|past the end"):
        GGUFFile(bad)
    with pytest.raises(LoaderError, match="bad.gguf: not a readable GGUF file"):
        open_gguf(bad)


def test_a_huge_array_count_is_refused_before_reading(tmp_path: Path) -> None:
    data = bytearray(_write(tmp_path / "all.gguf").read_bytes())
    at = data.index(b"t.strs") + len(b"t.strs") + 4 + 4  # value type ARRAY, element type STRING
    data[at:at + 8] = (2**62).to_bytes(8, "little")
    bad = tmp_path / "bad.gguf"
    bad.write_bytes(bytes(data))
    with pytest.raises(GGUFFormatError, match="an array of 4611686018427387904 values"):
        GGUFFile(bad)


def test_an_empty_file_and_a_wrong_version_are_refused(tmp_path: Path) -> None:
    empty = tmp_path / "empty.gguf"
    empty.write_bytes(b"")
    with pytest.raises(GGUFFormatError, match="truncated"):
        GGUFFile(empty)
    v1 = tmp_path / "v1.gguf"
    v1.write_bytes(b"GGUF" + (1).to_bytes(4, "little") + bytes(16))
    with pytest.raises(GGUFFormatError, match="GGUF version 1"):
        GGUFFile(v1)
