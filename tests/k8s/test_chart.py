"""The Helm chart (deploy/helm/microbatch-server) with each profile in its ci/ folder: helm lint
--strict, the values schema enforced, every rendered document valid for Kubernetes 1.25 and
1.37 (strict: an unknown field fails), the custom resources against their documented fields
(crds.py), and the invariants a production chart must keep (manifests.py).
"""

from __future__ import annotations

import copy
import json
import os
from pathlib import Path
from typing import Any
from urllib.parse import urlsplit

import kubernetes_validate
import pytest
import yaml

from app.settings import SECRET_SETTINGS
from tests.k8s import crds
from tests.k8s import manifests as m
from tests.k8s.conftest import (
    CHART,
    NAMESPACE,
    PROFILE_DIR,
    PROFILES,
    RELEASE,
    REPO,
    REQUIRED_PROFILES,
    profile_path,
    render,
    run_helm,
)
from tests.k8s.crds import KUBE_VERSIONS

# The mode each shipped profile must render (tests/k8s checks the shape; others may be either).
EXPECTED_MODE = {
    "cpu-single": "single",
    "kserve": "single",
    "cpu-broker": "broker",
    "gpu-broker": "broker",
    "keda": "broker",
}


def mode_of(docs: list[m.Doc]) -> str:
    components = {m.component(w) for w in m.workloads(docs)}
    if "server" in components and not components & {"frontend", "worker"}:
        return "single"
    if {"frontend", "worker"} <= components and "server" not in components:
        return "broker"
    return f"neither ({sorted(map(str, components))})"


def broker_profiles() -> list[str]:
    return [p for p in PROFILES if EXPECTED_MODE.get(p, "broker") == "broker"]


def gpu_profiles() -> list[str]:
    return [p for p in PROFILES if p.startswith("gpu")]


# -- the chart and its profiles --------------------------------------------------------------


def test_the_required_profiles_exist(chart: Path) -> None:
    present = sorted(path.stem for path in PROFILE_DIR.glob("*.yaml"))
    assert set(REQUIRED_PROFILES) <= set(present), f"{PROFILE_DIR} has {present}"


@pytest.mark.parametrize("kube_version", KUBE_VERSIONS)
@pytest.mark.parametrize("profile", [None, *PROFILES], ids=lambda p: p or "defaults")
def test_helm_lint_strict_is_clean(chart: Path, profile: str | None, kube_version: str) -> None:
    args = ["lint", "--strict", str(chart), "--kube-version", kube_version]
    if profile is not None:
        args += ["-f", str(profile_path(profile))]
    result = run_helm(*args)
    output = result.stdout + result.stderr
    assert result.returncode == 0, output
    assert "[WARNING]" not in output, output
    assert "[ERROR]" not in output, output


@pytest.mark.parametrize("profile", PROFILES)
def test_each_profile_renders_its_mode(profile: str) -> None:
    docs = render(profile)
    assert docs, f"{profile} renders nothing"
    assert mode_of(docs) in {"single", "broker"}, mode_of(docs)
    assert mode_of(docs) == EXPECTED_MODE.get(profile, mode_of(docs)), profile


@pytest.mark.parametrize("profile", PROFILES)
def test_no_two_objects_share_a_kind_and_name(profile: str) -> None:
    seen = [m.ident(doc) for doc in render(profile)]
    assert sorted({x for x in seen if seen.count(x) > 1}) == []


# -- the values schema is enforced -----------------------------------------------------------


def chart_values() -> dict[str, Any]:
    values = yaml.safe_load((CHART / "values.yaml").read_text())
    assert isinstance(values, dict)
    return values


@pytest.mark.parametrize(
    "setting",
    [
        "bogusKey=1",
        "image.bogusKey=1",
        "config.bogusKey=1",
        "auth.bogusKey=1",
        "models.bogusKey=1",
        "frontend.bogusKey=1",
        "workers.bogusKey=1",
        "workers.autoscaling.bogusKey=1",
        "redis.bogusKey=1",
        "grpc.bogusKey=1",
        "observability.bogusKey=1",
        "observability.grafanaDashboard.bogusKey=1",
        "observability.prometheusRule.bogusKey=1",
    ],
)
def test_the_values_schema_rejects_unknown_keys(chart: Path, setting: str) -> None:
    parent = setting.split("=", 1)[0].rpartition(".")[0]
    if parent:
        # Else the chart renamed the section and this setting would fail for another reason.
        node: Any = chart_values()
        for part in parent.split("."):
            node = node.get(part) if isinstance(node, dict) else None
        assert isinstance(node, dict), f"values.yaml has no section {parent}: update this test"
    result = run_helm("lint", "--strict", str(chart), "--set", setting)
    output = result.stdout + result.stderr
    assert result.returncode != 0, f"--set {setting} was accepted:\n{output}"
    assert "additional properties 'bogusKey' not allowed" in output, output


