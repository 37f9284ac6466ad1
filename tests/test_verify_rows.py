"""A speculative draft's rows attended as decodes (`SequenceInput.as_decodes`): the same logits
as the causal chunk they replace, beside other sequences, on block boundaries; and a step of
them is decode-only, so the decode kernels and graph serve it."""

from __future__ import annotations

import pytest
import torch

from qworker.model.batch import SequenceInput, build_batch
from qworker.model.kv_cache import KVCache
from tests.engine_fixtures import tiny_model

BLOCK = 4


def logits_after(prefix: list[int], chunk: list[int], other: list[int], as_decodes: bool,
                 ) -> torch.Tensor:
    """Every row's logits of `chunk` computed after `prefix`, in one step beside `other`'s
    decode (both cached first)."""
    model = tiny_model(64)
    cache = KVCache.allocate(model.config, 32, BLOCK, model.dtype, model.device)
    mine, theirs = list(range(0, 16)), list(range(16, 32))
    model(build_batch([SequenceInput(prefix, 0, mine), SequenceInput(other, 0, theirs)], BLOCK,
                      model.device), cache)
    step = [SequenceInput(other[-1:], len(other), theirs),
            SequenceInput(chunk, len(prefix), mine, all_logits=True, as_decodes=as_decodes)]
    batch = build_batch(step, BLOCK, model.device)
    assert (not batch.prefills) == as_decodes
    return model(batch, cache)[1:]


@pytest.mark.parametrize("cached", [5, 7, 8])  # the rows start mid-block, at its end, at a new one
def test_rows_as_decodes_give_the_chunks_logits(cached: int) -> None:
    prefix = [(7 * i + 3) % 64 for i in range(cached)]
    chunk, other = [11, 12, 13, 14, 15], [(5 * i + 1) % 64 for i in range(9)]
    as_chunk = logits_after(prefix, chunk, other, as_decodes=False)
    as_rows = logits_after(prefix, chunk, other, as_decodes=True)
    assert as_rows.shape == (len(chunk), 64)
    torch.testing.assert_close(as_rows, as_chunk, rtol=0, atol=1e-9)


def test_each_row_attends_to_its_own_length() -> None:
    batch = build_batch([SequenceInput([1, 2, 3], 6, [4, 5, 6], as_decodes=True)], BLOCK)
    (group,) = batch.decodes
    assert group.context_lens.tolist() == [7, 8, 9]
    assert group.block_tables.tolist() == [[4, 5, 0], [4, 5, 0], [4, 5, 6]]  # padded
    assert batch.positions.tolist() == [6, 7, 8]
