"""Sliding windows in the paged cache (block_manager.py, block_groups.py): a Gemma 3 model's
windowed layers hold only the blocks their window sees, with the logits of transformers and of
the all-blocks cache (torch path, native attention, decode graph) and its greedy tokens through
an engine that preempts and shares cached prefixes; the windowed group's blocks stay bounded as a
sequence grows; and on random workloads under preemption, prefix caching and aborts no block
leaks or is freed twice, and every position a query sees holds its own tokens (a ledger runner
that checks the blocks each step reads)."""

from __future__ import annotations

import random
from pathlib import Path

import pytest
import torch
import transformers

from qworker.engine.block_groups import BlockGroups, KVGroup, make_blocks
from qworker.engine.block_manager import NULL_BLOCK, BlockManager
from qworker.engine.byte_tokenizer import ByteDetokenizer, ByteTokenizer
from qworker.engine.config import EngineConfig
from qworker.engine.core import EngineCore, Vocabulary
from qworker.engine.engine import Engine, kv_groups
from qworker.engine.hash_runner import HashRunner
from qworker.engine.request import Request, SamplingParams
from qworker.engine.sequence import Sequence
from qworker.engine.simulated import run_offline
from qworker.engine.text import TextStream
from qworker.model.batch import SequenceInput, build_batch
from qworker.model.config import LayerAttention, ModelConfig
from qworker.model.decoder import DecoderModel, load_model
from qworker.model.kernels import native
from qworker.model.kv_cache import KVCache, KVLayout, blocks_for_budget
from qworker.model.tokenizer.tokenizer import Tokenizer
from tests.model_harness import (
    RUNNABLE_FAMILIES,
    TEST_DEVICE,
    Step,
    greedy,
    kernel_family,
    run_schedule,
)

VOCAB, WINDOW, BLOCK = 128, 8, 4
NEW = 20  # tokens each engine request generates


