"""The service on the real default model (SmolLM2, float64 so greedy texts compare exactly):
producer round trip, kill -9 of a worker mid-run, and preemption through `qw:requeue`."""

from __future__ import annotations

import signal
from pathlib import Path

import pytest
import redis
import torch

from qworker.engine.config import EngineConfig
from qworker.engine.engine import Engine
from qworker.engine.request import SamplingParams
from qworker.model.decoder import DecoderModel, load_model
from qworker.model.tokenizer.tokenizer import Tokenizer
from qworker_client import Producer
from tests.service_harness import (
    KEYS,
    check_stream,
    group_pending,
    owners_by_job,
    spawn_worker,
    stop_process,
    terminal,
    thread_worker,
    wait_for,
    wait_terminal,
)

# float64 costs ~0.3 GFLOP per token on 2 cores: few, short jobs
TOPICS = ["the moon", "bread", "rivers", "chess", "owls", "rain", "clocks", "maps", "salt",
          "bees", "glass", "snow"]


def chat(topic: str) -> list[dict[str, str]]:
    return [{"role": "user", "content": f"Write one sentence about {topic}."}]


@pytest.fixture(scope="module")
def model(smollm2_path: Path) -> DecoderModel:
    return load_model(smollm2_path, dtype=torch.float64)


def engine(model: DecoderModel, tokenizer: Tokenizer, **settings: object) -> Engine:
    defaults: dict[str, object] = dict(requeue_preempted=True, max_num_seqs=8, block_size=16,
                                       num_blocks=512)
    config = EngineConfig(**{**defaults, **settings})  # type: ignore[arg-type]
    return Engine(model, tokenizer, config)


@pytest.fixture(scope="module")
def offline(model: DecoderModel, smollm2_tokenizer: Tokenizer) -> dict[str, list[int]]:
    """What an uninterrupted run gives, once for the module: the offline engine, greedy, no
    Redis, every topic at once, 32 tokens (a shorter job's tokens are a prefix of these)."""
    prompts = [smollm2_tokenizer.encode_chat(chat(t)) for t in TOPICS]
    done = engine(model, smollm2_tokenizer, requeue_preempted=False,
                  max_num_seqs=len(TOPICS)).generate(
        prompts, SamplingParams(max_tokens=32, temperature=0.0))
    return {t: c.token_ids for t, c in zip(TOPICS, done, strict=True)}


def offline_texts(offline: dict[str, list[int]], tokenizer: Tokenizer, topics: list[str],
                  max_tokens: int) -> dict[str, str]:
    """The texts of the first `max_tokens` tokens of the offline run (EOS, if any, is no text)."""
    return {t: tokenizer.decode(offline[t][:max_tokens], skip_special_tokens=True)
            for t in topics}


def test_twelve_producer_jobs_on_one_worker(redis_url: str, model: DecoderModel,
                                            smollm2_tokenizer: Tokenizer,
                                            offline: dict[str, list[int]]) -> None:
    want = offline_texts(offline, smollm2_tokenizer, TOPICS, max_tokens=16)
    client = redis.Redis.from_url(redis_url)
    # 8 slots: the twelve jobs queue beyond them
    with thread_worker(redis_url, "real", engine(model, smollm2_tokenizer)) as w, \
            Producer(redis_url) as producer:
        jobs = {t: producer.submit(messages=chat(t), max_tokens=16, temperature=0)
                for t in TOPICS}
        results = {t: job.result(timeout=300) for t, job in jobs.items()}
        assert w.stop() == 0
    for topic, job in jobs.items():
        done = check_stream(client, job.id)  # indices 0..n-1, joined text == done text
        assert results[topic].text == done.text == want[topic], topic
    assert all(r.text.strip() for r in results.values())
    assert group_pending(client) == 0


def test_kill_9_one_of_two_real_workers(redis_url: str, model: DecoderModel,
                                        smollm2_tokenizer: Tokenizer, smollm2_path: Path,
                                        tmp_path: Path, offline: dict[str, list[int]]) -> None:
    topics = TOPICS[:6]
    want = offline_texts(offline, smollm2_tokenizer, topics, max_tokens=32)
    client = redis.Redis.from_url(redis_url)
    victim = spawn_worker(redis_url, "victim", "--model", str(smollm2_path), "--dtype", "float64",
                          "--max-num-seqs", "4", "--claim-idle-ms", "4000",
                          log_path=tmp_path / "victim.log")
    try:
        wait_for(lambda: client.exists(KEYS.worker("victim")), 120, what="victim worker up")
        with Producer(redis_url) as producer:
            jobs = {t: producer.submit(messages=chat(t), max_tokens=32, temperature=0)
                    for t in topics}
            ids = [job.id for job in jobs.values()]

            def victim_mid_run() -> list[str]:
                owners = owners_by_job(client, ids)
                return [j for j in ids if owners[j].startswith("victim/")
                        and client.xlen(KEYS.out(j)) > 2 and terminal(client, j) is None]

            wait_for(victim_mid_run, 120, what="victim mid-run")
            with thread_worker(redis_url, "survivor", engine(model, smollm2_tokenizer),
                               claim_idle_ms=4000) as survivor:
                victim.send_signal(signal.SIGKILL)
                victim.wait(10)
                wait_terminal(client, ids, timeout=300)
                assert survivor.worker.metrics.reclaimed._value.get() >= 1
                assert survivor.worker.metrics.resumed_tokens._value.get() > 0
                assert survivor.stop() == 0
    finally:
        stop_process(victim)
    for topic, job in jobs.items():
        assert check_stream(client, job.id).text == want[topic], topic
    assert group_pending(client) == 0


def test_tiny_kv_cache_requeues_and_keeps_texts(redis_url: str, model: DecoderModel,
                                                smollm2_tokenizer: Tokenizer,
                                                offline: dict[str, list[int]]) -> None:
    topics = TOPICS[:8]
    want = offline_texts(offline, smollm2_tokenizer, topics, max_tokens=32)
    client = redis.Redis.from_url(redis_url)
    # 20 blocks of 16 tokens: room for about four of these ~70-token sequences at once
    tiny = engine(model, smollm2_tokenizer, num_blocks=20)
    with thread_worker(redis_url, "tiny", tiny) as w, Producer(redis_url) as producer:
        jobs = {t: producer.submit(messages=chat(t), max_tokens=32, temperature=0)
                for t in topics}
        wait_terminal(client, [j.id for j in jobs.values()], timeout=300)
        requeued = w.worker.metrics.requeues.labels("preempted")._value.get()
        assert w.stop() == 0
    assert tiny.num_preemptions > 0 and requeued == tiny.num_preemptions
    assert client.xinfo_stream(KEYS.requeue)["entries-added"] == requeued
    for topic, job in jobs.items():
        assert check_stream(client, job.id).text == want[topic], topic
    assert tiny.blocks.num_free == 20
    assert group_pending(client) == 0
