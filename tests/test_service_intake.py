"""Unit tests of intake, screening, readback, backoff, the serve flags and the simulated engine
(fakeredis where Redis is needed: none of these use scripts)."""

from __future__ import annotations

import argparse
import time
from dataclasses import replace

import fakeredis
import pytest

from qworker.commands import serve
from qworker.engine.config import EngineConfig
from qworker.engine.request import Request, RequestRejectedError, SamplingParams
from qworker.engine.simulated import SimOptions, SimulatedEngine, run_offline
from qworker.service.backoff import Backoff
from qworker.service.config import ServiceConfig
from qworker.service.errors import CannotWork
from qworker.service.groups import Groups
from qworker.service.intake import Intake, dead_fields
from qworker.service.job import Entry, Readback
from qworker.service.logs import get_logger
from qworker.service.scripts import Scripts
from qworker.service.worker import default_seed, sampling_params
from qworker_client.protocol import DoneEvent, Keys, TokenEvent, event_to_fields

KEYS = Keys()


@pytest.fixture
def intake() -> Intake:
    client = fakeredis.FakeRedis()
    config = ServiceConfig(redis_url="redis://fake", name="w1", max_deliveries=3)
    it = Intake(client, KEYS, config, Scripts(), token="w1/x")
    groups = Groups(client, it.streams, config.group, get_logger())
    assert groups.ensure() == list(it.streams)
    assert groups.ensure() == []  # BUSYGROUP is fine
    return it


def test_read_takes_requeue_first_and_never_more_than_admitted(intake: Intake) -> None:
    c = intake.client
    for k in range(5):
        c.xadd(KEYS.jobs, {"id": f"j{k}", "prompt": "x"})
    for k in range(2):
        c.xadd(KEYS.requeue, {"id": f"r{k}", "prompt": "x"})
    got = intake.read(3, block_ms=None)
    assert [e.fields[b"id"] for e in got] == [b"r0", b"r1", b"j0"]
    assert [e.stream for e in got] == [KEYS.requeue, KEYS.requeue, KEYS.jobs]
    assert intake.read(0, block_ms=None) == []
    assert [e.fields[b"id"] for e in intake.read(10, block_ms=None)] == [b"j1", b"j2", b"j3",
                                                                         b"j4"]
    assert c.xpending(KEYS.jobs, "workers")["pending"] == 5


def test_screen_sorts_out_invalid_and_duplicate(intake: Intake) -> None:
    entries = [
        Entry(KEYS.jobs, "1-0", {b"id": b"ok", b"prompt": b"x"}),
        Entry(KEYS.jobs, "1-1", {b"id": b"bad", b"prompt": b"x", b"top_p": b"2"}),
        Entry(KEYS.jobs, "1-2", {b"id": b"ok", b"prompt": b"again"}),
        Entry(KEYS.jobs, "1-3", {b"id": b"late", b"prompt": b"x", b"deadline_ms": b"5"}),
        Entry(KEYS.jobs, "1-4", {b"id": b"poison", b"prompt": b"x"}, deliveries=4),
        Entry(KEYS.jobs, "1-5", {b"prompt": b"x", b"oops": b"1"}, deliveries=4),
        Entry(KEYS.jobs, "1-6", {b"id": b"run", b"prompt": b"x"}),
    ]
    good, rejects = intake.screen(entries, busy_job_ids={"run"})
    # the deadline is not screened: only a job that never started expires (see below); nor
    # are deliveries: poison is judged once taken, by how its workers ended (test_poison_rule)
    assert [job.id for _, job in good] == ["ok", "late", "poison"]
    codes = {r.entry.entry_id: (r.code, r.job_id) for r in rejects}
    assert codes == {
        "1-1": ("invalid_request", "bad"),
        "1-2": ("invalid_request", None),  # duplicate id: no error into the running job's stream
        "1-5": ("invalid_request", "1-5"),
        "1-6": ("invalid_request", None),
    }


