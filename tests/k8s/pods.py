"""The chart's rendered pods, run as processes on this machine the way a kubelet would run
them, with no cluster and no container engine (``make check-k8s``).

What is taken from the manifests, as rendered: each container's command and args, its env
(values, ``$(VAR)`` references to earlier variables, Secrets and the downward API resolved
as the kubelet resolves them), its ports, probes (HTTP, exec, TCP, and gRPC as the kubelet
asks it: ``grpc.health.v1.Health/Check``, SERVING or it fails), ``lifecycle.preStop`` and the
pod's ``terminationGracePeriodSeconds``; init containers run first, to completion. What a
container engine would give, and this machine substitutes (each substitution is printed):

- the image: this checkout is ``/srv/app`` (the Dockerfile's ``WORKDIR``), with the
  Dockerfile's ``ENV`` underneath the container's; ``python`` and ``gunicorn`` come from the
  environment running the checks; a ``redis`` image runs the local ``redis-server``;
- the network: every container port gets a free port on 127.0.0.1 (``0.0.0.0:<port>`` in a
  command line, and an env value that is the port, point at it), and a Service's DNS name
  and port (short or ``<svc>.<ns>.svc.cluster.local``) point at the port of the pod it
  selects;
- volumes: each ``emptyDir`` is a fresh folder per pod (``/dev/shm`` stays ``/dev/shm``),
  each ``persistentVolumeClaim`` a folder the caller names; mount paths in command lines and
  env values are rewritten to them.
"""

from __future__ import annotations

import base64
import functools
import os
import re
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import grpc
import httpx
from grpc_health.v1 import health_pb2, health_pb2_grpc

REPO = Path(__file__).resolve().parents[2]
IMAGE_WORKDIR = "/srv/app"
# How long a terminating pod stays in its Services' endpoints as kube-proxies see them.
ENDPOINT_LAG_S = 2.0


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


def grpc_serving(port: int, service: str, timeout: float) -> bool:
    """The kubelet's gRPC probe: ``grpc.health.v1.Health/Check`` for ``service`` on
    127.0.0.1:``port`` answers SERVING within ``timeout``; anything else (NOT_SERVING, an
    error status, no answer) fails it."""
    with grpc.insecure_channel(f"127.0.0.1:{port}") as channel:
        health: Any = health_pb2_grpc.HealthStub(channel)  # its stubs carry no types
        try:
            answer = health.Check(health_pb2.HealthCheckRequest(service=service), timeout=timeout)
        except grpc.RpcError:
            return False
    return bool(answer.status == health_pb2.HealthCheckResponse.SERVING)


def note(message: str) -> None:
    print(f"   {message}", flush=True)


def dockerfile_env() -> dict[str, str]:
    """The image's ``ENV`` (the Dockerfile's first ``ENV`` block)."""
    text = (REPO / "Dockerfile").read_text()
    block = re.search(r"^ENV ((?:.*\\\n)*.*)$", text, flags=re.M)
    assert block, "the Dockerfile sets no ENV"
    return dict(re.findall(r"(\w+)=(\S+)", block.group(1)))


def secrets_of(docs: list[dict[str, Any]]) -> dict[str, dict[str, str]]:
    """Every rendered Secret's keys, decoded."""
    found: dict[str, dict[str, str]] = {}
    for doc in docs:
        if doc.get("kind") != "Secret":
            continue
        values = {k: base64.b64decode(v).decode() for k, v in (doc.get("data") or {}).items()}
        values.update(doc.get("stringData") or {})
        found[doc["metadata"]["name"]] = values
    return found


def expand(value: str, env: Mapping[str, str]) -> str:
    """The kubelet's ``$(VAR)`` expansion: a defined variable's value, ``$$`` escapes, and an
    undefined reference left as written."""
    return re.sub(
        r"\$\$|\$\(([A-Za-z_][A-Za-z0-9_]*)\)",
        lambda m: "$" if m.group(0) == "$$" else env.get(m.group(1), m.group(0)),
        value,
    )


# Runs "$@" after "--" with the root filesystem read-only, except the folders before "--"
# (bind-mounted onto themselves first) and what is mounted apart (/dev/shm, /proc, /dev), in a
# mount namespace of its own (unshare): readOnlyRootFilesystem, for real.
READ_ONLY_ROOT = (
    'while [ "$1" != -- ]; do mount --bind "$1" "$1"; shift; done; shift; '
    'mount -o remount,bind,ro / && exec "$@"'
)


