"""Small readers and invariant checks over rendered manifests (lists of dicts), for
``test_chart.py``. Each ``*_problems`` function returns what is wrong as readable lines, so a
test asserts ``== []`` and its failure says which object broke which rule.

>>> selector_matches({"matchLabels": {"a": "1"}}, {"a": "1", "b": "2"})
True
>>> selector_matches({"matchExpressions": [{"key": "b", "operator": "NotIn", "values": ["2"]}]}, {"b": "2"})
False
>>> quantity("1500m") == quantity("1.5"), quantity("1Gi") > quantity("1G")
(True, True)
"""

from __future__ import annotations

import re
from collections.abc import Iterable, Mapping
from fractions import Fraction
from typing import Any

Doc = dict[str, Any]

COMPONENT = "app.kubernetes.io/component"
INSTANCE = "app.kubernetes.io/instance"
STANDARD_LABELS = (
    "app.kubernetes.io/name",
    INSTANCE,
    "app.kubernetes.io/managed-by",
    "helm.sh/chart",
)
# Pods that serve or hold models, and the front ends: the containers that must be probed.
APP_COMPONENTS = frozenset({"server", "frontend", "worker"})
# Pods that load models (and run them in worker processes over shared memory).
MODEL_COMPONENTS = frozenset({"server", "worker"})
WORKLOAD_KINDS = frozenset({"Deployment", "StatefulSet"})
# Volume types the "restricted" Pod Security Standard allows.
RESTRICTED_VOLUME_TYPES = frozenset(
    {
        "configMap",
        "csi",
        "downwardAPI",
        "emptyDir",
        "ephemeral",
        "persistentVolumeClaim",
        "projected",
        "secret",
    }
)
# Env vars that hold a credential: never an inline value, always a Secret.
SECRET_ENV = re.compile(r"(^|_)(PASSWORD|API_KEY|TOKEN|SECRET)$|^REDISCLI_AUTH$")
# A dependent variable, $(NAME); $$(NAME) is the escaped literal.
ENV_REFERENCE = re.compile(r"(?<!\$)\$\(([A-Z_][A-Z0-9_]*)\)")
# Seconds a model-loading container may take to start (model load + self-test): 300 s.
MIN_STARTUP_BUDGET_S = 300
# MB_REQUEST_TIMEOUT's and MB_BATCH_TIMEOUT's defaults (app/settings.py).
DEFAULT_REQUEST_TIMEOUT_S = 30
DEFAULT_BATCH_TIMEOUT_S = 60


# -- readers ---------------------------------------------------------------------------------


def name(doc: Mapping[str, Any]) -> str:
    return str(doc.get("metadata", {}).get("name"))


def ident(doc: Mapping[str, Any]) -> str:
    return f"{doc.get('kind')}/{name(doc)}"


def labels(doc: Mapping[str, Any]) -> dict[str, str]:
    return dict(doc.get("metadata", {}).get("labels") or {})


def of_kind(docs: Iterable[Doc], kind: str) -> list[Doc]:
    return [doc for doc in docs if doc.get("kind") == kind]


def workloads(docs: Iterable[Doc]) -> list[Doc]:
    """The Deployments and StatefulSets: every pod template the chart renders."""
    return [doc for doc in docs if doc.get("kind") in WORKLOAD_KINDS]


def pod_spec(workload: Mapping[str, Any]) -> dict[str, Any]:
    return dict(workload["spec"]["template"].get("spec") or {})


def pod_labels(workload: Mapping[str, Any]) -> dict[str, str]:
    return dict(workload["spec"]["template"].get("metadata", {}).get("labels") or {})


def component(workload: Mapping[str, Any]) -> str | None:
    return pod_labels(workload).get(COMPONENT)


def by_component(docs: Iterable[Doc], wanted: str) -> list[Doc]:
    return [workload for workload in workloads(docs) if component(workload) == wanted]


def the_workload(docs: Iterable[Doc], wanted: str) -> Doc:
    """The one workload of component ``wanted``; fails if there is none or several."""
    found = by_component(docs, wanted)
    assert len(found) == 1, (
        f"expected one workload with {COMPONENT}={wanted}, found {[ident(w) for w in found]}"
    )
    return found[0]


def containers(workload: Mapping[str, Any]) -> list[dict[str, Any]]:
    return list(pod_spec(workload).get("containers") or [])


