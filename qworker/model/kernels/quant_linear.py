"""A linear layer over a weight kept in its GGUF block format (`QuantWeight`). Activations run
in float32 (converted from and back to the model's dtype).

The kernels ("kinds"):
- "int16": the native integer dot on activations quantized per 32-block to 16 bits (d =
  max|x| / 32767), `_mm256_madd_epi16` against the weights widened to 16 bits; Q4_0, Q4_1,
  Q5_0, Q5_1, Q8_0, Q4_K (by its 32-value sub-blocks, each with its 6-bit scale and minimum)
  and Q6_K (values times their 16-value scales). Logits float32's to ~1e-5 of their range;
- "int8": the same on 8-bit activations (llama.cpp's scheme; no K-quant): 5-10% faster at one
  row, but its rounding flips the top token at 1-3% of positions (benchmarks/quant_quality.py),
  so it is never chosen, only run where forced (`run`, `set_choice`), to compare;
- "dequant": native, the weights dequantized to float32, every format (the K-quants too): for
  a few activation rows a weight row at a time (in L1), dotted with each; from 4 rows on, 16
  weight rows at a time into a panel of the float32 GEMM's layout (in L2), which its register
  tiles multiply with every activation row: float32's results, at near its speed for many rows;
- "int16x8", "dequantx8": "int16" and "dequant" on the weight repacked into groups of 8 rows
  (`quant_interleave`; Q4_0, Q4_1, Q5_0, Q8_0, Q4_K, Q6_K whose segments are whole 16-row
  groups): 8 rows' scales side by side, so the scale products and float accumulation are one
  8-wide operation for the 8 rows, and one broadcast activation pair feeds 8 rows'
  `_mm256_madd_epi16`;
- "bf16x8": for a bfloat16 model, on AVX512-BF16 builds: the x8 weight dequantized 16 rows at
  a time into a bfloat16 panel of the dense GEMM's layout, multiplied with the activations
  rounded to bfloat16, in float: the arithmetic of the file expanded to bfloat16, near its
  speed where many rows share each panel, from the blocks (nothing expanded stays resident);
- "int8x8": for a bfloat16 model with Q4_K or Q6_K blocks, on AVX512-VNNI builds: those
  segments' x8 weight against activations quantized per 32-block to 8 bits (llama.cpp's
  scheme), `vpdpbusd` on a panel of the weight's values as bytes (twice bf16x8's multiplies an
  instruction); its other segments as "bf16x8";
- "torch": gguf's reference dequantization of the whole weight, then `F.linear`. Only where no
  native build is loaded: it reads and writes 4 bytes per weight per call and cannot win.
Which native kind runs at each token-count bucket is measured at warm-up (`kernel_choice`); the
x8 kinds are measured on a repacked copy. Where one of them wins a bucket, the weight is repacked
in place of its file layout (one copy only), and every bucket runs the x8 twin of its choice.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from qworker.model.kernels import kernel_choice, native
from qworker.model.kernels.quant_weight import INT8_DOT_TYPES, INT16_DOT_TYPES, QuantWeight

X8_TWINS = {"int16": "int16x8", "dequant": "dequantx8"}  # file layout kind -> its x8 kind


class QuantLinear(nn.Module):
    choice: tuple[str, ...] | None = None
    released = False  # nothing to release: the blocks are the only copy
    float_out = False  # the results in float32, as computed, whatever x's dtype (an LM head's)
    _trial: QuantWeight | None = None  # an x8 copy, only while the kernels are measured

    def __init__(self, weight: QuantWeight, bias: torch.Tensor | None,
                 dtype: torch.dtype = torch.float32) -> None:
        super().__init__()
        self.quant = weight  # a plain attribute: no state_dict entry, untouched by .to()
        self.out_features, self.in_features = weight.shape
        self.model_dtype = dtype  # bfloat16: the bfloat16 panels are as precise as the model
        self.bias = None if bias is None else nn.Parameter(bias, requires_grad=False)

    @property
    def input_dtype(self) -> torch.dtype:
        return torch.float32

    @property
    def weight_format(self) -> str:
        return "+".join(self.quant.type_names)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.run(self.kind_for(x.shape[0]), x)

    def run(self, kind: str, x: torch.Tensor) -> torch.Tensor:
        if x.shape[0] == 0:  # a step none of whose rows samples (the LM head): nothing to run
            return x.new_empty((0, self.out_features))
        dtype = x.dtype
        x = x.float().contiguous()
        weight = self._weight_for(kind)
        if kind == "torch":
            out = F.linear(x, weight.dequantize())
        else:
            out = torch.empty((x.shape[0], self.out_features), dtype=torch.float32)
            row = 0
            for seg in weight.segments:
                done = native.quant_gemm(kind, seg.type_id, x, seg.raw,
                                         out[:, row : row + seg.rows])
                assert done, f"{kind} does not serve {seg.name}"
                row += seg.rows
        if self.bias is not None:
            out += self.bias.float()
        return out if self.float_out else out.to(dtype)

    def kind_for(self, rows: int) -> str:
        if self.choice is not None:
            return self.choice[kernel_choice.bucket(rows)]
        return self.kernels()[0]

    def _weight_for(self, kind: str) -> QuantWeight:
        """The weight in the layout `kind` reads (an x8 kind measured before the choice: a
        repacked copy, kept until set_choice)."""
        if kind == "torch" or kind.endswith("x8") == self.quant.is_x8:
            return self.quant
        assert kind.endswith("x8") and self.quant.x8_serves, f"{kind} on this layout"
        if self._trial is None:
            self._trial = self.quant.to_x8()
        return self._trial

    def kernels(self) -> tuple[str, ...]:
        """The kernels the measured choice picks among (the first where nothing is chosen)."""
        if native.library() is None:
            return ("torch",)
        x8 = (*X8_TWINS.values(), *(("bf16x8",) if self._bf16_panels() else ()),
              *(("int8x8",) if self._int8_panels() else ()))
        if self.quant.is_x8:
            return x8
        base = ("int16", "dequant") if self._integer_dot(INT16_DOT_TYPES) else ("dequant",)
        return (*base, *x8) if self.quant.x8_serves else base

    def _bf16_panels(self) -> bool:
        return self.model_dtype == torch.bfloat16 and native.bf16_panels()

    def _int8_panels(self) -> bool:
        """int8x8 is bf16x8 but for Q4_K and Q6_K: a candidate only where a segment is one."""
        return self._bf16_panels() and bool({"Q4_K", "Q6_K"} & set(self.quant.type_names))

    def runnable(self) -> tuple[str, ...]:
        """kernels() and those that run only where forced (int8)."""
        if self.quant.is_x8 or not self._integer_dot(INT8_DOT_TYPES):
            return self.kernels()
        return (*self.kernels(), "int8")

    def _integer_dot(self, types: frozenset[str]) -> bool:
        return (native.library() is not None and self.in_features % 32 == 0
                and set(self.quant.type_names) <= types)

    def kinds_run(self) -> set[str]:
        return set(self.choice) if self.choice is not None else {self.kernels()[0]}

    def set_choice(self, choice: tuple[str, ...]) -> None:
        """Takes the choice; where an x8 kind is in it, the weight is repacked (once) and every
        bucket runs its kind's x8 twin."""
        if any(kind.endswith("x8") for kind in choice) and not self.quant.is_x8:
            self.quant = self._trial if self._trial is not None else self.quant.to_x8()
        self._trial = None
        if self.quant.is_x8:
            choice = tuple(X8_TWINS.get(kind, kind) for kind in choice)
        assert all(kind in self.runnable() for kind in choice), choice
        self.choice = choice

    def release_weight(self) -> bool:
        return False

    def packed(self, kind: str) -> None:  # the decode graph's question: no native GEMM pack
        return None
