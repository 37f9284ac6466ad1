"""The two distributions as a user gets them: both wheels built from a copy of this checkout, the
client's installed alone into a fresh venv, the worker's into another without its `worker` extra.
The venvs' dependencies (redis-py, pydantic, tqdm, structlog) come from the package index."""

from __future__ import annotations

import configparser
import os
import re
import shutil
import subprocess
import sys
import zipfile
from email.message import Message
from email.parser import Parser
from pathlib import Path

import pytest
import redis

from qworker_client.commands.worker import INSTALL_HINT, WORKER_COMMANDS

ROOT = Path(__file__).resolve().parents[1]
HEAVY = ("torch", "numpy", "qworker")  # what the client must never import
pytestmark = pytest.mark.timeout(600)


def run(
    cmd: list[str | Path], env: dict[str, str] | None = None
) -> subprocess.CompletedProcess[str]:
    proc = subprocess.run(
        [str(c) for c in cmd], capture_output=True, text=True, timeout=300, env=env,
        cwd=outside(cmd[0]),
    )
    assert proc.returncode == 0, f"{cmd}: {proc.stdout}{proc.stderr}"
    return proc


def outside(program: str | Path) -> Path:
    """The program's own folder, never the checkout, whose `*.egg-info` Python would take for an
    installed distribution (and `qworker/` for an importable package)."""
    return Path(program).parent


def copy_sources(dst: Path) -> Path:
    """The checkout's package sources, without build products: the build then neither writes into
    the shared tree nor picks up kernels built there."""
    ignore = shutil.ignore_patterns("__pycache__", "native_lib", "build", "*.egg-info")
    for name in ("pyproject.toml", "setup.py", "README.md"):
        shutil.copy2(ROOT / name, dst / name)
    for name in ("qworker", "producer"):
        shutil.copytree(ROOT / name, dst / name, ignore=ignore)
    return dst


