"""Engine settings: model, device, KV cache sizing and scheduling limits."""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class EngineConfig:
    model: str = "smollm2"  # a name the model hub knows, a HF folder or a .gguf file
    device: str = "cpu"
    dtype: str = "auto"  # auto: bfloat16 where the CPU has AVX512-BF16/AMX or on CUDA, else float32
    max_num_seqs: int = 64
    max_batched_tokens: int = 2048  # prefill tokens per step (decode tokens do not count)
    prefill_chunk: int = 512  # prefill tokens per sequence per step
    # tokens per KV block. 128 as vLLM's CPU backend: attention reads each block as one contiguous
    # run, and on the development machine long runs made a decode step's attention ~35% faster
    # than 16-token blocks (workload v1: +2% in bfloat16, +5-10% in float32)
    block_size: int = 128
    num_blocks: int | None = None  # None: derived from kv_cache_gb
    kv_cache_gb: float = 1.0
    max_model_len: int | None = None  # None: the model's max_position_embeddings
    watermark: float = 0.01  # share of blocks kept free at admission, against preemption storms
    requeue_preempted: bool = False  # True: hand preempted requests back instead of re-waiting
    # pace prefill beside decodes so that such a step takes about this many times a decode-only
    # step (keeps inter-token latency even while a long prompt arrives); None: no pacing
    decode_stretch: float | None = None

    def __post_init__(self) -> None:
        for name in ("max_num_seqs", "max_batched_tokens", "prefill_chunk", "block_size"):
            if getattr(self, name) < 1:
                raise ValueError(f"{name} must be >= 1")
        if self.num_blocks is not None and self.num_blocks < 1:
            raise ValueError("num_blocks must be >= 1")
        if self.decode_stretch is not None and self.decode_stretch <= 1:
            raise ValueError("decode_stretch must be > 1")
        if self.kv_cache_gb <= 0:
            raise ValueError("kv_cache_gb must be > 0")