def test_only_a_job_that_never_started_expires() -> None:
    from qworker.service.intake import Taken
    from qworker_client.protocol import Job

    entry = Entry(KEYS.jobs, "1-3", {b"id": b"late"})
    late = Job(id="late", prompt="x", deadline_ms=5)

    def taken(job: Job, started_before: bool, tokens: list[int]) -> Taken:
        return Taken(entry, job, Readback(token_ids=tokens), cancelled=False, t0_ms=0,
                     started_ms=0, started_before=started_before)

    reject = Intake.expired(taken(late, False, []))
    assert reject is not None and (reject.code, reject.job_id) == ("expired", "late")
    assert Intake.expired(taken(late, True, [])) is None  # drained, preempted or reclaimed
    assert Intake.expired(taken(Job(id="t", prompt="x"), False, [])) is None
    future = Job(id="f", prompt="x", deadline_ms=int(time.time() * 1000) + 60_000)
    assert Intake.expired(taken(future, False, [])) is None


def test_dead_fields_keep_the_original_fields() -> None:
    entry = Entry(KEYS.jobs, "3-0", {b"reason": b"mine", b"prompt": b"\xff"})
    fields = dead_fields(entry, "invalid_request", "bad", "w9")
    assert fields[b"reason"] == b"bad" and fields[b"original.reason"] == b"mine"
    assert fields[b"prompt"] == b"\xff" and fields[b"source_id"] == b"3-0"
    assert fields[b"source"] == KEYS.jobs.encode() and fields[b"worker"] == b"w9"


def test_readback_continues_after_a_clean_prefix() -> None:
    toks = [event_to_fields(TokenEvent(i=i, token_id=65 + i, text=chr(65 + i))) for i in range(3)]
    rb = Readback.parse([(b"1700000000005-0", f) for f in toks])
    assert (rb.token_ids, rb.text, rb.terminal, rb.first_token_ms) == (
        [65, 66, 67], "ABC", False, 1700000000005)
    done = event_to_fields(DoneEvent(finish_reason="stop", text="ABC", prompt_tokens=1,
                                     completion_tokens=3))
    assert Readback.parse([(b"1-0", f) for f in [*toks, done]]).terminal
    broken = Readback.parse([(b"1-0", f) for f in [toks[0], toks[2]]])
    assert broken.token_ids == [65] and not broken.consistent


def test_backoff_doubles_up_to_its_cap() -> None:
    b = Backoff(0.05, 0.4)
    delays = [b.failed(100.0) for _ in range(6)]
    assert delays == [0.05, 0.1, 0.2, 0.4, 0.4, 0.4]
    assert not b.ready(100.0) and b.ready(100.5)
    b.succeeded()
    assert b.ready(0.0)


def test_backoff_grows_through_successes_and_shrinks_only_after_a_quiet_spell() -> None:
    """Out of memory, Redis still answers a turn's reads: a success between two failures must
    not start the wait over at its shortest."""
    b = Backoff(0.05, 0.4)
    delays = []
    for k in range(5):
        delays.append(b.failed(100.0 + k * 0.1))
        b.succeeded()
    assert delays == [0.05, 0.1, 0.2, 0.4, 0.4]
    assert b.failed(101.0) == 0.4  # 0.6 s after the last failure: still the longest
    assert b.failed(101.9) == 0.05  # quiet for 0.9 s, more than twice max_s: the shortest again


def test_seedless_jobs_sample_reproducibly() -> None:
    assert default_seed("a") == default_seed("a") != default_seed("b")
    assert 0 <= default_seed("a") < 2**63


def _serve_args(argv: list[str]) -> argparse.Namespace:
    parser = argparse.ArgumentParser()
    serve.register(parser.add_subparsers())
    return parser.parse_args(["serve", *argv])


