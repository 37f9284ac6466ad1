"""Redis Cluster: `redis+cluster://` URLs, and workers, producers and the CLI on a real cluster of
our own on loopback (3 masters, one replica each; local_cluster.py).

On a cluster every key of a model's work carries the model's hash tag (`qw:out:{M}:<id>`): each
script touches one slot, a model's traffic lives on the master that serves its slot, and several
models spread over the masters. What a master's crash may lose is what Redis replication loses
(it is asynchronous): the tests make every submit reach the replica first (WAIT), so no job may
vanish; a job in flight ends complete and exact, or with `lost_state` (docs/operating.md).
"""

from __future__ import annotations

import html
import json
import re
import shlex
import subprocess
import sys
import time
from collections.abc import Iterator
from contextlib import ExitStack
from pathlib import Path
from typing import Any

import httpx2
import pytest
import redis
from openai import OpenAI
from redis.crc import key_slot

from qworker.service.config import ServiceConfig
from qworker_client.acl import roles as acl_roles
from qworker_client.client import Producer
from qworker_client.cluster_url import parse_cluster_url
from qworker_client.connect import RedisURLError, checked_url
from qworker_client.local_cluster import LocalCluster, local_cluster
from qworker_client.local_redis import RedisProcess
from qworker_client.protocol import BANDS, LOST_STATE, DoneEvent, ErrorEvent, Keys
from qworker_client.redis_clients import sync_redis
from tests.gateway_harness import gateway
from tests.service_harness import (
    ROOT,
    check_stream,
    events,
    expected,
    spawn_worker,
    stop_process,
    terminal,
    wait_for,
    wait_terminal,
)
from tests.worker_process import sim_worker

SIM = "sim:step_ms=20"
FAST_RECLAIM = ("--claim-idle-ms", "1000")
# refusals a script or a multi-key command on keys of several slots gets (redis-py's, Redis')
CROSS_SLOT = ("CROSSSLOT", "must map to the same key slot", "non local key")


@pytest.fixture(scope="module")
def cluster() -> Iterator[LocalCluster]:
    with local_cluster(masters=3, replicas=1) as running:
        yield running


def worker(cluster: LocalCluster, name: str, model: str, log_path: Path, *args: str) -> Any:
    """`qworker serve --redis-url redis+cluster://...` on the simulated engine, serving `model`."""
    return sim_worker(cluster.url, name, *FAST_RECLAIM, "--served-model-name", model, *args,
                      model=SIM, log_path=log_path, keys=Keys().in_slot(model))


def workers_of(stack: ExitStack, cluster: LocalCluster, models: list[str], stem: str,
               tmp_path: Path) -> list[Path]:
    """A worker for each model, stopped when `stack` closes; their logs."""
    logs = [tmp_path / f"{stem}-{i}.log" for i in range(len(models))]
    for i, model in enumerate(models):
        stack.enter_context(worker(cluster, f"{stem}-w{i}", model, logs[i]))
    return logs


def no_cross_slot(*logs: Path) -> None:
    for log in logs:
        text = log.read_text(errors="replace")
        assert not any(refusal in text for refusal in CROSS_SLOT), log


def test_a_cluster_url_names_its_nodes_and_their_settings() -> None:
    target = parse_cluster_url("rediss+cluster://app:s3cret@10.0.0.1:7000,10.0.0.2,[::1]:7001"
                               "?ssl_cert_reqs=none")
    assert target.nodes == (("10.0.0.1", 7000), ("10.0.0.2", 6379), ("::1", 7001))
    assert {k: target.node_kwargs[k] for k in ("username", "password", "ssl", "ssl_cert_reqs")} \
        == {"username": "app", "password": "s3cret", "ssl": True, "ssl_cert_reqs": "none"}


@pytest.mark.parametrize(("url", "why"), [
    ("redis+cluster://", "no cluster node address"),
    ("redis+cluster://h:port", "is not host[:port]"),
    ("redis+cluster://h:70000", "out of range"),
    ("redis+cluster://h:7000/3", "only database 0"),
])
def test_a_malformed_cluster_url_is_refused_saying_why(url: str, why: str) -> None:
    with pytest.raises(RedisURLError) as raised:
        checked_url(url)
    assert why in str(raised.value) and "\n" not in str(raised.value)


