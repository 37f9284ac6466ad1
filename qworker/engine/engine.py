"""The real engine: the engine core (core.py) over the torch model runner (runner.py)."""

from __future__ import annotations

from collections.abc import Callable, Mapping

import torch

from qworker.engine.block_groups import KVGroup
from qworker.engine.config import EngineConfig
from qworker.engine.core import EngineCore, Vocabulary
from qworker.engine.runner import Runner
from qworker.engine.step_memory import keep_step_buffers
from qworker.engine.validation import max_token_chars
from qworker.model.config import ModelConfig
from qworker.model.decoder import DecoderModel
from qworker.model.kernels.kernel_choice import Timer, one_call
from qworker.model.kv_cache import KVCache, KVLayout, blocks_for_budget, bytes_per_block
from qworker.model.tokenizer.tokenizer import IncrementalDetokenizer, Tokenizer


class Engine(EngineCore):
    runner: Runner

    def __init__(self, model: DecoderModel, tokenizer: Tokenizer, config: EngineConfig,
                 sampling_defaults: Mapping[str, float | int] | None = None) -> None:
        mc = model.config
        groups = kv_groups(mc, config, model.dtype)
        window_blocks = groups[1].num_blocks if len(groups) > 1 else None
        cache = KVCache.allocate(mc, groups[0].num_blocks, config.block_size, model.dtype,
                                 model.device, window_blocks)
        eos_token_ids = tuple(tokenizer.eos_token_ids) or mc.eos_token_ids
        vocab = Vocabulary(tokenizer, lambda: IncrementalDetokenizer(tokenizer), eos_token_ids,
                           max_token_chars(tokenizer))
        super().__init__(config, Runner(model, cache, eos_token_ids, config.follow_cores), vocab,
                         groups[0].num_blocks, groups)
        self.sampling_defaults = dict(sampling_defaults or {})

    def stats(self) -> dict[str, int]:
        """The core's, and the threads a step runs on where they follow the cores."""
        cores = self.runner.cores
        return {**super().stats(), **({"threads": cores.threads} if cores is not None else {})}

    @classmethod
    def from_config(cls, config: EngineConfig,
                    stage: Callable[[str], None] = lambda _name: None) -> Engine:
        """The engine of `config.model`, fetched on first use, loaded and readied; `stage` hears
        each stage as it begins: weights, tokenizer, kernels (the commands show it)."""
        from qworker.model.decoder import load_model
        from qworker.model.dtypes import resolve_dtype
        from qworker.model.home import qworker_home
        from qworker.model.loading.generation import sampling_defaults
        from qworker.model.loading.hub import resolve_model

        stage("weights")
        path = resolve_model(config.model)
        dtype = {"bf16": torch.bfloat16, "float32": torch.float32}.get(
            config.weights, resolve_dtype(config.dtype, config.device))
        model = load_model(path, dtype=dtype, device=config.device, weights=config.weights,
                           cache_dir=qworker_home() / "kernels")
        stage("tokenizer")
        engine = cls(model, Tokenizer.load(path), config, sampling_defaults(path))
        stage("kernels")
        engine.prepare()
        return engine

    def prepare(self) -> None:
        """Readies a loaded engine as a worker runs it: warms up, keeps only the packs the
        chosen kernels run (no weight held twice), then, the weights settled, has the steps'
        buffers reused from step to step (`step_memory`)."""
        self.warm_up()
        self.runner.model.release_weights()
        keep_step_buffers()

    def warm_up(self, step_timer: Timer = one_call) -> None:
        """Chooses each linear layer's matmul by measuring them on this CPU, and where those
        picks take decode steps off the decode graph, which way whole steps run faster (both
        cached in the qworker home; `step_timer` times one step); runs one tiny forward and makes
        one detokenizer (its tables take the tokenizer's JSON apart, 0.15 s for SmolLM2), so no
        request pays for any of them."""
        from qworker.model.home import qworker_home

        config = self.config
        drafts = config.speculate_max_batch * config.num_speculative_tokens  # a verify's rows
        self.runner.model.choose_kernels(config.max_batched_tokens + config.max_num_seqs + drafts,
                                         config.max_num_seqs + drafts, qworker_home() / "kernels",
                                         self.runner.cache, step_timer)
        self.blocks.drop_cache()  # the forward writes block 0
        self.runner.warm_up()
        self._detokenizer()


def kv_groups(mc: ModelConfig, config: EngineConfig, dtype: torch.dtype) -> tuple[KVGroup, ...]:
    """The pool of each KV group of the model (`KVLayout`; a windowed pool has its null block
    besides). One group: `num_blocks`, or as many as `kv_cache_gb` holds. Two: the windowed
    group gets as many blocks as the full one, or (less memory) what `max_num_seqs` windows
    and a step's prefill hold at most, the rest of the budget going to the full group."""
    layout, size = KVLayout.of(mc), config.block_size
    if len(layout.windows) == 1:
        blocks = config.num_blocks or blocks_for_budget(mc, size, dtype, config.kv_cache_gb)
        return (KVGroup(blocks + (layout.windows[0] is not None), layout.windows[0]),)
    window = layout.windows[1]
    assert window is not None
    most = (config.max_num_seqs * (-(-(window - 1) // size) + 2)
            + -(-config.max_batched_tokens // size))
    if config.num_blocks:
        full = config.num_blocks
        windowed = min(full, most)
    else:
        full_bytes, window_bytes = (bytes_per_block(mc, size, dtype, layout.num_layers_of(g))
                                    for g in (0, 1))
        budget = int(config.kv_cache_gb * 2**30)
        full = windowed = max(1, budget // (full_bytes + window_bytes))
        if full > most:
            windowed = most
            full = max(1, (budget - most * window_bytes) // full_bytes)
    return KVGroup(full), KVGroup(windowed + 1, window)
