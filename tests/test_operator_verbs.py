"""The operator's verbs against a real redis-server and a simulated worker: `qworker cancel`,
`qworker jobs` (running, waiting and recently ended jobs) and `qworker dead list | show | retry |
purge` (a retried job runs again under its id, afresh, on its model's stream)."""

from __future__ import annotations

import json
import re
from collections.abc import Iterator

import pytest
import redis

from qworker_client.cli import main
from qworker_client.protocol import Keys
from tests.service_harness import (
    KEYS,
    check_stream,
    sim_engine,
    thread_worker,
    wait_for,
    wait_terminal,
)


@pytest.fixture
def client(redis_url: str) -> Iterator[redis.Redis]:
    c = redis.Redis.from_url(redis_url, decode_responses=True)
    yield c
    c.close()


def qworker(capsys: pytest.CaptureFixture[str], url: str, *args: str) -> tuple[int, str, str]:
    """`qworker ARGS --redis-url URL` in this process: exit code, stdout, stderr (without the
    log lines other threads of this process wrote meanwhile: a worker's, or a thread an earlier
    test left behind)."""
    capsys.readouterr()
    code = main([*args, "--redis-url", url])
    out, err = capsys.readouterr()
    return code, _without_logs(out), _without_logs(err)


_LOG_LINE = re.compile(r"^\d{4}-\d\d-\d\d \d\d:\d\d:\d\d \[\w+ *\] ")  # structlog's console


def _without_logs(text: str) -> str:
    return "".join(line for line in text.splitlines(keepends=True) if not _LOG_LINE.match(line))


def json_lines(text: str) -> list[dict[str, object]]:
    return [json.loads(line) for line in text.splitlines()]


def died_too_often(client: redis.Redis, job_id: str, stream: str = KEYS.jobs,
                   **fields: str) -> str:
    """A job whose workers kept dying: delivered 4 times (past --max-deliveries 3)."""
    client.xgroup_create(stream, "workers", id="0", mkstream=True)
    entry = client.xadd(stream, {"id": job_id, "prompt": "unlucky", "max_tokens": "3", **fields})
    client.xreadgroup("workers", "ghost", {stream: ">"}, count=1)
    for _ in range(3):
        client.xclaim(stream, "workers", "ghost", 0, [entry])
    return entry


# ---------------------------------------------------------------------------------- cancel


def test_cancel_ends_a_running_job_and_leaves_an_ended_one(
        redis_url: str, client: redis.Redis, capsys: pytest.CaptureFixture[str]) -> None:
    with thread_worker(redis_url, "c", sim_engine("sim:step_ms=5")) as w:
        client.xadd(KEYS.jobs, {"id": "long", "prompt": "p", "max_tokens": "5000",
                                "ignore_eos": "true"})
        wait_for(lambda: client.xlen(KEYS.out("long")) >= 2, what="tokens")
        assert qworker(capsys, redis_url, "cancel", "long") == (0, "long: cancelling\n", "")
        done = wait_terminal(client, ["long"])["long"]
        assert w.stop() == 0  # its log lines (the job's end) are not the verb's output
    code, out, err = qworker(capsys, redis_url, "cancel", "long")
    assert done.type == "done" and done.finish_reason == "cancelled"
    assert check_stream(client, "long").completion_tokens < 5000
    assert (code, out) == (1, "") and err == "qworker: long: has already ended, left alone\n"
    assert qworker(capsys, redis_url, "cancel", "bad id")[0] == 2


# ---------------------------------------------------------------------------------- jobs


