"""KV events, service side, on a real Redis: workers with `--kv-events` run jobs that share
prefixes in small pools (blocks evicted, jobs preempted); a consumer that reads
`<prefix>:kv_events` alone (XRANGE) rebuilds each worker's cached blocks, equal to what its
block manager caches; a clean exit says the cache is gone; without the flag nothing is written;
entries lost to a Redis down are written again in order; a refused key ends the events only."""

from __future__ import annotations

import json
import random

import redis

from qworker.engine.request import Request, SamplingParams
from qworker.engine.simulated import SimulatedEngine
from qworker.service.config import ServiceConfig
from qworker.service.kv_events import KVEventPublisher
from qworker.service.logs import get_logger
from qworker_client.kv_events import Block, CachedBlocks, KVEventEntry, block_hashes
from tests.service_harness import KEYS, sim_engine, submit, thread_worker, wait_for, wait_terminal

MODEL = "sim:step_ms=1,block_size=4,num_blocks=40,max_num_seqs=4"


def cached(engine: SimulatedEngine) -> set[Block]:
    return {(pool.group.group_idx, h.hex()) for pool in engine.blocks.managers if pool.cache
            for h in pool.cache.block_of}


def rebuilt(client: redis.Redis) -> CachedBlocks:
    view = CachedBlocks()
    for _, fields in client.xrange(KEYS.kv_events):
        view.apply_entry(fields)
    return view


def jobs(n: int, seed: int = 0) -> dict[str, dict[str, object]]:
    rng = random.Random(seed)
    bases = ["You are a helpful assistant. Answer briefly: ", "Translate into French: ",
             "Summarize the following text in one line: "]
    return {f"job-{k}": {"prompt": rng.choice(bases) + f"question {rng.randrange(100)}",
                         "max_tokens": rng.randrange(4, 20)} for k in range(n)}


def test_a_consumer_rebuilds_each_workers_cached_blocks_from_the_stream(redis_url: str) -> None:
    client = redis.Redis.from_url(redis_url)
    work = jobs(24)
    engines = {"a": sim_engine(MODEL), "b": sim_engine(MODEL)}
    with thread_worker(redis_url, "a", engines["a"], kv_events=True) as a, \
            thread_worker(redis_url, "b", engines["b"], kv_events=True) as b:
        for job_id, fields in work.items():
            submit(client, job_id, **fields)
        wait_terminal(client, work)
        workers = {"a": a.worker, "b": b.worker}
        for name, worker in workers.items():
            wait_for(lambda w=worker, e=engines[name]:  # type: ignore[misc]
                     rebuilt(client).blocks_of(w.token) == cached(e),
                     timeout=10, what=f"worker {name}'s events to match its cache")
        view = rebuilt(client)
        assert all(view.workers[w.token].gaps == 0 for w in workers.values())
        assert sum(e.num_preemptions for e in engines.values()) > 0  # jobs requeued, resumed
        entries = [KVEventEntry.parse(f) for _, f in client.xrange(KEYS.kv_events)]
        kinds = {e["type"] for entry in entries for e in entry.events}
        assert kinds == {"AllBlocksCleared", "BlockStored", "BlockRemoved"}, kinds
        assert {(e.worker, e.model) for e in entries} == {("a", "sim"), ("b", "sim")}
        # a router hashes a prompt as the workers do, and finds who holds its prefix
        prompt = engines["a"].tokenizer.encode(str(work["job-23"]["prompt"]),
                                               add_special_tokens=True)
        first = (0, block_hashes(prompt, 4)[0])
        assert any(first in view.blocks_of(w.token) for w in workers.values())
        assert a.stop() == 0 and b.stop() == 0
    view = rebuilt(client)
    for worker in workers.values():  # a clean exit: its cache is gone with it
        assert view.blocks_of(worker.token) == set()
        last = [KVEventEntry.parse(f) for _, f in client.xrevrange(KEYS.kv_events)
                if f[b"token"].decode() == worker.token][0]
        assert [e["type"] for e in last.events] == ["AllBlocksCleared"]


