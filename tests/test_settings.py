"""Settings stated once: each field of ServiceConfig, EngineConfig, UpConfig and UpGatewayConfig is
a `qworker serve` / `up` flag and a QWORKER_* variable, with the field's default, and parses back
into that field (a variable that does not parse is ignored with one warning); every sampling field
of a Job is carried to SamplingParams under its own name."""

from __future__ import annotations

import argparse
import dataclasses
import os
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from qworker.cli import build_parser
from qworker.commands import serve
from qworker.commands.config_flags import Flag, env_name, flag_name, flags_of
from qworker.commands.up import EmbeddedRedis, LocalRedis, UpConfig, choose_redis
from qworker.commands.up_gateway import UpGatewayConfig
from qworker.engine.config import EngineConfig
from qworker.engine.request import SamplingParams, StructuredOutputs
from qworker.service.config import ServiceConfig
from qworker.service.worker import JOB_NOT_SAMPLING, default_seed, sampling_params
from qworker_client.protocol import Job

# config fields that are no flag, and why
NOT_FLAGS = {
    (ServiceConfig, "model"): "the engine's --model fills it",
    (ServiceConfig, "block_ms"): "how long an idle read blocks: internal",
    (ServiceConfig, "backoff_min_s"): "Redis retry pacing: internal",
    (ServiceConfig, "backoff_max_s"): "Redis retry pacing: internal",
    (EngineConfig, "watermark"): "a tuning of the scheduler, not an operator's setting",
    (EngineConfig, "requeue_preempted"): "a worker always requeues",
}
# flags of `serve` that are no config field
NOT_CONFIG = {"--log-level", "--on-done-rq-queue", "--on-done-rq-func"}
SERVE_CONFIGS = (ServiceConfig, EngineConfig)
UP_CONFIGS = (*SERVE_CONFIGS, UpConfig, UpGatewayConfig)
REQUIRED = ["--redis-url", "redis://r:1/0", "--model", "sim"]
# fields whose flag has no default: `serve` requires it, `up` starts a Redis without it
NO_DEFAULT = {"redis_url"}


@pytest.fixture(autouse=True)
def no_qworker_env(monkeypatch: pytest.MonkeyPatch) -> None:
    for name in [n for n in os.environ if n.startswith("QWORKER_") and n != "QWORKER_HOME"]:
        monkeypatch.delenv(name)


def command(name: str) -> argparse.ArgumentParser:
    """The sub-command's parser of the real `qworker` command (built now: it reads the env)."""
    parser = build_parser()
    subparsers = next(a for a in parser._actions if isinstance(a, argparse._SubParsersAction))
    return subparsers.choices[name]


def flags_in(parser: argparse.ArgumentParser) -> set[str]:
    return {opt for action in parser._actions for opt in action.option_strings
            if opt.startswith("--") and opt != "--help"}


def config_flags(*classes: type) -> Iterator[tuple[type, Flag]]:
    for cls in classes:
        for flag in flags_of(cls):
            yield cls, flag


def test_no_config_field_lacks_a_flag_but_the_listed_ones() -> None:
    unflagged = {(cls, f.name) for cls in UP_CONFIGS for f in dataclasses.fields(cls)
                 if flag_name(f) is None}
    assert unflagged == set(NOT_FLAGS)


@pytest.mark.parametrize("name,classes", [("serve", SERVE_CONFIGS), ("up", UP_CONFIGS)])
def test_every_flag_is_a_config_field_and_every_field_a_flag(name: str,
                                                             classes: tuple[type, ...]) -> None:
    from_fields = {flag.name for _, flag in config_flags(*classes)}
    assert len(from_fields) == sum(1 for _ in config_flags(*classes)), "one flag per field"
    assert flags_in(command(name)) == from_fields | NOT_CONFIG


def test_every_flag_says_its_variable_and_the_fields_default() -> None:
    helps = {a.option_strings[0]: a.help or "" for a in command("up")._actions}
    for cls, flag in config_flags(*UP_CONFIGS):
        assert f"env {env_name(flag.name)}" in helps[flag.name], flag.name
        field = next(f for f in dataclasses.fields(cls) if f.name == flag.field)
        if field.default not in (dataclasses.MISSING, None) and field.name not in NO_DEFAULT:
            assert f"default {field.default})" in helps[flag.name], flag.name