def test_jobs_lists_running_waiting_and_ended_jobs(
        redis_url: str, client: redis.Redis, capsys: pytest.CaptureFixture[str]) -> None:
    engine = sim_engine("sim:step_ms=5", max_num_seqs=1)
    with thread_worker(redis_url, "lister", engine, max_deliveries=3, claim_idle_ms=300) as w:
        client.xadd(KEYS.jobs, {"id": "short", "prompt": "p", "max_tokens": "3"})
        wait_terminal(client, ["short"])
        client.xadd(KEYS.jobs, {"id": "broken", "prompt": "p", "colour": "blue"})
        client.xadd(KEYS.jobs, {"id": "runs", "prompt": "p", "max_tokens": "5000",
                                "ignore_eos": "true"})
        wait_for(lambda: client.xlen(KEYS.out("runs")) >= 3, what="tokens of runs")
        client.xadd(KEYS.jobs, {"id": "waits", "prompt": "p", "max_tokens": "3"})  # no slot
        client.xadd(KEYS.jobs_of("nobody-serves-it"), {"id": "other", "prompt": "p"})
        wait_for(lambda: client.xlen(KEYS.dead) == 1, what="the dead letter")
        code, out, _ = qworker(capsys, redis_url, "jobs", "--json")
        text = qworker(capsys, redis_url, "jobs")[1]
        limited = json_lines(qworker(capsys, redis_url, "jobs", "--json", "--limit", "2")[1])
        only = json_lines(qworker(capsys, redis_url, "jobs", "--json", "--status", "dead")[1])
        client.set(KEYS.cancel("runs"), 1)
        wait_terminal(client, ["runs", "waits"])
        assert w.stop() == 0
    rows = {row["id"]: row for row in json_lines(out)}
    assert code == 0 and set(rows) == {"short", "broken", "runs", "waits", "other"}
    assert [row["id"] for row in json_lines(out)][:3] == ["runs", "waits", "other"]
    assert rows["runs"]["status"] == "running" and rows["runs"]["tokens"] >= 2
    assert rows["runs"]["detail"].startswith("lister ")
    assert (rows["waits"]["status"], rows["waits"]["tokens"]) == ("queued", 0)
    assert (rows["other"]["status"], rows["other"]["model"]) == ("queued", "nobody-serves-it")
    assert (rows["short"]["status"], rows["short"]["tokens"]) == ("done", 3)
    assert rows["short"]["detail"] == "length lister"
    assert (rows["broken"]["status"], rows["broken"]["detail"]) == ("dead", "invalid_request")
    assert text.splitlines()[0].split() == ["ID", "STATUS", "TENANT", "MODEL", "TOKENS", "AGE",
                                            "DETAIL"]
    assert [row["id"] for row in limited] == ["runs", "waits"]
    assert [row["id"] for row in only] == ["broken"]
    recent = client.xrange(KEYS.recent)
    assert [(f["id"], f["status"], f["reason"]) for _, f in recent] == [
        ("short", "done", "length"), ("runs", "done", "cancelled"), ("waits", "done", "length")]


# ---------------------------------------------------------------------------------- dead


def test_dead_retry_runs_the_job_again_under_its_id_afresh(
        redis_url: str, client: redis.Redis, capsys: pytest.CaptureFixture[str]) -> None:
    stream = KEYS.jobs_of("sim", "high")  # the model and band come from where it was queued
    first = died_too_often(client, "unlucky", stream, priority="-2")
    with thread_worker(redis_url, "r", max_deliveries=3, claim_idle_ms=300) as w:
        error = wait_terminal(client, ["unlucky"])["unlucky"]
        assert error.type == "error" and error.code == "too_many_deliveries"
        code, out, _ = qworker(capsys, redis_url, "dead", "list", "--json")
        (letter,) = json_lines(out)
        shown = qworker(capsys, redis_url, "dead", "show", "unlucky")[1]
        retried = qworker(capsys, redis_url, "dead", "retry", "unlucky")
        done = wait_terminal(client, ["unlucky"])["unlucky"]  # the old output went with it
        code_again, _, err_again = qworker(capsys, redis_url, "dead", "retry",
                                           str(letter["entry_id"]))
        assert w.stop() == 0
    assert code == 0 and letter["job_id"] == "unlucky"
    assert letter["fields"]["code"] == "too_many_deliveries"  # type: ignore[index]
    assert letter["fields"]["source_id"] == first  # type: ignore[index]
    assert f"source: {stream}\n" in shown and "prompt: unlucky\n" in shown
    assert retried[0] == 0 and retried[1].startswith(f"unlucky: queued again on {stream} (")
    check_stream(client, "unlucky")  # its old error event is gone: tokens 0..2, then done
    assert done.completion_tokens == 3
    assert client.xlen(KEYS.dead) == 0
    assert (code_again, err_again.count("\n")) == (1, 1) and "no dead letter" in err_again


def test_dead_retry_says_where_the_job_went_and_refuses_what_it_cannot_rebuild(
        redis_url: str, client: redis.Redis, capsys: pytest.CaptureFixture[str]) -> None:
    died_too_often(client, "plain")
    client.xadd(KEYS.jobs, {"id": "huge", "prompt": "x" * 5000})  # too long for the sim model
    client.xadd(KEYS.jobs, {"id": "typo", "prompt": "p", "max_tokenz": "3"})
    with thread_worker(redis_url, "d", sim_engine("sim:max_model_len=64"), max_deliveries=3,
                       claim_idle_ms=300) as w:
        wait_for(lambda: client.xlen(KEYS.dead) == 3, what="three dead letters")
        assert w.stop() == 0
    # no worker now: a retried job waits in its stream
    code, out, err = qworker(capsys, redis_url, "dead", "retry", "plain", "huge", "typo")
    assert code == 1
    assert out.startswith(f"plain: queued again on {KEYS.jobs} (")
    lines = err.splitlines()
    assert len(lines) == 2 and "Traceback" not in err
    assert "huge" in lines[0] and "cut copy" in lines[0] and "'prompt' was cut" in lines[0]
    assert "typo" in err and "max_tokenz" in lines[1]
    ((entry_id, fields),) = client.xrange(KEYS.jobs)
    assert fields == {"id": "plain", "prompt": "unlucky", "max_tokens": "3"}
    assert client.xpending(KEYS.jobs, "workers")["pending"] == 0  # fresh: delivered 0 times
    assert not client.exists(KEYS.owner("plain")) and not client.exists(KEYS.out("plain"))
    assert client.get(KEYS.submitted("plain")) == entry_id
    assert client.xlen(KEYS.dead) == 2  # the refused ones stay