def test_serve_flags_come_from_the_environment(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("QWORKER_REDIS_URL", "redis://h:1/2")
    monkeypatch.setenv("QWORKER_MAX_NUM_SEQS", "7")
    monkeypatch.setenv("QWORKER_KV_CACHE_GB", "0.5")
    args = _serve_args(["--model", "sim", "--max-num-seqs", "9"])
    assert args.redis_url == "redis://h:1/2" and args.kv_cache_gb == 0.5
    assert args.max_num_seqs == 9  # the command line wins
    monkeypatch.setenv("QWORKER_MODEL", "sim:step_ms=1,num_blocks=9")
    args = _serve_args([])
    assert args.max_num_seqs == 7 and args.claim_idle_ms == 30_000
    engine = serve.build_engine(args)
    assert isinstance(engine, SimulatedEngine) and engine.blocks.num_blocks == 9
    assert engine.config.requeue_preempted and engine.config.max_num_seqs == 7


def test_serve_requires_redis_url_and_model(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("QWORKER_REDIS_URL", raising=False)
    monkeypatch.delenv("QWORKER_MODEL", raising=False)
    with pytest.raises(SystemExit):
        _serve_args(["--model", "sim"])


def test_sim_options_parse() -> None:
    opts, overrides = SimOptions.parse("sim:step_ms=2.5,eos_every=7,num_blocks=12")
    assert (opts.step_ms, opts.eos_every, overrides) == (2.5, 7, {"num_blocks": 12})
    with pytest.raises(ValueError):
        SimOptions.parse("sim:bogus=1")


def _engine(**kw: object) -> SimulatedEngine:
    model = str(kw.pop("model", "sim:step_ms=0"))
    return SimulatedEngine.from_config(EngineConfig(model=model, requeue_preempted=True, **kw))


def test_sim_resumed_request_continues_exactly() -> None:
    req = Request("r", list(b"the prompt"), SamplingParams(max_tokens=30, seed=3))
    full = run_offline(_engine(), [req])["r"]
    for cut in (0, 1, 17, 29):
        part = run_offline(_engine(), [replace(req, output_token_ids=full.token_ids[:cut])])["r"]
        assert part.token_ids == full.token_ids
        assert _engine().tokenizer.decode(full.token_ids[:cut]) + part.text == full.text


def test_sim_stop_strings_tokens_and_eos() -> None:
    req = Request("r", list(b"abc"), SamplingParams(max_tokens=200, seed=1))
    text = run_offline(_engine(), [req])["r"].text
    stop = text[40:42]
    first = text.find(stop)
    res = run_offline(_engine(), [replace(req, params=replace(req.params, stop=(stop,)))])["r"]
    assert res.finish_reason == "stop" and res.text == text[:first]
    tok = ord(text[10])
    res = run_offline(_engine(), [replace(req, params=replace(req.params,
                                                               stop_token_ids=(tok,)))])["r"]
    assert res.finish_reason == "stop" and res.token_ids[-1] == tok
    assert res.text == text[:text.find(text[10])]
    res = run_offline(_engine(model="sim:step_ms=0,eos_every=5"), [req])["r"]
    assert res.finish_reason == "stop" and res.token_ids[-1] == 0 and len(res.token_ids) < 200


def test_sim_preemption_hands_requests_back_and_frees_blocks() -> None:
    e = _engine(num_blocks=10, block_size=4, max_num_seqs=4)
    for k in range(4):
        e.add(Request(f"r{k}", list(b"12345678"), SamplingParams(max_tokens=20)))
    preempted = []
    while e.has_unfinished():
        preempted += [o.request_id for o in e.step() if o.preempted]
    assert preempted and e.blocks.num_free == 10


def test_sim_rejects_what_cannot_fit() -> None:
    e = _engine(model="sim:step_ms=0,max_model_len=16")
    with pytest.raises(RequestRejectedError) as info:
        e.add(Request("r", list(range(40, 56))))
    assert info.value.code == "prompt_too_long"
    with pytest.raises(RequestRejectedError):
        e.add(Request("r", [256]))
    e.add(Request("ok", [65]))
    e.abort("ok")
    assert not e.has_unfinished() and e.free_slots() == e.config.max_num_seqs


def test_sampling_params_map_every_job_field() -> None:
    from qworker_client.protocol import parse_job_fields

    job = parse_job_fields({"prompt": "x", "stop": '["a"]', "top_k": "5", "seed": "9",
                            "min_tokens": "1", "presence_penalty": "0.5"}, "1-0")
    p = sampling_params(job, "1-0")
    assert (p.stop, p.top_k, p.seed, p.min_tokens, p.presence_penalty) == (("a",), 5, 9, 1, 0.5)


def test_worker_backs_off_on_transient_errors_and_raises_on_bugs() -> None:
    import redis

    from qworker.service.worker import Worker

    config = ServiceConfig(redis_url="redis://fake")
    worker = Worker(_engine(), config, client=fakeredis.FakeRedis())

    def fail(exc: Exception) -> None:
        raise exc

    for exc in (redis.exceptions.OutOfMemoryError("full"), redis.ReadOnlyError("replica"),
                redis.ConnectionError("gone"), redis.ResponseError("MISCONF no disk")):
        assert worker._guard(lambda e=exc: fail(e)) is False
        assert not worker.backoff.ready(time.monotonic())
        worker.backoff.succeeded()
    assert worker._guard(lambda: fail(redis.ResponseError("NOGROUP no group"))) is False
    assert not worker._ready
    # an error reply escaping a worker-wide phase (reading the job stream, say) means the worker
    # cannot work: `run` turns it into exit code 2 (per-job errors are settled inside a phase)
    for reply in ("WRONGTYPE Operation", "NOPERM no permissions", "MOVED 1 10.0.0.1:6379"):
        with pytest.raises(CannotWork, match=reply.split()[0]):
            worker._guard(lambda r=reply: fail(redis.ResponseError(r)))
    with pytest.raises(KeyError):  # a bug is not a Redis error
        worker._guard(lambda: fail(KeyError("bug")))


def test_heartbeat_snapshot_follows_what_the_worker_holds() -> None:
    from qworker.service.worker import Worker

    worker = Worker(_engine(), ServiceConfig(redis_url="redis://fake"),
                    client=fakeredis.FakeRedis())
    worker.inbox.append(Entry(KEYS.jobs, "1-0", {}))  # read, being admitted
    worker._track()
    assert [h.entry_id for h in worker.heartbeat._held] == ["1-0"]
    worker.inbox.clear()
    worker._track()  # rejected, or finished: no longer beaten, so never held forever
    assert worker.heartbeat._held == ()


def test_entries_read_beside_a_step_are_held_until_the_loop_tracks_them() -> None:
    """The Redis thread hands the heartbeat what a round trip read (`hold`); the loop's snapshot
    takes them over when it lands the round trip, and from then on only it decides."""
    from qworker.service.worker import Worker

    worker = Worker(_engine(), ServiceConfig(redis_url="redis://fake"),
                    client=fakeredis.FakeRedis())
    read = [Entry(KEYS.jobs, "1-0", {}), Entry(KEYS.jobs, "1-1", {})]
    worker.heartbeat.hold(read)  # on the Redis thread, while a step runs
    worker._track()  # the loop's turn ends before the round trip lands: still held
    assert [h.entry_id for h in worker.heartbeat._held + worker.heartbeat._read] == ["1-0", "1-1"]
    worker.inbox += read  # landed
    worker._track()
    assert worker.heartbeat._read == ()
    assert [h.entry_id for h in worker.heartbeat._held] == ["1-0", "1-1"]


def test_deleted_entries_in_a_reply_are_not_jobs() -> None:
    """A reply may name an entry deleted while pending (an XTRIM): fields nil, or parsed as none.
    It is no job (an XADD has at least one field): skipped, not dead-lettered as invalid."""
    from qworker.service.intake import _entries

    reply = [(b"1-0", None), (b"1-1", {}), (b"1-2", {b"id": b"j", b"prompt": b"x"})]
    assert [e.entry_id for e in _entries(KEYS.jobs, reply)] == ["1-2"]