def test_the_values_schema_rejects_an_unknown_mode(chart: Path) -> None:
    result = run_helm("lint", "--strict", str(chart), "--set", "mode=nonsense")
    output = result.stdout + result.stderr
    assert result.returncode != 0, f"mode=nonsense was accepted:\n{output}"
    assert "/mode" in output, output


@pytest.mark.parametrize("name", sorted(SECRET_SETTINGS | {"REDIS_PASSWORD"}))
def test_the_values_schema_refuses_an_inline_credential_in_extra_env(
    chart: Path, name: str
) -> None:
    inline = run_helm(
        "lint",
        "--strict",
        str(chart),
        "--set-json",
        f'config.extraEnv=[{{"name":"{name}","value":"x"}}]',
    )
    assert inline.returncode != 0, f"{name} given inline was accepted:\n{inline.stdout}"
    other = run_helm(
        "lint",
        "--strict",
        str(chart),
        "--set-json",
        'config.extraEnv=[{"name":"MB_DTYPE","value":"x"}]',
    )
    assert other.returncode == 0, other.stdout + other.stderr


def test_kubernetes_before_1_25_is_refused(chart: Path) -> None:
    result = run_helm("template", RELEASE, str(chart), "--kube-version", "1.24.0")
    assert result.returncode != 0, "the chart rendered for Kubernetes 1.24"
    assert "requires kubeVersion" in result.stderr, result.stderr


@pytest.mark.parametrize("setting", ["mode=single", "mode=broker"])
def test_the_values_schema_accepts_the_modes(chart: Path, setting: str) -> None:
    result = run_helm("lint", "--strict", str(chart), "--set", setting)
    assert result.returncode == 0, result.stdout + result.stderr


# -- every document against the Kubernetes schemas, custom resources against crds.py ----------


def validation_errors(doc: m.Doc, kube_version: str) -> list[str]:
    """Strict kubernetes-validate for a built-in kind; crds.check for a described custom
    resource. A missing schema (an unknown kind) is an error, never a warning."""
    if crds.is_custom(doc):
        return [f"{m.ident(doc)}: {error}" for error in crds.check(doc)]
    try:
        kubernetes_validate.validate(doc, kube_version, strict=True)
    except kubernetes_validate.ValidationError as error:
        path = ".".join(str(part) for part in error.path)
        return [f"{m.ident(doc)}: {path}: {error.message}"]
    except (
        kubernetes_validate.SchemaNotFoundError,
        kubernetes_validate.InvalidSchemaError,
    ) as error:
        return [f"{m.ident(doc)}: {error.message}"]
    return []


@pytest.mark.parametrize("kube_version", KUBE_VERSIONS)
@pytest.mark.parametrize("profile", PROFILES)
def test_every_document_is_valid(profile: str, kube_version: str) -> None:
    errors = [
        error
        for doc in render(profile, kube_version)
        for error in validation_errors(doc, kube_version)
    ]
    assert errors == []


def test_a_broken_document_fails_validation() -> None:
    service = {
        "apiVersion": "v1",
        "kind": "Service",
        "metadata": {"name": "s"},
        "spec": {"ports": [{"port": 8000, "targetPortt": "http"}]},
    }
    assert validation_errors(service, KUBE_VERSIONS[0]) != []
    unknown = {"apiVersion": "example.com/v1", "kind": "Widget", "metadata": {"name": "w"}}
    assert validation_errors(unknown, KUBE_VERSIONS[0]) != []


# -- custom resources: the field checks can fail ---------------------------------------------