def all_containers(workload: Mapping[str, Any]) -> list[dict[str, Any]]:
    """Init containers first, then the containers."""
    spec = pod_spec(workload)
    return list(spec.get("initContainers") or []) + list(spec.get("containers") or [])


def env_value(container: Mapping[str, Any], var: str) -> str | None:
    """The inline value of env var ``var``, or None (absent, or from a Secret)."""
    for entry in container.get("env") or []:
        if entry.get("name") == var:
            value = entry.get("value")
            return None if value is None else str(value)
    return None


def env_names(container: Mapping[str, Any]) -> list[str]:
    return [str(entry.get("name")) for entry in container.get("env") or []]


def selector_matches(selector: Mapping[str, Any] | None, target: Mapping[str, str]) -> bool:
    """Whether a LabelSelector selects objects labelled ``target``; an empty one selects all."""
    selector = selector or {}
    for key, value in (selector.get("matchLabels") or {}).items():
        if target.get(key) != value:
            return False
    for expression in selector.get("matchExpressions") or []:
        key, operator, values = (
            expression["key"],
            expression["operator"],
            expression.get("values") or [],
        )
        if operator == "In" and target.get(key) not in values:
            return False
        if operator == "NotIn" and key in target and target[key] in values:
            return False
        if operator == "Exists" and key not in target:
            return False
        if operator == "DoesNotExist" and key in target:
            return False
    return True


def selected_workloads(docs: Iterable[Doc], selector: Mapping[str, Any] | None) -> list[Doc]:
    return [
        workload for workload in workloads(docs) if selector_matches(selector, pod_labels(workload))
    ]


def service_selects(service: Mapping[str, Any], workload: Mapping[str, Any]) -> bool:
    """A Service's selector is a plain map; an empty one selects nothing (no Endpoints)."""
    selector = service.get("spec", {}).get("selector") or {}
    return bool(selector) and all(pod_labels(workload).get(k) == v for k, v in selector.items())


_SUFFIXES = {
    "Ki": Fraction(2**10),
    "Mi": Fraction(2**20),
    "Gi": Fraction(2**30),
    "Ti": Fraction(2**40),
    "Pi": Fraction(2**50),
    "Ei": Fraction(2**60),
    "n": Fraction(1, 10**9),
    "u": Fraction(1, 10**6),
    "m": Fraction(1, 10**3),
    "": Fraction(1),
    "k": Fraction(10**3),
    "M": Fraction(10**6),
    "G": Fraction(10**9),
    "T": Fraction(10**12),
    "P": Fraction(10**15),
    "E": Fraction(10**18),
}
_QUANTITY = re.compile(
    r"([+-]?(?:\d+(?:\.\d*)?|\.\d+))(?:[eE]([+-]?\d+))?(Ki|Mi|Gi|Ti|Pi|Ei|n|u|m|k|M|G|T|P|E)?"
)


def quantity(value: object) -> Fraction:
    """A Kubernetes resource quantity ("250m", "1Gi", 2) as an exact number."""
    match = _QUANTITY.fullmatch(str(value))
    if match is None:
        raise ValueError(f"not a quantity: {value!r}")
    number, exponent, suffix = match.groups()
    return Fraction(number) * Fraction(10) ** int(exponent or 0) * _SUFFIXES[suffix or ""]


def container_ports(container: Mapping[str, Any]) -> tuple[set[str], set[int]]:
    ports = container.get("ports") or []
    return {str(p["name"]) for p in ports if "name" in p}, {int(p["containerPort"]) for p in ports}


def probe_port(probe: Mapping[str, Any]) -> int | str | None:
    for handler in ("httpGet", "tcpSocket", "grpc"):
        if handler in probe:
            port = probe[handler].get("port")
            return port if isinstance(port, (int, str)) else None
    return None


