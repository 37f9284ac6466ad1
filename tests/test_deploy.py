"""The deploy files agree with the code: they parse, their `qworker` commands and `QWORKER_*`
variables are the CLI's, their timeouts and ports match, the dashboard's metrics exist, and the
README's docker commands are the Dockerfile's."""

from __future__ import annotations

import json
import re
import shlex
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import redis
import yaml

from qworker.cli import build_parser
from qworker.commands.serve import env_name
from qworker.commands.up import STREAM_NODE_MAX_BYTES
from qworker.service.metrics import Metrics
from qworker.service.worker import EXIT_GRACE_S
from qworker_client.gateway.config import GatewayConfig
from qworker_client.gateway.metrics import Metrics as GatewayMetrics
from qworker_client.local_redis import free_port
from qworker_client.protocol import DEFAULT_GROUP, Keys
from qworker_client.stats import collect_stats

ROOT = Path(__file__).resolve().parents[1]
DEPLOY = ROOT / "deploy"
DOCKERFILE = DEPLOY / "Dockerfile"
COMPOSE = ROOT / "docker-compose.yml"
K8S = DEPLOY / "k8s"
DASHBOARD = DEPLOY / "grafana" / "qworker-dashboard.json"
YAML_FILES = sorted([COMPOSE, *DEPLOY.rglob("*.yaml"), *DEPLOY.rglob("*.yml")])
JSON_FILES = sorted([*DEPLOY.rglob("*.json"), ROOT / "examples" / "node" / "package.json"])


def load_yaml(path: Path) -> list[Any]:
    return [doc for doc in yaml.safe_load_all(path.read_text()) if doc is not None]


def k8s_docs() -> list[dict[str, Any]]:
    return [doc for path in sorted(K8S.glob("*.yaml")) for doc in load_yaml(path)]


def k8s(kind: str, name: str) -> dict[str, Any]:
    found = [d for d in k8s_docs() if d["kind"] == kind and d["metadata"]["name"] == name]
    assert len(found) == 1, (kind, name)
    return found[0]


def compose() -> dict[str, Any]:
    return load_yaml(COMPOSE)[0]


def serve_env_vars() -> set[str]:
    serve = build_parser()._subparsers._group_actions[0].choices["serve"]  # type: ignore[union-attr]
    return {env_name(opt) for action in serve._actions for opt in action.option_strings
            if opt.startswith("--") and opt != "--help"}


def dockerfile_instructions() -> list[tuple[str, str]]:
    """(INSTRUCTION, rest) with continuation lines joined, comments dropped."""
    text = re.sub(r"\\\n\s*", " ", DOCKERFILE.read_text())
    out = []
    for line in text.splitlines():
        line = line.strip()
        if line and not line.startswith("#"):
            word, _, rest = line.partition(" ")
            out.append((word.upper(), rest.strip()))
    return out


def dockerfile(instruction: str) -> list[str]:
    return [rest for word, rest in dockerfile_instructions() if word == instruction]


def exec_form(value: str) -> list[str]:
    parsed = json.loads(value)
    assert isinstance(parsed, list), value
    return parsed


def dockerfile_env() -> dict[str, str]:
    env: dict[str, str] = {}
    for rest in dockerfile("ENV"):
        env.update(dict(pair.split("=", 1) for pair in shlex.split(rest)))
    return env


def dockerfile_args() -> dict[str, str]:
    return dict(rest.split("=", 1) for rest in dockerfile("ARG") if "=" in rest)


def parse_qworker(argv: list[str], env: dict[str, str], monkeypatch: pytest.MonkeyPatch
                  ) -> Any:
    """The CLI's own parser over a command line, with the QWORKER_* variables it would see."""
    with monkeypatch.context() as m:
        for name, value in env.items():
            m.setenv(name, value)
        try:
            return build_parser().parse_args(argv)
        except SystemExit as exc:
            raise AssertionError(f"qworker {shlex.join(argv)} does not parse") from exc