SCALED_OBJECT: dict[str, Any] = {
    "apiVersion": "keda.sh/v1alpha1",
    "kind": "ScaledObject",
    "metadata": {"name": "w"},
    "spec": {
        "scaleTargetRef": {"name": "w"},
        "minReplicaCount": 0,
        "triggers": [
            {
                "type": "metrics-api",
                "metadata": {
                    "url": "http://f:8000/backlog",
                    "valueLocation": "backlog",
                    "targetValue": "64",
                },
            }
        ],
    },
}
SERVICE_MONITOR: dict[str, Any] = {
    "apiVersion": "monitoring.coreos.com/v1",
    "kind": "ServiceMonitor",
    "metadata": {"name": "f"},
    "spec": {
        "selector": {"matchLabels": {"a": "b"}},
        "endpoints": [{"port": "http", "path": "/metrics"}],
    },
}
SERVING_RUNTIME: dict[str, Any] = {
    "apiVersion": "serving.kserve.io/v1alpha1",
    "kind": "ServingRuntime",
    "metadata": {"name": "r"},
    "spec": {
        "supportedModelFormats": [{"name": "microbatch", "version": "1", "autoSelect": True}],
        "protocolVersions": ["v2"],
        "multiModel": False,
        "containers": [
            {"name": "kserve-container", "image": "i", "ports": [{"containerPort": 8080}]}
        ],
    },
}


def rendered_or_sample(kind: str, sample: dict[str, Any]) -> list[dict[str, Any]]:
    """The sample, and every rendered object of that kind (so the chart's own copy is broken too)."""
    found = [
        doc
        for p in PROFILES
        if (PROFILE_DIR / f"{p}.yaml").is_file()
        for doc in m.of_kind(render(p), kind)
    ]
    return [copy.deepcopy(sample), *found]


PROMETHEUS_RULE: dict[str, Any] = {
    "apiVersion": "monitoring.coreos.com/v1",
    "kind": "PrometheusRule",
    "metadata": {"name": "r"},
    "spec": {
        "groups": [
            {
                "name": "g",
                "rules": [
                    {
                        "alert": "A",
                        "expr": "up == 0",
                        "for": "5m",
                        "labels": {"severity": "warning"},
                        "annotations": {"summary": "s"},
                    }
                ],
            }
        ]
    },
}


def test_the_samples_pass_the_field_checks() -> None:
    for doc in (SCALED_OBJECT, SERVICE_MONITOR, SERVING_RUNTIME, PROMETHEUS_RULE):
        assert crds.check(doc) == [], m.ident(doc)


def test_an_unknown_trigger_metadata_key_fails() -> None:
    for doc in rendered_or_sample("ScaledObject", SCALED_OBJECT):
        doc["spec"]["triggers"][0]["metadata"]["valueLocaton"] = "backlog"
        assert any(
            "triggers[0].metadata.valueLocaton: unknown key" in e for e in crds.check(doc)
        ), m.ident(doc)


def test_a_non_string_trigger_metadata_value_fails() -> None:
    doc = copy.deepcopy(SCALED_OBJECT)
    doc["spec"]["triggers"][0]["metadata"]["targetValue"] = 64
    assert crds.check(doc) != []


def test_an_undescribed_trigger_type_fails() -> None:
    doc = copy.deepcopy(SCALED_OBJECT)
    doc["spec"]["triggers"][0]["type"] = "redis-streams"
    assert crds.check(doc) != []


def test_a_typo_in_service_monitor_endpoints_fails() -> None:
    for doc in rendered_or_sample("ServiceMonitor", SERVICE_MONITOR):
        endpoint = doc["spec"]["endpoints"][0]
        endpoint["pathh"] = endpoint.pop("path", "/metrics")
        assert any("endpoints[0].pathh: unknown key" in e for e in crds.check(doc)), m.ident(doc)


def test_a_bad_serving_runtime_container_fails() -> None:
    for doc in rendered_or_sample("ServingRuntime", SERVING_RUNTIME):
        doc["spec"]["containers"][0]["portz"] = []
        errors = crds.check(doc)
        assert any("spec.containers: not a valid" in e for e in errors), (m.ident(doc), errors)


def test_a_typo_in_a_prometheus_rule_fails() -> None:
    for doc in rendered_or_sample("PrometheusRule", PROMETHEUS_RULE):
        rule = doc["spec"]["groups"][0]["rules"][0]
        rule["exprr"] = rule.pop("expr")
        errors = crds.check(doc)
        assert "spec.groups[0].rules[0].exprr: unknown key (did you mean 'expr'?)" in errors, (
            m.ident(doc),
            errors,
        )
        assert "spec.groups[0].rules[0].expr: required key missing" in errors


def test_a_missing_required_field_fails() -> None:
    doc = copy.deepcopy(SCALED_OBJECT)
    del doc["spec"]["scaleTargetRef"]
    assert crds.check(doc) == ["spec.scaleTargetRef: required key missing"]


# -- invariants over every pod template ------------------------------------------------------


def workloads_of(profile: str) -> list[m.Doc]:
    found = m.workloads(render(profile))
    assert found, f"{profile} renders no Deployment or StatefulSet"
    return found