def test_every_key_of_a_models_slot_hashes_to_that_slot() -> None:
    keys, model = Keys("qw").in_slot("llama-3:8b"), "llama-3:8b"
    slot = key_slot(b"qw:jobs:{llama-3:8b}")
    names = [keys.out("j1"), keys.cancel("j1"), keys.submitted("j1"), keys.owner("j1"),
             keys.worker("w/1"), keys.alone("t/1"), keys.lease("t/1"), keys.takeovers,
             keys.tenants, keys.tpm(123), keys.running, keys.dead, keys.offers, keys.readers,
             keys.delayed_of(model), keys.delayed_jobs_of(model)]
    for stream in keys.streams_for(model):
        names.append(stream)
        if not keys.is_requeue(stream):
            names += [keys.ready_of(stream), keys.vtime_of(stream), keys.held_of(stream)]
        names += [keys.affinity_of(stream), keys.affinity_seen_of(stream)]
    assert {name: key_slot(name.encode()) for name in names} == {name: slot for name in names}
    assert len(keys.streams_for(model)) == 2 * len(BANDS)  # no model-less streams
    assert keys.out("j1") == "qw:out:{llama-3:8b}:j1" and Keys("qw").out("j1") == "qw:out:j1"
    assert keys.worker_name(keys.worker("w/1")) == "w/1"


def test_a_worker_on_a_cluster_must_serve_a_named_model() -> None:
    with pytest.raises(ValueError, match="serves a named model"):
        ServiceConfig(redis_url="redis+cluster://127.0.0.1:7000")
    assert ServiceConfig(redis_url="redis+cluster://127.0.0.1:7000", model="m").keys.slot == "m"


def test_a_model_less_job_is_refused_before_anything_is_sent(cluster: LocalCluster) -> None:
    with Producer(cluster.url) as producer:
        with pytest.raises(ValueError, match="every job names its model"):
            producer.submit_many([{"prompt": "m", "model": "m-x"}, {"prompt": "no model"}])
        assert not any(producer.redis.scan_iter(match="qw:jobs*"))


def test_workers_of_three_models_run_on_three_masters(cluster: LocalCluster,
                                                      tmp_path: Path) -> None:
    models = cluster.models_on_each_master("spread")
    jobs = {f"spread-{m}-{k}": {"prompt": f"job {k} of {m}", "max_tokens": 12, "seed": k,
                                "model": m} for m in models for k in range(4)}
    with ExitStack() as stack:
        logs = workers_of(stack, cluster, models, "spread", tmp_path)
        producer = stack.enter_context(Producer(cluster.url))
        handles = producer.submit_many([{"id": job_id, **fields}
                                        for job_id, fields in jobs.items()])
        texts = {h.id: (r.text, r.finish_reason)
                 for h in handles for r in [h.result(timeout=60)]}
        for model in models:  # each model's outputs live on the master of its slot
            master = cluster.master_of(Keys().jobs_of(model))
            with redis.Redis(port=master.port, socket_timeout=5) as node:
                assert node.exists(Keys().in_slot(model).out(f"spread-{model}-0")) == 1
    assert texts == expected(jobs)
    no_cross_slot(*logs)


