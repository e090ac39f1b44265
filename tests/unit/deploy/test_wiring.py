"""The deploy files are wired to the code as it is: ports, flags, probes, routes, metrics.

No container engine or cluster runs here, so these tests read the compose
file, the Kubernetes manifests, the Dockerfiles, the Prometheus rules and the
Grafana dashboard, and check them against the servers' own settings parsers,
defaults, route loader and metric names.
"""

from __future__ import annotations

import json
import re
import subprocess
import sys
from collections.abc import Mapping
from pathlib import Path, PurePosixPath
from typing import Any

import pytest
import yaml

import capability.config as capability_config
import capability.metrics as capability_metrics
import classify_common.logs as common_logs
import classify_common.metrics as common_metrics
import classify_common.span_export as common_span_export
import classify_common.tracing as common_tracing
import orchestrator.config as orchestrator_config
import orchestrator.metrics as orchestrator_metrics
import orchestrator.state.connection as state_metrics
import orchestrator.workers as worker_metrics
from capability.config import CapabilitySettings
from classify_common.nodes import NODES
from orchestrator.config import OrchestratorSettings
from orchestrator.routing import load_routes
from orchestrator.security import load_api_keys
from tests.conftest import REPO_ROOT
from tests.unit.deploy.manifests import (
    DEPLOY_DIR,
    DOCKER_DIR,
    compose_services,
    container,
    container_port,
    env_values,
    final_stage,
    interpolate,
    k8s_resource,
    k8s_resources,
    parse_duration_seconds,
)
from tools import make_credentials
from tools import run_stack as tools_run_stack

NAMESPACE = "classify"
JAEGER_OTLP_GRPC_PORT = 4317
HEALTH_CHECK_SCRIPT = "/app/grpc_health_check.py"
# Metric names the rules and dashboard may use before the code exports them as a
# module constant (the test below finds those by itself). Empty: every name is
# exported; add one here only while its metric is being written.
PENDING_METRIC_NAMES: set[str] = set()
LIFECYCLE_NODES = {
    "grpc_receive", "auth_validate", "rate_limit_check", "input_validate", "route_match",
    "backend_select", "upstream_call", "capability_receive", "tokenize", "queue_admit",
    "gpu_queue_wait", "batch_assemble", "h2d_copy", "cuda_launch", "postprocess",
    "output_serialize", "response_send",
}  # fmt: skip


class RecordingEnviron(dict[str, str]):
    """An environment that remembers which variables the settings parser asked for."""

    def __init__(self, values: Mapping[str, str]) -> None:
        super().__init__(values)
        self.asked: set[str] = set()

    def __contains__(self, key: object) -> bool:
        if isinstance(key, str):
            self.asked.add(key)
        return super().__contains__(key)


def capability_settings(environ: Mapping[str, str]) -> CapabilitySettings:
    """Parse a deployment's environment as the server does; every variable must be known.

    A CUDA device is checked against this machine's devices, and this machine has
    none: it is parsed as `cpu`, and the tests of GPU deployments read the raw value
    (capability_device)."""
    if capability_device(environ).startswith("cuda"):
        environ = {**environ, "CAPABILITY_DEVICE": "cpu"}
    recorded = RecordingEnviron(environ)
    settings = CapabilitySettings.from_args([], environ=recorded)
    unknown = {name for name in environ if name.startswith("CAPABILITY_")} - recorded.asked
    assert not unknown, f"the capability server reads no {sorted(unknown)}"
    return settings


def capability_device(environ: Mapping[str, str]) -> str:
    return environ.get("CAPABILITY_DEVICE", capability_config.CapabilitySettings().device)


def orchestrator_settings(environ: Mapping[str, str]) -> OrchestratorSettings:
    recorded = RecordingEnviron(environ)
    settings = OrchestratorSettings.from_args([], environ=recorded)
    unknown = {name for name in environ if name.startswith("ORCHESTRATOR_")} - recorded.asked
    assert not unknown, f"the orchestrator reads no {sorted(unknown)}"
    return settings


# --- compose ------------------------------------------------------------------------

CAPABILITY_GPU_SERVICES = ("capability-1", "capability-2")
CAPABILITY_CPU_SERVICES = ("capability-cpu-1", "capability-cpu-2")
SERVER_SERVICES = ["orchestrator", *CAPABILITY_GPU_SERVICES, *CAPABILITY_CPU_SERVICES]


def compose_environment(service: str) -> dict[str, str]:
    spec = compose_services()[service]
    return {name: interpolate(str(value)) for name, value in spec["environment"].items()}


def mount_target(volume: str) -> tuple[str, str]:
    source, target = volume.split(":")[:2]
    return source, target


