"""The decode graph's ABI: ctypes mirrors of the structs `csrc/decoder.cpp` takes, field by field
under the C names, so that Python fills them by name, never by position.

`layout_mismatches` compares them with the layout the loaded build reports (`qw_decode_abi`).
"""

from __future__ import annotations

import ctypes

_P, _I = ctypes.c_void_p, ctypes.c_int64


class DecodeQuantSegment(ctypes.Structure):
    """A run of a quantized weight's rows of one GGUF format, and the kernel that runs it
    (C `QuantSegment`; type: the ggml type id, method: `native.QUANT_METHODS`)."""

    _fields_ = [("blocks", _P), ("type", _I), ("method", _I), ("rows", _I)]


class DecodeProj(ctypes.Structure):
    """One projection's weight (C `Proj`): a `gemm_pack` (pack) and the GEMM that reads it
    (kernel: `GEMM_KERNELS`), or quantized segments (pack null; run in float32, a bf16 step's
    activations converted)."""

    _fields_ = [("pack", _P), ("segments", ctypes.POINTER(DecodeQuantSegment)),
                ("num_segments", _I), ("kernel", _I)]


GEMM_KERNELS = {"native": 0, "amx": 1}  # C kVectorGemm, kAmxGemm


class DecodeExperts(ctypes.Structure):
    """A routed-experts layer's MLP (C `Experts`): the router, and each expert's gate_up and down
    at each token-count bucket up to the step's (bucket b's expert e at b * count + e); edges:
    the buckets' edges (`kernel_choice`), a row count's bucket the number of edges below it;
    router_width: the router's output columns, count or more (`PaddedLinear`'s pack)."""

    _fields_ = [("router", DecodeProj), ("gate_up", ctypes.POINTER(DecodeProj)),
                ("down", ctypes.POINTER(DecodeProj)), ("count", _I), ("top_k", _I),
                ("normalize", _I), ("inter", _I), ("num_buckets", _I), ("router_width", _I),
                ("edges", ctypes.POINTER(ctypes.c_double)), ("num_edges", _I)]


class DecodeLayer(ctypes.Structure):
    """One decoder layer's tensors (C `Layer`); qkv_bias may be null, and q_norm with k_norm;
    attn_out_norm and mlp_out_norm (Gemma's norms of the attention's and the MLP's outputs; then
    post_norm is the MLP input's) null where the model has none, cos / sin (the layer's own RoPE
    tables) null for the step's; experts: a routed-experts layer's (then gate_up and down are
    unused), else null; activation: `ACTIVATIONS`; window: the layer's sliding window,
    0 for none; kv_group: 1 where its blocks are the windowed KV group's, else 0."""

    _fields_ = [
        ("input_norm", _P), ("qkv", DecodeProj), ("qkv_bias", _P), ("q_norm", _P),
        ("k_norm", _P), ("o", DecodeProj),
        ("post_norm", _P), ("gate_up", DecodeProj), ("down", DecodeProj), ("k_cache", _P),
        ("v_cache", _P),
        ("attn_out_norm", _P), ("mlp_out_norm", _P), ("cos", _P), ("sin", _P),
        ("experts", ctypes.POINTER(DecodeExperts)), ("activation", _I), ("window", _I),
        ("kv_group", _I),
    ]


ACTIVATIONS = {"silu": 0, "gelu_tanh": 1}  # C kSilu, kGeluTanh


class DecodeDims(ctypes.Structure):
    """The model's and the step's sizes (C `Dims`); window_num_blocks: the windowed KV group's
    pool, 0 where the model has one group."""

    _fields_ = [
        ("hidden", _I), ("heads", _I), ("kv_heads", _I), ("head_dim", _I), ("inter", _I),
        ("num_blocks", _I), ("block_size", _I), ("max_blocks", _I), ("vocab", _I),
        ("window_num_blocks", _I),
    ]


def field_names(mirror: type[ctypes.Structure]) -> list[str]:
    return [name for name, *_ in mirror._fields_]


MIRRORS: dict[str, type[ctypes.Structure]] = {
    "QuantSegment": DecodeQuantSegment, "Proj": DecodeProj, "Layer": DecodeLayer,
    "Experts": DecodeExperts, "Dims": DecodeDims,
}


def layout_mismatches(lib: ctypes.CDLL) -> list[str]:
    """Every size or field offset where a mirror differs from the library's struct; [] when
    they agree."""
    report = lib.qw_decode_abi
    report.argtypes, report.restype = [ctypes.c_char_p], ctypes.c_int64
    wrong = []
    for c_name, mirror in MIRRORS.items():
        places = {c_name: ctypes.sizeof(mirror)}
        places |= {f"{c_name}.{name}": getattr(mirror, name).offset for name in field_names(mirror)}
        for place, ours in places.items():
            theirs = report(place.encode())
            if theirs != ours:
                wrong.append(f"{place}: {ours} here, {theirs} in the library")
    return wrong