def test_every_script_runs_on_a_cluster(cluster: LocalCluster, tmp_path: Path) -> None:
    """Fair share with tenants, a session's affinity, a delayed job, priorities, a cancel, a dead
    letter, a drain that requeues: each a script of the worker's, none refused as cross-slot."""
    model = "scripts"
    keys = Keys().in_slot(model)
    logs = [tmp_path / "a.log", tmp_path / "b.log"]
    client = sync_redis(cluster.url, socket_timeout=5)
    jobs = {f"scr-{k}": {"prompt": f"script {k}", "max_tokens": 60, "seed": k, "model": model,
                         "tenant": f"t{k % 3}", "session": f"s{k % 2}",
                         "priority": (k % 3) - 1} for k in range(9)}
    jobs["scr-later"] = {"prompt": "later", "max_tokens": 5, "model": model,
                         "not_before_ms": int(time.time() * 1000) + 1500}
    client.hset(keys.tenants, "t0", "3 0 0")
    with Producer(cluster.url) as producer:
        with worker(cluster, "scr-a", model, logs[0], "--drain-timeout", "0") as first:
            handles = producer.submit_many([{"id": k, **v} for k, v in jobs.items()])
            producer.submit(id="scr-cancel", prompt="cancel me", max_tokens=500, model=model)
            client.xadd(keys.jobs_of(model), {"id": "scr-bad", "max_tokens": "many"})
            wait_for(lambda: len(events(client, "scr-0", keys)) >= 3, what="tokens")
            assert producer.cancel("scr-cancel", model=model)
            stop_process(first, sig=15)  # SIGTERM, no drain time: what runs is requeued
        with worker(cluster, "scr-b", model, logs[1]):
            ends = wait_terminal(client, [*jobs, "scr-cancel", "scr-bad"], keys=keys)
            texts = {h.id: (r.text, r.finish_reason)
                     for h in handles for r in [h.result(timeout=60)]}
    assert texts == expected(jobs)
    assert isinstance(ends["scr-cancel"], DoneEvent)
    assert ends["scr-cancel"].finish_reason == "cancelled"
    assert isinstance(ends["scr-bad"], ErrorEvent) and client.xlen(keys.dead) == 1
    first_log = logs[0].read_text()
    assert '"requeued at shutdown"' in first_log and '"delayed"' in first_log
    for job_id in jobs:
        check_stream(client, job_id, keys)
    client.close()
    no_cross_slot(*logs)


def test_a_killed_workers_jobs_are_reclaimed_on_a_cluster(cluster: LocalCluster,
                                                          tmp_path: Path) -> None:
    model = "chaos"
    keys = Keys().in_slot(model)
    jobs = {f"chaos-{k}": {"prompt": f"chaos {k}", "max_tokens": 80, "seed": k, "model": model}
            for k in range(6)}
    logs = [tmp_path / "a.log", tmp_path / "b.log"]
    client = sync_redis(cluster.url, socket_timeout=5)
    with worker(cluster, "chaos-a", model, logs[0]) as doomed, Producer(cluster.url) as producer:
        producer.submit_many([{"id": k, **v} for k, v in jobs.items()])
        wait_for(lambda: len(events(client, "chaos-0", keys)) >= 10, what="tokens")
        stop_process(doomed)  # SIGKILL
        with worker(cluster, "chaos-b", model, logs[1]):
            wait_terminal(client, jobs, keys=keys)
    done = {k: check_stream(client, k, keys) for k in jobs}
    assert {k: (d.text, d.finish_reason) for k, d in done.items()} == expected(jobs)
    client.close()
    no_cross_slot(*logs)


