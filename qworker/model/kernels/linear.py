"""A linear layer whose weight is repacked, on the CPU, into the layout of the matmul it runs.
A pack is a copy, made on first use and redone whenever the weight changes in place.

The kernels ("kinds") a layer can run:
- "native": the native GEMM of the loaded instruction-set level (`native.gemm`), bfloat16 and
  float32, widths in blocks of 16;
- "amx": the native GEMM on AMX tiles (bfloat16, depth in steps of 32), from the same pack;
- "onednn": oneDNN through torch with the weight prepacked once (`F.linear` reorders it on every
  call: up to 2x slower at decode batch sizes); on AMX CPUs this is oneDNN's AMX path;
- "plain": `F.linear` (CUDA, float64, and what neither of the others takes).
Which one runs for a step of m rows is measured at warm-up (`kernel_choice`); until then, or where
`QWORKER_KERNELS` forces a family, the first of `kernels()`.

Once chosen, `release_weight` drops the original weight where every kind the layer runs reads
only its pack, so no weight is held twice; a stand-in of the same shape and dtype (one element,
broadcast) keeps the layer's description. A released layer runs only the kinds it kept, and
each kind reads its own pack at every row count (none at zero rows: a step that samples no row
gives the LM head none), so every row count a step can have runs on what was kept.
"""

from __future__ import annotations

import functools

import torch
import torch.nn.functional as F
from torch import nn

from qworker.model.kernels import kernel_choice, native

ONEDNN_DTYPES = (torch.float32, torch.bfloat16)
BATCH_HINT = 64  # rows oneDNN tunes its layout for; any row count works


def packing_available() -> bool:
    return torch.backends.mkldnn.is_available() and hasattr(torch.ops.mkldnn, "_linear_pointwise")


@functools.cache
def onednn_packs(dtype: torch.dtype) -> bool:
    """Whether oneDNN prepacks this dtype here (bfloat16 needs AVX512-BW/VL/DQ or AVX-NE-CONVERT;
    on an AVX2-only CPU its reorder raises)."""
    if dtype not in ONEDNN_DTYPES or not packing_available():
        return False
    try:
        torch.ops.mkldnn._reorder_linear_weight(torch.zeros(16, 16, dtype=dtype), BATCH_HINT)
    except RuntimeError:
        return False
    return True


class Linear(nn.Linear):
    _packs: tuple[int, dict[str, torch.Tensor | None]] | None = None  # weight version, packs
    choice: tuple[str, ...] | None = None  # the kind per kernel_choice bucket, once measured
    released: bool = False  # the weight is a stand-in: only the packs are left

    @property
    def input_dtype(self) -> torch.dtype:
        return self.weight.dtype

    @property
    def weight_format(self) -> str:  # as kernel_choice keys a shape
        return str(self.weight.dtype).removeprefix("torch.")

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.run(self.kind_for(x.shape[0]), x)

    def run(self, kind: str, x: torch.Tensor) -> torch.Tensor:
        """x @ W.T + bias by `kind`, which reads only its own pack (or, "plain", the weight),
        whatever the row count: a layer runs every row count on the kinds it kept."""
        if x.shape[0] == 0:  # a step none of whose rows samples (the LM head): nothing to run
            return x.new_empty((0, self.out_features))
        packed = self.packed(kind)
        if kind in native.PACKED_KINDS:
            assert packed is not None
            return native.gemm(x, packed, self.bias, amx=kind == "amx")
        if kind == "onednn":
            return torch.ops.mkldnn._linear_pointwise(x, packed, self.bias, "none", [], "")
        assert kind == "plain", f"no kernel {kind!r}"
        assert not self.released, "a released layer has no weight for F.linear"
        return F.linear(x, self.weight, self.bias)

    def kind_for(self, rows: int) -> str:
        if self.choice is not None:
            return self.choice[kernel_choice.bucket(rows)]
        return self.kernels()[0]

    def kernels(self) -> tuple[str, ...]:
        """The kinds this layer can run here, the unmeasured default first."""
        weight = self.weight
        if weight.device.type != "cpu":
            return ("plain",)
        native_kinds = (("amx", native.amx_serves), ("native", native.gemm_serves))
        gemm_weight = self._gemm_weight(weight)
        kinds = [kind for kind, serves in native_kinds if serves(gemm_weight)]
        if kinds and native.status().forced:  # that family's best kernel, unmeasured
            return (kinds[0],)
        kinds.append("onednn" if onednn_packs(weight.dtype) else "plain")
        return tuple(kinds)

    def set_choice(self, choice: tuple[str, ...]) -> None:
        assert all(kind in self.kernels() for kind in choice), choice
        assert not self.released or set(choice) <= self.kinds_run(), "released: no weight to pack"
        self.choice = choice
        if self._packs is not None:  # packs no bucket runs go
            for kind in set(self._packs[1]) - {_pack_of(kind) for kind in choice}:
                del self._packs[1][kind]

    def kinds_run(self) -> set[str]:
        """The kinds a step may run here: the chosen ones, else the default."""
        return set(self.choice) if self.choice is not None else {self.kernels()[0]}

    def release_weight(self) -> bool:
        """Drops the original weight if every kind this layer runs reads only its pack (made
        now); whether it did. Nothing else may hold the weight (a tied embedding does)."""
        kinds = self.kinds_run()
        if self.released or "plain" in kinds:
            return self.released
        packs = {_pack_of(kind): self.packed(kind) for kind in kinds}
        assert all(pack is not None for pack in packs.values())
        weight = self.weight
        stand_in = torch.zeros((), dtype=weight.dtype, device=weight.device).expand(weight.shape)
        self.weight = nn.Parameter(stand_in, requires_grad=False)
        self._packs = (self.weight._version, packs)
        self.released = True
        return True

    def pack(self) -> tuple[str, torch.Tensor | None]:
        """The unmeasured default kind and its pack."""
        kind = self.kind_for(1) if self.choice is not None else self.kernels()[0]
        return kind, self.packed(kind)

    def packed(self, kind: str) -> torch.Tensor | None:
        kind = _pack_of(kind)
        version = self.weight._version
        if self._packs is None or self._packs[0] != version:
            self._packs = (version, {})
        packs = self._packs[1]
        if kind not in packs:
            packs[kind] = self._make_pack(kind)
        return packs[kind]

    def _make_pack(self, kind: str) -> torch.Tensor | None:
        assert not self.released, f"released: no weight to make a {kind} pack of"
        weight = self.weight.detach()
        if kind == "native":
            return native.gemm_pack(self._gemm_weight(weight))
        if kind == "onednn":
            return torch.ops.mkldnn._reorder_linear_weight(weight, BATCH_HINT)
        return None


    def _gemm_weight(self, weight: torch.Tensor) -> torch.Tensor:
        """The weight as the native GEMM packs it (a subclass may pad it)."""
        return weight


def _pack_of(kind: str) -> str:
    """The kind whose pack `kind` reads (the AMX GEMM reads the native pack)."""
    return "native" if kind == "amx" else kind