@functools.cache
def can_unshare() -> bool:
    """Whether this machine lets a mount namespace of its own be made (root, not forbidden)."""
    probe = ["unshare", "--mount", "--propagation", "private", "sh", "-c", READ_ONLY_ROOT]
    try:
        done = subprocess.run([*probe, "sh", "--", "true"], capture_output=True, timeout=10)
    except (OSError, subprocess.TimeoutExpired):
        return False
    return done.returncode == 0


def read_only_root(argv: list[str], writable: list[str]) -> list[str]:
    """``argv`` wrapped to run with a read-only root filesystem but ``writable`` (the
    container's writable volumes); unchanged, and said so, where no namespace can be made."""
    if not can_unshare():
        note("readOnlyRootFilesystem NOT emulated: this machine refuses `unshare --mount`")
        return argv
    wrap = ["unshare", "--mount", "--propagation", "private", "sh", "-c", READ_ONLY_ROOT, "sh"]
    return [*wrap, *writable, "--", *argv]


@dataclass
class Container:
    """One running container: its process, and the rewritten spec it was started from."""

    name: str
    spec: dict[str, Any]
    argv: list[str]
    env: dict[str, str]
    ports: dict[str, int]  # port name or number (as text) -> local port
    rewrite: Any  # str -> str, the pod's substitutions
    process: subprocess.Popen[bytes] | None = None
    log: Path | None = None

    def local_port(self, port: int | str) -> int:
        return self.ports[str(port)]


@dataclass
class Pod:
    name: str
    workload: dict[str, Any]
    scratch: Path
    containers: list[Container] = field(default_factory=list)

    @property
    def template(self) -> dict[str, Any]:
        template: dict[str, Any] = self.workload["spec"]["template"]
        return template

    @property
    def labels(self) -> dict[str, str]:
        labels: dict[str, str] = self.template["metadata"]["labels"]
        return labels

    @property
    def grace_s(self) -> float:
        return float(self.template["spec"].get("terminationGracePeriodSeconds", 30))

    def container(self, name: str | None = None) -> Container:
        return next(c for c in self.containers if name in (None, c.name))