def prestop_sleep_seconds(container: Mapping[str, Any]) -> int | None:
    """Seconds a preStop hook sleeps: ``exec: [sleep, N]`` (or ``sh -c "sleep N"``), or the
    ``sleep`` action; None when there is no such hook."""
    pre_stop = (container.get("lifecycle") or {}).get("preStop") or {}
    if "sleep" in pre_stop:
        return int(pre_stop["sleep"]["seconds"])
    command = [str(part) for part in (pre_stop.get("exec") or {}).get("command") or []]
    if len(command) == 2 and command[0] in {"sleep", "/bin/sleep"}:
        return int(command[1])
    if len(command) == 3 and command[:2] in (["sh", "-c"], ["/bin/sh", "-c"]):
        match = re.fullmatch(r"\s*sleep\s+(\d+)\s*", command[2])
        return int(match.group(1)) if match else None
    return None


# -- invariants ------------------------------------------------------------------------------


def security_problems(workload: Mapping[str, Any]) -> list[str]:
    """The "restricted" Pod Security Standard plus a read-only root filesystem, for every
    container, init containers included."""
    spec = pod_spec(workload)
    pod = spec.get("securityContext") or {}
    problems = []
    if (pod.get("seccompProfile") or {}).get("type") not in {"RuntimeDefault", "Localhost"}:
        problems.append(
            f"{ident(workload)}: pod securityContext.seccompProfile.type is not RuntimeDefault"
        )
    for host in ("hostNetwork", "hostPID", "hostIPC"):
        if spec.get(host):
            problems.append(f"{ident(workload)}: {host} is set")
    for volume in spec.get("volumes") or []:
        kinds = set(volume) - {"name"}
        if not kinds <= RESTRICTED_VOLUME_TYPES:
            problems.append(f"{ident(workload)}: volume {volume.get('name')} is {sorted(kinds)}")
    for container in all_containers(workload):
        where = f"{ident(workload)} container {container.get('name')}"
        own = container.get("securityContext") or {}
        if own.get("runAsNonRoot", pod.get("runAsNonRoot")) is not True:
            problems.append(f"{where}: runAsNonRoot is not true")
        if own.get("runAsUser", pod.get("runAsUser")) == 0:
            problems.append(f"{where}: runs as uid 0")
        if own.get("allowPrivilegeEscalation") is not False:
            problems.append(f"{where}: allowPrivilegeEscalation is not false")
        if own.get("privileged"):
            problems.append(f"{where}: privileged")
        capabilities = own.get("capabilities") or {}
        if "ALL" not in (capabilities.get("drop") or []):
            problems.append(f"{where}: capabilities.drop lacks ALL")
        if set(capabilities.get("add") or []) - {"NET_BIND_SERVICE"}:
            problems.append(f"{where}: adds capabilities {capabilities['add']}")
        if own.get("readOnlyRootFilesystem") is not True:
            problems.append(f"{where}: readOnlyRootFilesystem is not true")
        for port in container.get("ports") or []:
            if "hostPort" in port:
                problems.append(f"{where}: hostPort {port['hostPort']}")
    return problems


def resource_problems(workload: Mapping[str, Any]) -> list[str]:
    """Requests and limits for cpu and memory on every container, requests within limits."""
    problems = []
    for container in all_containers(workload):
        where = f"{ident(workload)} container {container.get('name')}"
        resources = container.get("resources") or {}
        requests, limits = resources.get("requests") or {}, resources.get("limits") or {}
        for resource in ("cpu", "memory"):
            if resource not in requests:
                problems.append(f"{where}: no {resource} request")
            if resource not in limits:
                problems.append(f"{where}: no {resource} limit")
        for resource in set(requests) & set(limits):
            if quantity(requests[resource]) > quantity(limits[resource]):
                problems.append(
                    f"{where}: {resource} request {requests[resource]} > limit {limits[resource]}"
                )
    return problems


def shm_problems(workload: Mapping[str, Any]) -> list[str]:
    """Model-loading pods mount /dev/shm from a memory-backed emptyDir with a sizeLimit, within
    the container's memory limit (tmpfs pages count against it)."""
    volumes = {volume.get("name"): volume for volume in pod_spec(workload).get("volumes") or []}
    problems = []
    for container in containers(workload):
        where = f"{ident(workload)} container {container.get('name')}"
        mounts = [
            m for m in container.get("volumeMounts") or [] if m.get("mountPath") == "/dev/shm"
        ]
        if not mounts:
            problems.append(f"{where}: nothing mounted at /dev/shm")
            continue
        empty_dir = volumes.get(mounts[0].get("name"), {}).get("emptyDir")
        if not isinstance(empty_dir, dict) or empty_dir.get("medium") != "Memory":
            problems.append(f"{where}: /dev/shm is not an emptyDir with medium Memory")
            continue
        if "sizeLimit" not in empty_dir:
            problems.append(f"{where}: /dev/shm emptyDir has no sizeLimit")
            continue
        limit = ((container.get("resources") or {}).get("limits") or {}).get("memory")
        if limit is not None and quantity(empty_dir["sizeLimit"]) > quantity(limit):
            problems.append(
                f"{where}: /dev/shm sizeLimit {empty_dir['sizeLimit']} exceeds memory limit {limit}"
            )
    return problems