def test_unset_flags_give_each_configs_own_defaults() -> None:
    args = command("serve").parse_args(REQUIRED)
    service = serve.service_config(args)
    assert service == dataclasses.replace(ServiceConfig(), redis_url="redis://r:1/0",
                                          name=service.name, model="sim")
    assert serve.engine_config(args) == EngineConfig(model="sim", requeue_preempted=True)


def other_value(flag: Flag) -> str:
    """A valid value of the flag's type that is not its default."""
    if flag.choices:
        return next(c for c in flag.choices if c != flag.default)
    if flag.type is bool:
        return "1"  # given: the other value of its field
    if flag.type is int:
        return str((flag.default or 0) + 3)
    if flag.type is float:
        return str((flag.default or 1.0) * 1.5)  # within a share's range too
    return f"x-{flag.field}"


@pytest.mark.parametrize("given_as", ["flag", "env"])
def test_each_serve_flag_reaches_its_config_field(given_as: str,
                                                  monkeypatch: pytest.MonkeyPatch) -> None:
    argv = list(REQUIRED)
    expected = {}
    for cls, flag in config_flags(*SERVE_CONFIGS):
        value = other_value(flag)
        expected[cls, flag.field] = not flag.default if flag.type is bool else flag.type(value)
        if given_as == "env":
            monkeypatch.setenv(env_name(flag.name), value)
        elif flag.name in ("--redis-url", "--model"):
            argv[argv.index(flag.name) + 1] = value
        else:
            argv += [flag.name] if flag.type is bool else [flag.name, value]
    args = command("serve").parse_args([] if given_as == "env" else argv)
    built = {ServiceConfig: serve.service_config(args), EngineConfig: serve.engine_config(args)}
    for (cls, field), value in expected.items():
        assert getattr(built[cls], field) == value, (cls.__name__, field)


@pytest.mark.parametrize("given_as", ["flag", "env"])
def test_the_up_flags_reach_the_redis_it_starts(given_as: str,
                                                monkeypatch: pytest.MonkeyPatch) -> None:
    values = {"--data-dir": "/tmp/x-up", "--redis-port": "7", "--redis-maxmemory": "5mb"}
    if given_as == "env":
        for flag, value in values.items():
            monkeypatch.setenv(env_name(flag), value)
        args = command("up").parse_args([])
    else:
        args = command("up").parse_args([word for pair in values.items() for word in pair])
    monkeypatch.setattr("shutil.which", lambda _name: "/bin/redis-server")
    own, why = choose_redis(args)
    assert isinstance(own, LocalRedis) and why is None
    assert (own.data_dir, own.port, own.maxmemory) == (Path("/tmp/x-up"), 7, "5mb")
    assert args.model == EngineConfig.model and args.redis_url is None


def test_up_embedded_from_the_flag_or_the_environment(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr("shutil.which", lambda _name: "/bin/redis-server")
    assert isinstance(choose_redis(command("up").parse_args([]))[0], LocalRedis)
    assert isinstance(choose_redis(command("up").parse_args(["--embedded"]))[0], EmbeddedRedis)
    monkeypatch.setenv("QWORKER_EMBEDDED", "1")
    own, why = choose_redis(command("up").parse_args([]))
    assert isinstance(own, EmbeddedRedis) and why == "--embedded"


@pytest.fixture
def fresh_warnings(monkeypatch: pytest.MonkeyPatch) -> None:
    """Each variable is warned about once per process: forget the ones warned already."""
    monkeypatch.setattr("qworker_client.env._warned", set())


@pytest.mark.usefixtures("fresh_warnings")
def test_a_variable_that_does_not_parse_is_ignored_with_one_warning(
        monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]) -> None:
    monkeypatch.setattr("shutil.which", lambda _name: "/bin/redis-server")
    monkeypatch.setenv("QWORKER_EMBEDDED", "maybe")  # a bool: read as the parser is built
    monkeypatch.setenv("QWORKER_MAX_NUM_SEQS", "tcp://10.0.0.5:8000")
    monkeypatch.setenv("QWORKER_PORT", "tcp://10.0.0.5:8000")  # a Service named `qworker`
    monkeypatch.setenv("QWORKER_DRAIN_TIMEOUT", "soon")
    args = command("up").parse_args([])
    own, _ = choose_redis(args)
    assert isinstance(own, LocalRedis), "QWORKER_EMBEDDED=maybe: the default, not embedded"
    assert (args.max_num_seqs, args.port, args.drain_timeout) == (
        EngineConfig.max_num_seqs, UpGatewayConfig.port, ServiceConfig.drain_timeout)
    lines = capsys.readouterr().err.splitlines()
    assert sorted(line.split("=")[0] for line in lines) == [
        f"qworker: warning: ignoring QWORKER_{n}" for n in
        ("DRAIN_TIMEOUT", "EMBEDDED", "MAX_NUM_SEQS", "PORT")], lines
    port_line = next(line for line in lines if "QWORKER_PORT" in line)
    assert "not an integer" in port_line and "Service named 'qworker'" in port_line


