"""The gateway deployed, and the workers autoscaled on what it queues: the image installs the
gateway and imports it at build time, Compose and Kubernetes run it with variables its own CLI
reads, the dashboard shows its latencies; KEDA has a trigger on every stream a worker of the
deployed model reads (computed from the worker's code, not listed here), so gateway traffic alone
wakes a fleet scaled to zero; and no Service's variables are ones a qworker command reads."""

from __future__ import annotations

import json
import re
import subprocess
import sys
from typing import Any

import pytest
import redis

from qworker.cli import build_parser
from qworker.commands import serve
from qworker.commands.config_flags import env_name
from qworker.commands.up_gateway import UpGatewayConfig
from qworker.engine.config import EngineConfig
from qworker_client.gateway.config import base_url
from qworker_client.protocol import Keys
from tests.gateway_harness import OpenRequest, gateway, live_worker
from tests.service_harness import ROOT, checkout_env, sim_engine, wait_for
from tests.test_deploy import (
    DEPLOY,
    compose,
    compose_worker_env,
    dashboard_exprs,
    dockerfile,
    dockerfile_env,
    k8s,
    k8s_docs,
    k8s_worker_env,
    keda_triggers,
    keda_value,
    load_yaml,
    parse_qworker,
    qworker_env,
)

GATEWAY = ("Deployment", "qworker-gateway")


def command_env_vars(name: str) -> set[str]:
    """The QWORKER_* variables a `qworker <name>` flag reads (QWORKER_<FLAG>)."""
    parser = build_parser()._subparsers._group_actions[0].choices[name]  # type: ignore[union-attr]
    return {env_name(opt) for action in parser._actions for opt in action.option_strings
            if opt.startswith("--") and opt != "--help"}


def read_by_qworker() -> set[str]:
    return command_env_vars("serve") | command_env_vars("up") | command_env_vars("gateway")


def gateway_container() -> dict[str, Any]:
    return k8s(*GATEWAY)["spec"]["template"]["spec"]["containers"][0]


def k8s_gateway_env() -> dict[str, str]:
    return dict(k8s("ConfigMap", "qworker-gateway")["data"])


def models_of(env: dict[str, str]) -> list[str]:
    return [m.strip() for m in env["QWORKER_MODEL"].split(",") if m.strip()]


# ---------------------------------------------------------------------- the image


def test_the_image_installs_the_gateway_and_imports_it_at_build() -> None:
    runs = " ".join(dockerfile("RUN"))
    checks = re.findall(r'python -c "(import qworker_client\.gateway[^"]*)"', runs)
    assert checks, "a RUN imports the gateway, so a build without its extra fails"
    ran = subprocess.run([sys.executable, "-c", checks[0]], capture_output=True, text=True,
                         cwd=ROOT, env=checkout_env(), timeout=60)
    assert ran.returncode == 0, ran.stderr
    assert "qworker_client.gateway.server" in checks[0]


# ---------------------------------------------------------------------- Compose


def test_compose_runs_the_gateway_on_port_8000_over_the_workers_redis(
        monkeypatch: pytest.MonkeyPatch) -> None:
    service = compose()["services"]["gateway"]
    assert service["image"] == compose()["services"]["worker"]["image"]
    assert service["entrypoint"] == ["qworker"]
    env = {k: str(v) for k, v in service["environment"].items()}
    unknown = set(qworker_env(env)) - command_env_vars("gateway")
    assert not unknown, f"no gateway flag for {sorted(unknown)}"
    args = parse_qworker(service["command"], env, monkeypatch)
    assert (args.command, args.host, args.port) == ("gateway", "0.0.0.0", 8000)
    assert f"{args.port}:{args.port}" in service["ports"]
    workers = compose_worker_env()
    assert env["QWORKER_REDIS_URL"] == workers["QWORKER_REDIS_URL"]
    assert models_of(env) == [workers["QWORKER_MODEL"]], "it serves the workers' model"
    check = service["healthcheck"]["test"]
    assert check[:3] == ["CMD", "python", "-c"]
    compile(check[-1], "healthcheck", "exec")
    assert f"127.0.0.1:{args.port}/health'" in check[-1]
    scrapes = load_yaml(DEPLOY / "prometheus" / "prometheus.yml")[0]["scrape_configs"]
    targets = [(sd["names"], sd["port"]) for job in scrapes for sd in job["dns_sd_configs"]]
    assert (["gateway"], args.port) in targets, "Prometheus scrapes the gateway's /metrics"


