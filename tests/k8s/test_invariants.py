"""Each invariant in manifests.py can fail: break one thing in a rendered broker profile and
the check names a problem it did not name before."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import pytest

from tests.k8s import manifests as m
from tests.k8s.conftest import render

PROFILE = "cpu-broker"
Check = Callable[[list[m.Doc]], list[str]]


def each(check: Callable[[m.Doc], list[str]]) -> Check:
    return lambda docs: [p for w in m.workloads(docs) for p in check(w)]


def container(docs: list[m.Doc], component: str) -> dict[str, Any]:
    return m.containers(m.the_workload(docs, component))[0]


def env_entry(docs: list[m.Doc], component: str, var: str) -> dict[str, Any]:
    entries = [e for e in container(docs, component).get("env") or [] if e.get("name") == var]
    assert entries, f"the {component} container has no env {var}"
    return dict(entries[0])


def set_env(docs: list[m.Doc], component: str, var: str, entry: dict[str, Any]) -> None:
    env = container(docs, component)["env"]
    env[[e.get("name") for e in env].index(var)] = entry


def security(key: str, value: Any) -> Callable[[list[m.Doc]], None]:
    return lambda docs: (
        container(docs, "frontend").setdefault("securityContext", {}).__setitem__(key, value)
    )


def pod_spec(docs: list[m.Doc], component: str) -> dict[str, Any]:
    spec: dict[str, Any] = m.the_workload(docs, component)["spec"]["template"]["spec"]
    return spec


def drop_shm_medium(docs: list[m.Doc]) -> None:
    mounts = container(docs, "worker")["volumeMounts"]
    mount = next(v for v in mounts if v["mountPath"] == "/dev/shm")
    volume = next(v for v in pod_spec(docs, "worker")["volumes"] if v["name"] == mount["name"])
    volume["emptyDir"].pop("medium", None)


def move_broker_first(docs: list[m.Doc]) -> None:
    env = container(docs, "worker")["env"]
    env.insert(0, env.pop([e.get("name") for e in env].index("MB_BROKER")))


def drop_worker_pdb(docs: list[m.Doc]) -> None:
    labels = m.pod_labels(m.the_workload(docs, "worker"))
    for pdb in m.of_kind(docs, "PodDisruptionBudget"):
        if m.selector_matches(pdb["spec"].get("selector"), labels):
            docs.remove(pdb)


def admit_everyone(docs: list[m.Doc]) -> None:
    for policy in m.of_kind(docs, "NetworkPolicy"):
        for rule in policy["spec"].get("ingress") or []:
            rule.setdefault("from", []).append({"podSelector": {}})


def drop_network_policies(docs: list[m.Doc]) -> None:
    for policy in m.of_kind(docs, "NetworkPolicy"):
        docs.remove(policy)


def retarget_services(docs: list[m.Doc]) -> None:
    for service in m.of_kind(docs, "Service"):
        service["spec"]["ports"][0]["targetPort"] = "no-such-port"


BREAKAGES: dict[str, tuple[Callable[[list[m.Doc]], None], Check]] = {
    "writable root filesystem": (
        security("readOnlyRootFilesystem", False),
        each(m.security_problems),
    ),
    "privilege escalation": (security("allowPrivilegeEscalation", True), each(m.security_problems)),
    "capabilities kept": (security("capabilities", {"drop": []}), each(m.security_problems)),
    "runs as root": (security("runAsUser", 0), each(m.security_problems)),
    "no worker limits": (
        lambda docs: container(docs, "worker")["resources"].pop("limits"),
        each(m.resource_problems),
    ),
    "/dev/shm on disk": (drop_shm_medium, each(m.shm_problems)),
    "inline Redis password": (
        lambda docs: set_env(
            docs, "frontend", "REDIS_PASSWORD", {"name": "REDIS_PASSWORD", "value": "hunter2"}
        ),
        each(m.secret_env_problems),
    ),
    "password in MB_BROKER": (
        lambda docs: set_env(
            docs,
            "worker",
            "MB_BROKER",
            {"name": "MB_BROKER", "value": "redis://:hunter2@redis:6379/0"},
        ),
        each(m.secret_env_problems),
    ),
    "inline API key": (
        lambda docs: container(docs, "frontend")["env"].append({"name": "API_KEY", "value": "k"}),
        each(m.secret_env_problems),
    ),
    "MB_BROKER before REDIS_PASSWORD": (move_broker_first, each(m.env_reference_problems)),
    "no startup probe": (
        lambda docs: container(docs, "worker").pop("startupProbe"),
        each(m.probe_problems),
    ),
    "liveness on /readyz": (
        lambda docs: container(docs, "frontend")["livenessProbe"]["httpGet"].__setitem__(
            "path", "/readyz"
        ),
        each(m.probe_problems),
    ),
    "front end killed mid-request": (
        lambda docs: pod_spec(docs, "frontend").__setitem__("terminationGracePeriodSeconds", 10),
        lambda docs: m.frontend_shutdown_problems(m.the_workload(docs, "frontend")),
    ),
    "gunicorn's own 30 s graceful timeout": (
        lambda docs: container(docs, "frontend").__setitem__(
            "command",
            [
                part.replace("--graceful-timeout 35", "")
                for part in container(docs, "frontend")["command"]
            ],
        ),
        lambda docs: m.frontend_shutdown_problems(m.the_workload(docs, "frontend")),
    ),
    "front end without preStop": (
        lambda docs: container(docs, "frontend").pop("lifecycle"),
        lambda docs: m.frontend_shutdown_problems(m.the_workload(docs, "frontend")),
    ),
    "worker killed mid-batch": (
        lambda docs: pod_spec(docs, "worker").__setitem__("terminationGracePeriodSeconds", 60),
        lambda docs: m.worker_shutdown_problems(m.the_workload(docs, "worker")),
    ),
    "worker without a PDB": (drop_worker_pdb, m.pdb_problems),
    "Redis open to every pod": (admit_everyone, m.redis_network_policy_problems),
    "Redis without a NetworkPolicy": (drop_network_policies, m.redis_network_policy_problems),
    "Service to an undeclared port": (retarget_services, m.service_problems),
    "worker selector picks front ends": (
        lambda docs: m.the_workload(docs, "worker")["spec"]["selector"].__setitem__(
            "matchLabels", {m.COMPONENT: "frontend"}
        ),
        m.workload_selector_problems,
    ),
}


@pytest.mark.parametrize("breakage", sorted(BREAKAGES))
def test_each_invariant_can_fail(breakage: str) -> None:
    breaker, check = BREAKAGES[breakage]
    docs = render(PROFILE)
    before = set(check(docs))
    breaker(docs)
    assert set(check(docs)) - before, (
        f"breaking it ({breakage}) went unnoticed (or it was broken already)"
    )


def test_an_external_redis_gives_each_role_its_own_url_and_the_tls_files() -> None:
    """ci/sentinel.yaml (issue #49): the workers read their own user's URL, the front ends
    theirs and the admin routes' (MB_BROKER_ADMIN), each from the Secret; both mount the TLS
    files the URLs name, read-only."""
    docs = render("sentinel")

    def ref(component: str, var: str) -> Any:
        return env_entry(docs, component, var)["valueFrom"]["secretKeyRef"]

    assert ref("frontend", "MB_BROKER") == {"name": "mb-redis", "key": "url"}
    assert ref("frontend", "MB_BROKER_ADMIN") == {"name": "mb-redis", "key": "admin-url"}
    assert ref("worker", "MB_BROKER") == {"name": "mb-redis", "key": "worker-url"}
    assert not [e for e in container(docs, "worker")["env"] if e["name"] == "MB_BROKER_ADMIN"]
    for component in ("frontend", "worker"):
        mounts = {v["name"]: v for v in container(docs, component)["volumeMounts"]}
        assert mounts["redis-tls"] == {
            "name": "redis-tls", "mountPath": "/etc/microbatch/redis-tls", "readOnly": True,
        }  # fmt: skip
        volumes = {v["name"]: v for v in pod_spec(docs, component)["volumes"]}
        assert volumes["redis-tls"]["secret"]["secretName"] == "mb-redis-tls"