@pytest.fixture(scope="module")
def gemma3(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """7 layers: 5 local (window 8), the 6th global, a 7th local; random norms."""
    config = transformers.Gemma3TextConfig(
        vocab_size=VOCAB, hidden_size=64, intermediate_size=96, num_hidden_layers=7,
        num_attention_heads=4, num_key_value_heads=2, head_dim=16, max_position_embeddings=512,
        sliding_window=WINDOW)
    torch.manual_seed(3)
    model = transformers.AutoModelForCausalLM.from_config(config)
    with torch.no_grad():
        for name, param in model.named_parameters():
            if "norm" in name:
                param.uniform_(-0.5, 0.5)
            elif "embed" in name:
                param.normal_(0, 1.0)
    path = tmp_path_factory.mktemp("gemma3") / "gemma3"
    model.eval().save_pretrained(path, safe_serialization=True)
    return path


def tokens(n: int, seed: int) -> list[int]:
    rng = random.Random(seed)
    return [rng.randrange(VOCAB) for _ in range(n)]


def sequence(token_ids: list[int], rid: str = "s", salt: str | None = None) -> Sequence:
    return Sequence(rid, token_ids, len(token_ids), SamplingParams(), 0, 0, 0,
                    TextStream(ByteDetokenizer()), cache_salt=salt)


def held(table: list[int]) -> int:
    return sum(1 for block in table if block != NULL_BLOCK)


def test_a_gemma3_layout_has_two_groups_and_others_one(gemma3: Path) -> None:
    config = load_model(gemma3).config
    assert KVLayout.of(config) == KVLayout((1, 1, 1, 1, 1, 0, 1), (None, WINDOW))
    llama = ModelConfig(vocab_size=VOCAB, hidden_size=32, intermediate_size=64, num_layers=2,
                        num_heads=4, num_kv_heads=2, head_dim=8, max_position_embeddings=64)
    assert KVLayout.of(llama) == KVLayout((0, 0), (None,))
    engine = EngineConfig(block_size=16, kv_cache_gb=0.01, max_num_seqs=4)
    # a model without windows: one pool, as many blocks as before
    assert kv_groups(llama, engine, torch.float32) == (
        KVGroup(blocks_for_budget(llama, 16, torch.float32, 0.01)),)
    full, windowed = kv_groups(config, engine, torch.float32)
    # the windowed group: 4 windows of 8 tokens and a step's prefill, in 16-token blocks, and
    # its null block; the memory it does not take goes to the full-attention layer's pool
    assert windowed == KVGroup(4 * 3 + 32 + 1, WINDOW)
    equal_split = blocks_for_budget(config, 16, torch.float32, 0.01)
    assert full.window is None and full.num_blocks > 5 * equal_split
    given = EngineConfig(block_size=4, num_blocks=30, max_num_seqs=4, max_batched_tokens=16)
    assert kv_groups(config, given, torch.float32) == (KVGroup(30), KVGroup(4 * 4 + 4 + 1, 8))


# two sequences: chunked prefills, one starting later, then decodes side by side
SCHEDULE: list[Step] = [[(0, 12)], [(0, 12), (1, 9)], [(0, 6), (1, 12)],
                        *([[(0, 1), (1, 1)]] * 30), *([[(0, 1)]] * 8)]
LENGTHS = [30 + 38, 21 + 30]


@pytest.mark.parametrize("family", RUNNABLE_FAMILIES)
def test_windowed_blocks_give_the_logits_of_transformers_and_of_all_blocks(
        gemma3: Path, family: str, monkeypatch: pytest.MonkeyPatch) -> None:
    seqs = [tokens(n, seed=i) for i, n in enumerate(LENGTHS)]
    hf = transformers.AutoModelForCausalLM.from_pretrained(gemma3, dtype=torch.float32,
                                                           attn_implementation="sdpa")
    with torch.no_grad():
        reference = [hf(torch.tensor([s])).logits[0] for s in seqs]
    graph_windows: list[bool] = []
    real = native.decode_step

    def spy(*args: object) -> torch.Tensor | None:
        graph_windows.append(args[-1] is not None)  # the windowed group's tables
        return real(*args)  # type: ignore[arg-type]

    monkeypatch.setattr(native, "decode_step", spy)
    with kernel_family(family):
        model = load_model(gemma3, dtype=torch.float32, device=TEST_DEVICE)
        all_blocks = run_schedule(model, seqs, SCHEDULE, BLOCK)
        graph_windows.clear()  # those steps had one group
        blocks = make_blocks((KVGroup(64), KVGroup(1 + 16, WINDOW)), BLOCK, False, max_chunk=12)
        assert isinstance(blocks, BlockGroups)
        cache = KVCache.allocate(model.config, 64, BLOCK, model.dtype, model.device,
                                 window_blocks=1 + 16)
        live = [sequence(s, f"s{i}") for i, s in enumerate(seqs)]
        most_held: list[int] = []
        for step, expected in zip(_run(model, cache, blocks, live, SCHEDULE, most_held),
                                  _by_step(all_blocks), strict=True):
            for (i, pos, logits), (j, p, old) in zip(step, expected, strict=True):
                assert (i, pos) == (j, p)
                assert (logits - reference[i][pos]).abs().max() < 1e-4, (family, i, pos)
                assert (logits - old).abs().max() < 1e-5, (family, i, pos)
    # the windowed layers' blocks: while prefilling, a window before a 12-token chunk (20
    # positions over at most 6 blocks); while decoding, the 8 positions of a window (3 blocks),
    # far below the 17 blocks of 68 tokens the full-attention layer holds
    assert max(most_held[:3]) <= 6 and max(most_held[3:]) <= 3
    assert len(live[0].block_table) == 17
    if family != "torch":  # native attention: decode steps run the graph, over both groups
        assert graph_windows and all(graph_windows)


def _run(model: torch.nn.Module, cache: KVCache, blocks: BlockGroups, live: list[Sequence],
         schedule: list[Step], most_held: list[int]
         ) -> list[list[tuple[int, int, torch.Tensor]]]:
    """Each step's (sequence, position, logits); the most blocks a windowed table held in each
    step appended to `most_held`."""
    results = []
    for step in schedule:
        inputs = []
        for i, n in step:
            seq = live[i]
            blocks.grow(seq, seq.num_computed + n)
            inputs.append(SequenceInput(seq.token_ids[seq.num_computed:seq.num_computed + n],
                                        seq.num_computed, seq.block_table,
                                        window_table=seq.window_table))
        most_held.append(max(held(seq.window_table) for seq in live))
        logits = model(build_batch(inputs, BLOCK, TEST_DEVICE), cache).cpu()
        out = []
        for row, (i, n) in enumerate(step):
            live[i].num_computed += n
            out.append((i, live[i].num_computed - 1, logits[row]))
        blocks.check(live)
        results.append(out)
    return results


def _by_step(results: list[tuple[int, int, torch.Tensor]]
             ) -> list[list[tuple[int, int, torch.Tensor]]]:
    steps, k = [], 0
    for step in SCHEDULE:
        steps.append(results[k:k + len(step)])
        k += len(step)
    return steps


def test_greedy_through_an_engine_that_preempts_and_shares_prefixes(
        gemma3: Path, smollm2_tokenizer: Tokenizer) -> None:
    """Four requests sharing 3 windows of prefix, a full-attention pool that holds two of them:
    preempted and recomputed, they start from cached prefixes, and each greedy text is the one
    the all-blocks cache gives it alone."""
    model = load_model(gemma3, dtype=torch.float64, device=TEST_DEVICE)
    engine = Engine(model, smollm2_tokenizer, EngineConfig(
        num_blocks=24, block_size=BLOCK, max_num_seqs=4, max_batched_tokens=16, prefill_chunk=8))
    assert isinstance(engine.blocks, BlockGroups)
    prefix = tokens(3 * WINDOW, seed=7)
    requests = [Request(f"r{k}", prefix + tokens(3 + k, seed=20 + k),
                        SamplingParams(max_tokens=NEW, temperature=0.0, ignore_eos=True))
                for k in range(4)]
    step, most_held = engine.step, 0

    def checked_step() -> list[object]:
        nonlocal most_held
        outputs = step()
        live = list(engine._seqs.values())
        engine.blocks.check(live)
        most_held = max([most_held, *(held(seq.window_table) for seq in live)])
        return outputs  # type: ignore[return-value]

    engine.step = checked_step  # type: ignore[method-assign,assignment]
    results = run_offline(engine, requests)
    for r in requests:
        assert results[r.request_id].token_ids == greedy(model, r.prompt_token_ids, NEW, BLOCK)
    assert engine.num_preemptions > 0
    assert engine.stats()["prefix_cache_hits"] > 0
    assert most_held <= 5  # a window before an 8-token chunk: 15 positions over 5 blocks
    assert engine.blocks.windowed.num_free == engine.blocks.windowed.capacity  # all given back


def test_a_model_windowed_in_every_layer_runs_one_windowed_pool(
        smollm2_tokenizer: Tokenizer) -> None:
    """As Mistral v0.1: one group, windowed; each greedy text as the all-blocks cache gives it."""
    torch.manual_seed(5)
    config = ModelConfig(vocab_size=VOCAB, hidden_size=32, intermediate_size=64, num_layers=2,
                         num_heads=4, num_kv_heads=2, head_dim=8, max_position_embeddings=256,
                         layer_attention=(LayerAttention(WINDOW),) * 2)
    model = DecoderModel(config, dtype=torch.float64, device=TEST_DEVICE)
    with torch.no_grad():
        model.embed_tokens.weight.normal_(0, 1.0)
    engine = Engine(model, smollm2_tokenizer, EngineConfig(
        num_blocks=14, block_size=BLOCK, max_num_seqs=3, max_batched_tokens=16, prefill_chunk=8))
    assert isinstance(engine.blocks, BlockManager) and engine.blocks.window == WINDOW
    assert engine.blocks.capacity == 14 and engine.runner.cache.layer_groups is None
    requests = [Request(f"r{k}", tokens(30 + k, seed=40 + k),
                        SamplingParams(max_tokens=NEW, temperature=0.0, ignore_eos=True))
                for k in range(3)]
    step = engine.step

    def checked_step() -> list[object]:
        outputs = step()
        engine.blocks.check(engine._seqs.values())
        return outputs  # type: ignore[return-value]

    engine.step = checked_step  # type: ignore[method-assign,assignment]
    results = run_offline(engine, requests)
    for r in requests:  # 3 x 52 tokens in 14 blocks of 4: only windows fit
        assert results[r.request_id].token_ids == greedy(model, r.prompt_token_ids, NEW, BLOCK)


class LedgerRunner(HashRunner):
    """The hash runner, keeping a ledger of what each KV slot of each group holds (the token
    prefix it was computed after), and checking before each step that every position each new
    token attends to (all before it in a full group, its window in a windowed one) is in its
    sequence's table and holds that sequence's own prefix there."""

    def __init__(self, block_size: int, windows: tuple[int | None, ...],
                 max_context: int) -> None:
        super().__init__(max_context)
        self.block_size, self.windows = block_size, windows
        self.ledger: list[dict[int, tuple[int, ...]]] = [{} for _ in windows]
        self.checked = 0

    def run(self, work: list[tuple[Sequence, int]]) -> dict[Sequence, int]:
        size = self.block_size
        for seq, n in work:
            for g, table in enumerate(self._tables(seq)):
                for pos in range(seq.num_computed, seq.num_computed + n):
                    block = table[pos // size]
                    assert self.windows[g] is None or block != NULL_BLOCK, "written to null"
                    self.ledger[g][block * size + pos % size] = _key(seq, pos)
        for seq, n in work:
            last = seq.num_computed + n - 1
            for g, table in enumerate(self._tables(seq)):
                window = self.windows[g]
                first = 0 if window is None else max(0, seq.num_computed - window + 1)
                for pos in range(first, last + 1):
                    block = table[pos // size]
                    assert window is None or block != NULL_BLOCK, f"{seq.request_id}: {pos} gone"
                    assert self.ledger[g].get(block * size + pos % size) == _key(seq, pos), \
                        f"{seq.request_id}: group {g} position {pos} holds other tokens"
                    self.checked += 1
        return super().run(work)

    def _tables(self, seq: Sequence) -> list[list[int]]:
        return [seq.block_table, seq.window_table][:len(self.windows)]


def _key(seq: Sequence, pos: int) -> tuple[int, ...]:
    return (hash(seq.cache_salt), *seq.token_ids[:pos + 1])


@pytest.mark.parametrize("seed", range(16))
def test_random_workloads_leak_nothing_and_read_only_their_own_tokens(seed: int) -> None:
    """Two groups (as Gemma 3), or for every fourth seed one windowed group (as Mistral)."""
    rng = random.Random(seed)
    size, window = rng.choice([2, 4]), rng.choice([3, 5, 8])
    chunk = rng.choice([3, 6])
    config = EngineConfig(model="sim", block_size=size, num_blocks=rng.randrange(40, 64) // size,
                          max_num_seqs=rng.choice([2, 4]), max_batched_tokens=8,
                          prefill_chunk=chunk, prefix_caching=rng.random() < 0.8)
    vocab = Vocabulary(ByteTokenizer(), ByteDetokenizer, ByteTokenizer.eos_token_ids, 1)
    full = config.num_blocks or 0
    groups = ((KVGroup(full + 1, window),) if seed % 4 == 3 else
              (KVGroup(full), KVGroup(1 + rng.randrange(-(-(window + 8) // size) + 1, 24),
                                      window)))
    runner = LedgerRunner(size, tuple(g.window for g in groups), 200)
    engine = EngineCore(config, runner, vocab, full, groups)
    assert isinstance(engine.blocks, BlockGroups if len(groups) == 2 else BlockManager)
    bases = [[rng.randrange(32, 127) for _ in range(30)] for _ in range(2)]
    requests = [Request(f"r{k}", rng.choice(bases)[:rng.randrange(1, 30)]
                        + [rng.randrange(32, 127) for _ in range(rng.randrange(0, 6))],
                        SamplingParams(max_tokens=rng.randrange(1, 25), ignore_eos=True),
                        cache_salt=rng.choice([None, None, "t"]))
                for k in range(rng.randrange(4, 9))]
    for r in requests:
        engine.add(r)
    aborted: set[str] = set()
    while engine.has_unfinished():
        for out in engine.step():  # the engine turns a step's exception into a failed request
            assert out.error is None, out.error
            assert not out.preempted, "a preempted request is re-waited, not handed back"
        engine.blocks.check(engine._seqs.values())
        running = [s.request_id for s in engine.scheduler.running]
        if running and rng.random() < 0.05:
            victim = rng.choice(running)
            engine.abort(victim)
            aborted.add(victim)
            engine.blocks.check(engine._seqs.values())
    assert runner.checked > 0
    pools = ([engine.blocks.full, engine.blocks.windowed] if isinstance(engine.blocks, BlockGroups)
             else [engine.blocks])
    for pool in pools:
        assert pool.num_free == pool.capacity, "a block was not given back"