@pytest.mark.parametrize("profile", PROFILES)
def test_pods_are_restricted_and_read_only(profile: str) -> None:
    assert [p for w in workloads_of(profile) for p in m.security_problems(w)] == []


@pytest.mark.parametrize("profile", PROFILES)
def test_every_container_has_requests_and_limits(profile: str) -> None:
    assert [p for w in workloads_of(profile) for p in m.resource_problems(w)] == []


@pytest.mark.parametrize("profile", PROFILES)
def test_model_pods_mount_a_memory_backed_dev_shm(profile: str) -> None:
    model_pods = [w for w in workloads_of(profile) if m.component(w) in m.MODEL_COMPONENTS]
    assert model_pods, f"{profile} renders no server or worker"
    assert [p for w in model_pods for p in m.shm_problems(w)] == []


# Every credential the chart takes, set, so that the env vars that carry them are rendered.
CREDENTIALS = {
    "auth.apiKey": "check-k8s-api-key",
    "auth.adminApiKey": "check-k8s-admin-api-key",
    "redis.auth.password": "check-k8s-redis-password",
}


@pytest.mark.parametrize("profile", PROFILES)
def test_credentials_only_come_from_secrets(profile: str) -> None:
    docs = render(profile, sets=tuple(f"{k}={v}" for k, v in CREDENTIALS.items()))
    assert [p for w in m.workloads(docs) for p in m.secret_env_problems(w)] == []
    api_keys = [
        c for w in m.workloads(docs) for c in m.containers(w) if "API_KEY" in m.env_names(c)
    ]
    assert api_keys, "auth.apiKey is set but no container gets API_KEY"
    for doc in docs:
        if doc.get("kind") != "Secret":
            text = yaml.safe_dump(doc)
            leaked = [v for v in CREDENTIALS.values() if v in text]
            assert leaked == [], f"{m.ident(doc)} holds a credential in clear"


@pytest.mark.parametrize("profile", PROFILES)
def test_every_dependent_variable_resolves(profile: str) -> None:
    assert [p for w in workloads_of(profile) for p in m.env_reference_problems(w)] == []


@pytest.mark.parametrize("profile", PROFILES)
def test_every_container_is_probed(profile: str) -> None:
    assert [p for w in workloads_of(profile) for p in m.probe_problems(w)] == []


@pytest.mark.parametrize("profile", broker_profiles())
def test_front_ends_drain_before_they_stop(profile: str) -> None:
    assert m.frontend_shutdown_problems(m.the_workload(render(profile), "frontend")) == []


@pytest.mark.parametrize("profile", broker_profiles())
def test_workers_finish_their_batch_before_sigkill(profile: str) -> None:
    assert m.worker_shutdown_problems(m.the_workload(render(profile), "worker")) == []


@pytest.mark.parametrize("profile", PROFILES)
def test_workload_selectors_select_their_own_pods(profile: str) -> None:
    assert m.workload_selector_problems(render(profile)) == []


@pytest.mark.parametrize("profile", PROFILES)
def test_every_deployment_has_one_disruption_budget(profile: str) -> None:
    assert m.pdb_problems(render(profile)) == []


@pytest.mark.parametrize("profile", PROFILES)
def test_services_reach_declared_ports(profile: str) -> None:
    assert m.service_problems(render(profile)) == []


@pytest.mark.parametrize("profile", PROFILES)
def test_standard_labels(profile: str) -> None:
    assert m.standard_label_problems(render(profile), RELEASE) == []


@pytest.mark.parametrize("profile", broker_profiles())
def test_only_front_ends_and_workers_reach_redis(profile: str) -> None:
    """With a Redis in the release; one outside it (ci/sentinel.yaml) is the cluster's to
    guard, and no policy names it."""
    docs = render(profile)
    if not [w for w in m.workloads(docs) if "-redis" in w["metadata"]["name"]]:
        assert m.of_kind(docs, "NetworkPolicy") == []
        return
    assert m.redis_network_policy_problems(docs) == []


# -- autoscaling, monitoring, GPUs, KServe ---------------------------------------------------


def front_end_service(docs: list[m.Doc]) -> m.Doc:
    frontend = m.the_workload(docs, "frontend")
    found = [s for s in m.of_kind(docs, "Service") if m.service_selects(s, frontend)]
    assert len(found) == 1, (
        f"expected one Service for the front ends, found {[m.ident(s) for s in found]}"
    )
    return found[0]