def test_the_image_preloads_an_allocator_it_installs() -> None:
    preload = dockerfile_env()["LD_PRELOAD"]
    runs = " ".join(dockerfile("RUN"))
    assert "libtcmalloc-minimal4" in runs and "ln -s" in runs and preload in runs, (
        f"LD_PRELOAD={preload} is not a file the image makes")


def qworker_env(env: dict[str, str]) -> dict[str, str]:
    return {k: v for k, v in env.items() if k.startswith("QWORKER_")}


def compose_worker_env() -> dict[str, str]:
    return {k: str(v) for k, v in compose()["services"]["worker"]["environment"].items()}


def k8s_worker_env() -> dict[str, str]:
    env = dict(k8s("ConfigMap", "qworker-worker")["data"])
    container = k8s("Deployment", "qworker-worker")["spec"]["template"]["spec"]["containers"][0]
    for var in container.get("env", []):
        env[var["name"]] = var.get("value", "from-field")
    return env


def all_qworker_envs() -> Iterator[tuple[str, dict[str, str]]]:
    yield "Dockerfile", qworker_env(dockerfile_env())
    yield "docker-compose.yml worker", qworker_env(compose_worker_env())
    yield "k8s worker", qworker_env(k8s_worker_env())


# ---------------------------------------------------------------------- parsing


@pytest.mark.parametrize("path", YAML_FILES, ids=lambda p: str(p.relative_to(ROOT)))
def test_every_yaml_file_parses(path: Path) -> None:
    assert load_yaml(path)


@pytest.mark.parametrize("path", JSON_FILES, ids=lambda p: str(p.relative_to(ROOT)))
def test_every_json_file_parses(path: Path) -> None:
    assert json.loads(path.read_text())


def test_inline_python_of_the_healthchecks_compiles() -> None:
    checks = [exec_form(dockerfile("HEALTHCHECK")[0].split("CMD", 1)[1].strip()),
              compose()["services"]["worker"]["healthcheck"]["test"]]
    for check in checks:
        assert check[:2] == ["python", "-c"] or check[:3] == ["CMD", "python", "-c"], check
        compile(check[-1], "healthcheck", "exec")
        assert "/healthz" in check[-1]


# ---------------------------------------------------------------------- the CLI's flags


# variables read by the code itself rather than through a flag
NOT_FLAGS = {"QWORKER_HOME"}


def test_the_variables_that_are_not_flags_are_read_by_the_code() -> None:
    source = " ".join(p.read_text() for p in (ROOT / "qworker").rglob("*.py"))
    for name in NOT_FLAGS:
        assert f'"{name}"' in source, name


@pytest.mark.parametrize("where,env", list(all_qworker_envs()),
                         ids=[where for where, _ in all_qworker_envs()])
def test_every_qworker_variable_is_a_serve_flag(where: str, env: dict[str, str]) -> None:
    unknown = set(env) - serve_env_vars() - NOT_FLAGS
    assert not unknown, f"{where}: no serve flag for {sorted(unknown)}"


def test_the_image_entrypoint_runs_serve_with_each_deploy_environment(
        monkeypatch: pytest.MonkeyPatch) -> None:
    entrypoint = exec_form(dockerfile("ENTRYPOINT")[0])
    assert entrypoint[:2] == ["qworker", "serve"]
    image_env = qworker_env(dockerfile_env())
    for where, env in list(all_qworker_envs())[1:]:  # the image's, with compose's or k8s'
        args = parse_qworker(entrypoint[1:], {**image_env, **env}, monkeypatch)
        assert args.command == "serve", where
        assert args.redis_url and args.model, where
    args = parse_qworker(entrypoint[1:], {**image_env, **compose_worker_env()}, monkeypatch)
    assert (args.metrics_port, args.drain_timeout) == (9100, 30.0)


def test_qworker_commands_in_the_dockerfile_parse(monkeypatch: pytest.MonkeyPatch) -> None:
    runs = [r for r in dockerfile("RUN") if "qworker " in r]
    assert runs, "the Dockerfile fetches the model with `qworker model fetch`"
    for run in runs:
        command = run.split("qworker ", 1)[1].split(";", 1)[0].split("&&", 1)[0]
        for name, value in dockerfile_args().items():
            command = command.replace(f'"${name}"', value).replace(f"${name}", value)
        args = parse_qworker(shlex.split(command), {}, monkeypatch)
        assert (args.command, args.model_command, args.name) == ("model", "fetch", "smollm2")