@pytest.mark.usefixtures("fresh_warnings")
def test_a_given_flag_leaves_its_variable_unread(monkeypatch: pytest.MonkeyPatch,
                                                 capsys: pytest.CaptureFixture[str]) -> None:
    monkeypatch.setenv("QWORKER_MAX_NUM_SEQS", "many")
    args = command("serve").parse_args([*REQUIRED, "--max-num-seqs", "5"])
    assert args.max_num_seqs == 5 and capsys.readouterr().err == ""
    with pytest.raises(SystemExit) as bad:
        command("serve").parse_args([*REQUIRED, "--max-num-seqs", "many"])
    assert bad.value.code == 2, "on the command line it stays a usage error"
    assert "--max-num-seqs: invalid int value: 'many'" in capsys.readouterr().err


def test_the_stall_timeout_flag_is_the_stall_timeout_s_field() -> None:
    args = command("serve").parse_args([*REQUIRED, "--stall-timeout", "9"])
    assert serve.service_config(args).stall_timeout_s == 9.0


def test_an_empty_worker_name_is_the_host_pid_default(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("QWORKER_NAME", "")
    name = serve.service_config(command("serve").parse_args(REQUIRED)).name
    assert name == ServiceConfig(model="sim").name and name


# ---------------------------------------------------------------------- a job's sampling


SAMPLING_FIELDS = {f.name for f in dataclasses.fields(SamplingParams)}
# one value for each sampling field, none of them the default
SAMPLED: dict[str, Any] = {
    "max_tokens": 7, "temperature": 0.5, "top_p": 0.9, "top_k": 3, "min_p": 0.1, "seed": 11,
    "stop": ["zz"], "stop_token_ids": [5], "ignore_eos": True, "min_tokens": 2,
    "repetition_penalty": 1.2, "presence_penalty": 0.3, "frequency_penalty": 0.4}
SAMPLED.update(logprobs=3, prompt_logprobs=2, speculate=False)
SAMPLED["structured_outputs"] = {"regex": "[ab]+"}
# what the engine gets where it is not the job's value itself (or its list as a tuple)
CARRIED: dict[str, Any] = {"structured_outputs": StructuredOutputs(regex="[ab]+")}


def test_a_jobs_sampling_fields_are_the_sampling_params_fields() -> None:
    assert set(Job.model_fields) - JOB_NOT_SAMPLING == SAMPLING_FIELDS
    assert set(Job.model_fields) >= JOB_NOT_SAMPLING


def test_each_sampling_field_of_a_job_is_carried() -> None:
    assert set(SAMPLED) == SAMPLING_FIELDS
    params = sampling_params(Job(prompt="x", **SAMPLED), "1-0")
    default = SamplingParams()
    for name, value in SAMPLED.items():
        carried = CARRIED.get(name, tuple(value) if isinstance(value, list) else value)
        assert getattr(params, name) == carried != getattr(default, name), name


def test_a_job_and_the_engine_default_alike() -> None:
    params = sampling_params(Job(prompt="x"), "1-0")
    assert params == dataclasses.replace(SamplingParams(), seed=default_seed("1-0"))