def test_keda_scales_workers_on_the_front_ends_backlog() -> None:
    docs = render("keda")
    worker, service = m.the_workload(docs, "worker"), front_end_service(docs)
    scaled = m.of_kind(docs, "ScaledObject")
    assert len(scaled) == 1, [m.ident(s) for s in scaled]
    spec = scaled[0]["spec"]
    assert spec["scaleTargetRef"]["name"] == m.name(worker)
    assert spec["scaleTargetRef"].get("kind", "Deployment") == worker["kind"] == "Deployment"
    assert spec["scaleTargetRef"].get("apiVersion", "apps/v1") == "apps/v1"
    assert [t["type"] for t in spec["triggers"]] == ["metrics-api"]
    metadata = spec["triggers"][0]["metadata"]
    url = urlsplit(metadata["url"])
    http_ports = [p["port"] for p in service["spec"]["ports"] if p.get("name") == "http"]
    assert url.hostname == f"{m.name(service)}.{NAMESPACE}.svc.cluster.local", metadata["url"]
    assert [url.port] == http_ports, (metadata["url"], http_ports)
    assert url.path == "/backlog", metadata["url"]
    assert metadata["valueLocation"] == "backlog"
    assert "replicas" not in worker["spec"], "KEDA owns the worker replicas"


def test_keda_scale_to_zero_tells_the_front_ends() -> None:
    docs = render("keda")
    spec = m.of_kind(docs, "ScaledObject")[0]["spec"]
    frontend = m.containers(m.the_workload(docs, "frontend"))[0]
    expected = "1" if spec.get("minReplicaCount", 0) == 0 else None
    assert m.env_value(frontend, "MB_SCALE_FROM_ZERO") == expected


def test_an_hpa_scales_the_front_ends_only() -> None:
    docs = render("keda")
    frontend, worker = m.the_workload(docs, "frontend"), m.the_workload(docs, "worker")
    hpas = m.of_kind(docs, "HorizontalPodAutoscaler")
    assert [h["apiVersion"] for h in hpas] == ["autoscaling/v2"]
    target = hpas[0]["spec"]["scaleTargetRef"]
    assert target == {"apiVersion": "apps/v1", "kind": "Deployment", "name": m.name(frontend)}
    assert target["name"] != m.name(worker), "KEDA makes the workers' HPA"
    assert "replicas" not in frontend["spec"], "the HPA owns the front-end replicas"


def test_the_service_monitor_scrapes_the_front_ends() -> None:
    docs = render("keda")
    service = front_end_service(docs)
    monitors = m.of_kind(docs, "ServiceMonitor")
    assert len(monitors) == 1, [m.ident(s) for s in monitors]
    spec = monitors[0]["spec"]
    assert m.selector_matches(spec["selector"], m.labels(service))
    assert [(e.get("port"), e.get("path")) for e in spec["endpoints"]] == [("http", "/metrics")]
    assert "http" in [p.get("name") for p in service["spec"]["ports"]]
    assert "authorization" not in spec["endpoints"][0]


def test_the_service_monitor_sends_a_metrics_key_where_keys_are_checked() -> None:
    """With a keys file /metrics asks a key with the metrics scope: the ServiceMonitor sends
    serviceMonitor.keySecret's as a bearer token (it had no way to: scrapes got 401)."""
    docs = render("keda", sets=("auth.keysSecret=mb-keys", "serviceMonitor.keySecret=mb-scrape"))
    (monitor,) = m.of_kind(docs, "ServiceMonitor")
    (endpoint,) = monitor["spec"]["endpoints"]
    assert endpoint["authorization"] == {
        "type": "Bearer",
        "credentials": {"name": "mb-scrape", "key": "metrics-key"},
    }


# -- observability: the dashboard and the alerts of deploy/, one copy each -------------------

DASHBOARD = REPO / "deploy" / "grafana" / "microbatch.json"
RULES = REPO / "deploy" / "prometheus" / "rules.yaml"
OBSERVABILITY_PROFILE = "observability"


def dashboard_config_maps(docs: list[m.Doc]) -> list[m.Doc]:
    return [
        doc
        for doc in m.of_kind(docs, "ConfigMap")
        if m.labels(doc).get("grafana_dashboard") is not None
    ]