def network_names(service: str) -> set[str]:
    """The names other containers reach a service by: its own and its aliases."""
    spec = compose_services()[service]
    aliases = (spec.get("networks") or {}).get("default", {}) or {}
    return {service, *aliases.get("aliases", [])}


@pytest.mark.parametrize("service", [*CAPABILITY_GPU_SERVICES, *CAPABILITY_CPU_SERVICES])
def test_compose_capability_settings_parse_and_use_the_default_ports(service: str) -> None:
    settings = capability_settings(compose_environment(service))

    assert settings.host == "0.0.0.0"
    assert settings.port == capability_config.DEFAULT_PORT
    assert settings.metrics_port == capability_config.DEFAULT_METRICS_PORT
    healthcheck = compose_services()[service]["healthcheck"]["test"]
    assert HEALTH_CHECK_SCRIPT in healthcheck
    assert healthcheck[healthcheck.index("--port") + 1] == str(capability_config.DEFAULT_PORT)


def test_compose_orchestrator_settings_parse_and_publish_the_default_port() -> None:
    settings = orchestrator_settings(compose_environment("orchestrator"))
    spec = compose_services()["orchestrator"]

    assert settings.host == "0.0.0.0"
    assert settings.port == orchestrator_config.DEFAULT_PORT
    assert settings.metrics_port == orchestrator_config.DEFAULT_METRICS_PORT
    assert settings.auth == "required"
    assert spec["ports"] == [f"127.0.0.1:{settings.port}:{settings.port}"]
    healthcheck = spec["healthcheck"]["test"]
    assert HEALTH_CHECK_SCRIPT in healthcheck
    assert healthcheck[healthcheck.index("--port") + 1] == str(orchestrator_config.DEFAULT_PORT)


@pytest.mark.parametrize("service", SERVER_SERVICES)
def test_compose_otlp_endpoint_is_jaegers_grpc_port(service: str) -> None:
    environment = compose_environment(service)
    settings = (
        orchestrator_settings(environment)
        if service == "orchestrator"
        else capability_settings(environment)
    )

    # host:port, no scheme: what the servers' --otlp-endpoint takes.
    assert settings.otlp_endpoint == f"jaeger:{JAEGER_OTLP_GRPC_PORT}"
    assert compose_services()["jaeger"]["image"].startswith("jaegertracing/")


def test_compose_routes_folder_is_mounted_so_host_edits_apply() -> None:
    spec = compose_services()["orchestrator"]
    settings = orchestrator_settings(compose_environment("orchestrator"))
    routes_file = PurePosixPath(str(settings.routes_file))

    mounts = dict(mount_target(volume)[::-1] for volume in spec["volumes"])
    # The folder holding the routes file is the mount, not the file itself.
    source = mounts[str(routes_file.parent)]
    host_routes = (DEPLOY_DIR / source / routes_file.name).resolve()
    assert host_routes.is_file()
    assert host_routes == (DEPLOY_DIR / "compose" / "routes.yaml").resolve()
    assert settings.routes_poll_seconds > 0


@pytest.mark.parametrize("profile", ["gpu", "cpu"])
def test_compose_routes_target_the_active_profiles_capability_replicas(profile: str) -> None:
    table = load_routes(DEPLOY_DIR / "compose" / "routes.yaml")
    replicas = [name for name in compose_services(profile) if name.startswith("capability")]
    reachable = {name for service in replicas for name in network_names(service)}

    targets = {target for backend in table.backends.values() for target in backend.targets}
    assert len(replicas) == 2
    assert targets == {f"capability-{n}:{capability_config.DEFAULT_PORT}" for n in (1, 2)}
    assert {target.split(":")[0] for target in targets} <= reachable


def test_compose_gpu_replicas_each_reserve_their_own_gpu() -> None:
    device_ids = []
    for service in CAPABILITY_GPU_SERVICES:
        spec = compose_services()[service]
        (device,) = spec["deploy"]["resources"]["reservations"]["devices"]
        assert device["driver"] == "nvidia"
        assert device["capabilities"] == ["gpu"]
        assert "count" not in device  # count: 1 would put both on the first GPU
        device_ids += [interpolate(d) for d in device["device_ids"]]
        assert spec["profiles"] == ["gpu"]
        # Named, not `auto`, which serves on the CPU when the GPU is not visible.
        assert capability_device(compose_environment(service)) == "cuda:0"
    assert device_ids == ["0", "1"]