def secret_env_problems(workload: Mapping[str, Any]) -> list[str]:
    """No credential as an inline env value: API keys and passwords come from secretKeyRef;
    MB_BROKER either does too, or carries only ``$(VAR)`` for its password, where VAR is a
    Secret-backed variable defined before it."""
    problems = []
    for container in all_containers(workload):
        where = f"{ident(workload)} container {container.get('name')}"
        from_secret: set[str] = set()
        for entry in container.get("env") or []:
            var = str(entry.get("name"))
            secret_ref = (entry.get("valueFrom") or {}).get("secretKeyRef")
            if secret_ref:
                from_secret.add(var)
            if var == "MB_BROKER" and "value" in entry:
                problems.extend(_broker_url_problems(where, str(entry["value"]), from_secret))
            elif var == "MB_BROKER" and not secret_ref:
                problems.append(f"{where}: MB_BROKER is neither a value nor a secretKeyRef")
            elif SECRET_ENV.search(var) and not secret_ref:
                how = "an inline value" if "value" in entry else "not from a secretKeyRef"
                problems.append(f"{where}: {var} is {how}")
    return problems


def _broker_url_problems(where: str, url: str, from_secret: set[str]) -> list[str]:
    authority = url.split("://", 1)[-1].split("/", 1)[0]
    if "@" not in authority:
        return []
    userinfo = authority.rsplit("@", 1)[0]
    password = userinfo.split(":", 1)[1] if ":" in userinfo else userinfo
    match = re.fullmatch(r"\$\(([A-Z_][A-Z0-9_]*)\)", password)
    if match is None:
        return [f"{where}: MB_BROKER carries an inline password"]
    if match.group(1) not in from_secret:
        return [
            f"{where}: MB_BROKER's $({match.group(1)}) is not a Secret-backed variable defined before it"
        ]
    return []


def env_reference_problems(workload: Mapping[str, Any]) -> list[str]:
    """Every ``$(VAR)`` resolves: in an env value, to a variable defined before it; in command
    or args, to one of the container's variables (the kubelet leaves others as literal text)."""
    problems = []
    for container in all_containers(workload):
        where = f"{ident(workload)} container {container.get('name')}"
        seen: list[str] = []
        for entry in container.get("env") or []:
            for ref in ENV_REFERENCE.findall(str(entry.get("value", ""))):
                if ref not in seen:
                    problems.append(
                        f"{where}: env {entry.get('name')} uses $({ref}) before it is defined"
                    )
            seen.append(str(entry.get("name")))
        for part in [*(container.get("command") or []), *(container.get("args") or [])]:
            for ref in ENV_REFERENCE.findall(str(part)):
                if ref not in seen:
                    problems.append(f"{where}: command/args use $({ref}), which is not in its env")
    return problems


def probe_problems(workload: Mapping[str, Any]) -> list[str]:
    """App containers have startup, readiness and liveness probes on ports they declare; the
    liveness probe never asks /readyz (a Redis outage must not restart every pod); model
    loaders give the start-up 300 s. Redis has readiness and liveness."""
    problems = []
    app = component(workload) in APP_COMPONENTS
    wanted = (
        ("startupProbe", "readinessProbe", "livenessProbe")
        if app
        else ("readinessProbe", "livenessProbe")
    )
    for container in containers(workload):
        where = f"{ident(workload)} container {container.get('name')}"
        names, numbers = container_ports(container)
        for kind in wanted:
            probe = container.get(kind)
            if not probe:
                problems.append(f"{where}: no {kind}")
                continue
            port = probe_port(probe)
            if port is not None and port not in names and port not in numbers:
                problems.append(f"{where}: {kind} port {port!r} is not a declared containerPort")
        liveness = container.get("livenessProbe") or {}
        if (liveness.get("httpGet") or {}).get("path") == "/readyz":
            problems.append(f"{where}: livenessProbe asks /readyz")
        startup = container.get("startupProbe") or {}
        if component(workload) in MODEL_COMPONENTS and startup:
            budget = int(startup.get("periodSeconds", 10)) * int(startup.get("failureThreshold", 3))
            if budget < MIN_STARTUP_BUDGET_S:
                problems.append(
                    f"{where}: startupProbe allows {budget} s, under {MIN_STARTUP_BUDGET_S} s"
                )
    return problems