def test_the_chart_reads_the_dashboard_and_rules_of_deploy_through_symlinks() -> None:
    """One source of truth: the chart's files are links to deploy/ (helm follows them), never
    copies that could drift from what the tests prove."""
    for name, target in (
        ("grafana-dashboard.json", DASHBOARD),
        ("prometheus-rules.yaml", RULES),
    ):
        link = CHART / "files" / name
        assert link.is_symlink(), f"{link.relative_to(REPO)} is not a symlink to {target}"
        assert not Path(os.readlink(link)).is_absolute(), "an absolute link breaks in a clone"
        assert link.resolve() == target.resolve()


@pytest.mark.parametrize("profile", [p for p in PROFILES if p != OBSERVABILITY_PROFILE])
def test_the_dashboard_and_the_rules_are_off_unless_asked(profile: str) -> None:
    docs = render(profile)
    assert m.of_kind(docs, "PrometheusRule") == []
    assert dashboard_config_maps(docs) == []
    values = chart_values()["observability"]
    assert not values["grafanaDashboard"]["enabled"] and not values["prometheusRule"]["enabled"]


def test_the_observability_profile_holds_the_dashboard_for_grafanas_sidecar() -> None:
    found = dashboard_config_maps(render(OBSERVABILITY_PROFILE))
    assert len(found) == 1, [m.ident(doc) for doc in found]
    config_map = found[0]
    assert m.labels(config_map)["grafana_dashboard"] == "1"
    assert list(config_map["data"]) == ["microbatch.json"]
    assert json.loads(config_map["data"]["microbatch.json"]) == json.loads(DASHBOARD.read_text())
    # A ConfigMap holds at most 1 MiB; a client-side apply keeps the whole object in an
    # annotation limited to 256 KiB.
    assert len(config_map["data"]["microbatch.json"].encode()) < 256 * 1024


def test_the_observability_profile_holds_the_rules_as_a_prometheus_rule() -> None:
    docs = render(OBSERVABILITY_PROFILE)
    rules = m.of_kind(docs, "PrometheusRule")
    assert len(rules) == 1, [m.ident(doc) for doc in rules]
    assert rules[0]["apiVersion"] == "monitoring.coreos.com/v1"
    assert rules[0]["spec"] == {"groups": yaml.safe_load(RULES.read_text())["groups"]}
    assert m.of_kind(docs, "ServiceMonitor"), "rules without a scrape see nothing"


@pytest.mark.parametrize("profile", gpu_profiles())
def test_gpu_workers_request_a_gpu_and_tolerate_gpu_nodes(profile: str) -> None:
    worker = m.the_workload(render(profile), "worker")
    container = m.containers(worker)[0]
    resources = container.get("resources") or {}
    assert m.quantity((resources.get("limits") or {}).get("nvidia.com/gpu", 0)) >= 1, resources
    tolerations = m.pod_spec(worker).get("tolerations") or []
    assert any(t.get("key") == "nvidia.com/gpu" for t in tolerations), tolerations
    assert m.env_value(container, "CUDA_DEVICES") != "cpu"


@pytest.mark.parametrize("profile", [p for p in PROFILES if p not in gpu_profiles()])
def test_cpu_profiles_request_no_gpu(profile: str) -> None:
    for workload in m.workloads(render(profile)):
        for container in m.all_containers(workload):
            resources = container.get("resources") or {}
            assert "nvidia.com/gpu" not in {
                **resources.get("requests", {}),
                **resources.get("limits", {}),
            }


def test_the_kserve_runtime_matches_the_server() -> None:
    docs = render("kserve")
    runtimes = m.of_kind(docs, "ServingRuntime")
    assert len(runtimes) == 1, [m.ident(r) for r in runtimes]
    spec = runtimes[0]["spec"]
    assert {"name": "microbatch", "version": "1", "autoSelect": True} in spec[
        "supportedModelFormats"
    ]
    assert spec["protocolVersions"] == ["v2", "grpc-v2"]
    assert spec["multiModel"] is False
    container = spec["containers"][0]
    assert container["name"] == "kserve-container"
    # One declared port: Knative (KServe's Serverless mode) refuses a second one.
    assert [p["containerPort"] for p in container["ports"]] == [8080]
    assert m.env_value(container, "PORT") == "8080"
    assert m.env_value(container, "MB_GRPC_PORT") == str(DEFAULT_GRPC_PORT)
    for probe in ("startupProbe", "readinessProbe", "livenessProbe"):
        assert "httpGet" in container[probe], probe  # Knative probes the serving port


# -- gRPC (the Open Inference Protocol, grpc.port) -------------------------------------------

DEFAULT_GRPC_PORT = 8001
GRPC_OFF = ("grpc.port=null", "grpc.port=0")