def test_a_job_queued_again_under_its_id_is_not_retried_over(
        redis_url: str, client: redis.Redis, capsys: pytest.CaptureFixture[str]) -> None:
    client.xadd(KEYS.dead, {"reason": "r", "code": "expired", "source": KEYS.jobs,
                            "source_id": "1-1", "worker": "w", "id": "again", "prompt": "p"})
    client.hset(KEYS.owner("again"), mapping={"worker": "", "t0": "1"})  # requeued, waiting
    code, _, err = qworker(capsys, redis_url, "dead", "retry", "again")
    assert code == 1 and "queued or running again" in err
    client.delete(KEYS.owner("again"))
    client.xadd(KEYS.out("again"), {"type": "token", "i": "0", "token_id": "1", "text": "a"})
    code, _, err = qworker(capsys, redis_url, "dead", "retry", "again")
    assert code == 1 and "does not end" in err
    assert client.xlen(KEYS.dead) == 1 and client.xlen(KEYS.jobs) == 0


def test_dead_purge_is_bounded_and_asks_for_yes(
        redis_url: str, client: redis.Redis, capsys: pytest.CaptureFixture[str]) -> None:
    ids = [client.xadd(KEYS.dead, {"reason": "r", "code": "expired" if k % 2 else "internal",
                                   "source": KEYS.jobs, "source_id": f"1-{k}", "worker": "w",
                                   "id": f"j{k}", "prompt": "p"}) for k in range(10)]
    code, out, err = qworker(capsys, redis_url, "dead", "purge", "--limit", "3")
    assert (code, out) == (2, "") and "would purge 3 dead letter(s)" in err and "--yes" in err
    assert client.xlen(KEYS.dead) == 10
    assert qworker(capsys, redis_url, "dead", "purge", "--limit", "3", "--code", "expired",
                   "--yes")[1] == "purged 3 dead letter(s)\n"
    left = [entry_id for entry_id, _ in client.xrange(KEYS.dead)]
    assert left == [i for k, i in enumerate(ids) if k % 2 == 0 or k >= 7]  # the oldest 3 expired
    assert qworker(capsys, redis_url, "dead", "purge", "--older-than", "3600", "--yes")[1] == \
        "purged 0 dead letter(s)\n"
    assert qworker(capsys, redis_url, "dead", "purge", "--yes")[1] == "purged 7 dead letter(s)\n"
    assert client.xlen(KEYS.dead) == 0


def test_dead_list_newest_first_bounded_and_by_code(
        redis_url: str, client: redis.Redis, capsys: pytest.CaptureFixture[str]) -> None:
    for k in range(5):
        client.xadd(KEYS.dead, {"reason": f"reason {k}", "code": "c" if k < 3 else "d",
                                "source": Keys().jobs_of("m"), "source_id": f"1-{k}",
                                "worker": "w", "prompt": "p"})
    listed = json_lines(qworker(capsys, redis_url, "dead", "list", "--json", "--limit", "2")[1])
    assert [d["job_id"] for d in listed] == ["1-4", "1-3"]  # no `id`: named by its entry
    by_code = json_lines(qworker(capsys, redis_url, "dead", "list", "--json", "--code", "c")[1])
    assert [d["job_id"] for d in by_code] == ["1-2", "1-1", "1-0"]
    table = qworker(capsys, redis_url, "dead", "list")[1].splitlines()
    assert table[0].split() == ["ENTRY", "JOB", "CODE", "SOURCE", "AGE", "REASON"]
    assert len(table) == 6 and "reason 4" in table[1]
    assert qworker(capsys, redis_url, "dead", "show", "nothing-like-it")[0] == 1


def test_protocol_md_gives_the_retry_script_word_for_word() -> None:
    import re
    from pathlib import Path

    from qworker_client.scripts import RETRY_SCRIPT

    doc = Path(__file__).resolve().parents[1] / "docs" / "protocol.md"
    assert RETRY_SCRIPT in re.findall(r"```lua\n(.*?)```", doc.read_text(), re.S)