@pytest.fixture(scope="module")
def wheels(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    src = copy_sources(tmp_path_factory.mktemp("src"))
    out = tmp_path_factory.mktemp("wheels")
    run([sys.executable, "-m", "pip", "wheel", "-q", "--no-deps", "--no-build-isolation",
         "-w", out, src / "producer", src], env={**os.environ, "QWORKER_BUILD_KERNELS": "0"})
    return {name: next(out.glob(f"{name}-*.whl")) for name in ("qworker_client", "qworker_llm")}


def fresh_venv(path: Path, *wheel_files: Path) -> Path:
    """A venv without pip of its own (this pip installs into it: `--python`), for speed."""
    run([sys.executable, "-m", "venv", "--without-pip", path])
    bin_dir = path / "bin"
    run([sys.executable, "-m", "pip", "--python", bin_dir / "python", "install", "-q",
         "--disable-pip-version-check", *wheel_files])
    return bin_dir


@pytest.fixture(scope="module")
def client_bin(wheels: dict[str, Path], tmp_path_factory: pytest.TempPathFactory) -> Path:
    return fresh_venv(tmp_path_factory.mktemp("client-venv"), wheels["qworker_client"])


@pytest.fixture(scope="module")
def worker_bin(wheels: dict[str, Path], tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The worker without its `worker` extra: no torch. The client wheel is given too, so its
    exact pin resolves to this checkout's client."""
    return fresh_venv(tmp_path_factory.mktemp("worker-venv"), wheels["qworker_client"],
                      wheels["qworker_llm"])


def wheel_text(wheel: Path, suffix: str) -> str:
    with zipfile.ZipFile(wheel) as archive:
        name = next(n for n in archive.namelist() if n.endswith(f".dist-info/{suffix}"))
        return archive.read(name).decode()


def wheel_files(wheel: Path) -> list[str]:
    with zipfile.ZipFile(wheel) as archive:
        return [n for n in archive.namelist() if ".dist-info/" not in n]


def metadata(wheel: Path) -> Message:
    return Parser().parsestr(wheel_text(wheel, "METADATA"))


def requirement_name(requirement: str) -> str:
    match = re.match(r"[A-Za-z0-9._-]+", requirement)
    assert match, requirement
    return match.group(0).lower().replace("_", "-")


class CaseKeepingParser(configparser.ConfigParser):
    def optionxform(self, optionstr: str) -> str:
        return optionstr


def entry_points(wheel: Path) -> dict[str, dict[str, str]]:
    parser = CaseKeepingParser(delimiters=("=",))
    parser.read_string(wheel_text(wheel, "entry_points.txt"))
    return {section: dict(parser[section]) for section in parser.sections()}


def test_the_client_wheel_needs_neither_torch_nor_the_worker(wheels: dict[str, Path]) -> None:
    wheel = wheels["qworker_client"]
    meta = metadata(wheel)
    assert meta["Name"] == "qworker-client"
    required = {requirement_name(r) for r in meta.get_all("Requires-Dist") or []}
    assert {"redis", "pydantic"} <= required and not required & {"torch", "numpy", "qworker-llm"}
    assert all(name.startswith("qworker_client/") for name in wheel_files(wheel))
    assert entry_points(wheel)["console_scripts"] == {"qworker": "qworker_client.cli:main"}
    files = set(wheel_files(wheel))  # the dashboard's pages and script travel with it
    assert {"qworker_client/dashboard/templates/base.html",
            "qworker_client/dashboard/static/dashboard.js"} <= files


def test_the_worker_wheel_pins_the_client_and_gives_torch_a_range(
    wheels: dict[str, Path],
) -> None:
    wheel = wheels["qworker_llm"]
    meta = metadata(wheel)
    requires = meta.get_all("Requires-Dist") or []
    client_version = metadata(wheels["qworker_client"])["Version"]
    assert meta["Name"] == "qworker-llm" and meta["Version"] == client_version
    assert f"qworker-client=={client_version}" in requires
    torch = [r.split(";")[0] for r in requires if requirement_name(r) == "torch"]
    assert torch and all(">=" in r and "==" not in r for r in torch), torch
    assert all(name.startswith("qworker/") for name in wheel_files(wheel))


def test_the_worker_registers_each_command_module_once(wheels: dict[str, Path]) -> None:
    points = entry_points(wheels["qworker_llm"])
    assert "console_scripts" not in points, "`qworker` is the client's script alone"
    modules = {p.stem for p in (ROOT / "qworker" / "commands").glob("*.py")
               if "\ndef register(" in p.read_text()}
    assert set(WORKER_COMMANDS) == modules
    assert points["qworker.commands"] == {
        name: f"qworker.commands.{name}:register" for name in WORKER_COMMANDS}


def test_the_client_alone_submits_a_job(client_bin: Path, redis_url: str) -> None:
    assert "--stream" in run([client_bin / "qworker", "submit", "--help"]).stdout
    assert "submit" in run([client_bin / "python", "-m", "qworker_client", "--help"]).stdout
    submitted = run([client_bin / "qworker", "submit", "hi", "--no-wait", "--id", "pkg-1",
                     "--redis-url", redis_url])
    assert submitted.stdout == "pkg-1\n"
    assert redis.Redis.from_url(redis_url).xlen("qw:jobs") == 1


@pytest.mark.parametrize("command", WORKER_COMMANDS)
def test_a_worker_command_without_the_worker_says_what_to_install(
    client_bin: Path, command: str
) -> None:
    proc = subprocess.run([client_bin / "qworker", command, "--help"], capture_output=True,
                          text=True, timeout=60, cwd=client_bin)
    assert (proc.returncode, proc.stdout) == (2, "")
    assert proc.stderr.count("\n") == 1 and INSTALL_HINT in proc.stderr, proc.stderr
    assert "qworker-llm" in INSTALL_HINT


def test_importing_the_client_imports_neither_torch_nor_numpy(client_bin: Path) -> None:
    code = (
        "import importlib, importlib.util, pkgutil, sys, qworker_client\n"
        "assert importlib.util.find_spec('torch') is None, 'the venv has torch'\n"
        "for m in pkgutil.walk_packages(qworker_client.__path__, 'qworker_client.'):\n"
        "    extra = m.name == 'qworker_client.rq' or m.name.startswith(\n"
        "        ('qworker_client.gateway', 'qworker_client.dashboard'))\n"
        "    if not extra and m.name != 'qworker_client.__main__':  # rq, gateway: their extras\n"
        "        importlib.import_module(m.name)\n"
        "importlib.import_module('qworker_client.cli').build_parser()\n"
        f"heavy = sorted(m for m in sys.modules if m.split('.')[0] in {HEAVY!r})\n"
        "assert not heavy, heavy\n"
    )
    run([client_bin / "python", "-c", code])


def test_the_worker_without_its_extra_names_what_is_missing(worker_bin: Path) -> None:
    assert "--redis-url" in run([worker_bin / "qworker", "serve", "--help"]).stdout
    proc = subprocess.run([worker_bin / "qworker", "generate", "hi"], capture_output=True,
                          text=True, timeout=60, cwd=worker_bin)
    assert (proc.returncode, proc.stdout) == (2, "")
    hint = f"qworker: `generate` needs the worker (torch is missing): {INSTALL_HINT}\n"
    assert proc.stderr == hint


def test_the_gateway_without_its_extra_says_what_to_install(client_bin: Path) -> None:
    proc = subprocess.run([client_bin / "qworker", "gateway", "--port", "1"], capture_output=True,
                          text=True, timeout=60, cwd=client_bin)
    assert (proc.returncode, proc.stdout) == (2, "")
    assert proc.stderr.count("\n") == 1 and "qworker-client[gateway]" in proc.stderr, proc.stderr
