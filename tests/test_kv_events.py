"""KV events, engine side: a consumer that applies the engine's events (as they go on the wire,
JSON) to a set holds, after every step, exactly the blocks the block managers cache; random
workloads of prompts sharing prefixes, with preemption, eviction under a small pool, aborts,
salts and sliding-window groups. The client's hash recipe gives the engine's hashes."""

from __future__ import annotations

import json
import random
import re
from pathlib import Path

from hypothesis import given, settings
from hypothesis import strategies as st

from qworker.engine.block_groups import KVGroup
from qworker.engine.byte_tokenizer import ByteDetokenizer, ByteTokenizer
from qworker.engine.config import EngineConfig
from qworker.engine.core import EngineCore, Vocabulary
from qworker.engine.hash_runner import HashRunner
from qworker.engine.kv_events import AllBlocksCleared, BlockRemoved, BlockStored, KVEvent
from qworker.engine.prefix_cache import block_hash
from qworker.engine.request import Request, SamplingParams
from qworker.engine.simulated import SimulatedEngine
from qworker_client.kv_events import Block, apply, block_hashes


def cached(engine: EngineCore) -> set[Block]:
    """What the engine's block managers cache, as (group, hex hash)."""
    return {(pool.group.group_idx, h.hex()) for pool in engine.blocks.managers if pool.cache
            for h in pool.cache.block_of}


def wire(engine: EngineCore, events: list[KVEvent]) -> list[dict[str, object]]:
    decoded: list[dict[str, object]] = json.loads(json.dumps(
        [event.wire(engine.kv_medium) for event in events]))
    return decoded


