"""The runtime-only install, proven: what the Docker image has, and what ``make install`` gives.

    make check-install        # or: .venv/bin/python .ci/runtime_check.py

Builds a virtual environment from ``requirements.txt`` alone (``make install VENV=...``, the
same pip command as the Dockerfile), then, with that environment's Python only:

1. imports every module of ``app/``;
2. runs ``make run-cluster`` (Redis, front ends, workers) and has one image tagged through it;
3. starts each service of ``docker/docker-compose.yml`` (``server``; ``redis``, ``frontend``
   and ``model-worker`` of the cluster profile) with the command and environment the compose
   file gives it, on top of the Dockerfile's ``ENV`` and ``CMD``, and has one image tagged
   through ``server`` and one through ``frontend``;
4. exports the default model in int8 (``--precision int8 --calibrate``, nncf), on views of
   the cat photo, and has the cat tagged through ``python -m app`` serving it.

There is no Docker engine here, so the container-only parts are substituted, and each
substitution is printed: services listen on 127.0.0.1 at free ports instead of 0.0.0.0:8000
(and gRPC's 8001, where the compose file sets MB_GRPC_PORT, then also tags the cat over it),
the host name ``redis`` becomes a local ``redis-server``, container paths become scratch
folders, and the model store is exported with the Dockerfile's own ``python -m app.export``
line. This script runs with the dev environment (it reads YAML and speaks HTTP with httpx);
everything it starts runs in the runtime one.
"""

from __future__ import annotations

import os
import re
import shlex
import signal
import socket
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterator
from contextlib import ExitStack, contextmanager
from pathlib import Path

import httpx
import yaml

REPO = Path(__file__).resolve().parents[1]
VENV = Path(os.environ.get("RUNTIME_VENV", REPO / ".venv-runtime"))
PY = VENV / "bin" / "python"
IMAGE = REPO / "docs" / "cat.jpg"
READY_TIMEOUT_S = 240.0


def step(message: str) -> None:
    print(f"\n== {message}", flush=True)


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


def substitute(value: str) -> str:
    """Compose's ``${NAME:-default}`` and ``${NAME}``, nested ones too (``${A:-${B:-x}}``),
    with nothing set on the command line: the innermost first, until none is left; then
    ``$$``, compose's escape, is the shell's own ``$``."""
    while True:
        done = re.sub(
            r"(?<!\$)\$\{(\w+)(?::?-([^${}]*))?\}",
            lambda m: os.environ.get(m.group(1)) or m.group(2) or "",
            value,
        )
        if done == value:
            return done.replace("$$", "$")
        value = done


def wait_ready(url: str, processes: list[subprocess.Popen[bytes]]) -> None:
    deadline = time.monotonic() + READY_TIMEOUT_S
    while time.monotonic() < deadline:
        for process in processes:
            if process.poll() is not None:
                raise SystemExit(f"FAIL: {process.args!r} exited with {process.returncode}")
        try:
            if httpx.get(f"{url}/readyz", timeout=2).status_code == 200:
                return
        except httpx.HTTPError:
            pass
        time.sleep(0.5)
    raise SystemExit(f"FAIL: {url} was not ready within {READY_TIMEOUT_S:.0f} s")


def tag_one_image(url: str) -> None:
    """One real request: the cat photo comes back with a cat among its top labels."""
    response = httpx.post(
        f"{url}/predict/tag", files={"image": ("cat.jpg", IMAGE.read_bytes())}, timeout=60
    )
    if response.status_code != 200:
        status = response.status_code
        raise SystemExit(f"FAIL: {url}/predict/tag answered {status}: {response.text}")
    names = [tag["name"] for tag in response.json()]
    print(f"   {url}/predict/tag -> {names}", flush=True)
    if not any("cat" in name for name in names):
        raise SystemExit(f"FAIL: the cat photo came back as {names}")


