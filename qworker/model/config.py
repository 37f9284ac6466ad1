"""The architecture hyper-parameters of a Llama-family model, read from a HF config or GGUF."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

SUPPORTED_ARCHITECTURES = ("llama", "mistral", "qwen2")


class UnsupportedModelError(ValueError):
    """The checkpoint describes a model this loader cannot run."""


@dataclass(frozen=True)
class ModelConfig:
    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    max_position_embeddings: int = 2048
    rms_norm_eps: float = 1e-5
    rope_theta: float = 10000.0
    rope_scaling: dict[str, Any] | None = None
    tie_word_embeddings: bool = False
    attention_bias: bool = False
    architecture: str = "llama"
    bos_token_id: int | None = None
    eos_token_ids: tuple[int, ...] = field(default_factory=tuple)

    def __post_init__(self) -> None:
        if self.architecture not in SUPPORTED_ARCHITECTURES:
            raise UnsupportedModelError(
                f"unsupported architecture {self.architecture!r}; "
                f"supported: {', '.join(SUPPORTED_ARCHITECTURES)}"
            )
        if self.num_heads % self.num_kv_heads:
            raise UnsupportedModelError(
                f"num_heads {self.num_heads} is not a multiple of num_kv_heads {self.num_kv_heads}"
            )

    @classmethod
    def from_hf(cls, cfg: dict[str, Any]) -> ModelConfig:
        """Build from a Hugging Face `config.json` dict."""
        model_type = cfg.get("model_type", "llama")
        num_heads = cfg["num_attention_heads"]
        eos = cfg.get("eos_token_id")
        eos_ids = tuple(eos) if isinstance(eos, list) else (() if eos is None else (eos,))
        # transformers >= 5 folds rope_theta and rope_scaling into one `rope_parameters` dict.
        rope = cfg.get("rope_parameters") or cfg.get("rope_scaling") or {}
        scaling = rope if rope.get("rope_type", rope.get("type", "default")) != "default" else None
        return cls(
            vocab_size=cfg["vocab_size"],
            hidden_size=cfg["hidden_size"],
            intermediate_size=cfg["intermediate_size"],
            num_layers=cfg["num_hidden_layers"],
            num_heads=num_heads,
            num_kv_heads=cfg.get("num_key_value_heads") or num_heads,
            head_dim=cfg.get("head_dim") or cfg["hidden_size"] // num_heads,
            max_position_embeddings=cfg.get("max_position_embeddings", 2048),
            rms_norm_eps=cfg.get("rms_norm_eps", 1e-5),
            rope_theta=cfg.get("rope_theta") or rope.get("rope_theta", 10000.0),
            rope_scaling=scaling,
            tie_word_embeddings=cfg.get("tie_word_embeddings", False),
            attention_bias=cfg.get("attention_bias", model_type == "qwen2"),
            architecture=model_type,
            bos_token_id=cfg.get("bos_token_id"),
            eos_token_ids=eos_ids,
        )