def test_compose_cpu_profile_reserves_no_gpu_and_runs_on_the_cpu() -> None:
    threads = set()
    for service in CAPABILITY_CPU_SERVICES:
        spec = compose_services()[service]
        assert spec["profiles"] == ["cpu"]
        assert "deploy" not in spec
        settings = capability_settings(compose_environment(service))
        assert settings.device == "cpu"
        assert spec["build"]["args"]["TORCH_INDEX_URL"].endswith("/whl/cpu")
        threads.add(settings.torch_threads)
    # Named, the same for both: left at 0, each replica took every core of the host,
    # and the two on one host ran twice as many compute threads as it has cores (the
    # oversubscription capability/workers/threads.py measures as a loss).
    (each,) = threads
    assert each > 0


@pytest.mark.parametrize("service", SERVER_SERVICES)
def test_compose_servers_run_read_only_without_capabilities(service: str) -> None:
    spec = compose_services()[service]

    assert spec["read_only"] is True
    assert spec["tmpfs"] == ["/tmp"]
    assert compose_environment(service)["HOME"] == "/tmp"
    assert spec["cap_drop"] == ["ALL"]
    assert "no-new-privileges:true" in spec["security_opt"]


@pytest.mark.parametrize("service", SERVER_SERVICES)
def test_compose_stop_grace_outlasts_the_servers_drain(service: str) -> None:
    environment = compose_environment(service)
    settings = (
        orchestrator_settings(environment)
        if service == "orchestrator"
        else capability_settings(environment)
    )
    stop_grace = parse_duration_seconds(compose_services()[service]["stop_grace_period"])

    assert stop_grace > worst_stop_seconds(settings)


def worst_stop_seconds(settings: CapabilitySettings | OrchestratorSettings) -> float:
    """The longest a server takes to stop after SIGTERM: its drain, and for an
    orchestrator of several processes the supervisor's slack before it kills them."""
    if isinstance(settings, OrchestratorSettings) and settings.processes > 1:
        return settings.grace_seconds + worker_metrics.STOP_SLACK_SECONDS
    return settings.grace_seconds


def test_compose_credentials_are_the_files_the_servers_read_and_no_more(
    tmp_path: Path,
) -> None:
    """The orchestrator reads the keys file and token from `credentials`; the capability
    servers mount only `capability-token`, which holds the same token and nothing else."""
    services = compose_services()
    init = services["credentials"]
    arguments = make_credentials.parse_arguments(init["command"])
    mounts = dict(mount_target(volume) for volume in init["volumes"])
    assert mounts["credentials"] == str(arguments.directory)
    assert mounts["capability-token"] == str(arguments.token_copy)

    orchestrator = orchestrator_settings(compose_environment("orchestrator"))
    credentials = PurePosixPath(arguments.directory)
    assert orchestrator.api_keys_file == Path(credentials / make_credentials.API_KEYS_FILE)
    assert orchestrator.internal_token_file == Path(
        credentials / make_credentials.INTERNAL_TOKEN_FILE
    )
    assert f"credentials:{credentials}:ro" in services["orchestrator"]["volumes"]
    for service in ("capability-1", "capability-cpu-1"):
        capability = capability_settings(compose_environment(service))
        assert capability.internal_token_file == Path(
            PurePosixPath(arguments.token_copy) / make_credentials.INTERNAL_TOKEN_FILE
        )
        assert services[service]["volumes"] == [f"capability-token:{arguments.token_copy}:ro"]
    for service in ("orchestrator", "capability-1", "capability-cpu-1"):
        assert services[service]["depends_on"]["credentials"] == {
            "condition": "service_completed_successfully"
        }

    # What the credentials service writes: the token-only folder holds the same token.
    made, token_only = tmp_path / "credentials", tmp_path / "token"
    assert make_credentials.main([str(made), f"--token-copy={token_only}"]) == 0
    assert [path.name for path in token_only.iterdir()] == [make_credentials.INTERNAL_TOKEN_FILE]
    token_file = make_credentials.INTERNAL_TOKEN_FILE
    assert (token_only / token_file).read_text() == (made / token_file).read_text()