GRPC_TAG = """
import sys, grpc
from app.v2.proto import inference_pb2 as pb, inference_pb2_grpc as pb_grpc
from app.v2.tensors import pack_bytes, unpack_bytes
with grpc.insecure_channel(f"127.0.0.1:{sys.argv[1]}") as channel:
    stub = pb_grpc.GRPCInferenceServiceStub(channel)
    (model,) = [m.name for m in stub.RepositoryIndex(pb.RepositoryIndexRequest()).models]
    request = pb.ModelInferRequest(model_name=model)
    request.inputs.add(name="image", datatype="BYTES", shape=[1])
    request.outputs.add(name="top_k_probs").parameters["classification"].int64_param = 3
    request.raw_input_contents.append(pack_bytes([open(sys.argv[2], "rb").read()]))
    answer = stub.ModelInfer(request, timeout=60)
for cell in unpack_bytes(answer.raw_output_contents[0], "top_k_probs"):
    print(cell.decode())
"""


def grpc_tag_one_image(port: int) -> None:
    """The same over gRPC (MB_GRPC_PORT): the v2 ModelInfer of the cat photo's own bytes, sent
    by the runtime environment's Python (grpcio is a runtime requirement)."""
    out = subprocess.run(
        [str(PY), "-c", GRPC_TAG, str(port), str(IMAGE)],
        cwd=REPO, env=runtime_env(), capture_output=True, text=True, timeout=120,
    )  # fmt: skip
    top = out.stdout.split()
    print(f"   grpc 127.0.0.1:{port} ModelInfer -> {out.stdout.splitlines()}", flush=True)
    if out.returncode != 0 or not any("cat" in line for line in out.stdout.splitlines()):
        raise SystemExit(f"FAIL: the cat photo over gRPC: {top} {out.stderr[-2000:]}")


@contextmanager
def started(argv: list[str], env: dict[str, str], name: str) -> Iterator[subprocess.Popen[bytes]]:
    """Run ``argv`` in its own process group; SIGTERM the group on the way out."""
    print(f"   start {name}: {shlex.join(argv)}", flush=True)
    process = subprocess.Popen(argv, env=env, cwd=REPO, start_new_session=True)
    try:
        yield process
    finally:
        if process.poll() is None:
            os.killpg(process.pid, signal.SIGTERM)
            try:
                process.wait(timeout=90)
            except subprocess.TimeoutExpired:
                os.killpg(process.pid, signal.SIGKILL)
                process.wait()


def runtime_env(**overrides: str) -> dict[str, str]:
    """The runtime venv first on PATH (``python``, ``gunicorn`` are its own), no dev leftovers."""
    env = {k: v for k, v in os.environ.items() if not k.startswith(("MB_", "VIRTUAL_ENV"))}
    env["PATH"] = f"{VENV / 'bin'}{os.pathsep}{env['PATH']}"
    env["VIRTUAL_ENV"] = str(VENV)
    env.update(overrides)
    return env


def build_venv() -> None:
    step(f"runtime-only environment: make install VENV={VENV}")
    subprocess.run(["make", "install", f"VENV={VENV}"], cwd=REPO, check=True)
    subprocess.run([str(PY), "-m", "pip", "check"], cwd=REPO, check=True)


def import_every_module() -> None:
    step("import every module of app/ in the runtime environment")
    code = (
        "import importlib, pkgutil, app\n"
        "names = [m.name for m in pkgutil.walk_packages(app.__path__, 'app.')]\n"
        "for name in names: importlib.import_module(name)\n"
        "print(f'   imported {len(names) + 1} modules')\n"
    )
    subprocess.run([str(PY), "-c", code], cwd=REPO, check=True, env=runtime_env())


def export_store(store: Path) -> None:
    """The model store, exported by the Dockerfile's own ``RUN python -m app.export`` line."""
    dockerfile = (REPO / "Dockerfile").read_text()
    match = re.search(r"^RUN (python -m app\.export [^&\n]*)", dockerfile, flags=re.M)
    assert match, "the Dockerfile no longer exports the model with python -m app.export"
    line = match.group(1).rstrip(" \\")  # the line goes on with `&& chown ...`
    argv = shlex.split(line.replace('"$MODEL_STORE"', str(store)))
    step(f"model store, as the image builds it (container /srv/app/model_store -> {store})")
    print(f"   {shlex.join(argv)}", flush=True)
    subprocess.run(argv, cwd=REPO, check=True, env=runtime_env())