def test_the_compose_producer_is_a_qworker_command(monkeypatch: pytest.MonkeyPatch) -> None:
    producer = compose()["services"]["producer"]
    assert producer["entrypoint"] == ["qworker"]
    args = parse_qworker(producer["command"], {}, monkeypatch)
    assert args.command == "submit" and args.stream
    assert producer["environment"]["REDIS_URL"] == compose_worker_env()["QWORKER_REDIS_URL"]


def test_k8s_worker_runs_the_image_entrypoint() -> None:
    container = k8s("Deployment", "qworker-worker")["spec"]["template"]["spec"]["containers"][0]
    assert "command" not in container and not container.get("args"), "flags go by QWORKER_*"


# ---------------------------------------------------------------------- the README


def readme_commands(prefix: str) -> list[str]:
    lines = (ROOT / "README.md").read_text().splitlines()
    return [line.split("  #", 1)[0].strip() for line in lines if line.startswith(prefix)]


def test_the_readme_docker_commands_are_the_dockerfiles(monkeypatch: pytest.MonkeyPatch) -> None:
    in_dockerfile = [line.lstrip("#").strip() for line in DOCKERFILE.read_text().splitlines()
                     if line.startswith("#   docker ")]
    assert in_dockerfile and set(in_dockerfile) <= set(readme_commands("docker ")), (
        "the commands in the Dockerfile's header are the README's")
    build = shlex.split(readme_commands("docker build")[0])
    assert (ROOT / build[build.index("-f") + 1]) == DOCKERFILE and build[-1] == "."
    tag = build[build.index("-t") + 1]
    assert compose()["services"]["worker"]["image"].split(":")[0] == tag
    assert compose()["services"]["worker"]["build"]["dockerfile"] == "deploy/Dockerfile"
    run = shlex.split(readme_commands("docker run")[0])
    image_args = run[run.index(tag) + 1:]
    entrypoint = exec_form(dockerfile("ENTRYPOINT")[0])
    args = parse_qworker([*entrypoint[1:], *image_args], {}, monkeypatch)
    assert args.command == "serve" and args.model == "smollm2"
    assert f"{args.metrics_port or dockerfile_env()['QWORKER_METRICS_PORT']}:" in " ".join(run)


def test_the_readme_compose_and_kubectl_commands_match_the_files() -> None:
    profiles = {p for s in compose()["services"].values() for p in s.get("profiles", [])}
    for command in readme_commands("docker compose"):
        words = shlex.split(command)
        if "--profile" in words:
            assert words[words.index("--profile") + 1] in profiles, command
    for command in readme_commands("kubectl apply -k"):
        folder = ROOT / shlex.split(command)[-1]
        assert (folder / "kustomization.yaml").is_file(), command
        listed = load_yaml(folder / "kustomization.yaml")[0]["resources"]
        assert sorted(listed) == sorted(p.name for p in folder.glob("*.yaml")
                                        if p.name != "kustomization.yaml")


def test_makefile_has_a_phony_demo_target() -> None:
    makefile = (ROOT / "Makefile").read_text()
    assert re.search(r"^\.PHONY:.*\bdemo\b", makefile, re.M)
    assert re.search(r"^demo: install\n\t\$\(BIN\)/qworker demo$", makefile, re.M)


# ---------------------------------------------------------------------- timeouts, ports, Redis


def seconds(duration: str) -> float:
    match = re.fullmatch(r"(\d+)(s|m)", duration)
    assert match, duration
    return int(match.group(1)) * (60 if match.group(2) == "m" else 1)