def test_a_key_appended_to_made_keys_files_as_documented_is_loaded(tmp_path: Path) -> None:
    """deploy/README.md adds a key by appending `new-key`'s entry (`cat >>`): after the
    file's `tenants` section, as make_credentials.py wrote it, the entry broke the file
    (refused; the running orchestrator kept the old keys, and a restart failed on it).
    `make run`'s file likewise, with its commented rate limit turned on."""
    made = tmp_path / "credentials"
    assert make_credentials.main([str(made), "--tenant=local"]) == 0
    printed = subprocess.run(
        [sys.executable, "-m", "orchestrator.security", "new-key", "--id", "ci", "--tenant", "ci"],
        cwd=REPO_ROOT,
        capture_output=True,
        text=True,
        check=True,
    ).stdout
    entry = printed.split("\n", 2)[2]  # after the key line and the entry's heading
    keys_file = made / make_credentials.API_KEYS_FILE
    with keys_file.open("a") as appended:
        appended.write(entry)
    loaded = load_api_keys(keys_file)
    assert sorted(c.tenant for c in loaded.callers_by_hash.values()) == ["ci", "local"]
    assert set(loaded.tenant_limits) == {"local"}

    made_by_make_run = tools_run_stack.local_keys_file_text("ck_local")
    uncommented = made_by_make_run.replace("# tenants:\n", "tenants:\n").replace(
        "#   local: {", "  local: {"
    )
    assert uncommented != made_by_make_run
    run_keys = tmp_path / "run-api-keys.yaml"
    run_keys.write_text(uncommented + entry)
    loaded = load_api_keys(run_keys)
    assert sorted(c.tenant for c in loaded.callers_by_hash.values()) == ["ci", "local"]
    assert loaded.tenant_limits["local"].rate_per_second == 200


def test_compose_prometheus_scrapes_both_services_on_their_metrics_ports() -> None:
    config = yaml.safe_load((DEPLOY_DIR / "prometheus" / "prometheus.yml").read_text())
    jobs = {
        job["job_name"]: [t for group in job["static_configs"] for t in group["targets"]]
        for job in config["scrape_configs"]
    }

    assert jobs == {
        "orchestrator": [f"orchestrator:{orchestrator_config.DEFAULT_METRICS_PORT}"],
        "capability": [f"capability-{n}:{capability_config.DEFAULT_METRICS_PORT}" for n in (1, 2)],
    }
    assert config["rule_files"] == ["rules/*.yml"]
    assert "./prometheus:/etc/prometheus:ro" in compose_services()["prometheus"]["volumes"]


# --- Dockerfiles -----------------------------------------------------------------------


@pytest.mark.parametrize(
    ("dockerfile", "port", "metrics_port", "port_env"),
    [
        (
            "capability.Dockerfile",
            capability_config.DEFAULT_PORT,
            capability_config.DEFAULT_METRICS_PORT,
            "CAPABILITY_PORT",
        ),
        (
            "orchestrator.Dockerfile",
            orchestrator_config.DEFAULT_PORT,
            orchestrator_config.DEFAULT_METRICS_PORT,
            "ORCHESTRATOR_PORT",
        ),
    ],
)
def test_image_runs_unprivileged_exposes_defaults_and_checks_grpc_health(
    dockerfile: str, port: int, metrics_port: int, port_env: str
) -> None:
    stage = final_stage(DOCKER_DIR / dockerfile)
    arguments = {keyword: [a for k, a in stage if k == keyword] for keyword, _ in stage}

    assert arguments["EXPOSE"] == [f"{port} {metrics_port}"]
    assert arguments["USER"] == ["10001:10001"]
    (healthcheck,) = arguments["HEALTHCHECK"]
    assert HEALTH_CHECK_SCRIPT in healthcheck
    assert f'"--port-env", "{port_env}", "--port", "{port}"' in healthcheck
    assert f"{port_env}={port}" in " ".join(arguments["ENV"])
    # Nothing that compiles or installs reaches the final stage.
    assert not any("pip install" in a or "apt-get install" in a for a in arguments.get("RUN", []))


def test_capability_image_labels_model_weights_and_cuda() -> None:
    (labels,) = [a for k, a in final_stage(DOCKER_DIR / "capability.Dockerfile") if k == "LABEL"]

    for label in ("ai.classify.model", "ai.classify.weights.sha256", "ai.classify.cuda.version"):
        assert f"{label}=" in labels


# --- Kubernetes --------------------------------------------------------------------------


def resolve_env(resource_env: Mapping[str, Any]) -> dict[str, str]:
    """Container env with configMapKeyRef values read from the ConfigMaps here."""
    resolved = {}
    for name, value in resource_env.items():
        if isinstance(value, dict):
            ref = value["configMapKeyRef"]
            value = k8s_resource("ConfigMap", ref["name"])["data"][ref["key"]]
        resolved[name] = str(value)
    return resolved


def capability_pod() -> tuple[dict[str, Any], dict[str, Any]]:
    deployment = k8s_resource("Deployment", "capability")
    return deployment, container(deployment, "capability")


def orchestrator_pod() -> tuple[dict[str, Any], dict[str, Any]]:
    deployment = k8s_resource("Deployment", "orchestrator")
    return deployment, container(deployment, "orchestrator")