def test_a_worker_and_the_gateway_follow_a_masters_failover(tmp_path: Path) -> None:
    model = "failover"
    keys = Keys().in_slot(model)
    with local_cluster(masters=3, replicas=1) as cluster:
        master = cluster.master_of(keys.jobs_of(model))
        jobs = {f"pre-{k}": {"prompt": f"before {k}", "max_tokens": 150, "seed": k,
                             "model": model} for k in range(4)}
        log = tmp_path / "w.log"
        with worker(cluster, "fo-w", model, log) as proc, Producer(cluster.url) as producer, \
                gateway(cluster.url) as base, \
                OpenAI(base_url=f"{base}/v1", api_key="unused", max_retries=0, timeout=60) as sdk:
            client = sync_redis(cluster.url, socket_timeout=5)
            before = sdk.completions.create(model=model, prompt="before", max_tokens=8, seed=1)
            assert before.choices[0].finish_reason == "length"
            producer.submit_many([{"id": k, **v} for k, v in jobs.items()])
            replicated(master)  # no submit may be lost: only what the worker wrote since
            wait_for(lambda: len(events(client, "pre-0", keys)) >= 10, what="tokens")
            assert terminal(client, "pre-0", keys) is None  # in flight when its master dies
            cluster.kill(master)
            cluster.wait_ok(30)
            assert cluster.master_of(keys.jobs_of(model)) is not master
            after = {f"post-{k}": {"prompt": f"after {k}", "max_tokens": 20, "seed": k,
                                   "model": model} for k in range(4)}
            producer.submit_many([{"id": k, **v} for k, v in after.items()])
            wait_for(lambda: model in [m.id for m in sdk.models.list()], timeout=30,
                     what="the gateway to see the worker again")  # 503s meanwhile
            streamed = [c.choices[0].text for c in sdk.completions.create(  # the gateway's
                model=model, prompt="after", max_tokens=8, seed=2, stream=True) if c.choices]
            assert "".join(streamed)  # per-model pool and hub, on the promoted master
            ends = wait_terminal(client, [*jobs, *after], timeout=60, keys=keys)
            assert proc.poll() is None, "the worker died in the failover"
            want = expected({**jobs, **after})
            for job_id in after:
                done = check_stream(client, job_id, keys)
                assert (done.text, done.finish_reason) == want[job_id]
            for job_id in jobs:  # complete and exact, or ended as Redis lost its state
                end = ends[job_id]
                if isinstance(end, ErrorEvent):
                    assert end.code == LOST_STATE, (job_id, end)
                else:
                    done = check_stream(client, job_id, keys)
                    assert (done.text, done.finish_reason) == want[job_id], job_id
            client.close()
    no_cross_slot(log)


def replicated(master: RedisProcess) -> None:
    """Returns once the master's replica has every write it took so far (WAIT)."""
    with redis.Redis(port=master.port, socket_timeout=5) as client:
        assert client.wait(1, 3000) == 1, "the replica did not catch up"


def cli(cluster: LocalCluster, *args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, "-m", "qworker_client", *args, "--redis-url",
                           cluster.url], capture_output=True, text=True, timeout=60, cwd=ROOT)


def test_the_cli_submits_follows_and_asks_of_a_job_on_a_cluster(cluster: LocalCluster,
                                                                 tmp_path: Path) -> None:
    model = "cli"
    with worker(cluster, "cli-w", model, tmp_path / "w.log"):
        submitted = cli(cluster, "submit", "hello there", "--model", model, "--max-tokens", "8",
                        "--id", "cli-1", "--wait")
        tailed = cli(cluster, "tail", "cli-1", "--model", model)
        found = cli(cluster, "tail", "cli-1")  # its model found by its id
        status = cli(cluster, "status", "cli-1")
        ended = cli(cluster, "cancel", "cli-1")
        unknown = [cli(cluster, verb, "cli-nobody") for verb in ("tail", "status", "cancel")]
        model_less = cli(cluster, "submit", "no model", "--no-wait")
    assert submitted.returncode == 0 and submitted.stdout.strip(), submitted.stderr
    assert tailed.returncode == 0 and tailed.stdout == submitted.stdout, tailed.stderr
    assert found.returncode == 0 and found.stdout == submitted.stdout, found.stderr
    assert status.returncode == 0 and status.stdout.startswith("done"), status.stderr
    assert ended.returncode == 1 and "already ended" in ended.stderr, ended.stderr
    assert [p.returncode for p in unknown] == [1, 1, 1], [p.stderr for p in unknown]
    assert unknown[1].stdout.strip() == "unknown"
    assert model_less.returncode == 2, model_less.stderr
    assert model_less.stderr.count("\n") == 1 and "names its model" in model_less.stderr


