"""What a new user meets first: `--version`, a wrong `--log-level`, `generate`'s sampling, the
README's first Python example, and the extra that `qworker up`'s embedded Redis needs."""

from __future__ import annotations

import argparse
import re
import subprocess
import sys
from importlib import metadata

import pytest
import redis
import structlog
import tomllib

from qworker.cli import build_parser, main
from qworker.commands import up
from qworker.commands.serve import LOG_LEVELS
from qworker.engine.request import SamplingParams
from qworker.service.logs import configure_logging, get_logger
from qworker_client import Producer
from qworker_client.protocol import Job, Keys
from tests.service_harness import ROOT, checkout_env
from tests.worker_process import sim_worker

SERVE = ["serve", "--redis-url", "redis://r:1/0", "--model", "sim"]


def test_version_names_the_client_and_the_worker(capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit) as done:
        build_parser().parse_args(["--version"])
    assert done.value.code == 0
    out = capsys.readouterr().out
    assert f"qworker-client {metadata.version('qworker-client')}" in out
    assert f"qworker-llm {metadata.version('qworker-llm')}" in out


def test_version_from_the_installed_command() -> None:
    ran = subprocess.run([sys.executable, "-m", "qworker.cli", "--version"], cwd=ROOT,
                         capture_output=True, text=True, timeout=60)
    assert ran.returncode == 0 and ran.stdout.startswith("qworker-client "), ran.stderr


@pytest.mark.parametrize("given_as", ["flag", "env"])
def test_an_unknown_log_level_is_a_usage_error(given_as: str, monkeypatch: pytest.MonkeyPatch,
                                               capsys: pytest.CaptureFixture[str]) -> None:
    argv = [*SERVE, "--log-level", "verbose"] if given_as == "flag" else SERVE
    if given_as == "env":
        monkeypatch.setenv("QWORKER_LOG_LEVEL", "verbose")
    with pytest.raises(SystemExit) as done:
        build_parser().parse_args(argv)
    assert done.value.code == 2
    err = capsys.readouterr().err
    assert "--log-level: invalid choice: 'verbose'" in err and "debug, info" in err


def test_every_log_level_offered_filters_as_named(capsys: pytest.CaptureFixture[str]) -> None:
    try:
        for level in LOG_LEVELS:
            args = build_parser().parse_args([*SERVE, "--log-level", level])
            configure_logging(args.log_level, json=True)
            get_logger().debug("a debug line")
            get_logger().error("an error line")
            err = capsys.readouterr().err
            assert "an error line" in err, level
            assert ("a debug line" in err) == (level == "debug"), level
    finally:
        structlog.reset_defaults()  # later tests capture what the worker logs


def generate_parser() -> argparse.ArgumentParser:
    parser = build_parser()
    subparsers = next(a for a in parser._actions if isinstance(a, argparse._SubParsersAction))
    return subparsers.choices["generate"]


def test_generate_samples_as_a_job_does_and_says_how_to_be_greedy() -> None:
    args = generate_parser().parse_args(["hi"])
    for name in ("max_tokens", "temperature", "top_p", "top_k", "seed"):
        assert getattr(args, name) == Job.model_fields[name].default, name
    assert args.max_tokens == SamplingParams().max_tokens
    for name in ("temperature", "top_p", "top_k"):  # unset: the model's default, as a job's
        assert getattr(args, name) is None, name
    assert SamplingParams().temperature > 0
    assert "--temperature 0" in generate_parser().format_help()


def test_generate_runs_the_simulated_engine(capsys: pytest.CaptureFixture[str]) -> None:
    argv = ["generate", "--model", "sim:step_ms=0", "--max-tokens", "9", "--seed", "4", "hi"]
    assert main(argv) == 0
    first = capsys.readouterr().out
    assert main(argv) == 0
    assert capsys.readouterr().out == first and len(first.strip()) > 0


def readme_first_python_example() -> str:
    text = (ROOT / "README.md").read_text()
    blocks = re.findall(r"```python\n(.*?)```", text, re.S)
    assert blocks and "Producer" in blocks[0], "the README's first example submits a job"
    return blocks[0]


def test_the_readme_example_prints_the_answer_once(redis_url: str) -> None:
    code = readme_first_python_example()
    assert "redis://localhost:6379/0" in code
    code = code.replace("redis://localhost:6379/0", redis_url)
    with sim_worker(redis_url, "readme-1"):
        ran = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True,
                             text=True, timeout=60, env=checkout_env())
    assert ran.returncode == 0, ran.stderr
    client = redis.Redis.from_url(redis_url, decode_responses=True)
    (key,) = client.scan_iter(match=Keys().out("*"))
    client.close()
    with Producer(redis_url) as producer:
        done = producer.job(str(key).split(":out:", 1)[1]).result(timeout=10)
    assert done.usage.completion_tokens > 0
    assert ran.stdout == done.text + "\n"


def test_fakeredis_is_the_embedded_extra_that_up_names() -> None:
    project = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]
    extras = project["optional-dependencies"]
    assert any(d.startswith("fakeredis[lua]") for d in extras["embedded"])
    assert not any(d.startswith("fakeredis") for d in extras["worker"] + project["dependencies"])
    assert f"pip install '{project['name']}[embedded]'" == up.EMBEDDED_EXTRA
    assert up.EMBEDDED_EXTRA in up.NO_REDIS


def test_up_without_fakeredis_names_the_extra(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setitem(sys.modules, "fakeredis", None)  # as if not installed
    with pytest.raises(up.RedisProcessError, match=re.escape(up.EMBEDDED_EXTRA)):
        up.EmbeddedRedis().start()