def test_stopping_waits_longer_than_the_drain() -> None:
    drain = float(compose_worker_env()["QWORKER_DRAIN_TIMEOUT"])
    assert seconds(compose()["services"]["worker"]["stop_grace_period"]) > drain + EXIT_GRACE_S
    pod = k8s("Deployment", "qworker-worker")["spec"]["template"]["spec"]
    pre_stop = pod["containers"][0]["lifecycle"]["preStop"]["exec"]["command"]
    assert pre_stop[0] == "sleep"
    k8s_drain = float(k8s_worker_env()["QWORKER_DRAIN_TIMEOUT"])
    assert pod["terminationGracePeriodSeconds"] > float(pre_stop[1]) + k8s_drain + EXIT_GRACE_S


def test_the_metrics_port_is_loopback_unless_a_manifest_says_otherwise(
        monkeypatch: pytest.MonkeyPatch) -> None:
    args = parse_qworker(["serve", "--redis-url", "redis://r/0", "--model", "sim"], {},
                         monkeypatch)
    assert args.metrics_host == "127.0.0.1"
    metrics = Metrics()
    metrics.serve(free_port())
    try:
        assert metrics._server is not None
        assert metrics._server.server_address[0] == "127.0.0.1"
    finally:
        metrics.close()
    for where, env in all_qworker_envs():  # the image's, compose's, k8s' (probes, scrapes)
        assert env["QWORKER_METRICS_HOST"] == "0.0.0.0", where


def test_probes_and_scrapes_use_the_metrics_port() -> None:
    port = int(dockerfile_env()["QWORKER_METRICS_PORT"])
    assert dockerfile("EXPOSE")[0].split() == [str(port), str(GatewayConfig.port)]
    assert int(compose_worker_env()["QWORKER_METRICS_PORT"]) == port
    assert f"127.0.0.1:{port}/healthz" in " ".join(compose()["services"]["worker"]["healthcheck"]
                                                    ["test"])
    container = k8s("Deployment", "qworker-worker")["spec"]["template"]["spec"]["containers"][0]
    assert int(k8s_worker_env()["QWORKER_METRICS_PORT"]) == port
    assert container["ports"] == [{"name": "metrics", "containerPort": port}]
    probes = {name: container[name]["httpGet"] for name in
              ("startupProbe", "livenessProbe", "readinessProbe")}
    assert {p["port"] for p in probes.values()} == {"metrics"}
    assert probes["livenessProbe"]["path"] == "/livez"
    assert probes["readinessProbe"]["path"] == "/healthz"
    assert {"cpu", "memory"} <= set(container["resources"]["requests"])
    scrape = load_yaml(DEPLOY / "prometheus" / "prometheus.yml")[0]["scrape_configs"][0]
    assert scrape["dns_sd_configs"][0] == {"names": ["worker"], "type": "A", "port": port,
                                           "refresh_interval": "15s"}


REDIS_SETTINGS = {"appendonly": "yes", "appendfsync": "everysec", "maxmemory-policy": "noeviction",
                  "stream-node-max-bytes": STREAM_NODE_MAX_BYTES}
MEMORY_UNITS = {"": 1, "b": 1, "k": 1000, "kb": 1024, "m": 10**6, "mb": 1024**2, "g": 10**9,
                "gb": 1024**3}
K8S_MEMORY_UNITS = {"Mi": 1024**2, "Gi": 1024**3}


def redis_bytes(value: str) -> int:
    """A redis.conf memory size (`1gb`, `1536mb`, `100000`) in bytes."""
    match = re.fullmatch(r"(\d+)([a-z]*)", value.lower())
    assert match and match.group(2) in MEMORY_UNITS, value
    return int(match.group(1)) * MEMORY_UNITS[match.group(2)]


def k8s_bytes(value: str) -> int:
    match = re.fullmatch(r"(\d+)(Mi|Gi)", value)
    assert match, value
    return int(match.group(1)) * K8S_MEMORY_UNITS[match.group(2)]


def redis_conf() -> dict[str, str]:
    conf = k8s("ConfigMap", "qworker-redis")["data"]["redis.conf"]
    lines = [line.strip() for line in conf.splitlines()]
    return dict(line.split(" ", 1) for line in lines if line and not line.startswith("#"))