def test_stats_and_dead_letters_of_several_models_on_a_cluster(cluster: LocalCluster,
                                                               tmp_path: Path) -> None:
    models = cluster.models_on_each_master("dead")[:2]
    client = sync_redis(cluster.url, socket_timeout=5)
    with ExitStack() as stack:
        logs = workers_of(stack, cluster, models, "dead", tmp_path)
        before = json.loads(cli(cluster, "stats", "--json").stdout)["dead_letters"]
        for model in models:
            client.xadd(Keys().jobs_of(model), {"id": f"bad-{model}", "max_tokens": "many"})
        wait_terminal(client, [f"bad-{models[0]}"], keys=Keys().in_slot(models[0]))
        wait_terminal(client, [f"bad-{models[1]}"], keys=Keys().in_slot(models[1]))
        stats = cli(cluster, "stats", "--json")
        listed = cli(cluster, "dead", "list", "--model", models[1], "--json")
        unnamed = cli(cluster, "dead", "list")
    client.close()
    assert stats.returncode == 0, stats.stderr
    found = json.loads(stats.stdout)
    assert found["dead_letters"] == before + 2  # one in each model's slot
    assert sorted(w["served_model_name"] for w in found["workers"]) == sorted(models)
    assert listed.returncode == 0, listed.stderr
    assert [json.loads(line)["job_id"] for line in listed.stdout.splitlines()] == \
        [f"bad-{models[1]}"]
    assert unnamed.returncode == 2 and "names its model" in unnamed.stderr, unnamed.stderr
    no_cross_slot(*logs)


def test_the_gateway_serves_models_of_several_masters(cluster: LocalCluster,
                                                      tmp_path: Path) -> None:
    """Chat completions (whole and streamed), a stored response, a job's status and its stream
    resumed by id: each model's keys on its own master, read through the gateway's per-slot
    connections."""
    models = cluster.models_on_each_master("gw")[:2]
    with ExitStack() as stack:
        logs = workers_of(stack, cluster, models, "gw", tmp_path)
        base = stack.enter_context(gateway(cluster.url))
        sdk = stack.enter_context(OpenAI(base_url=f"{base}/v1", api_key="unused",
                                         max_retries=0, timeout=60))
        for model in models:
            whole = sdk.chat.completions.create(
                model=model, messages=[{"role": "user", "content": "hi"}], max_tokens=12, seed=1)
            assert whole.choices[0].finish_reason == "length" and whole.choices[0].message.content
            streamed = "".join(chunk.choices[0].delta.content or "" for chunk in
                               sdk.chat.completions.create(
                                   model=model, messages=[{"role": "user", "content": "hi"}],
                                   max_tokens=12, seed=1, stream=True) if chunk.choices)
            assert streamed == whole.choices[0].message.content
            response = sdk.responses.create(model=model, input="hello", max_output_tokens=8)
            assert sdk.responses.retrieve(response.id).output_text == response.output_text
        raw = httpx2.post(f"{base}/v1/completions", timeout=60, json={
            "model": models[1], "prompt": "resume me", "max_tokens": 10, "seed": 3})
        job_id = raw.headers["x-qworker-job-id"]
        status = httpx2.get(f"{base}/v1/jobs/{job_id}", timeout=30).json()
        resumed = httpx2.get(f"{base}/v1/jobs/{job_id}/stream", timeout=30).text
    assert status["status"] == "done", status
    assert raw.json()["choices"][0]["text"] and "data: [DONE]" in resumed
    no_cross_slot(*logs)


def test_worker_and_producer_run_as_their_acl_users_on_a_cluster(cluster: LocalCluster,
                                                                 tmp_path: Path) -> None:
    """The ACL users of docs/operating.md (`qworker_client.acl`), set on every node: a worker
    and a producer do their work on a cluster with no command refused."""
    users = {name: role for name, role in acl_roles("qw").items() if name in ("worker",
                                                                              "producer")}
    for node in cluster.running():
        with redis.Redis(port=node.port, socket_timeout=5) as admin:
            for name, role in users.items():
                admin.execute_command(*shlex.split(role.setuser(f"pw-{name}")))

    def url(name: str) -> str:
        return cluster.url.replace("://", f"://qworker-{name}:pw-{name}@")
    model = "acl"
    log = tmp_path / "w.log"
    proc = spawn_worker(url("worker"), "acl-w", *FAST_RECLAIM, "--model", SIM,
                        "--served-model-name", model, log_path=log)
    try:
        with Producer(url("producer")) as producer:
            result = producer.submit("as acl users", model=model, max_tokens=6,
                                     tenant="t1").result(timeout=60)
            assert (result.finish_reason, result.usage.completion_tokens) == ("length", 6)
            assert producer.status(result.job_id, model=model).status == "done"
    finally:
        stop_process(proc, sig=15)
        proc.wait(30)
    refused = log.read_text()
    assert "NOPERM" not in refused and "no permissions" not in refused, refused[-2000:]
    no_cross_slot(log)


