"""`qworker batch run` / `qworker_client.batch`: bad lines, duplicates, back-pressure, resuming
after Ctrl-C and kill -9 without submitting a line twice; against a real redis-server."""

from __future__ import annotations

import io
import json
import signal
import subprocess
import sys
import threading
from pathlib import Path
from typing import Any

import pytest
import redis

from qworker_client import Producer
from qworker_client.batch import (
    BatchLine,
    NoProgress,
    Submitter,
    TqdmProgress,
    make_progress,
    parse_line,
    read_jsonl_repairing,
    run_batch,
)
from qworker_client.protocol import DoneEvent, Keys, TokenEvent, event_to_fields
from tests.service_harness import ROOT, checkout_env, wait_for
from tests.worker_process import sim_worker

KEYS = Keys("qw")


def good_line(i: int, max_tokens: int = 8) -> dict[str, Any]:
    """Prompts of all three kinds, with a seed so a direct submit gives the same text."""
    line: dict[str, Any] = {"custom_id": f"c{i}", "max_tokens": max_tokens, "seed": i}
    kind = i % 3
    if kind == 0:
        line["prompt"] = f"line {i}"
    elif kind == 1:
        line["messages"] = [{"role": "user", "content": f"line {i}"}]
    else:
        line["prompt_token_ids"] = [65 + i % 26, 66, 67]
    return line


# (raw line, error code): one of each way a line can be bad.
BAD_LINES = [
    ("this is not json", "invalid_line"),
    ("[1, 2, 3]", "invalid_line"),
    (json.dumps({"prompt": "no custom id"}), "invalid_line"),
    (json.dumps({"custom_id": 7, "prompt": "numeric custom id"}), "invalid_line"),
    (json.dumps({"custom_id": "bad-noprompt", "max_tokens": 4}), "invalid_request"),
    (json.dumps({"custom_id": "bad-two", "prompt": "a", "prompt_token_ids": [1]}),
     "invalid_request"),
    (json.dumps({"custom_id": "bad-max", "prompt": "a", "max_tokens": -1}), "invalid_request"),
    (json.dumps({"custom_id": "bad-field", "prompt": "a", "temprature": 0.5}), "invalid_request"),
    (json.dumps({"custom_id": "bad-id", "prompt": "a", "id": "mine"}), "invalid_request"),
    (json.dumps({"custom_id": "bad-temp", "prompt": "a", "temperature": "hot"}),
     "invalid_request"),
]


def write_lines(path: Path, lines: list[str]) -> Path:
    path.write_text("".join(line + "\n" for line in lines), encoding="utf-8")
    return path


def batch_cli(*args: str, url: str) -> subprocess.Popen[str]:
    cmd = [sys.executable, "-m", "qworker.cli", "batch", "run", *args, "--redis-url", url]
    return subprocess.Popen(cmd, cwd=ROOT, env=checkout_env(), stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True, preexec_fn=default_sigint)


def default_sigint() -> None:
    """In the child: Ctrl-C as in a terminal, even where this suite runs with SIGINT ignored."""
    signal.signal(signal.SIGINT, signal.SIG_DFL)


def finish(proc: subprocess.Popen[str], timeout: float = 60) -> tuple[int, str, str]:
    out, err = proc.communicate(timeout=timeout)
    return proc.returncode, out, err


def records(path: Path) -> list[dict[str, Any]]:
    return [json.loads(line) for line in path.read_text(encoding="utf-8").splitlines()]


def jobs_added(client: redis.Redis) -> int:
    """Entries ever XADDed to qw:jobs (workers XDEL acked ones, so XLEN does not count)."""
    if not client.exists(KEYS.jobs):
        return 0
    return int(client.xinfo_stream(KEYS.jobs)["entries-added"])


def line_count(path: Path) -> int:
    return path.read_bytes().count(b"\n") if path.exists() else 0


@pytest.fixture
def client(redis_url: str) -> redis.Redis:
    return redis.Redis.from_url(redis_url, decode_responses=True)