def graceful_timeout_seconds(container: Mapping[str, Any]) -> int | None:
    """gunicorn's ``--graceful-timeout`` in a container's command line (None: not given, so
    gunicorn's 30 s default)."""
    line = " ".join(
        str(part) for part in [*container.get("command", []), *container.get("args", [])]
    )
    found = re.search(r"--graceful-timeout[ =](\d+)", line)
    return int(found.group(1)) if found else None


def frontend_shutdown_problems(workload: Mapping[str, Any]) -> list[str]:
    """A front end sleeps in preStop (its endpoints leave the Service first); gunicorn gives
    admitted requests at least the longest request (MB_REQUEST_TIMEOUT, 30 s by default) to
    finish after SIGTERM (``--graceful-timeout``, else only its own 30 s); and the grace
    period covers the sleep plus that."""
    problems = []
    grace = int(pod_spec(workload).get("terminationGracePeriodSeconds", 30))
    for container in containers(workload):
        where = f"{ident(workload)} container {container.get('name')}"
        sleep = prestop_sleep_seconds(container)
        if sleep is None:
            problems.append(f"{where}: no preStop sleep")
            continue
        timeout = max(
            DEFAULT_REQUEST_TIMEOUT_S, int(float(env_value(container, "MB_REQUEST_TIMEOUT") or 0))
        )
        graceful = graceful_timeout_seconds(container)
        if graceful is None or graceful < timeout:
            problems.append(
                f"{where}: gunicorn --graceful-timeout {graceful} under the request timeout {timeout} s"
            )
        if grace < sleep + (graceful or timeout):
            problems.append(
                f"{ident(workload)}: terminationGracePeriodSeconds {grace} < preStop {sleep} s + graceful timeout {graceful or timeout} s"
            )
    return problems


def worker_shutdown_problems(workload: Mapping[str, Any]) -> list[str]:
    """A worker's grace period exceeds the longest batch (MB_BATCH_TIMEOUT, 60 s by default), so
    SIGTERM's drain finishes before SIGKILL."""
    grace = int(pod_spec(workload).get("terminationGracePeriodSeconds", 30))
    longest = max(
        [DEFAULT_BATCH_TIMEOUT_S]
        + [int(float(env_value(c, "MB_BATCH_TIMEOUT") or 0)) for c in containers(workload)]
    )
    if grace <= longest:
        return [
            f"{ident(workload)}: terminationGracePeriodSeconds {grace} <= batch timeout {longest} s"
        ]
    return []


def workload_selector_problems(docs: list[Doc]) -> list[str]:
    """Each workload's selector selects its own template and no other workload's pods."""
    problems = []
    for workload in workloads(docs):
        selector = workload["spec"].get("selector")
        if not selector_matches(selector, pod_labels(workload)):
            problems.append(f"{ident(workload)}: spec.selector does not match its pod template")
        others = [ident(w) for w in selected_workloads(docs, selector) if w is not workload]
        if others:
            problems.append(f"{ident(workload)}: spec.selector also selects the pods of {others}")
    return problems