def test_the_dashboard_finds_each_models_jobs_and_dead_letters(cluster: LocalCluster,
                                                               tmp_path: Path) -> None:
    models = cluster.models_on_each_master("board")[:2]
    client = sync_redis(cluster.url, socket_timeout=5)
    with ExitStack() as stack:
        logs = workers_of(stack, cluster, models, "board", tmp_path)
        base = stack.enter_context(gateway(cluster.url))
        with Producer(cluster.url) as producer:
            texts = {m: producer.submit("show me", id=f"board-{m}", model=m, max_tokens=6,
                                        seed=1).result(timeout=60).text for m in models}
        for model in models:
            client.xadd(Keys().jobs_of(model), {"id": f"board-bad-{model}", "max_tokens": "x"})
            wait_terminal(client, [f"board-bad-{model}"], keys=Keys().in_slot(model))
        pages = {m: httpx2.get(f"{base}/dashboard/jobs/board-{m}", timeout=30) for m in models}
        dead = httpx2.get(f"{base}/dashboard/dead", timeout=30)
    client.close()
    for model, page in pages.items():
        assert page.status_code == 200 and texts[model] in html.unescape(page.text), page.text
    assert dead.status_code == 200
    assert all(f"board-bad-{m}" in dead.text for m in models), dead.text
    no_cross_slot(*logs)


def test_batches_say_in_one_line_that_they_do_not_run_on_a_cluster(cluster: LocalCluster,
                                                                   tmp_path: Path) -> None:
    source = tmp_path / "in.jsonl"
    source.write_text('{"custom_id": "a", "prompt": "x", "model": "m", "max_tokens": 4}\n')
    proc = cli(cluster, "batch", "run", str(source), str(tmp_path / "out.jsonl"))
    assert proc.returncode == 2, proc.stderr
    assert proc.stderr.count("\n") == 1 and "Redis Cluster" in proc.stderr, proc.stderr
    gateway_proc = cli(cluster, "gateway", "--port", "0", "--files-dir", str(tmp_path / "files"))
    assert gateway_proc.returncode == 2, gateway_proc.stderr
    assert "Redis Cluster" in gateway_proc.stderr.splitlines()[-1], gateway_proc.stderr


def test_the_dashboard_retries_and_purges_every_models_dead_letters(cluster: LocalCluster
                                                                   ) -> None:
    models = cluster.models_on_each_master("retry")[:2]
    client = sync_redis(cluster.url, socket_timeout=5, decode_responses=True)
    for model in models:
        keys = Keys().in_slot(model)
        client.xgroup_create(keys.jobs_of(model), "workers", id="0", mkstream=True)
        for job_id, code in ((f"exp-{model}", "expired"), (f"poi-{model}", "poison")):
            client.xadd(keys.dead, {"reason": "r", "code": code, "source": keys.jobs_of(model),
                                    "source_id": "1-0", "worker": "w1", "id": job_id,
                                    "prompt": "hi", "max_tokens": "4", "model": model})
    admin_key = "sk-admin-9876543210"
    with gateway(cluster.url, admin_keys=(admin_key,)) as base, \
            httpx2.Client(base_url=f"{base}/dashboard", follow_redirects=False) as admin:
        assert admin.post("/login", data={"key": admin_key}).status_code == 303
        token = re.search(r'name="csrf" value="([0-9a-f]+)"', admin.get("/dead").text)
        assert token is not None
        retried = admin.post("/dead/retry", data={"code": "expired", "csrf": token.group(1)})
        purged = admin.post("/dead/purge", data={"csrf": token.group(1), "code": "poison",
                                                 "confirm": "purge"})
    assert "queued+again%3A+2" in retried.headers["location"], retried.headers
    assert "purged+2" in purged.headers["location"], purged.headers
    for model in models:
        keys = Keys().in_slot(model)
        assert [f["id"] for _, f in client.xrange(keys.jobs_of(model))] == [f"exp-{model}"]
        assert client.xlen(keys.dead) == 0
    client.close()