def test_redis_keeps_jobs_aof_and_no_eviction() -> None:
    service = compose()["services"]["redis"]
    assert service["image"].startswith("redis:7")
    flags = service["command"]
    assert flags[0] == "redis-server"
    for key, value in REDIS_SETTINGS.items():
        assert flags[flags.index(f"--{key}") + 1] == value
    assert any(v.endswith(":/data") for v in service["volumes"])
    settings = redis_conf()
    assert {k: settings[k] for k in REDIS_SETTINGS} == REDIS_SETTINGS
    sts = k8s("StatefulSet", "qworker-redis")
    assert sts["spec"]["template"]["spec"]["containers"][0]["image"].startswith("redis:7")
    assert sts["spec"]["volumeClaimTemplates"][0]["metadata"]["name"] == "data"


def test_redis_memory_is_bounded_below_what_the_container_may_use() -> None:
    """noeviction only acts under a maxmemory: without one the kernel OOM-kills Redis instead
    of Redis refusing writes."""
    flags = compose()["services"]["redis"]["command"]
    assert redis_bytes(flags[flags.index("--maxmemory") + 1]) >= 256 * 1024**2
    container = k8s("StatefulSet", "qworker-redis")["spec"]["template"]["spec"]["containers"][0]
    limit = k8s_bytes(container["resources"]["limits"]["memory"])
    maxmemory = redis_bytes(redis_conf()["maxmemory"])
    assert 256 * 1024**2 <= maxmemory <= 0.8 * limit, (maxmemory, limit)


def keda_triggers() -> list[dict[str, Any]]:
    return k8s("ScaledObject", "qworker-worker")["spec"]["triggers"]


def test_keda_scales_on_the_length_of_every_work_stream_of_every_band() -> None:
    keys = Keys("qw")
    scaled = k8s("ScaledObject", "qworker-worker")["spec"]
    assert scaled["scaleTargetRef"]["name"] == "qworker-worker"
    triggers = keda_triggers()
    assert {t["type"] for t in triggers} == {"redis-streams"}
    # every stream a worker of the model reads: tests/test_deploy_gateway.py
    assert {keys.jobs, keys.requeue, keys.jobs_of(None, "high"), keys.jobs_of(None, "low")} <= {
        t["metadata"]["stream"] for t in triggers}
    redis_url = k8s_worker_env()["QWORKER_REDIS_URL"]
    batch = int(k8s_worker_env()["QWORKER_MAX_NUM_SEQS"])
    for t in triggers:
        meta = t["metadata"]
        # KEDA's XLEN mode: no consumerGroup (with one it reads XPENDING or the lag instead)
        assert not {"consumerGroup", "lagCount", "pendingEntriesCount"} & set(meta), meta
        assert int(meta["streamLength"]) == batch  # one worker per full batch of jobs
        assert f"//{meta['address']}/{meta['databaseIndex']}" in redis_url
    service = k8s("Service", "qw-redis")
    assert service["spec"]["ports"][0]["port"] == 6379
    pdb = k8s("PodDisruptionBudget", "qworker-worker")["spec"]
    pod_labels = k8s("Deployment", "qworker-worker")["spec"]["template"]["metadata"]["labels"]
    assert pdb["selector"]["matchLabels"].items() <= pod_labels.items()


def keda_value(client: Any, meta: dict[str, str]) -> int:
    """What KEDA's redis-streams scaler reads for a trigger (pkg/scalers/redis_streams_scaler.go:
    XPENDING with consumerGroup + pendingEntriesCount, the group's lag with lagCount, else XLEN;
    a NULL lag reads as 0)."""
    if "consumerGroup" not in meta:
        return int(client.xlen(meta["stream"]))
    groups = {g["name"]: g for g in client.xinfo_groups(meta["stream"])}
    group = groups[meta["consumerGroup"]]
    if "lagCount" in meta:
        return int(group["lag"] or 0)
    return int(group["pending"])