def test_k8s_redis_password_is_read_from_a_file_not_the_environment_or_arguments() -> None:
    """In no environment variable and on no command line (both readable in /proc):
    read from the Secret's file into the configuration redis-server reads on stdin."""
    redis = container(k8s_resource("StatefulSet", "redis"), "redis")
    script = " ".join(redis["args"])

    assert "env" not in redis
    assert "--requirepass" not in script
    assert "$(cat /var/run/secrets/classify/redis/password)" in script
    # Exec'd with a here-document: through a pipe, the shell stayed PID 1 and ignored
    # SIGTERM, so every stop ended in SIGKILL at the grace period.
    assert script.startswith("exec redis-server - ")
    assert "<<EOF\n" in script
    assert "|" not in script
    (mount,) = [m for m in redis["volumeMounts"] if m["name"] == "redis-password"]
    assert mount["readOnly"] is True
    assert f"$(cat {mount['mountPath']}/password)" in script


def test_every_k8s_resource_is_in_the_classify_namespace() -> None:
    for resource in k8s_resources():
        if resource["kind"] == "Namespace" or resource["metadata"]["name"] == "prometheus-adapter":
            continue
        assert resource["metadata"]["namespace"] == NAMESPACE, resource["metadata"]["name"]


@pytest.mark.parametrize("pod", [capability_pod, orchestrator_pod])
def test_k8s_probes_are_grpc_health_on_the_default_grpc_port(pod: Any) -> None:
    _, spec = pod()
    environment = resolve_env(env_values(spec))
    is_capability = spec["name"] == "capability"
    settings = (
        capability_settings(environment) if is_capability else orchestrator_settings(environment)
    )
    default = capability_config if is_capability else orchestrator_config

    assert settings.port == default.DEFAULT_PORT == container_port(spec, "grpc")
    assert settings.metrics_port == default.DEFAULT_METRICS_PORT == container_port(spec, "metrics")
    for probe in ("startupProbe", "readinessProbe", "livenessProbe"):
        assert spec[probe]["grpc"] == {"port": default.DEFAULT_PORT}, probe


@pytest.mark.parametrize("pod", [capability_pod, orchestrator_pod])
def test_k8s_termination_grace_outlasts_prestop_and_drain(pod: Any) -> None:
    deployment, spec = pod()
    environment = resolve_env(env_values(spec))
    settings = (
        capability_settings(environment)
        if spec["name"] == "capability"
        else orchestrator_settings(environment)
    )
    pre_stop = spec["lifecycle"]["preStop"]["sleep"]["seconds"]

    assert deployment["spec"]["template"]["spec"]["terminationGracePeriodSeconds"] > (
        pre_stop + worst_stop_seconds(settings)
    )


def test_k8s_routes_configmap_is_mounted_as_a_folder_holding_the_routes_file() -> None:
    deployment, spec = orchestrator_pod()
    settings = orchestrator_settings(resolve_env(env_values(spec)))
    volumes = {v["name"]: v for v in deployment["spec"]["template"]["spec"]["volumes"]}
    (mount,) = [
        m
        for m in spec["volumeMounts"]
        if "configMap" in volumes[m["name"]]
        and volumes[m["name"]]["configMap"]["name"] == "classify-routes"
    ]

    assert "subPath" not in mount  # a subPath mount never sees the ..data swap
    assert PurePosixPath(str(settings.routes_file)).parent == PurePosixPath(mount["mountPath"])
    key = PurePosixPath(str(settings.routes_file)).name
    assert key in k8s_resource("ConfigMap", "classify-routes")["data"]
    assert "items" not in volumes[mount["name"]]["configMap"]


def test_k8s_routes_target_the_capability_headless_service(tmp_path: Path) -> None:
    routes = tmp_path / "routes.yaml"
    routes.write_text(k8s_resource("ConfigMap", "classify-routes")["data"]["routes.yaml"])
    service = k8s_resource("Service", "capability")
    grpc_port = next(p for p in service["spec"]["ports"] if p["name"] == "grpc")

    table = load_routes(routes)

    expected = f"dns:///capability.{NAMESPACE}.svc.cluster.local:{capability_config.DEFAULT_PORT}"
    assert {t for b in table.backends.values() for t in b.targets} == {expected}
    assert service["spec"]["clusterIP"] == "None"
    assert grpc_port["port"] == capability_config.DEFAULT_PORT
    assert (
        service["spec"]["selector"]
        == (k8s_resource("Deployment", "capability")["spec"]["selector"]["matchLabels"])
    )