def test_an_entry_is_plain_strings_a_json_batch_in_vllms_schema(redis_url: str) -> None:
    client = redis.Redis.from_url(redis_url)
    with thread_worker(redis_url, "w", sim_engine(MODEL), kv_events=True,
                       served_model_name="m1") as w:
        submit(client, "j", prompt="x" * 9, max_tokens=2)  # m1 takes model-less jobs too
        wait_terminal(client, ["j"])
        wait_for(lambda: any(b"BlockStored" in f[b"batch"]
                             for _, f in client.xrange(KEYS.kv_events)), timeout=10)
        entry = next(f for _, f in client.xrange(KEYS.kv_events) if b"BlockStored" in f[b"batch"])
        assert set(entry) == {b"worker", b"token", b"model", b"seq", b"batch"}
        assert entry[b"token"].decode() == w.worker.token and entry[b"model"] == b"m1"
        batch = json.loads(entry[b"batch"])
        assert set(batch) == {"ts", "events", "data_parallel_rank"}
        stored = next(e for e in batch["events"] if e["type"] == "BlockStored")
        assert stored["token_ids"] == list(b"x" * 8)  # the byte tokenizer's: two full blocks
        assert stored["block_hashes"] == block_hashes(list(b"x" * 9), 4)
        assert stored["block_size"] == 4 and stored["medium"] == "CPU"
        assert stored["parent_block_hash"] is None and stored["group_idx"] == 0
        assert stored["kv_cache_spec_kind"] == "full_attention" and stored["lora_id"] is None
        assert all(len(h) == 64 for h in stored["block_hashes"])


def test_without_the_flag_no_event_is_written(redis_url: str) -> None:
    client = redis.Redis.from_url(redis_url)
    engine = sim_engine(MODEL)
    with thread_worker(redis_url, "w", engine):
        submit(client, "j", prompt="y" * 30, max_tokens=3)
        wait_terminal(client, ["j"])
    assert not client.exists(KEYS.kv_events) and engine.kv_events is None


class FlakyRedis:
    """XADD that fails `down` times (connection lost) before it writes."""

    def __init__(self, down: int) -> None:
        self.down = down
        self.entries: list[dict[str, str]] = []

    def xadd(self, key: str, fields: dict[str, str], **_: object) -> str:
        if self.down > 0:
            self.down -= 1
            raise redis.exceptions.ConnectionError("down")
        self.entries.append(dict(fields))
        return "0-1"


def publisher(client: object, engine: SimulatedEngine) -> KVEventPublisher:
    config = ServiceConfig(name="w", model="sim", kv_events=True, backoff_min_s=0.001,
                           backoff_max_s=0.002)
    return KVEventPublisher(client, KEYS, config, engine,  # type: ignore[arg-type]
                            "w/tok", get_logger())


def test_entries_lost_to_a_redis_down_are_written_again_in_order() -> None:
    engine, client = sim_engine(MODEL), FlakyRedis(down=5)
    events = publisher(client, engine)
    for k, prompt in enumerate(["abcdefghij", "abcdefgh12", "zzzzzzzzzz"]):
        engine.add(Request(f"r{k}", list(prompt.encode()), SamplingParams(max_tokens=3)))
    while engine.has_unfinished() or events._unsent is not None or events._flight is not None:
        if engine.has_unfinished():
            engine.step()
        events.turn()
    seqs = [int(e["seq"]) for e in client.entries]
    assert seqs == list(range(len(seqs))) and client.down == 0
    view = CachedBlocks()
    for entry in client.entries:
        view.apply_entry(entry)
    assert view.blocks_of("w/tok") == cached(engine) != set()


def test_a_refused_key_ends_the_events_not_the_worker(redis_url: str) -> None:
    client = redis.Redis.from_url(redis_url)
    client.set(KEYS.kv_events, "not a stream")
    engine = sim_engine(MODEL)
    with thread_worker(redis_url, "w", engine, kv_events=True) as w:
        submit(client, "j", prompt="z" * 30, max_tokens=3)
        assert wait_terminal(client, ["j"])["j"].type == "done"
        wait_for(lambda: w.worker.kv_events is not None and w.worker.kv_events.stopped,
                 timeout=10, what="the events to stop")
        assert engine.kv_events is None
        assert w.stop() == 0
    assert client.get(KEYS.kv_events) == b"not a stream"