def grpc_port_of(profile: str) -> int | None:
    """The gRPC port a profile asks for (the chart's default unless it sets one); None: off."""
    values = yaml.safe_load(profile_path(profile).read_text()) or {}
    port = (values.get("grpc") or {}).get("port", chart_values()["grpc"]["port"])
    return int(port) if port else None


def serving_component(docs: list[m.Doc]) -> str:
    return "server" if mode_of(docs) == "single" else "frontend"


def the_service(docs: list[m.Doc]) -> m.Doc:
    serving = m.the_workload(docs, serving_component(docs))
    found = [s for s in m.of_kind(docs, "Service") if m.service_selects(s, serving)]
    assert len(found) == 1, [m.ident(s) for s in found]
    return found[0]


def service_port(service: m.Doc, port_name: str) -> dict[str, Any] | None:
    ports = [p for p in service["spec"]["ports"] if p.get("name") == port_name]
    return ports[0] if ports else None


def without_handler(probe: dict[str, Any]) -> dict[str, Any]:
    return {k: v for k, v in probe.items() if k not in {"httpGet", "grpc", "tcpSocket", "exec"}}


def test_the_chart_serves_grpc_by_default_on_8001() -> None:
    assert chart_values()["grpc"]["port"] == DEFAULT_GRPC_PORT


def test_the_profiles_render_grpc_both_on_and_off() -> None:
    ports = {p: grpc_port_of(p) for p in PROFILES}
    assert None in ports.values() and DEFAULT_GRPC_PORT in ports.values(), ports


@pytest.mark.parametrize("profile", [p for p in PROFILES if grpc_port_of(p)])
def test_grpc_is_served_by_the_serving_pods_only(profile: str) -> None:
    """The server or every front end: MB_GRPC_PORT, a containerPort and a Service port named
    grpc (cleartext HTTP/2), readiness asked over gRPC; the workers and Redis: none of it."""
    port = grpc_port_of(profile)
    docs = render(profile)
    serving = serving_component(docs)
    for workload in m.workloads(docs):
        for container in m.containers(workload):
            names, numbers = m.container_ports(container)
            if m.component(workload) == serving:
                assert m.env_value(container, "MB_GRPC_PORT") == str(port)
                assert {"name": "grpc", "containerPort": port, "protocol": "TCP"} in container[
                    "ports"
                ]
            else:
                assert "MB_GRPC_PORT" not in m.env_names(container), m.ident(workload)
                assert "grpc" not in names and port not in numbers, m.ident(workload)
                assert "grpc" not in container.get("readinessProbe", {}), m.ident(workload)
    assert service_port(the_service(docs), "grpc") == {
        "name": "grpc",
        "port": port,
        "targetPort": "grpc",
        "protocol": "TCP",
        "appProtocol": "kubernetes.io/h2c",
    }


@pytest.mark.parametrize("profile", [p for p in PROFILES if grpc_port_of(p)])
def test_readiness_is_a_grpc_probe_and_the_rest_stay_http(profile: str) -> None:
    """Readiness is Kubernetes' gRPC probe on the port (grpc.health.v1 for the server as a
    whole: no service named), with the timing the HTTP probe had; startup and liveness stay
    HTTP, so a gRPC hiccup never restarts a pod."""
    docs, docs_off = render(profile), render(profile, sets=(GRPC_OFF[0],))
    on = m.containers(m.the_workload(docs, serving_component(docs)))[0]
    off = m.containers(m.the_workload(docs_off, serving_component(docs)))[0]
    assert on["readinessProbe"]["grpc"] == {"port": grpc_port_of(profile)}
    assert "httpGet" not in on["readinessProbe"]
    assert without_handler(on["readinessProbe"]) == without_handler(off["readinessProbe"])
    for kind in ("startupProbe", "livenessProbe"):
        assert on[kind] == off[kind], kind
        assert on[kind]["httpGet"]["port"] == "http", kind


@pytest.mark.parametrize("setting", GRPC_OFF)
@pytest.mark.parametrize("profile", ["cpu-single", "keda", "kserve"])
def test_grpc_off_removes_all_of_it(profile: str, setting: str) -> None:
    """grpc.port null or 0: no MB_GRPC_PORT, no grpc port on any container or Service, no
    grpc-v2 in the KServe runtime, and readiness is GET /readyz on http again."""
    docs = render(profile, sets=(setting,))
    text = yaml.safe_dump_all(docs)
    assert "MB_GRPC_PORT" not in text and "grpc:" not in text and "h2c" not in text
    for workload in m.workloads(docs):
        for container in m.containers(workload):
            assert "grpc" not in m.container_ports(container)[0], m.ident(workload)
    assert service_port(the_service(docs), "grpc") is None
    serving = m.containers(m.the_workload(docs, serving_component(docs)))[0]
    assert serving["readinessProbe"]["httpGet"] == {"path": "/readyz", "port": "http"}
    for runtime in m.of_kind(docs, "ServingRuntime"):
        assert runtime["spec"]["protocolVersions"] == ["v2"]