# ---------------------------------------------------------------------- Kubernetes


def test_k8s_runs_the_gateway_behind_a_service_scaled_on_cpu(
        monkeypatch: pytest.MonkeyPatch) -> None:
    container = gateway_container()
    assert container["command"][0] == "qworker"
    env = {**qworker_env(dockerfile_env()), **k8s_gateway_env()}
    unknown = set(k8s_gateway_env()) - command_env_vars("gateway")
    assert not unknown, f"no gateway flag for {sorted(unknown)}"
    args = parse_qworker(container["command"][1:], env, monkeypatch)
    assert (args.command, args.host) == ("gateway", "0.0.0.0")
    assert container["ports"] == [{"name": "http", "containerPort": args.port}]
    assert container["readinessProbe"]["httpGet"] == {"path": "/health", "port": "http"}
    assert k8s_gateway_env()["QWORKER_REDIS_URL"] == k8s_worker_env()["QWORKER_REDIS_URL"]
    assert models_of(k8s_gateway_env()) == [k8s_worker_env()["QWORKER_MODEL"]]
    service = k8s("Service", "qw-gateway")["spec"]
    assert service["ports"] == [{"name": "http", "port": 8000, "targetPort": "http"}]
    pod_labels = k8s(*GATEWAY)["spec"]["template"]["metadata"]["labels"]
    assert service["selector"].items() <= pod_labels.items()
    hpa = k8s("HorizontalPodAutoscaler", "qworker-gateway")["spec"]
    assert hpa["scaleTargetRef"] == {"apiVersion": "apps/v1", "kind": GATEWAY[0],
                                     "name": GATEWAY[1]}
    assert [m["resource"]["name"] for m in hpa["metrics"] if m["type"] == "Resource"] == ["cpu"]
    assert "cpu" in container["resources"]["requests"], "CPU utilization is of the request"
    assert 1 <= hpa["minReplicas"] <= hpa["maxReplicas"]
    pdb = k8s("PodDisruptionBudget", "qworker-gateway")["spec"]
    assert pdb["selector"]["matchLabels"].items() <= pod_labels.items()
    assert pdb["maxUnavailable"] < hpa["minReplicas"], "a drain leaves a gateway answering"


def link_variables(service: dict[str, Any]) -> set[str]:
    """What Kubernetes sets in a pod for a Service of its namespace (enableServiceLinks)."""
    name = service["metadata"]["name"].upper().replace("-", "_")
    found = {f"{name}_SERVICE_HOST", f"{name}_SERVICE_PORT", f"{name}_PORT"}
    for port in service["spec"]["ports"]:
        proto = port.get("protocol", "TCP")
        tcp = f"{name}_PORT_{port['port']}_{proto}"
        found |= {tcp, f"{tcp}_PROTO", f"{tcp}_PORT", f"{tcp}_ADDR"}
        if "name" in port:
            found.add(f"{name}_SERVICE_PORT_{port['name'].upper().replace('-', '_')}")
    return found


def test_no_service_sets_a_variable_that_qworker_reads() -> None:
    read = read_by_qworker()
    services = [d for d in k8s_docs() if d["kind"] == "Service"]
    assert {s["metadata"]["name"] for s in services} >= {"qw-gateway", "qw-redis"}
    for service in services:
        clash = link_variables(service) & read
        assert not clash, f"Service {service['metadata']['name']} would set {sorted(clash)}"
        ours = {v for v in link_variables(service) if v.startswith("QWORKER_")}
        assert not ours, f"Service {service['metadata']['name']}: no QWORKER_ variables at all"
    named_qworker = {"metadata": {"name": "qworker"}, "spec": {"ports": [{"port": 8000}]}}
    assert link_variables(named_qworker) & read == {"QWORKER_PORT"}, "what the test guards"
    for kind, name in (GATEWAY, ("Deployment", "qworker-worker")):
        assert k8s(kind, name)["spec"]["template"]["spec"]["enableServiceLinks"] is False, name