def random_engine(rng: random.Random) -> EngineCore:
    """A small pool (so blocks are evicted and sequences preempted), one group or two (a
    full-attention group and a sliding-window one, as Gemma 3), speculation on some."""
    size = rng.choice([2, 4])
    num_blocks = rng.randrange(40, 80) // size
    two_groups = rng.random() < 0.3
    config = EngineConfig(model="sim", block_size=size, num_blocks=num_blocks,
                          max_num_seqs=rng.choice([2, 4]), max_batched_tokens=8,
                          prefill_chunk=rng.choice([3, 6]),
                          num_speculative_tokens=0 if two_groups else rng.choice([0, 0, 3]))
    vocab = Vocabulary(ByteTokenizer(), ByteDetokenizer, ByteTokenizer.eos_token_ids, 1)
    window = rng.choice([3, 5, 8])
    groups = (KVGroup(num_blocks), KVGroup(1 + rng.randrange(-(-(window + 8) // size) + 1, 24),
                                           window)) if two_groups else None
    return EngineCore(config, HashRunner(200), vocab, num_blocks, groups)


def random_requests(rng: random.Random) -> list[Request]:
    bases = [[rng.randrange(32, 127) for _ in range(30)] for _ in range(2)]
    return [Request(f"r{k}", rng.choice(bases)[:rng.randrange(1, 30)]
                    + [rng.randrange(32, 127) for _ in range(rng.randrange(0, 6))],
                    SamplingParams(max_tokens=rng.randrange(1, 25), ignore_eos=True),
                    cache_salt=rng.choice([None, None, "t"]))
            for k in range(rng.randrange(4, 10))]


@settings(max_examples=60, deadline=None)
@given(st.integers(0, 2**32))
def test_a_consumer_of_the_events_holds_what_the_cache_holds_after_every_step(seed: int) -> None:
    rng = random.Random(seed)
    engine = random_engine(rng)
    engine.record_kv_events()
    view: set[Block] = {(9, "stale")}  # the first event clears it
    for r in random_requests(rng):
        engine.add(r)
    stored = removed = 0
    while engine.has_unfinished():
        engine.step()
        events = engine.take_kv_events()
        stored += sum(len(e.block_hashes) for e in events if isinstance(e, BlockStored))
        removed += sum(len(e.block_hashes) for e in events if isinstance(e, BlockRemoved))
        apply(view, wire(engine, events))
        assert view == cached(engine)
        running = [s.request_id for s in engine.scheduler.running]
        if running and rng.random() < 0.05:
            engine.abort(rng.choice(running))
    assert stored - removed == len(view)


def test_a_small_pool_evicts_and_preempts_and_the_events_follow() -> None:
    """The random test's workloads do evict (else it could pass without BlockRemoved)."""
    totals = {"stored": 0, "removed": 0, "preemptions": 0}
    for seed in range(20):
        rng = random.Random(seed)
        engine = random_engine(rng)
        engine.record_kv_events()
        for r in random_requests(rng):
            engine.add(r)
        while engine.has_unfinished():
            engine.step()
            for e in engine.take_kv_events():
                if isinstance(e, BlockStored | BlockRemoved):
                    totals["stored" if isinstance(e, BlockStored) else "removed"] += len(
                        e.block_hashes)
        totals["preemptions"] += engine.num_preemptions
    assert all(totals.values()), totals


def test_stored_events_chain_parents_and_carry_their_tokens() -> None:
    engine = random_engine(random.Random(3))
    engine.record_kv_events()
    size = engine.config.block_size
    prompt = list(range(40, 40 + 5 * size + 1))
    engine.add(Request("a", prompt, SamplingParams(max_tokens=1), cache_salt="s"))
    events: list[KVEvent] = []
    while engine.has_unfinished():
        engine.step()
        events += engine.take_kv_events()
    stored = [e for e in events if isinstance(e, BlockStored) and e.group.group_idx == 0]
    hashes = [h for e in stored for h in e.block_hashes]
    assert [h.hex() for h in hashes] == block_hashes(prompt, size, "s")[:len(hashes)]
    assert len(hashes) == 5
    for e in stored:
        assert len(e.token_ids) == size * len(e.block_hashes)
        first = hashes.index(e.block_hashes[0])
        assert e.parent_block_hash == (hashes[first - 1] if first else None)
        assert e.token_ids == prompt[first * size:(first + len(e.block_hashes)) * size]


@settings(max_examples=50, deadline=None)
@given(st.lists(st.integers(0, 2**40), min_size=0, max_size=20), st.integers(1, 6),
       st.one_of(st.none(), st.text(max_size=8)))
def test_the_clients_recipe_gives_the_engines_hashes(tokens: list[int], size: int,
                                                    salt: str | None) -> None:
    parent = None
    expected = []
    for i in range(len(tokens) // size):
        parent = block_hash(parent, tokens[i * size:(i + 1) * size], salt)
        expected.append(parent.hex())
    assert block_hashes(tokens, size, salt) == expected


def test_an_engine_whose_events_nobody_takes_drops_its_cache_and_says_so() -> None:
    engine = random_engine(random.Random(5))
    engine.record_kv_events(limit=3)
    for r in random_requests(random.Random(6)):
        engine.add(r)
    view: set[Block] = set()
    clears = 0
    while engine.has_unfinished():
        engine.step()
        engine.step()
        events = engine.take_kv_events()  # every other step: past 3 blocks now and then
        clears += sum(1 for e in events if isinstance(e, AllBlocksCleared))
        apply(view, wire(engine, events))
        assert view == cached(engine)
    assert clears > 1  # the first says the engine starts empty; the others, overflows


def test_off_by_default_and_nothing_recorded() -> None:
    engine = random_engine(random.Random(1))
    for r in random_requests(random.Random(2)):
        engine.add(r)
    while engine.has_unfinished():
        engine.step()
    assert engine.kv_events is None and engine.take_kv_events() == []
    assert all(pool.events is None for pool in engine.blocks.managers)


def test_protocol_mds_example_batch_is_what_the_engine_records() -> None:
    """docs/protocol.md, "KV events": its XREAD example's batch, but for `ts`, is the simulated
    engine's after the prompt `Hello, world` in blocks of 4."""
    doc = (Path(__file__).resolve().parents[1] / "docs" / "protocol.md").read_text()
    shown = re.search(r'^\s+10\) "(\{\\"ts\\".*)"$', doc, re.MULTILINE)
    assert shown is not None
    batch = json.loads(shown.group(1).replace('\\"', '"'))
    engine = SimulatedEngine.from_config(EngineConfig(model="sim:step_ms=0,block_size=4"))
    engine.record_kv_events()
    engine.add(Request("a", list(b"Hello, world"), SamplingParams(max_tokens=1)))
    while engine.has_unfinished():
        engine.step()
    assert batch["events"] == wire(engine, engine.take_kv_events())
    assert batch["events"][1]["block_hashes"] == block_hashes(list(b"Hello, world"), 4)