def pdb_problems(docs: list[Doc]) -> list[str]:
    """Every Deployment's pods are covered by exactly one PodDisruptionBudget, which lets at
    least one pod go (a drain never blocks); every PDB covers some pods."""
    pdbs = of_kind(docs, "PodDisruptionBudget")
    problems = []
    for deployment in of_kind(docs, "Deployment"):
        covering = [
            pdb
            for pdb in pdbs
            if selector_matches(pdb["spec"].get("selector"), pod_labels(deployment))
        ]
        if len(covering) != 1:
            problems.append(f"{ident(deployment)}: covered by {len(covering)} PodDisruptionBudgets")
    for pdb in pdbs:
        selector = pdb["spec"].get("selector")
        if not selector or not selected_workloads(docs, selector):
            problems.append(f"{ident(pdb)}: selects no rendered pods")
        if str(pdb["spec"].get("maxUnavailable", "")) in {"0", "0%"}:
            problems.append(f"{ident(pdb)}: maxUnavailable 0 blocks every drain")
        min_available = pdb["spec"].get("minAvailable")
        for workload in selected_workloads(docs, selector):
            replicas = workload["spec"].get("replicas")
            if (
                isinstance(min_available, int)
                and isinstance(replicas, int)
                and min_available >= replicas
            ):
                problems.append(
                    f"{ident(pdb)}: minAvailable {min_available} >= {ident(workload)} replicas {replicas}"
                )
    return problems


def service_problems(docs: list[Doc]) -> list[str]:
    """Every Service selects rendered pods, and each port's targetPort is one they declare."""
    problems = []
    for service in of_kind(docs, "Service"):
        targets = [w for w in workloads(docs) if service_selects(service, w)]
        if not targets:
            problems.append(f"{ident(service)}: selects no rendered pods")
        for port in service["spec"].get("ports") or []:
            target = port.get("targetPort", port.get("port"))
            for workload in targets:
                declared = [container_ports(c) for c in containers(workload)]
                if not any(target in names or target in numbers for names, numbers in declared):
                    problems.append(
                        f"{ident(service)}: targetPort {target!r} is not declared by {ident(workload)}"
                    )
    return problems


def redis_network_policy_problems(docs: list[Doc]) -> list[str]:
    """A NetworkPolicy admits to the Redis pods exactly this release's front ends and workers,
    on the Redis port, and nothing else."""
    redis = the_workload(docs, "redis")
    policies = [
        policy
        for policy in of_kind(docs, "NetworkPolicy")
        if selector_matches(policy["spec"].get("podSelector"), pod_labels(redis))
    ]
    if not policies:
        return [f"no NetworkPolicy selects the Redis pods of {ident(redis)}"]
    problems = []
    admitted: set[str | None] = set()
    for policy in policies:
        others = [
            ident(w)
            for w in selected_workloads(docs, policy["spec"].get("podSelector"))
            if w is not redis
        ]
        if others:
            problems.append(f"{ident(policy)}: also applies to {others}")
        if "Ingress" not in (policy["spec"].get("policyTypes") or ["Ingress"]):
            problems.append(f"{ident(policy)}: policyTypes lacks Ingress")
        for i, rule in enumerate(policy["spec"].get("ingress") or []):
            where = f"{ident(policy)} ingress[{i}]"
            if not rule.get("from"):
                problems.append(f"{where}: no 'from' (admits every source)")
            ports = rule.get("ports") or []
            if not ports or any(p.get("port") not in (6379, "redis") for p in ports):
                problems.append(f"{where}: ports {ports} are not only the Redis port")
            for peer in rule.get("from") or []:
                if set(peer) != {"podSelector"}:
                    problems.append(f"{where}: peer {peer} is not a podSelector in this namespace")
                    continue
                if INSTANCE not in (peer["podSelector"].get("matchLabels") or {}):
                    problems.append(
                        f"{where}: peer {peer} does not pin {INSTANCE} (other releases match)"
                    )
                admitted |= {component(w) for w in selected_workloads(docs, peer["podSelector"])}
    if admitted != {"frontend", "worker"}:
        problems.append(
            f"Redis admits components {sorted(map(str, admitted))}, not exactly frontend and worker"
        )
    return problems


def standard_label_problems(docs: list[Doc], release: str) -> list[str]:
    problems = []
    for doc in docs:
        missing = [label for label in STANDARD_LABELS if label not in labels(doc)]
        if missing:
            problems.append(f"{ident(doc)}: lacks labels {missing}")
        elif labels(doc)[INSTANCE] != release:
            problems.append(
                f"{ident(doc)}: {INSTANCE} is {labels(doc)[INSTANCE]!r}, not {release!r}"
            )
    for workload in workloads(docs):
        if component(workload) not in APP_COMPONENTS | {"redis"}:
            problems.append(
                f"{ident(workload)}: pod template {COMPONENT} is {component(workload)!r}"
            )
    return problems
