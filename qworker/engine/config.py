"""Engine settings: model, device, KV cache sizing and scheduling limits."""

from __future__ import annotations

from dataclasses import dataclass, field

SIM_HELP = ("model name, HF folder or .gguf file; `sim` or `sim:step_ms=5,max_model_len=4096,"
            "eos_every=0,token_us=0` selects the built-in simulated engine (no torch: a byte "
            "tokenizer and a deterministic fake model with the real scheduling, for tests and "
            "scale-out benchmarks)")


@dataclass(frozen=True)
class EngineConfig:
    """The engine's settings. The metadata (`help`; `flag`: None for no flag) makes each field a
    `qworker serve` flag (see qworker/commands/config_flags.py); the engine reads none of it."""

    # a name the model hub knows, a HF folder or a .gguf file
    model: str = field(default="smollm2", metadata={"help": SIM_HELP})
    device: str = field(default="cpu", metadata={"help": "engine device",
                                                  "choices": ("cpu", "cuda")})
    # auto: bfloat16 where the CPU has AVX512-BF16/AMX or on CUDA, else float32
    dtype: str = field(default="auto", metadata={"help": "auto | float32 | bfloat16 | float16"})
    # a GGUF's block-quantized matrices: kept in their blocks (native kernels over Q4_0 ... Q6_K),
    # or expanded to bf16 / float32 weights (which then set the dtype)
    weights: str = field(default="auto", metadata={
        "help": "auto (a quantized GGUF on the CPU kept in its blocks unless expanding adds "
                "at most 256 MB and times faster; else --dtype) | quantized | bf16 | float32",
        "choices": ("auto", "quantized", "bf16", "float32")})
    max_num_seqs: int = field(default=64, metadata={"help": "most sequences in a batch"})
    # decode tokens do not count. 512: on the CPU a step of 512 rows already runs the matmuls at
    # full speed (workload v1 the same as at 2048), and smaller steps give first tokens sooner,
    # most where many prompts share a cached prefix, and stall running decodes less
    max_batched_tokens: int = field(default=512, metadata={
        "help": "prefill tokens per step (a GPU may want 2048 or more)"})
    prefill_chunk: int = field(default=512, metadata={
        "help": "prefill tokens per sequence per step"})
    # tokens per KV block. 128 as vLLM's CPU backend: attention reads each block as one contiguous
    # run, and on the development machine long runs made a decode step's attention ~35% faster
    # than 16-token blocks (workload v1: +2% in bfloat16, +5-10% in float32)
    block_size: int = field(default=128, metadata={"help": "tokens per KV block"})
    num_blocks: int | None = field(default=None, metadata={
        "help": "KV cache blocks (default: from --kv-cache-gb)"})
    kv_cache_gb: float = field(default=1.0, metadata={"help": "KV cache size"})
    max_model_len: int | None = field(default=None, metadata={
        "help": "context limit (default: the model's)"})
    # share of blocks kept free at admission, against preemption storms (a tuning of the
    # scheduler, not an operator's setting)
    watermark: float = field(default=0.01, metadata={"flag": None})
    # True: hand preempted requests back instead of re-waiting (a worker always does)
    requeue_preempted: bool = field(default=False, metadata={"flag": None})
    # starvation bound: a request's effective priority improves by one per this many seconds it
    # has waited, not counting the time it ran (see aging.py); 0: no aging, strict priority
    priority_aging_s: float = field(default=60.0, metadata={
        "help": "seconds of waiting that make a request as urgent as one of the next better "
                "priority (bounds starvation; 0: strict priority)"})
    # pace prefill beside decodes so that such a step takes about this many times a decode-only
    # step (keeps inter-token latency even while a long prompt arrives); None: no pacing
    decode_stretch: float | None = field(default=None, metadata={
        "help": "pace prefill so a step with decodes takes about this many times a decode-only "
                "step (even inter-token latency while long prompts arrive; default: off)"})

    # how tool calls are read out of the text (tool_calls.py); auto: from the chat template
    tool_call_parser: str = field(default="auto", metadata={
        "help": "tool-call format: auto (from the chat template) | hermes | llama3_json | "
                "mistral", "choices": ("auto", "hermes", "llama3_json", "mistral")})

    # the CPU engine's threads follow the cores other processes leave it (core_share.py)
    follow_cores: bool = field(default=True, metadata={
        "flag": "--no-follow-cores",
        "help": "keep the thread count fixed, whatever other processes take of the CPUs"})

    # reuse the KV blocks of a prompt prefix already computed (prefix_cache.py)
    prefix_caching: bool = field(default=True, metadata={
        "flag": "--no-prefix-caching",
        "help": "turn off prefix caching (reusing the KV blocks of shared prompt prefixes)"})

    # speculative decoding by prompt lookup (speculation.py): draft tokens verified per decode
    # step; 0: off. Greedy and seeded output are the same tokens either way
    num_speculative_tokens: int = field(default=0, metadata={
        "flag": "--speculate-tokens",
        "help": "speculative decoding: draft up to this many tokens per decode step from the "
                "job's own prompt and output (n-gram lookup), verified in one forward; same "
                "output, faster where answers copy their input (default 0: off)"})
    # the most; within it, where speculation pays is measured as it runs (speculation_gate.py)
    speculate_max_batch: int = field(default=4, metadata={
        "help": "speculate only in steps of at most this many decoding sequences"})
    speculate_measured: bool = field(default=True, metadata={
        "help": "draft only at batch sizes where steps with drafts were measured to make tokens "
                "at least as fast as steps without (off: every small enough step drafts)"})
    speculate_min_acceptance: float = field(default=0.3, metadata={
        "help": "a sequence whose recent share of accepted draft tokens falls below this pauses "
                "speculating (for longer each time)"})

    def __post_init__(self) -> None:
        for name in ("max_num_seqs", "max_batched_tokens", "prefill_chunk", "block_size"):
            if getattr(self, name) < 1:
                raise ValueError(f"{name} must be >= 1")
        if self.num_blocks is not None and self.num_blocks < 1:
            raise ValueError("num_blocks must be >= 1")
        if self.decode_stretch is not None and self.decode_stretch <= 1:
            raise ValueError("decode_stretch must be > 1")
        if not self.priority_aging_s >= 0:
            raise ValueError("priority_aging_s must be >= 0")
        if not 0 <= self.num_speculative_tokens <= 64:
            raise ValueError("num_speculative_tokens must be in 0..64")
        if self.speculate_max_batch < 1:
            raise ValueError("speculate_max_batch must be >= 1")
        if not 0 <= self.speculate_min_acceptance <= 1:
            raise ValueError("speculate_min_acceptance must be in [0, 1]")
        if self.kv_cache_gb <= 0:
            raise ValueError("kv_cache_gb must be > 0")