def test_k8s_secrets_are_mounted_where_the_flags_point() -> None:
    for deployment, spec in (capability_pod(), orchestrator_pod()):
        volumes = {v["name"]: v for v in deployment["spec"]["template"]["spec"]["volumes"]}
        mounted = {
            volumes[m["name"]]["secret"]["secretName"]: PurePosixPath(m["mountPath"])
            for m in spec["volumeMounts"]
            if "secret" in volumes[m["name"]]
        }
        environment = resolve_env(env_values(spec))
        files = {
            "classify-internal-token": make_credentials.INTERNAL_TOKEN_FILE,
            "classify-api-keys": make_credentials.API_KEYS_FILE,
        }
        for variable, value in environment.items():
            if variable.endswith(("_API_KEYS_FILE", "_INTERNAL_TOKEN_FILE")):
                path = PurePosixPath(value)
                secret = next(name for name, folder in mounted.items() if path.parent == folder)
                assert path.name == files[secret], variable
    assert orchestrator_settings(resolve_env(env_values(orchestrator_pod()[1]))).auth == "required"


def test_compose_orchestrator_runs_two_processes_sharing_the_redis_service() -> None:
    settings = orchestrator_settings(compose_environment("orchestrator"))
    services = compose_services()
    assert settings.processes == 2
    assert settings.state_url == "redis://redis:6379/0"
    assert "redis" in services
    assert services["orchestrator"]["depends_on"]["redis"] == {"condition": "service_healthy"}


def test_compose_redis_is_reached_by_the_orchestrator_alone() -> None:
    """It has no password in compose; on the default network the capability servers,
    which run model code, could read and change every tenant's results and buckets."""
    services = compose_services()
    on_state = sorted(
        name for name, service in services.items() if "state" in service.get("networks", [])
    )
    assert on_state == ["orchestrator", "redis"]
    assert services["redis"]["networks"] == ["state"]


def test_k8s_orchestrator_uses_the_redis_service_with_the_password_secret() -> None:
    deployment, spec = orchestrator_pod()
    settings = orchestrator_settings(resolve_env(env_values(spec)))
    service = k8s_resource("Service", "redis")
    port = service["spec"]["ports"][0]["port"]
    assert settings.state_url == f"redis://redis.classify.svc.cluster.local:{port}/0"
    assert settings.processes > 1
    volumes = {v["name"]: v for v in deployment["spec"]["template"]["spec"]["volumes"]}
    mounts = {PurePosixPath(m["mountPath"]): m["name"] for m in spec["volumeMounts"]}
    assert settings.state_password_file is not None
    volume = volumes[mounts[PurePosixPath(settings.state_password_file).parent]]
    assert volume["secret"]["secretName"] == "classify-redis"
    # Redis reads the same Secret's same key, as a file too.
    redis_pod = k8s_resource("StatefulSet", "redis")["spec"]["template"]["spec"]
    (redis_volume,) = [v for v in redis_pod["volumes"] if "secret" in v]
    assert redis_volume["secret"]["secretName"] == "classify-redis"
    (redis,) = redis_pod["containers"]
    (mount,) = [m for m in redis["volumeMounts"] if m["name"] == redis_volume["name"]]
    password_file = f"{mount['mountPath']}/{settings.state_password_file.name}"
    assert f"$(cat {password_file})" in " ".join(redis["args"])


def test_k8s_capability_pod_takes_one_gpu_of_a_selected_model() -> None:
    deployment, spec = capability_pod()
    pod = deployment["spec"]["template"]["spec"]
    terms = pod["affinity"]["nodeAffinity"]["requiredDuringSchedulingIgnoredDuringExecution"]

    assert spec["resources"]["requests"]["nvidia.com/gpu"] == 1
    assert spec["resources"]["limits"]["nvidia.com/gpu"] == 1
    # Its one GPU, named: `auto` would turn ready on the CPU when the GPU is not visible.
    assert capability_device(resolve_env(env_values(spec))) == "cuda:0"
    (expression,) = terms["nodeSelectorTerms"][0]["matchExpressions"]
    assert expression["key"] == "nvidia.com/gpu.product"
    assert expression["values"]
    assert (
        k8s_resource("PodDisruptionBudget", "capability")["spec"]["selector"]
        == (deployment["spec"]["selector"])
    )


def test_k8s_otlp_endpoint_comes_from_the_telemetry_configmap() -> None:
    for _, spec in (capability_pod(), orchestrator_pod()):
        reference = env_values(spec)[spec["name"].upper() + "_OTLP_ENDPOINT"]
        assert reference["configMapKeyRef"]["name"] == "classify-telemetry"
        endpoint = resolve_env({"x": reference})["x"]
        assert re.fullmatch(r"[a-z0-9.-]+:4317", endpoint), endpoint


