"""A fleet serving two models (simulated workers `--served-model-name a` / `b`): each model's jobs
run only on its workers, model-less ones on any; requeued (preempted, drained) and reclaimed
work of a model stays with that model's workers."""

from __future__ import annotations

import signal
import time
from collections.abc import Iterator

import pytest
import redis

from qworker.service.config import ServiceConfig
from qworker_client import Producer
from qworker_client.protocol import PARKED_CONSUMER, ErrorEvent
from tests.service_harness import (
    KEYS,
    check_stream,
    expected,
    group_pending,
    sim_engine,
    spy,
    terminal,
    thread_worker,
    wait_for,
    wait_terminal,
)
from tests.worker_process import sim_worker


def live(client: redis.Redis, name: str) -> None:
    wait_for(lambda: client.exists(KEYS.worker(name)), what=f"worker {name} to be live")


@pytest.fixture
def client(redis_url: str) -> Iterator[redis.Redis]:
    c = redis.Redis.from_url(redis_url)
    yield c
    c.close()


@pytest.fixture
def prod(redis_url: str) -> Iterator[Producer]:
    with Producer(redis_url) as p:
        yield p


def submit_all(prod: Producer, prefix: str, model: str | None, n: int = 4,
               max_tokens: int = 6) -> list[str]:
    return [prod.submit(f"{prefix} {k}", model=model, max_tokens=max_tokens, seed=k,
                        id=f"{prefix}{k}").id for k in range(n)]


def test_each_models_jobs_run_only_on_its_workers(redis_url: str, client: redis.Redis,
                                                  prod: Producer) -> None:
    eng_a, eng_b = sim_engine(), sim_engine()
    ran_a, ran_b = spy(eng_a), spy(eng_b)
    with thread_worker(redis_url, "wa", eng_a, served_model_name="a") as wa:
        live(client, "wa")
        for_b = submit_all(prod, "b", "b")
        for_a = submit_all(prod, "a", "a")
        free_1 = submit_all(prod, "n", None)
        wait_terminal(client, for_a + free_1)
        time.sleep(0.5)  # b's jobs stay queued: no worker of b yet
        assert client.xlen(KEYS.jobs_of("b")) == 4 and not any(terminal(client, j)
                                                               for j in for_b)
        with thread_worker(redis_url, "wb", eng_b, served_model_name="b"):
            wait_terminal(client, for_b)
            assert wa.stop() == 0
            free_2 = submit_all(prod, "m", None)  # only b's worker is left: it takes them
            late_a = submit_all(prod, "late", "a", n=2)
            wait_terminal(client, free_2)
            time.sleep(0.5)
            assert not any(terminal(client, j) for j in late_a)
    assert set(for_a + free_1) <= set(ran_a) and set(for_b + free_2) <= set(ran_b)
    assert not set(ran_a) & set(for_b) and not set(ran_b) & set(for_a + late_a)
    for job_id in for_a + for_b + free_1 + free_2:
        check_stream(client, job_id)
    assert client.xlen(KEYS.jobs_of("a")) == 2  # the late ones wait for a worker of a


def test_an_entrys_model_must_fit_its_stream(redis_url: str, client: redis.Redis) -> None:
    """On `qw:jobs` a job names no model (any worker takes it there): naming one is refused
    by every worker alike. On a model's stream the model field may be left out."""
    with thread_worker(redis_url, "wa", sim_engine(), served_model_name="a"):
        client.xadd(KEYS.jobs, {"id": "plain", "prompt": "v1", "max_tokens": "3"})
        client.xadd(KEYS.jobs_of("a"), {"id": "bare", "prompt": "no field", "max_tokens": "3"})
        client.xadd(KEYS.jobs, {"id": "astray", "prompt": "x", "model": "a"})
        client.xadd(KEYS.jobs_of("a"), {"id": "mixed", "prompt": "x", "model": "b"})
        ends = wait_terminal(client, ["plain", "bare", "astray", "mixed"])
    check_stream(client, "plain")
    check_stream(client, "bare")
    for job_id, hint in (("astray", "qw:jobs:{a}"), ("mixed", "qw:jobs:{a}")):
        end = ends[job_id]
        assert isinstance(end, ErrorEvent) and end.code == "invalid_request", end
        assert hint in end.message
    dead = [fields for _, fields in client.xrange(KEYS.dead)]
    assert sorted(f[b"source"].decode() for f in dead) == ["qw:jobs", "qw:jobs:{a}"]
    assert group_pending(client) == 0