def test_bad_lines_go_to_the_error_file_and_the_rest_runs(
    redis_url: str, client: redis.Redis, tmp_path: Path
) -> None:
    bad_at = {5 + 19 * k: raw_code for k, raw_code in enumerate(BAD_LINES)}  # line numbers
    lines, good_ids, n_good = [], set(), 0
    for line_no in range(1, 201):
        if line_no in bad_at:
            lines.append(bad_at[line_no][0])
        else:
            lines.append(json.dumps(good_line(n_good)))
            good_ids.add(f"c{n_good}")
            n_good += 1
    source = write_lines(tmp_path / "in.jsonl", lines)
    output, errors = tmp_path / "out.jsonl", tmp_path / "failed.jsonl"
    with sim_worker(redis_url):
        code, out, err = finish(batch_cli(str(source), str(output), "--errors", str(errors),
                                          "--max-in-flight", "32", url=redis_url))
        added = jobs_added(client)
        with Producer(redis_url) as producer:
            direct = {i: producer.submit(**{k: v for k, v in good_line(i).items()
                                            if k != "custom_id"}).result(timeout=30).text
                      for i in (0, 1, 2)}

    assert code == 1, err  # finished, with failed lines
    summary = json.loads(out)
    assert (summary["succeeded"], summary["invalid"], summary["failed"]) == (190, 10, 0)
    results = records(output)
    assert len(results) == 190 and {r["custom_id"] for r in results} == good_ids
    by_id = {r["custom_id"]: r for r in results}
    for r in results:
        assert set(r) == {"custom_id", "text", "finish_reason", "usage"}
        assert r["finish_reason"] == "length" and r["usage"]["completion_tokens"] == 8
    assert {i: by_id[f"c{i}"]["text"] for i in direct} == direct
    failed = records(errors)
    assert sorted((e["line"], e["error"]["code"]) for e in failed) == sorted(
        (line_no, code) for line_no, (_, code) in bad_at.items())
    assert all(e["error"]["message"] for e in failed)
    assert added == 190


def test_duplicate_custom_ids_refuse_the_whole_batch(
    redis_url: str, client: redis.Redis, tmp_path: Path
) -> None:
    lines = [json.dumps(good_line(i)) for i in range(5)] + [json.dumps(good_line(2))]
    source = write_lines(tmp_path / "in.jsonl", lines)
    output = tmp_path / "out.jsonl"
    code, out, err = finish(batch_cli(str(source), str(output), url=redis_url))
    assert code == 2, err
    assert "duplicate custom_id" in err and "'c2' (lines 3 and 6)" in err
    assert jobs_added(client) == 0 and not output.exists()


def test_in_flight_jobs_never_exceed_the_bound(
    redis_url: str, client: redis.Redis, tmp_path: Path
) -> None:
    """The test is the worker here: it finishes one job at a time and checks, every time, how
    many the batch has submitted and not seen finish."""
    source = write_lines(tmp_path / "in.jsonl", [json.dumps(good_line(i)) for i in range(20)])
    output = tmp_path / "out.jsonl"
    result: list[Any] = []
    thread = threading.Thread(target=lambda: result.append(run_batch(
        source, output, redis_url=redis_url, max_in_flight=4)), daemon=True)
    thread.start()
    finished: set[str] = set()
    peak = 0
    while len(finished) < 20:
        outstanding = wait_for(lambda: unfinished(client, finished), timeout=30,
                               what="a submitted job")
        peak = max(peak, len(outstanding))
        assert len(outstanding) <= 4, outstanding
        entry_id, job_id = outstanding[0]
        complete(client, job_id, entry_id)
        finished.add(job_id)
    thread.join(30)
    assert not thread.is_alive()
    assert peak == 4
    summary = result[0]
    assert (summary.succeeded, summary.submitted, summary.tokens) == (20, 20, 20)
    assert line_count(output) == 20


def unfinished(client: redis.Redis, finished: set[str]) -> list[tuple[str, str]]:
    entries = client.xrange(KEYS.jobs)
    return [(entry_id, f["id"]) for entry_id, f in entries if f["id"] not in finished]


def complete(client: redis.Redis, job_id: str, entry_id: str) -> None:
    client.xadd(KEYS.out(job_id), event_to_fields(TokenEvent(i=0, token_id=65, text="A")))
    done = DoneEvent(finish_reason="length", text="A", prompt_tokens=3, completion_tokens=1)
    client.xadd(KEYS.out(job_id), event_to_fields(done))
    client.xdel(KEYS.jobs, entry_id)


