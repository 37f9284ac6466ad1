"""A decoder's hyper-parameters as one checkpoint states them: its family's declaration (`arch/`),
its sizes, and what differs between checkpoints of a family. Read from a HF config or a GGUF's
metadata by `loading/`."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from qworker.model.arch.architecture import Architecture
from qworker.model.arch.llama import LLAMA
from qworker.model.errors import ModelInputError

ACTIVATIONS = ("silu", "gelu_tanh")
ROPE_SCALINGS = ("linear", "llama3", "freq_factors")  # freq_factors: a GGUF's rope_freqs


class UnsupportedModelError(ValueError, ModelInputError):
    """The checkpoint describes a model this loader cannot run."""


@dataclass(frozen=True)
class LayerAttention:
    """How one layer attends, where a model's layers differ."""

    window: int | None = None  # a token sees itself and the window - 1 before it; None: all
    rope_theta: float | None = None  # the layer's own RoPE base, unscaled; None: the model's


@dataclass(frozen=True)
class Experts:
    """Routed experts in place of the MLP (an architecture that declares `experts`)."""

    count: int  # experts in each sparse layer
    per_token: int  # the top k a token is routed to
    intermediate_size: int  # of each expert's gated MLP
    normalize: bool  # the top k's weights rescaled to sum to 1 (HF `norm_topk_prob`)
    dense_layers: frozenset[int] = frozenset()  # layers that keep one MLP of intermediate_size

    def sparse(self, layer: int) -> bool:
        return layer not in self.dense_layers


@dataclass(frozen=True)
class ModelConfig:
    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    arch: Architecture = LLAMA
    max_position_embeddings: int = 2048
    rms_norm_eps: float = 1e-5
    rope_theta: float = 10000.0
    rope_scaling: dict[str, Any] | None = None
    tie_word_embeddings: bool = False
    attention_bias: bool = False
    activation: str = "silu"
    layer_attention: tuple[LayerAttention, ...] = ()  # one per layer; () where all attend alike
    experts: Experts | None = None  # where the architecture routes tokens to experts
    query_pre_attn_scalar: float | None = None  # attention scale 1 / sqrt(it); None: head_dim
    bos_token_id: int | None = None
    eos_token_ids: tuple[int, ...] = field(default_factory=tuple)

    def __post_init__(self) -> None:
        for name in ("vocab_size", "hidden_size", "intermediate_size", "num_layers", "num_heads",
                     "num_kv_heads", "head_dim", "max_position_embeddings"):
            value = getattr(self, name)
            if not isinstance(value, int) or isinstance(value, bool) or value <= 0:
                raise ValueError(f"{name} is {value!r}, not a positive integer")
        if self.head_dim % 2:
            raise UnsupportedModelError(f"an odd head_dim ({self.head_dim}): RoPE rotates pairs")
        if self.num_heads % self.num_kv_heads:
            raise UnsupportedModelError(
                f"num_heads {self.num_heads} is not a multiple of num_kv_heads {self.num_kv_heads}"
            )
        if self.activation not in ACTIVATIONS:
            raise UnsupportedModelError(f"unsupported activation {self.activation!r} "
                                        f"(supported: {', '.join(ACTIVATIONS)})")
        kind = None if self.rope_scaling is None else self.rope_scaling.get(
            "rope_type", self.rope_scaling.get("type"))
        if kind is not None and kind not in ROPE_SCALINGS:
            raise UnsupportedModelError(f"unsupported rope scaling {kind!r} "
                                        f"(supported: {', '.join(ROPE_SCALINGS)})")
        needs = {"linear": ("factor",), "llama3": ("factor", "low_freq_factor",
                                                   "high_freq_factor",
                                                   "original_max_position_embeddings")}
        for key in needs.get(str(kind), ()):
            value = (self.rope_scaling or {}).get(key)
            if not isinstance(value, int | float) or isinstance(value, bool) or value <= 0:
                raise ValueError(f"rope scaling {kind!r}: {key} is {value!r}, "
                                 "not a positive number")
        factors = (self.rope_scaling or {}).get("factors") if kind == "freq_factors" else None
        if factors is not None and (len(factors) != self.head_dim // 2
                                    or not all(f > 0 for f in factors)):
            raise ValueError(f"rope_freqs: {len(factors)} factors for head_dim {self.head_dim}, "
                             "or not all positive")
        scalar = self.query_pre_attn_scalar
        if scalar is not None and (not isinstance(scalar, int | float) or isinstance(scalar, bool)
                                   or not scalar > 0):
            raise ValueError(f"query_pre_attn_scalar is {scalar!r}, not a positive number")
        if any(not isinstance(w, int) or isinstance(w, bool) or w <= 0 for w in self.windows):
            raise ValueError(f"sliding windows {self.windows} are not positive integers")
        self._check_experts()
        if self.layer_attention and len(self.layer_attention) != self.num_layers:
            raise UnsupportedModelError(f"{len(self.layer_attention)} layers' attention for "
                                        f"{self.num_layers} layers")

    def _check_experts(self) -> None:
        e = self.experts
        if (e is not None) != self.arch.experts:
            raise UnsupportedModelError(f"{self.arch.name}: experts "
                                        f"{'given' if e else 'missing'} in the config")
        if e is None:
            return
        for name in ("count", "per_token", "intermediate_size"):
            value = getattr(e, name)
            if not isinstance(value, int) or isinstance(value, bool) or value <= 0:
                raise ValueError(f"experts' {name} is {value!r}, not a positive integer")
        if e.per_token > e.count:
            raise ValueError(f"{e.per_token} experts per token of {e.count}")

    @property
    def windows(self) -> tuple[int, ...]:
        """The sliding windows of the layers that have one."""
        return tuple(a.window for a in self.layer_attention if a.window is not None)

    @property
    def context_length(self) -> int:
        """The positions a sequence may take: the checkpoint's (a windowed layer attends only to
        its window, `paged_attention`)."""
        return self.max_position_embeddings

    @property
    def attention_scale(self) -> float:
        return float(self.query_pre_attn_scalar or self.head_dim) ** -0.5

    def attention_of(self, layer: int) -> LayerAttention:
        """How `layer` attends."""
        return self.layer_attention[layer] if self.layer_attention else LayerAttention()
