"""No weight is held twice: once the kernels are chosen, a linear layer keeps only the packs it
runs, and a tied embedding reads its rows from the LM head's native pack. Results do not move."""

from __future__ import annotations

import torch

from qworker.model.batch import SequenceInput, build_batch
from qworker.model.kernels.linear import Linear
from qworker.model.kv_cache import KVCache
from tests.engine_fixtures import tiny_model
from tests.test_decode_graph import Step, run_schedule

VOCAB = 256
SCHEDULE: list[Step] = [[(0, 10), (1, 10)], [(0, 1), (1, 1)], [(0, 1), (1, 1)]]
SEQUENCES = [list(range(3, 20)), list(range(40, 52))]


def test_released_weights_give_the_same_logits_in_less_memory() -> None:
    model = tiny_model(VOCAB, dtype=torch.float32, seed=3)
    for layer in model.modules():
        if isinstance(layer, Linear):
            layer.set_choice(("native",) * 5)
    want = run_schedule(model, SEQUENCES, SCHEDULE, block_size=4)
    before = model.weight_bytes()
    freed = model.release_weights()
    assert freed > 0 and model.weight_bytes() == before - freed
    assert all(m.released for m in model.modules() if isinstance(m, Linear))
    assert model.embed_tokens.lookup is not None  # tied: rows from the LM head's pack
    assert model.embed_tokens.weight.untyped_storage().nbytes() <= 4  # the stand-in
    got = run_schedule(model, SEQUENCES, SCHEDULE, block_size=4)
    for (_, _, a), (_, _, b) in zip(got, want, strict=True):
        assert torch.equal(a, b)


def test_a_layer_that_may_run_f_linear_keeps_its_weight() -> None:
    model = tiny_model(VOCAB, dtype=torch.float32, seed=4)
    down = model.layers[0].mlp.down_proj
    down.choice = ("plain",) + ("native",) * 4  # F.linear at one bucket (as on CUDA, float64)
    model.lm_head.choice = ("plain",) * 5
    model.release_weights()
    assert not down.released and down.weight.untyped_storage().nbytes() == down.weight.nbytes
    assert not model.lm_head.released and model.embed_tokens.lookup is None
    assert model.layers[1].mlp.down_proj.released  # the default: native, no weight needed


def test_a_released_model_runs_a_step_that_samples_no_row() -> None:
    """A prefill chunk short of its prompt's end samples nothing: the LM head gets zero rows,
    which need no kernel (they once fell through to F.linear and the released weight)."""
    model = tiny_model(VOCAB, dtype=torch.float32, seed=5)
    for layer in model.modules():
        if isinstance(layer, Linear):
            layer.set_choice(("native",) * 5)
    model.release_weights()
    assert model.lm_head.released
    cache = KVCache.allocate(model.config, 8, 4, model.dtype, model.device)
    chunk = SequenceInput(list(range(3, 13)), 0, [0, 1, 2], need_logits=False)
    assert model(build_batch([chunk], 4, model.device), cache).shape == (0, VOCAB)