def test_k8s_only_the_orchestrator_reaches_capability_grpc() -> None:
    policy = k8s_resource("NetworkPolicy", "capability")
    capability_labels = k8s_resource("Deployment", "capability")["spec"]["selector"]
    orchestrator_labels = k8s_resource("Deployment", "orchestrator")["spec"]["selector"]
    default_deny = k8s_resource("NetworkPolicy", "default-deny")

    assert default_deny["spec"]["podSelector"] == {}
    assert set(default_deny["spec"]["policyTypes"]) == {"Ingress", "Egress"}
    assert policy["spec"]["podSelector"] == capability_labels
    by_port = {rule["ports"][0]["port"]: rule["from"] for rule in policy["spec"]["ingress"]}
    assert by_port[capability_config.DEFAULT_PORT] == [{"podSelector": orchestrator_labels}]
    metrics_from = by_port[capability_config.DEFAULT_METRICS_PORT]
    assert all("namespaceSelector" in peer for peer in metrics_from)
    assert set(by_port) == {capability_config.DEFAULT_PORT, capability_config.DEFAULT_METRICS_PORT}


def test_k8s_autoscaling_uses_custom_metrics_the_adapter_serves() -> None:
    hpa = k8s_resource("HorizontalPodAutoscaler", "capability")
    adapter = yaml.safe_load(k8s_resource("ConfigMap", "prometheus-adapter")["data"]["config.yaml"])
    served = {rule["name"]["as"] for rule in adapter["rules"]}

    assert hpa["spec"]["scaleTargetRef"]["name"] == "capability"
    assert {metric["type"] for metric in hpa["spec"]["metrics"]} == {"Pods"}  # not Resource/CPU
    assert {metric["pods"]["metric"]["name"] for metric in hpa["spec"]["metrics"]} == served


def test_k8s_deployments_an_autoscaler_scales_leave_the_count_to_it() -> None:
    """A `replicas` in the manifest of a Deployment the autoscaler scales sets the
    fleet back to it at every `kubectl apply -k` (a routes edit), killing the pods
    the autoscaler added."""
    scaled = {
        resource["spec"]["scaleTargetRef"]["name"]
        for resource in k8s_resources()
        if resource["kind"] == "HorizontalPodAutoscaler"
    }
    assert scaled
    for name in scaled:
        assert "replicas" not in k8s_resource("Deployment", name)["spec"], name


def test_k8s_pods_are_annotated_for_scraping_on_the_metrics_port() -> None:
    for deployment, spec in (capability_pod(), orchestrator_pod()):
        annotations = deployment["spec"]["template"]["metadata"]["annotations"]
        assert annotations["prometheus.io/scrape"] == "true"
        assert int(annotations["prometheus.io/port"]) == container_port(spec, "metrics")


def scrape_relabelling_setting_job() -> dict[str, Any]:
    """The relabel rule deploy/README.md gives a pod-annotation scrape job to set `job`."""
    readme = (DEPLOY_DIR / "README.md").read_text()
    blocks = re.findall(r"^```yaml\n(.*?)^```", readme, flags=re.MULTILINE | re.DOTALL)
    (block,) = [body for body in blocks if "target_label: job" in body]
    (scrape_job,) = yaml.safe_load(block)["scrape_configs"]
    (rule,) = [r for r in scrape_job["relabel_configs"] if r.get("target_label") == "job"]
    return dict(rule)


def test_k8s_scrape_relabelling_gives_each_pod_the_job_the_rules_and_dashboard_select() -> None:
    """They select on job="orchestrator" and "capability"; a pod-annotation scrape job
    names every target after itself, so the README's rule is what makes the cluster's
    pods seen at all."""
    rule = scrape_relabelling_setting_job()
    jobs = {}
    for deployment, _ in (orchestrator_pod(), capability_pod()):
        # What Prometheus's pod discovery offers: label names with `.`, `/`, `-` as `_`.
        meta = {"__meta_kubernetes_namespace": deployment["metadata"]["namespace"]}
        for label, value in deployment["spec"]["template"]["metadata"]["labels"].items():
            meta["__meta_kubernetes_pod_label_" + re.sub(r"[^a-zA-Z0-9_]", "_", label)] = value
        source = rule.get("separator", ";").join(meta[name] for name in rule["source_labels"])
        match = re.fullmatch(rule["regex"], source)  # Prometheus anchors its regexes
        assert match is not None, source
        replacement = re.sub(r"\$(\d+)", r"\\\1", rule.get("replacement", "$1"))
        jobs[deployment["metadata"]["name"]] = match.expand(replacement)

    assert jobs == {"orchestrator": "orchestrator", "capability": "capability"}
    selected = {
        job
        for name, text in monitoring_texts().items()
        if name != "prometheus-adapter"  # it selects on namespace and pod instead
        for jobs_matched in re.findall(r'\bjob=~?"([^"]+)"', text)
        for job in jobs_matched.split("|")
    }
    assert selected == set(jobs.values())