def test_a_served_model_name_unfit_for_a_key_is_refused() -> None:
    with pytest.raises(ValueError, match="--served-model-name"):
        ServiceConfig(model="/models/My Model.gguf")
    assert ServiceConfig(model="/models/My Model.gguf", served_model_name="my").served_model == "my"
    assert ServiceConfig(model="sim:step_ms=2").served_model == "sim:step_ms=2"
    assert ServiceConfig().served_model is None  # no name: only model-less jobs


def test_preempted_work_of_a_model_resumes_only_on_its_workers(redis_url: str,
                                                               client: redis.Redis,
                                                               prod: Producer) -> None:
    tiny = sim_engine("sim:step_ms=1", num_blocks=36, block_size=4, max_num_seqs=8)
    other = sim_engine("sim:step_ms=1")
    ran_b = spy(other)
    jobs = {f"p{k}": {"prompt": f"preempt me {k}", "max_tokens": 40, "seed": k, "model": "a"}
            for k in range(10)}
    want = expected(jobs)
    with thread_worker(redis_url, "wa", tiny, served_model_name="a") as wa, \
            thread_worker(redis_url, "wb", other, served_model_name="b"):
        live(client, "wb")
        for job_id, fields in jobs.items():
            prod.submit(id=job_id, **fields)
        wait_terminal(client, jobs)
        requeued = wa.worker.metrics.requeues.labels("preempted")._value.get()
    assert tiny.num_preemptions > 0 and requeued == tiny.num_preemptions
    assert client.xinfo_stream(KEYS.requeue_of("a"))["entries-added"] == requeued
    assert client.xinfo_stream(KEYS.requeue)["entries-added"] == 0  # none went model-less
    assert ran_b == []
    for job_id in jobs:
        done = check_stream(client, job_id)
        assert (done.text, done.finish_reason) == want[job_id], job_id


def test_drained_work_of_a_model_waits_for_a_worker_of_it(redis_url: str, client: redis.Redis,
                                                          prod: Producer) -> None:
    other = sim_engine("sim:step_ms=1")
    ran_b = spy(other)
    second = sim_engine("sim:step_ms=2")
    ran_a2 = spy(second)
    with thread_worker(redis_url, "wb", other, served_model_name="b"):
        with thread_worker(redis_url, "wa1", sim_engine("sim:step_ms=20"),
                           served_model_name="a", drain_timeout=0) as wa1:
            job = prod.submit("drained", model="a", max_tokens=200, seed=3)
            wait_for(lambda: client.xlen(KEYS.out(job.id)) >= 5, what="a few tokens")
            assert wa1.stop() == 0  # drain_timeout 0: requeued at once
        assert client.xlen(KEYS.requeue_of("a")) == 1 and client.xlen(KEYS.requeue) == 0
        time.sleep(0.5)
        assert client.xlen(KEYS.requeue_of("a")) == 1, "the worker of b left it alone"
        with thread_worker(redis_url, "wa2", second, served_model_name="a"):
            done = wait_terminal(client, [job.id])[job.id]
    assert ran_b == [] and ran_a2 == [job.id]
    assert check_stream(client, job.id) == done and done.completion_tokens == 200
    assert group_pending(client) == 0


def test_a_killed_workers_job_is_reclaimed_by_a_worker_of_its_model(
        redis_url: str, client: redis.Redis, prod: Producer) -> None:
    fast = ("--claim-idle-ms", "1000")
    model = "sim:step_ms=20"

    def owner() -> str:
        return (client.hget(KEYS.owner(job.id), "worker") or b"").decode()

    with sim_worker(redis_url, "ka1", "--served-model-name", "a", *fast, model=model) as ka1:
        job = prod.submit("reclaim me", model="a", max_tokens=150, seed=4)
        wait_for(lambda: owner().startswith("ka1/") and client.xlen(KEYS.out(job.id)) >= 5,
                 what="ka1 to run the job")
        with sim_worker(redis_url, "kb", "--served-model-name", "b", *fast, model=model), \
                sim_worker(redis_url, "ka2", "--served-model-name", "a", *fast, model=model):
            ka1.send_signal(signal.SIGKILL)
            ka1.wait(30)
            wait_for(lambda: owner().startswith("ka2/") or terminal(client, job.id),
                     timeout=60, what="ka2 to reclaim the job")
            assert not owner().startswith("kb/")
            wait_terminal(client, [job.id], timeout=90)
            consumers = {c["name"].decode()
                         for c in client.xinfo_consumers(KEYS.jobs_of("a"), "workers")}
    done = check_stream(client, job.id)  # resumed where ka1 stopped: each index once
    assert done.completion_tokens == 150
    # b's worker never read a's stream (`~ready`: the fair read's parked entries, nobody's)
    assert consumers - {PARKED_CONSUMER} <= {"ka1", "ka2"}, consumers