@pytest.mark.parametrize(
    ("sets", "message"),
    [
        (("grpc.port=8000",), "grpc.port 8000 is the HTTP port"),
        (("kserve.enabled=true", "grpc.port=8080"), "grpc.port 8080 is the KServe container's"),
        (("grpc.port=-1",), "/grpc/port"),
        (("grpc.port=70000",), "/grpc/port"),
    ],
)
def test_a_grpc_port_that_cannot_work_is_refused(
    chart: Path, sets: tuple[str, ...], message: str
) -> None:
    # helm template, not lint: lint reports the chart's own `fail` as INFO and passes.
    result = run_helm("template", RELEASE, str(chart), *(a for s in sets for a in ("--set", s)))
    output = result.stdout + result.stderr
    assert result.returncode != 0, f"{sets} was accepted:\n{output}"
    assert message in output, output


@pytest.mark.parametrize("profile", ["cpu-single", "cpu-broker"])
def test_a_keys_secret_is_mounted_as_the_keys_file_of_every_front(profile: str) -> None:
    """auth.keysSecret (docs/tenants.md): the Secret's keys.yaml, read-only, named by
    MB_KEYS_FILE in the server and the front ends; the workers check no keys."""
    docs = render(profile, sets=("auth.keysSecret=mb-keys",))
    fronts = 0
    for workload in m.workloads(docs):
        if m.component(workload) not in ("server", "frontend", "worker"):
            continue
        volumes = {v["name"]: v for v in m.pod_spec(workload).get("volumes") or []}
        assert volumes["keys"]["secret"]["secretName"] == "mb-keys"
        assert volumes["keys"]["secret"]["items"] == [{"key": "keys.yaml", "path": "keys.yaml"}]
        for container in m.containers(workload):
            names = m.env_names(container)
            assert "API_KEY" not in names and "ADMIN_API_KEY" not in names
            if m.component(workload) == "worker":
                assert "MB_KEYS_FILE" not in names
                continue
            fronts += 1
            path = m.env_value(container, "MB_KEYS_FILE")
            assert path == "/etc/microbatch/keys/keys.yaml"
            mounts = {v["name"]: v for v in container.get("volumeMounts") or []}
            assert mounts["keys"] == {
                "name": "keys",
                "mountPath": "/etc/microbatch/keys",
                "readOnly": True,
            }
    assert fronts, f"{profile}: no server or front end got the keys file"


def test_a_keys_secret_is_mounted_in_the_kserve_runtime_that_reads_it() -> None:
    """KServe's runtime checks keys as the server does: MB_KEYS_FILE names the Secret's
    keys.yaml, mounted read-only (it was named and not mounted: the pod refused to start)."""
    (runtime,) = m.of_kind(render("kserve", sets=("auth.keysSecret=mb-keys",)), "ServingRuntime")
    (container,) = runtime["spec"]["containers"]
    assert m.env_value(container, "MB_KEYS_FILE") == "/etc/microbatch/keys/keys.yaml"
    mounts = {v["name"]: v for v in container["volumeMounts"]}
    assert mounts["keys"] == {"name": "keys", "mountPath": "/etc/microbatch/keys", "readOnly": True}
    volumes = {v["name"]: v for v in runtime["spec"]["volumes"]}
    assert volumes["keys"]["secret"]["secretName"] == "mb-keys"
    (plain,) = m.of_kind(render("kserve"), "ServingRuntime")
    assert "keys" not in {v["name"] for v in plain["spec"]["volumes"]}
    assert "MB_KEYS_FILE" not in m.env_names(plain["spec"]["containers"][0])


def test_a_keys_secret_beside_an_api_key_is_refused(chart: Path) -> None:
    sets = ("auth.keysSecret=mb-keys", "auth.apiKey=secret")
    result = run_helm("template", RELEASE, str(chart), *(a for s in sets for a in ("--set", s)))
    output = result.stdout + result.stderr
    assert result.returncode != 0, output
    assert "auth.keysSecret replaces auth.apiKey" in output