def test_resume_after_ctrl_c_and_kill_submits_nothing_twice(
    redis_url: str, client: redis.Redis, tmp_path: Path
) -> None:
    n = 200
    source = write_lines(tmp_path / "in.jsonl",
                         [json.dumps(good_line(i, max_tokens=40)) for i in range(n)])
    output = tmp_path / "out.jsonl"
    args = (str(source), str(output), "--max-in-flight", "16")
    with sim_worker(redis_url):
        first = batch_cli(*args, url=redis_url)
        wait_for(lambda: line_count(output) >= 30, timeout=60, what="30 results")
        first.send_signal(signal.SIGINT)
        code, _, err = finish(first)
        assert code == 130 and "run the same command again" in err, err

        second = batch_cli(*args, url=redis_url)
        done_before = line_count(output)
        wait_for(lambda: line_count(output) >= done_before + 30, timeout=60, what="30 more")
        second.kill()
        second.wait(30)
        with open(output, "a", encoding="utf-8") as file:
            file.write('{"custom_id": "c1", "text": "cut sh')  # a crash in the middle of a write

        code, out, err = finish(batch_cli(*args, url=redis_url))
    assert code == 0, err
    summary = json.loads(out)
    assert summary["attached"] >= 1, summary  # jobs in flight at the kill were read back
    assert summary["skipped"] + summary["succeeded"] == n
    results = records(output)
    assert sorted(r["custom_id"] for r in results) == sorted(f"c{i}" for i in range(n))
    assert jobs_added(client) == n  # every line reached qw:jobs exactly once


def test_submit_reattaches_while_the_job_lives_and_resubmits_a_lost_one(
    client: redis.Redis,
) -> None:
    line = parse_line(1, json.dumps(good_line(1)).encode(), "batch-x")
    assert isinstance(line, BatchLine)
    submitter = Submitter(client, KEYS, "batch-x")
    assert submitter.submit([line]) == [True]
    assert submitter.submit([line]) == [False]  # queued: its entry is in qw:jobs
    (entry_id, fields), = client.xrange(KEYS.jobs)
    client.xdel(KEYS.jobs, entry_id)
    client.xadd(KEYS.requeue, fields)
    assert submitter.submit([line]) == [False]  # requeued by a worker
    client.delete(KEYS.requeue)
    client.xadd(KEYS.out(line.job_id), {"type": "token", "i": "0", "token_id": "1", "text": ""})
    assert submitter.submit([line]) == [False]  # running: its output stream exists
    client.delete(KEYS.out(line.job_id))
    assert submitter.submit([line]) == [True]  # result expired: the only way is to run it again
    assert jobs_added(client) == 2
    assert client.ttl("qw:batch:batch-x") > 0


def test_a_line_whose_output_key_is_no_stream_fails_alone(
    redis_url: str, client: redis.Redis, tmp_path: Path
) -> None:
    raws = [json.dumps(good_line(i)) for i in range(4)]
    hostile = parse_line(2, raws[1].encode(), "b-wrongtype")
    assert isinstance(hostile, BatchLine)
    client.set(KEYS.out(hostile.job_id), "not a stream")  # the runner follows it: "already out"
    source = write_lines(tmp_path / "in.jsonl", raws)
    output, errors = tmp_path / "out.jsonl", tmp_path / "failed.jsonl"
    with sim_worker(redis_url):
        summary = run_batch(source, output, errors, client=client, batch_id="b-wrongtype")
    assert (summary.succeeded, summary.failed) == (3, 1)
    assert sorted(r["custom_id"] for r in records(output)) == ["c0", "c2", "c3"]
    (failed,) = records(errors)
    assert (failed["custom_id"], failed["error"]["code"]) == ("c1", "bad_event")


def test_job_ids_depend_on_batch_custom_id_and_content() -> None:
    raw = json.dumps(good_line(1)).encode()
    same = parse_line(1, raw, "b1"), parse_line(9, raw, "b1")
    other_batch = parse_line(1, raw, "b2")
    edited = parse_line(1, json.dumps({**good_line(1), "max_tokens": 9}).encode(), "b1")
    lines = [x for x in (*same, other_batch, edited) if isinstance(x, BatchLine)]
    ids = [x.job_id for x in lines]
    assert len(ids) == 4
    assert ids[0] == ids[1] and len(set(ids)) == 3
    assert all(i.startswith("batch-") and len(i) == 30 for i in ids)


def test_an_unterminated_last_line_is_cut_off(tmp_path: Path) -> None:
    path = tmp_path / "out.jsonl"
    path.write_bytes(b'{"custom_id": "a"}\n{"custom_id": "b"}\n{"custom_id": "c", "te')
    assert [r["custom_id"] for r in read_jsonl_repairing(path)] == ["a", "b"]
    assert path.read_bytes().endswith(b'"b"}\n')


def test_progress_bar_only_when_asked_and_on_a_terminal(
    monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    assert isinstance(make_progress(False), NoProgress)
    monkeypatch.setattr(sys, "stderr", io.StringIO())  # not a TTY
    assert isinstance(make_progress(True), NoProgress)
    monkeypatch.undo()
    bar = TqdmProgress()
    bar.start(total=3, initial=1)
    bar.tokens(50)
    bar.finished(True)
    bar.finished(False)
    bar.close()
    err = capsys.readouterr().err
    assert "3/3" in err and "failed=1" in err and "tok_s=" in err