def null_lag_state(client: Any, stream: str) -> tuple[int, int]:
    """The state of a busy fleet: 6 entries, 3 delivered, the last delivered one acked and
    deleted while the older two are pending, then 4 more queued. (pending, undelivered)."""
    client.xgroup_create(stream, DEFAULT_GROUP, id="0", mkstream=True)
    ids = [client.xadd(stream, {"prompt": f"p{n}"}) for n in range(6)]
    client.xreadgroup(DEFAULT_GROUP, "w1", {stream: ">"}, count=3)
    client.xack(stream, DEFAULT_GROUP, ids[2])
    client.xdel(stream, ids[2])
    for n in range(4):
        client.xadd(stream, {"prompt": f"q{n}"})
    return 2, 3 + 4


def test_the_keda_signal_counts_the_backlog_where_the_lag_is_null(redis_url: str) -> None:
    client = redis.Redis.from_url(redis_url, decode_responses=True)
    keys = Keys("qw")
    pending, undelivered = null_lag_state(client, keys.jobs)
    client.xadd(keys.requeue, {"prompt": "resumed"})  # one requeued, not yet taken
    lag_trigger = {"stream": keys.jobs, "consumerGroup": DEFAULT_GROUP, "lagCount": "16"}
    assert client.xinfo_groups(keys.jobs)[0]["lag"] is None, "Redis reports no lag here"
    assert keda_value(client, lag_trigger) == 0, "the old trigger saw no work at all"
    values = {t["metadata"]["stream"]: keda_value(client, t["metadata"]) for t in keda_triggers()}
    assert values == {**dict.fromkeys(values, 0), keys.jobs: pending + undelivered,
                      keys.requeue: 1}
    stats = collect_stats(client, keys)
    assert (stats.backlog, stats.unfinished) == (undelivered + 1, pending + undelivered + 1)


def test_dockerfile_builds_the_package_as_a_non_root_user() -> None:
    assert dockerfile("FROM") == ["python:3.11-slim"]
    runs = " ".join(dockerfile("RUN"))
    pinned = re.search(r"install --quiet torch==([\d.]+)", (ROOT / "Makefile").read_text())
    assert pinned and f"torch=={pinned.group(1)} --index-url" in runs, "the pin of make install"
    assert "download.pytorch.org/whl/cpu" in runs
    assert "pip install './producer[gateway]' '.[worker]'" in runs, (
        "the client (with the gateway) first, then the worker")


def test_the_docker_context_holds_every_copied_path() -> None:
    allowed = {line.lstrip("!").rstrip("/") for line in
               (DEPLOY / "Dockerfile.dockerignore").read_text().splitlines()
               if line.startswith("!")}
    copied = {source for rest in dockerfile("COPY") for source in rest.split()[:-1]
              if not source.startswith("--")}
    assert copied and copied <= allowed, copied - allowed
    users = dockerfile("USER")
    assert users and users[-1] not in ("root", "0")
    assert dockerfile_env()["QWORKER_HOME"] == "/models"


# ---------------------------------------------------------------------- the dashboard


def exported_names() -> set[str]:
    names = {"up"}
    families = [*Metrics().registry.collect(), *GatewayMetrics().registry.collect()]
    for family in families:
        if family.type == "counter":
            names |= {f"{family.name}_total"}
        elif family.type == "histogram":
            names |= {f"{family.name}_{suffix}" for suffix in ("bucket", "sum", "count")}
        else:
            names.add(family.name)
    return names


def dashboard_exprs() -> list[str]:
    panels = json.loads(DASHBOARD.read_text())["panels"]
    return [t["expr"] for p in panels for t in p["targets"]]


def test_the_dashboard_queries_only_exported_metrics() -> None:
    used = {m for e in dashboard_exprs() for m in re.findall(r"\b(qworker_\w+|up)\{", e)}
    missing = used - exported_names()
    assert not missing, f"the dashboard queries metrics no worker exports: {sorted(missing)}"


def test_the_dashboard_shows_every_metric_of_the_issue() -> None:
    used = " ".join(dashboard_exprs())
    for metric in ("requests_running", "requests_waiting", "kv_blocks_free", "kv_blocks_used",
                   "generated_tokens", "prompt_tokens", "ttft_seconds", "inter_token_seconds",
                   "queue_seconds", "job_seconds", "preemptions", "requeues", "reclaimed",
                   "dead_letters", "step_seconds", "batch_size"):
        assert f"qworker_{metric}" in used, metric
