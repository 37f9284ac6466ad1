"""Drive our paged model through a schedule of packed steps and compare with reference logits."""

from __future__ import annotations

import os
import random
from collections.abc import Iterator
from contextlib import contextmanager

import pytest
import torch

from qworker.model.batch import SequenceInput, build_batch
from qworker.model.decoder import DecoderModel
from qworker.model.kernels import native
from qworker.model.kernels import native_build as nb
from qworker.model.kv_cache import KVCache

# the suite runs on the CPU; QWORKER_TEST_DEVICE=cuda runs the model and engine tests on a GPU
TEST_DEVICE = os.environ.get("QWORKER_TEST_DEVICE", "cpu")

Step = list[tuple[int, int]]  # (sequence index, number of new tokens) per scheduled sequence
RUNNABLE_LEVELS = {level.name for level in nb.runnable_levels()}
# every kernel family this CPU runs: the torch path, and each native one whose instructions it has
RUNNABLE_FAMILIES = ["torch", *(f for f, levels in nb.FAMILIES.items()
                                if RUNNABLE_LEVELS & set(levels))]


def skip_unless_runnable(family: str) -> None:
    if family not in RUNNABLE_FAMILIES:
        pytest.skip(f"this CPU ({nb.cpu_model()}) lacks the {family} instructions "
                    f"(needs {' or '.join(sorted(nb.FAMILIES[family]))}); absent hardware")


@contextmanager
def kernel_family(family: str) -> Iterator[None]:
    """`QWORKER_KERNELS=family` in this process (the native build chosen anew), then as before.
    Models made inside run that family; make none that outlives the block."""
    saved = os.environ.get("QWORKER_KERNELS")
    os.environ["QWORKER_KERNELS"] = family
    _forget_native()
    try:
        yield
    finally:
        if saved is None:
            os.environ.pop("QWORKER_KERNELS", None)
        else:
            os.environ["QWORKER_KERNELS"] = saved
        _forget_native()


def _forget_native() -> None:
    native._loaded.cache_clear()
    native.amx_ready.cache_clear()


def disjoint_block_tables(
    lengths: list[int], block_size: int, num_blocks: int, rng: random.Random
) -> list[list[int]]:
    """Shuffled, non-contiguous blocks: each sequence gets enough for its whole length."""
    pool = list(range(num_blocks))
    rng.shuffle(pool)
    tables = []
    for length in lengths:
        need = -(-length // block_size)
        tables.append([pool.pop() for _ in range(need)])
    return tables


def run_schedule(
    model: DecoderModel, sequences: list[list[int]], schedule: list[Step], block_size: int,
    seed: int = 0,
) -> list[tuple[int, int, torch.Tensor]]:
    """Returns (sequence, position, logits) for the last new token of every scheduled sequence."""
    rng = random.Random(seed)
    lengths = [len(s) for s in sequences]
    num_blocks = sum(-(-n // block_size) for n in lengths) + 7
    cache = KVCache.allocate(model.config, num_blocks, block_size, model.dtype, model.device)
    tables = disjoint_block_tables(lengths, block_size, num_blocks, rng)
    cached = [0] * len(sequences)
    results = []
    for step in schedule:
        inputs = []
        for seq, n in step:
            tokens = sequences[seq][cached[seq] : cached[seq] + n]
            assert len(tokens) == n, "schedule runs past the end of a sequence"
            inputs.append(SequenceInput(tokens, cached[seq], tables[seq]))
        logits = model(build_batch(inputs, block_size, model.device), cache).cpu()
        for row, (seq, n) in enumerate(step):
            cached[seq] += n
            results.append((seq, cached[seq] - 1, logits[row]))
    return results


def greedy(model: DecoderModel, prompt: list[int], new_tokens: int,
           block_size: int = 4) -> list[int]:
    """The prompt prefilled in one step, then `new_tokens` greedy tokens, each a decode step."""
    total = len(prompt) + new_tokens
    cache = KVCache.allocate(model.config, -(-total // block_size), block_size, model.dtype,
                             model.device)
    table = list(range(cache.num_blocks))
    tokens, step = list(prompt), list(prompt)
    while len(tokens) < total:
        batch = build_batch([SequenceInput(step, len(tokens) - len(step), table)], block_size,
                            model.device)
        step = [int(model(batch, cache)[0].argmax())]
        tokens += step
    return tokens[len(prompt):]