def run_cluster(store: Path) -> None:
    port, redis_port = free_port(), free_port()
    step(f"make run-cluster in the runtime environment (PORT={port}, REDIS_PORT={redis_port})")
    argv = ["make", "run-cluster", f"VENV={VENV}", f"PORT={port}", f"REDIS_PORT={redis_port}",
            f"MODEL_STORE={store}"]  # fmt: skip
    with started(argv, runtime_env(), "make run-cluster") as process:
        url = f"http://127.0.0.1:{port}"
        wait_ready(url, [process])
        tag_one_image(url)


def dockerfile_env() -> dict[str, str]:
    text = (REPO / "Dockerfile").read_text()
    block = re.search(r"^ENV ((?:.*\\\n)*.*)$", text, flags=re.M)
    assert block, "the Dockerfile sets no ENV"
    return dict(re.findall(r"(\w+)=(\S+)", block.group(1)))


def compose_services(store: Path) -> None:
    compose = yaml.safe_load((REPO / "docker" / "docker-compose.yml").read_text())
    services = compose["services"]
    image_cmd = ["python", "-m", "app"]  # the Dockerfile's CMD
    assert f"CMD {str(image_cmd).replace(chr(39), chr(34))}" in (REPO / "Dockerfile").read_text()
    scratch = Path(tempfile.mkdtemp(prefix="runtime-check-"))
    redis_port, server_port, frontend_port = free_port(), free_port(), free_port()
    grpc_ports = {"server": free_port(), "frontend": free_port()}
    image_env = dockerfile_env()

    def service_env(name: str, port: int | None = None, **container: str) -> dict[str, str]:
        given = services[name]["environment"]
        env = {**image_env, **{k: substitute(str(v)) for k, v in given.items()}}
        env["MODEL_STORE"] = str(store)
        if "MB_BROKER" in env:
            env["MB_BROKER"] = env["MB_BROKER"].replace("redis:6379", f"127.0.0.1:{redis_port}")
        if port is not None:
            env.update(HOST="127.0.0.1", PORT=str(port))
        if "MB_GRPC_PORT" in env:
            env["MB_GRPC_PORT"] = str(grpc_ports[name])
        if "PROMETHEUS_MULTIPROC_DIR" in env:
            env["PROMETHEUS_MULTIPROC_DIR"] = str(scratch / "metrics")
        env.update(container)
        shown = {k: v for k, v in env.items() if not k.startswith(("PYTHON", "PIP_"))}
        print(f"   {name} environment: {shown}", flush=True)
        return runtime_env(**env)

    def service_command(name: str, port: int | None = None) -> list[str]:
        command = [substitute(str(part)) for part in services[name].get("command", image_cmd)]
        rewritten = []
        for part in command:
            part = part.replace("/tmp/metrics", str(scratch / "metrics"))
            if port is not None:
                part = part.replace("0.0.0.0:8000", f"127.0.0.1:{port}")
            rewritten.append(part)
        return rewritten

    step("compose service `server` (the image's CMD, its compose environment)")
    print(f"   substitutions: 0.0.0.0:8000 -> 127.0.0.1:{server_port}; "
          f"/srv/app/model_store -> {store}", flush=True)  # fmt: skip
    with started(service_command("server", server_port), service_env("server", server_port),
                 "server") as server:  # fmt: skip
        url = f"http://127.0.0.1:{server_port}"
        wait_ready(url, [server])
        tag_one_image(url)
        if "MB_GRPC_PORT" in services["server"]["environment"]:
            grpc_tag_one_image(grpc_ports["server"])

    step("compose services `redis`, `model-worker` x replicas, `frontend` (profile cluster)")
    print(f"   substitutions: redis:6379 -> 127.0.0.1:{redis_port}; 0.0.0.0:8000 -> "
          f"127.0.0.1:{frontend_port}; /tmp/metrics -> {scratch / 'metrics'}; "
          f"/srv/app/model_store -> {store}; container host names -> MB_WORKER_NAME",
          flush=True)  # fmt: skip
    redis_argv = [*service_command("redis"), "--port", str(redis_port), "--bind", "127.0.0.1",
                  "--dir", str(scratch)]  # fmt: skip
    replicas = int(services["model-worker"].get("deploy", {}).get("replicas", 1))
    # Each replica is a container with a host name and ports of its own: its probes
    # (MB_HEALTH_PORT, which its compose health check asks) on a free port here.
    probes = {i: free_port() for i in range(replicas)}
    worker_env = services["model-worker"]["environment"]
    with ExitStack() as stack:
        running = [stack.enter_context(started(redis_argv, runtime_env(), "redis"))]
        for i in range(replicas):
            own = {"MB_WORKER_NAME": f"model-worker-{i}"}
            if "MB_HEALTH_PORT" in worker_env:
                own["MB_HEALTH_PORT"] = str(probes[i])
            running.append(stack.enter_context(started(
                service_command("model-worker"), service_env("model-worker", None, **own),
                f"model-worker {i}",
            )))  # fmt: skip
        running.append(stack.enter_context(started(
            service_command("frontend", frontend_port), service_env("frontend", frontend_port),
            "frontend",
        )))  # fmt: skip
        url = f"http://127.0.0.1:{frontend_port}"
        wait_ready(url, running)
        tag_one_image(url)
        if "MB_GRPC_PORT" in services["frontend"]["environment"]:
            grpc_tag_one_image(grpc_ports["frontend"])
        check = services["model-worker"].get("healthcheck", {}).get("test", [])
        if "MB_HEALTH_PORT" in worker_env:  # what its compose health check asks, answered
            port = str(worker_env["MB_HEALTH_PORT"])
            assert any(f":{port}/readyz" in str(part) for part in check), check
            for i in range(replicas):
                wait_ready(f"http://127.0.0.1:{probes[i]}", running)
            print("   each model-worker's /readyz (MB_HEALTH_PORT) answers 200", flush=True)