class Kubelet:
    """Starts rendered pods on this machine, probes them and stops them as a kubelet does."""

    def __init__(
        self,
        docs: list[dict[str, Any]],
        volumes: Mapping[str, Path],
        store: Path,
        namespace: str = "default",
    ) -> None:
        self.docs = docs
        self.namespace = namespace  # the one the manifests were rendered for
        self.secrets = secrets_of(docs)
        self.claims = dict(volumes)  # persistentVolumeClaim name -> local folder
        self.store = store  # the image's baked-in model store
        self.scratch = Path(tempfile.mkdtemp(prefix="check-k8s-"))
        self.services: dict[str, int] = {}  # "<svc>:<port>" -> local port
        self.pods: list[Pod] = []
        self._started = 0  # pods started so far: each gets a name of its own

    # -- objects ------------------------------------------------------------------------------

    def objects(self, kind: str) -> list[dict[str, Any]]:
        return [d for d in self.docs if d.get("kind") == kind]

    def workload(self, component: str) -> dict[str, Any]:
        """The Deployment or StatefulSet of one component (``app.kubernetes.io/component``)."""
        found = [
            d
            for d in self.docs
            if d.get("kind") in ("Deployment", "StatefulSet")
            and d["spec"]["template"]["metadata"]["labels"].get("app.kubernetes.io/component")
            == component
        ]
        assert len(found) == 1, f"{len(found)} workloads of component {component}"
        return found[0]

    # -- starting -----------------------------------------------------------------------------

    def start(self, component: str, pod_name: str | None = None) -> Pod:
        """One pod of ``component``: its volumes, init containers (to completion), then its
        containers; the Services selecting it point at it from now on."""
        workload = self.workload(component)
        self._started += 1
        name = pod_name or f"{workload['metadata']['name']}-{self._started}"
        pod = Pod(name, workload, self.scratch / name)
        pod.scratch.mkdir(parents=True)
        mounts = self._volumes(pod)
        spec = pod.template["spec"]
        for init in spec.get("initContainers", []):
            container = self._container(pod, init, mounts)
            note(f"{name}: init container {init['name']}: {container.argv}")
            done = subprocess.run(
                container.argv, env=container.env, cwd=REPO, capture_output=True, timeout=300
            )
            assert done.returncode == 0, f"init container {init['name']} failed: {done.stderr!r}"
        for spec_container in spec["containers"]:
            container = self._container(pod, spec_container, mounts)
            container.log = pod.scratch / f"{container.name}.log"
            note(f"{name}/{container.name}: {subprocess.list2cmdline(container.argv)}")
            with container.log.open("wb") as out:
                container.process = subprocess.Popen(
                    container.argv,
                    env=container.env,
                    cwd=container.env.get("PWD", str(REPO)),
                    stdout=out,
                    stderr=subprocess.STDOUT,
                    start_new_session=True,
                )
            pod.containers.append(container)
        self.pods.append(pod)
        self.serve(pod)
        return pod

    def _volumes(self, pod: Pod) -> dict[str, str]:
        """Volume name -> the local folder standing for it."""
        local: dict[str, str] = {}
        for volume in pod.template["spec"].get("volumes", []):
            if "emptyDir" in volume:
                if volume["emptyDir"].get("medium") == "Memory" and any(
                    m["name"] == volume["name"] and m["mountPath"] == "/dev/shm"
                    for c in pod.template["spec"]["containers"]
                    for m in c.get("volumeMounts", [])
                ):
                    local[volume["name"]] = "/dev/shm"
                    continue
                folder = pod.scratch / volume["name"]
                folder.mkdir()
                local[volume["name"]] = str(folder)
            elif "persistentVolumeClaim" in volume:
                claim = volume["persistentVolumeClaim"]["claimName"]
                assert claim in self.claims, f"no folder given for the claim {claim}"
                local[volume["name"]] = str(self.claims[claim])
            else:
                raise AssertionError(f"volume kind not run here: {volume}")
        return local

    def _container(self, pod: Pod, spec: dict[str, Any], volumes: dict[str, str]) -> Container:
        paths = {
            m["mountPath"]: volumes[m["name"]]
            for m in spec.get("volumeMounts", [])
            if volumes[m["name"]] != m["mountPath"]
        }
        image_env = dockerfile_env()
        paths.setdefault(image_env.get("MODEL_STORE", "/srv/app/model_store"), str(self.store))
        paths.setdefault(IMAGE_WORKDIR, str(REPO))
        ports = {}
        for port in spec.get("ports", []):
            local = free_port()
            ports[str(port["containerPort"])] = local
            if "name" in port:
                ports[port["name"]] = local

        # One pass over every mount path, the longest first, each only where a path starts.
        mounts = "|".join(re.escape(m) for m in sorted(paths, key=len, reverse=True))
        mounted = re.compile(rf"(?<![\w./-])({mounts})(?![\w.-])")

        def rewrite(text: str) -> str:
            text = mounted.sub(lambda m: paths[m.group(1)], text)
            text = self.route(text)
            for port_name, local in ports.items():
                if port_name.isdigit():
                    text = text.replace(f"0.0.0.0:{port_name}", f"127.0.0.1:{local}")
            return text

        env = {**{k: rewrite(v) for k, v in image_env.items()}, "PWD": str(REPO)}
        declared: dict[str, str] = {}  # $(VAR) sees the container's earlier variables only
        for var in spec.get("env", []):
            value = self._env_value(pod, var, declared)
            if value is None:
                continue
            declared[var["name"]] = value
            if value.isdigit() and value in ports:  # the port this container listens on
                value = str(ports[value])
            env[var["name"]] = rewrite(value)
        for key in ("HOST",):
            if env.get(key) == "0.0.0.0":
                env[key] = "127.0.0.1"
        if "PORT" in env and env["PORT"] in ports:
            env["PORT"] = str(ports[env["PORT"]])
        bin_dir = str(Path(sys.executable).parent)
        env["PATH"] = f"{bin_dir}{os.pathsep}{os.environ['PATH']}"
        argv = [expand(p, declared) for p in [*spec.get("command", []), *spec.get("args", [])]]
        argv = [rewrite(part) for part in argv]
        if spec["image"].split("/")[-1].startswith("redis"):
            data = paths.get("/data", str(pod.scratch))
            local = next(iter(ports.values()))
            argv = ["redis-server", *argv, "--port", str(local), "--bind", "127.0.0.1"]
            argv += ["--dir", data]
            note(f"{pod.name}: the redis image -> redis-server on 127.0.0.1:{local}")
        elif not argv:
            argv = ["python", "-m", "app"]  # the Dockerfile's CMD
        if spec.get("securityContext", {}).get("readOnlyRootFilesystem"):
            writable = [
                volumes[m["name"]]
                for m in spec.get("volumeMounts", [])
                if not m.get("readOnly") and volumes[m["name"]] != "/dev/shm"
            ]
            argv = read_only_root(argv, writable)
        return Container(spec["name"], spec, argv, env, ports, rewrite)

    def route(self, text: str) -> str:
        """Service addresses (``<svc>:<port>``, or ``<svc>.<ns>.svc.cluster.local:<port>``)
        in ``text`` pointed at the local port of the pod each selects."""
        for service, local in self.services.items():
            host, port = service.rsplit(":", 1)
            long = f"{host}.{self.namespace}.svc.cluster.local:{port}"
            text = text.replace(long, f"127.0.0.1:{local}")
            text = re.sub(rf"(?<![\w.-]){re.escape(service)}\b", f"127.0.0.1:{local}", text)
        return text

    def _env_value(self, pod: Pod, var: dict[str, Any], env: dict[str, str]) -> str | None:
        if "value" in var:
            return expand(str(var["value"]), env)
        source = var["valueFrom"]
        if "secretKeyRef" in source:
            ref = source["secretKeyRef"]
            value = self.secrets.get(ref["name"], {}).get(ref["key"])
            assert value is not None or ref.get("optional"), f"missing secret key {ref}"
            return value
        if "fieldRef" in source:
            path = source["fieldRef"]["fieldPath"]
            fields = {"metadata.name": pod.name, "metadata.namespace": self.namespace}
            return fields.get(path, "127.0.0.1")
        if "resourceFieldRef" in source:
            return "1"
        raise AssertionError(f"env source not run here: {var}")

    def serve(self, pod: Pod) -> None:
        """The Services that select ``pod`` send to it from now on."""
        for service in self.objects("Service"):
            selector = service["spec"].get("selector") or {}
            if not selector or any(pod.labels.get(k) != v for k, v in selector.items()):
                continue
            for port in service["spec"]["ports"]:
                target = port.get("targetPort", port["port"])
                for container in pod.containers:
                    if str(target) in container.ports:
                        key = f"{service['metadata']['name']}:{port['port']}"
                        self.services[key] = container.local_port(target)
                        note(f"Service {key} -> 127.0.0.1:{self.services[key]} ({pod.name})")

    def behind(self, service: str) -> Pod:
        """The pod a Service (``<svc>:<port>``) sends to now."""
        local = self.services[service]
        return next(p for p in self.pods for c in p.containers if local in c.ports.values())

    def _unserve(self, pod: Pod) -> None:
        """A terminating pod leaves its Services' endpoints at once (as the endpoints
        controller takes it out while its preStop hook runs): they point at another pod they
        select, if one runs."""
        ours = {c.local_port(p) for c in pod.containers for p in c.ports}
        self.services = {k: v for k, v in self.services.items() if v not in ours}
        for other in self.pods:
            if other is not pod:
                self.serve(other)

    # -- probing ------------------------------------------------------------------------------

    def probe(self, container: Container, kind: str) -> bool:
        """One probe of ``kind`` (startupProbe, readinessProbe, livenessProbe), read as the
        kubelet reads it: HTTP 200-399, exit status 0, a TCP connection, or gRPC SERVING."""
        probe = container.spec[kind]
        timeout = float(probe.get("timeoutSeconds", 1))
        if "httpGet" in probe:
            get = probe["httpGet"]
            url = f"http://127.0.0.1:{container.local_port(get['port'])}{get.get('path', '/')}"
            try:
                status = httpx.get(url, timeout=timeout).status_code
            except httpx.HTTPError:
                return False
            return 200 <= status < 400
        if "exec" in probe:
            argv = [container.rewrite(part) for part in probe["exec"]["command"]]
            for port, local in container.ports.items():
                if port.isdigit():
                    argv = [re.sub(rf"\b{port}\b", str(local), arg) for arg in argv]
            try:
                done = subprocess.run(argv, env=container.env, capture_output=True, timeout=timeout)
            except subprocess.TimeoutExpired:
                return False
            return done.returncode == 0
        if "tcpSocket" in probe:
            try:
                local = container.local_port(probe["tcpSocket"]["port"])
                socket.create_connection(("127.0.0.1", local), timeout=timeout).close()
            except OSError:
                return False
            return True
        if "grpc" in probe:
            local = container.local_port(probe["grpc"]["port"])
            return grpc_serving(local, str(probe["grpc"].get("service", "")), timeout)
        raise AssertionError(f"probe kind not run here: {probe}")

    def wait_started(self, pod: Pod, speed_up: float = 1.0) -> float:
        """Every container's startup probe until it succeeds, within the budget the kubelet
        gives it (``initialDelaySeconds + periodSeconds * failureThreshold``), probing at
        most every ``periodSeconds / speed_up``; returns the seconds it took."""
        began = time.monotonic()
        for container in pod.containers:
            probe = container.spec.get("startupProbe") or container.spec["readinessProbe"]
            kind = "startupProbe" if "startupProbe" in container.spec else "readinessProbe"
            period = float(probe.get("periodSeconds", 10))
            budget = probe.get("initialDelaySeconds", 0) + period * probe.get("failureThreshold", 3)
            while not self.probe(container, kind):
                assert container.process is not None
                if container.process.poll() is not None:
                    raise AssertionError(
                        f"{pod.name}/{container.name} exited:\n{self.log(container)}"
                    )
                if time.monotonic() - began > budget:
                    raise AssertionError(
                        f"{pod.name}/{container.name}: {kind} failed for {budget} s"
                    )
                time.sleep(period / speed_up)
        return time.monotonic() - began

    @staticmethod
    def log(container: Container) -> str:
        return container.log.read_text(errors="replace")[-4000:] if container.log else ""

    # -- stopping -----------------------------------------------------------------------------

    def terminate(self, pod: Pod) -> list[tuple[str, int | None, float]]:
        """The kubelet's pod termination: each container's preStop hook, then SIGTERM, then
        SIGKILL once ``terminationGracePeriodSeconds`` (counted from the start, hook
        included) is over; the pod leaves its Services' endpoints ``ENDPOINT_LAG_S`` after
        the start, as in a cluster the change takes a while to reach every kube-proxy (the
        race a preStop sleep exists for). Returns (container, exit status or None if killed,
        seconds)."""
        began = time.monotonic()
        # The Services go on sending to it until the endpoint change reaches every proxy.
        leaving = threading.Timer(ENDPOINT_LAG_S, self._unserve, [pod])
        leaving.start()
        results = []
        for container in pod.containers:
            hook = container.spec.get("lifecycle", {}).get("preStop")
            if hook and "exec" in hook:
                argv = [container.rewrite(p) for p in hook["exec"]["command"]]
                subprocess.run(argv, env=container.env, timeout=pod.grace_s)
            elif hook and "httpGet" in hook:
                get = hook["httpGet"]
                port = container.local_port(get["port"])
                httpx.get(f"http://127.0.0.1:{port}{get.get('path', '/')}", timeout=pod.grace_s)
            assert container.process is not None
            if container.process.poll() is None:
                container.process.send_signal(signal.SIGTERM)  # to the container's PID 1
        for container in pod.containers:
            assert container.process is not None
            left = max(0.0, pod.grace_s - (time.monotonic() - began))
            try:
                status: int | None = container.process.wait(timeout=left)
            except subprocess.TimeoutExpired:
                os.killpg(container.process.pid, signal.SIGKILL)
                container.process.wait()
                status = None
            results.append((container.name, status, time.monotonic() - began))
        leaving.join()
        self.pods.remove(pod)
        return results

    def close(self) -> None:
        """Everything still running is killed (a failed check leaves nothing behind)."""
        for pod in list(self.pods):
            for container in pod.containers:
                if container.process is not None and container.process.poll() is None:
                    os.killpg(container.process.pid, signal.SIGKILL)
                    container.process.wait()
        self.pods.clear()
        shutil.rmtree(self.scratch, ignore_errors=True)
