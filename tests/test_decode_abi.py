"""The ctypes mirrors of the decode graph's C structs have the sizes and field offsets the loaded
native build reports for them, field by field under the same names."""

from __future__ import annotations

import ctypes

import pytest

from qworker.model.kernels import decode_abi, native
from qworker.model.kernels.decode_abi import DecodeDims, DecodeLayer, DecodeProj, layout_mismatches


@pytest.fixture
def lib() -> ctypes.CDLL:
    loaded = native.library()
    assert loaded is not None, native.status().reason
    return loaded


def test_the_mirrors_match_the_native_structs(lib: ctypes.CDLL) -> None:
    assert layout_mismatches(lib) == []


def test_the_library_knows_every_mirrored_field_by_name(lib: ctypes.CDLL) -> None:
    report = lib.qw_decode_abi
    report.argtypes, report.restype = [ctypes.c_char_p], ctypes.c_int64
    assert report(b"Layer") == ctypes.sizeof(DecodeLayer)
    assert report(b"Dims.vocab") == DecodeDims.vocab.offset
    assert report(b"Layer.no_such_field") == -1


class _Swapped(ctypes.Structure):  # qkv and o in each other's place
    _fields_ = [(name, DecodeProj if name in ("qkv", "o", "gate_up", "down") else ctypes.c_void_p)
                for name in ("input_norm", "o", "qkv_bias", "qkv", "post_norm", "gate_up", "down",
                             "k_cache", "v_cache")]


class _Short(ctypes.Structure):  # one field missing: every later offset and the size differ
    _fields_ = [(name, ctypes.c_int64) for name in (
        "hidden", "heads", "kv_heads", "head_dim", "inter", "num_blocks", "block_size", "vocab")]


def test_a_mirror_out_of_step_with_the_c_struct_is_reported(
    lib: ctypes.CDLL, monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.setattr(decode_abi, "MIRRORS", {"Layer": _Swapped, "Dims": _Short})
    wrong = layout_mismatches(lib)
    assert any(w.startswith("Layer.o:") for w in wrong)
    assert any(w.startswith("Layer.qkv:") for w in wrong)
    assert any(w.startswith("Dims:") for w in wrong)
    assert any(w.startswith("Dims.vocab:") for w in wrong)
    assert not any(w.startswith("Layer.qkv_bias") or w.startswith("Dims.inter") for w in wrong)