def test_kustomization_lists_every_manifest_in_its_folder() -> None:
    kustomization = yaml.safe_load((DEPLOY_DIR / "k8s" / "kustomization.yaml").read_text())
    manifests = {
        path.name
        for path in (DEPLOY_DIR / "k8s").glob("*.yaml")
        if path.name != "kustomization.yaml"
    }

    assert set(kustomization["resources"]) == manifests


# --- metrics used by rules, dashboard and autoscaler -----------------------------------


def exported_metric_names() -> set[str]:
    """Every metric name the code declares as a module constant."""
    modules = (
        common_logs,
        common_metrics,
        common_tracing,
        common_span_export,
        capability_metrics,
        orchestrator_metrics,
        state_metrics,
        worker_metrics,
    )
    return {
        value
        for module in modules
        for name, value in vars(module).items()
        if name.isupper() and isinstance(value, str) and re.fullmatch(r"[a-z_]+_[a-z_]+", value)
    }


def used_metric_names(text: str) -> set[str]:
    names = set(re.findall(r"\b(?:classify_[a-z0-9_]+|model_fallback_total)\b", text))
    return {re.sub(r"_(bucket|count|sum)$", "", name) for name in names}


def monitoring_texts() -> dict[str, str]:
    """The PromQL of each file that queries metrics: rules, dashboard, adapter rules."""
    texts = {}
    for path in (DEPLOY_DIR / "prometheus" / "rules").glob("*.yml"):
        groups = yaml.safe_load(path.read_text())["groups"]
        texts[path.name] = "\n".join(rule["expr"] for group in groups for rule in group["rules"])
    for path in (DEPLOY_DIR / "grafana" / "dashboards").glob("*.json"):
        panels = json.loads(path.read_text())["panels"]
        texts[path.name] = "\n".join(t["expr"] for p in panels for t in p.get("targets", []))
    adapter = yaml.safe_load(k8s_resource("ConfigMap", "prometheus-adapter")["data"]["config.yaml"])
    texts["prometheus-adapter"] = "\n".join(
        rule[key] for rule in adapter["rules"] for key in ("seriesQuery", "metricsQuery")
    )
    return texts


def test_rules_dashboard_and_autoscaler_use_only_metrics_the_code_exports() -> None:
    known = exported_metric_names() | PENDING_METRIC_NAMES
    for name, text in monitoring_texts().items():
        used = used_metric_names(text)
        assert used, name
        assert used <= known, f"{name}: unknown metrics {sorted(used - known)}"


def test_node_labels_in_rules_and_dashboard_are_lifecycle_nodes() -> None:
    for name, text in monitoring_texts().items():
        for match in re.findall(r'lifecycle_node=~?\\?"([a-z0-9_|]+)\\?"', text):
            assert set(match.split("|")) <= LIFECYCLE_NODES, f"{name}: {match}"


def test_lifecycle_nodes_match_the_codes_table() -> None:
    assert {node.name for node in NODES} == LIFECYCLE_NODES


def test_dashboard_has_slo_root_cause_and_capacity_views() -> None:
    dashboard = json.loads((DEPLOY_DIR / "grafana" / "dashboards" / "classify.json").read_text())
    rows = [p["title"] for p in dashboard["panels"] if p["type"] == "row"]
    exprs = " ".join(
        target["expr"] for panel in dashboard["panels"] for target in panel.get("targets", [])
    )

    assert [row.split(":")[0] for row in rows] == ["SLO", "Root cause", "Capacity", "Shadow"]
    for needed in (
        "gpu_queue_wait",
        "cuda_launch",
        "output_serialize",
        "classify_queue_depth",
        "classify:worker_utilisation:predict30d",
        "classify:device_memory_ratio:predict30d",
        "classify:request_rate:predict30d",
        "classify_shadow_comparisons_total",
    ):
        assert needed in exprs


def test_the_fleets_state_processes_count_every_process_a_rollout_runs() -> None:
    """While Redis does not answer, each orchestrator process grants a tenant 1/N of
    its rate: N was the replicas' processes (4), and a rolling update's surge pod made
    them six, which together granted 150% of every tenant's rate."""
    deployment = k8s_resource("Deployment", "orchestrator")
    env = env_values(container(deployment, "orchestrator"))
    surge = deployment["spec"]["strategy"]["rollingUpdate"]["maxSurge"]
    at_once = (deployment["spec"]["replicas"] + surge) * int(env["ORCHESTRATOR_PROCESSES"])
    assert int(env["ORCHESTRATOR_STATE_PROCESSES"]) >= at_once