# ---------------------------------------------------------------------- the dashboard


def test_the_dashboard_shows_the_gateways_traffic_and_latency() -> None:
    used = " ".join(dashboard_exprs())
    for metric in ("requests_total", "responses_total", "first_chunk_seconds_bucket",
                   "request_seconds_bucket", "streams_open", "queue_depth"):
        assert f"qworker_gateway_{metric}" in used, metric
    assert "by (le, model)" in used, "latencies by model"


# ---------------------------------------------------------------------- KEDA


def deployed_worker_streams(monkeypatch: pytest.MonkeyPatch) -> tuple[str, ...]:
    """The streams the k8s worker reads: its config from the image's entrypoint and the pod's
    variables, its streams as its intake computes them (qworker/service/intake.py)."""
    entrypoint = ["serve"]
    args = parse_qworker(entrypoint, {**qworker_env(dockerfile_env()), **k8s_worker_env()},
                         monkeypatch)
    config = serve.service_config(args)
    return Keys(config.prefix).streams_for(config.served_model)


def test_keda_has_a_trigger_on_every_stream_a_worker_reads(
        monkeypatch: pytest.MonkeyPatch) -> None:
    streams = deployed_worker_streams(monkeypatch)
    keys, model = Keys("qw"), k8s_worker_env()["QWORKER_MODEL"]
    assert keys.jobs_of(model) in streams and keys.requeue_of(None, "low") in streams
    assert len(streams) == 12, "three bands of requeue and jobs, the model's and model-less"
    triggered = [t["metadata"]["stream"] for t in keda_triggers()]
    assert sorted(triggered) == sorted(streams), set(streams) ^ set(triggered)


def test_gateway_traffic_alone_wakes_a_fleet_scaled_to_zero(redis_url: str) -> None:
    """No worker at all (minReplicaCount 0): the deployed gateway queues a request for its model,
    a trigger turns active on it, and a worker that then starts serves it."""
    model = models_of(k8s_gateway_env())[0]
    triggers = [t["metadata"] for t in keda_triggers()]
    assert not [key for meta in triggers for key in meta if key.startswith("activation")], (
        "active as soon as a stream holds one job")
    client = redis.Redis.from_url(redis_url, decode_responses=True)
    with gateway(redis_url, models=tuple(models_of(k8s_gateway_env()))) as base:
        body = {"model": model, "messages": [{"role": "user", "content": "hi"}],
                "max_tokens": 5, "stream": True}
        request = OpenRequest(f"{base}/v1/chat/completions", body)
        assert request.answered.wait(30) and request.status == 200, request.failure
        values = {meta["stream"]: keda_value(client, meta) for meta in triggers}
        assert values == {**dict.fromkeys(values, 0), Keys("qw").jobs_of(model): 1}
        with live_worker(redis_url, "from-zero", sim_engine(), served_model_name=model):
            wait_for(lambda: request.ended, 30, what="the request to be served")
        assert request.done and not request.error_codes(), request.events
        assert sum(keda_value(client, meta) for meta in triggers) == 0, "back to zero"
    client.close()


# ---------------------------------------------------------------------- the README


def test_the_readmes_one_command_and_its_request_agree(monkeypatch: pytest.MonkeyPatch) -> None:
    text = (ROOT / "README.md").read_text()
    commands = re.findall(r"\.venv/bin/qworker (up --gateway[^#\n]*)", text)
    assert len(commands) >= 2, "the top block and the Use section show it"
    for command in commands:
        args = parse_qworker(command.split(), {}, monkeypatch)
        assert (args.command, args.gateway) == ("up", True)
    curl = re.search(r"curl (http://\S+)/chat/completions .*?-d '(\{.*?\})'", text, re.S)
    assert curl, "a request to try"
    assert curl.group(1) == base_url(UpGatewayConfig.host, UpGatewayConfig.port)
    assert json.loads(curl.group(2))["model"] == EngineConfig.model