def int8_store(scratch: Path) -> None:
    """The README's int8 export, then serving it: nncf and OpenVINO int8 from requirements.txt."""
    from PIL import Image, ImageOps

    photos = scratch / "calibration"
    photos.mkdir()
    with Image.open(IMAGE) as cat:
        width, height = cat.size
        for i in range(100):  # crops of 60-100% of each side, every other one mirrored
            scale = 0.6 + 0.4 * (i % 10) / 9
            w, h = int(width * scale), int(height * scale)
            left, top = (width - w) * (i % 7) // 6, (height - h) * (i % 5) // 4
            view = cat.crop((left, top, left + w, top + h))
            (ImageOps.mirror(view) if i % 2 else view).save(photos / f"{i:03d}.jpg")
    store = scratch / "int8_store"
    argv = [str(PY), "-m", "app.export", "--precision", "int8", "--calibrate", str(photos),
            "--accept-accuracy-loss", "--out", str(store)]  # fmt: skip
    step("an int8 export (nncf) in the runtime environment, then python -m app serving it")
    print(f"   {shlex.join(argv)}", flush=True)
    subprocess.run(argv, cwd=REPO, check=True, env=runtime_env())
    port = free_port()
    env = runtime_env(MODEL_STORE=str(store), PORT=str(port), CUDA_DEVICES="cpu")
    with started([str(PY), "-m", "app"], env, "python -m app (int8)") as process:
        url = f"http://127.0.0.1:{port}"
        wait_ready(url, [process])
        tag_one_image(url)
        model_id = httpx.get(f"{url}/info", timeout=10).json()["model_id"]
        if not model_id.endswith("+int8"):
            raise SystemExit(f"FAIL: the int8 store is served as {model_id}")
        print(f"   served as {model_id}", flush=True)


def main() -> int:
    build_venv()
    import_every_module()
    store = Path(tempfile.mkdtemp(prefix="runtime-check-store-")) / "model_store"
    export_store(store)
    run_cluster(store)
    compose_services(store)
    int8_store(store.parent)
    step("runtime-only install: every check passed")
    return 0


if __name__ == "__main__":
    sys.exit(main())
