"""TorchServe itself, for ``bench.torchserve_check``: what it needs (``prerequisites``: the
``torchserve`` command, Java, and a Python its workers can import torch, torchvision and
captum with) and ``TorchServe``, which starts ``torchserve --foreground`` on 127.0.0.1 with
the archives of a model store and stops its whole process group on leaving."""

from __future__ import annotations

import contextlib
import os
import shutil
import signal
import subprocess
import sys
import time
from collections.abc import Sequence
from pathlib import Path
from types import TracebackType

import httpx
import torch

from tests.server import free_port

HOST = "127.0.0.1"
INSTALL = """\
  apt-get install -y openjdk-17-jre-headless
  .venv/bin/python -m venv /tmp/ts-venv
  .venv/bin/python -c 'import site; print(site.getsitepackages()[0])' \\
      > /tmp/ts-venv/lib/python3.11/site-packages/project-venv.pth
  /tmp/ts-venv/bin/pip install torchserve==0.12.0 captum
then: python -m bench.torchserve_check --torchserve /tmp/ts-venv/bin/torchserve"""


class CheckError(Exception):
    """A prerequisite is missing or a server failed: the message says which, and how."""


def prerequisites(torchserve: str | None) -> tuple[str, str]:
    """``(torchserve command, versions line)``, or a CheckError saying what to install."""
    if torchserve is None or shutil.which(torchserve) is None:
        raise CheckError(
            f"torchserve not found ({torchserve or 'not on PATH'}); install:\n{INSTALL}"
        )
    java_home = os.environ.get("JAVA_HOME")
    java = shutil.which(f"{java_home}/bin/java" if java_home else "java")
    if java is None:
        where = f"JAVA_HOME={java_home}" if java_home else "PATH"
        raise CheckError(f"java not found on {where} (TorchServe's frontend); install:\n{INSTALL}")
    java_version = subprocess.run(
        [java, "-version"], capture_output=True, text=True, timeout=60
    ).stderr.splitlines()[0]
    # TorchServe starts its model workers with the interpreter its script runs on: that one
    # must import torch, torchvision and captum (the stock vision handlers import it).
    script = Path(shutil.which(torchserve) or torchserve)
    first_line = script.read_bytes()[:200].split(b"\n", 1)[0].decode(errors="replace")
    python = first_line[2:].split()[0] if first_line.startswith("#!") else sys.executable
    probe = subprocess.run(
        [
            python,
            "-c",
            "import captum, torch, torchvision, ts.version; "
            "print(ts.version.__version__, torch.__version__, torchvision.__version__)",
        ],
        capture_output=True,
        text=True,
        timeout=120,
    )
    if probe.returncode != 0:
        error = (probe.stderr.strip().splitlines() or ["(no output)"])[-1]
        raise CheckError(
            f"TorchServe's Python ({python}) cannot import what its workers need: {error}\n"
            f"install:\n{INSTALL}"
        )
    ts_version, torch_version, vision_version = probe.stdout.split()
    versions = (
        f"TorchServe {ts_version} ({script}), {java_version}, workers on torch {torch_version}"
        f" / torchvision {vision_version}; this server on torch {torch.__version__}"
    )
    return str(script), versions


def running_in_group(group: int) -> bool:
    """Whether a process of process group ``group`` still runs (a zombie does not count)."""
    for stat in Path("/proc").glob("[0-9]*/stat"):
        with contextlib.suppress(OSError):
            state, _, pgrp = stat.read_text().rsplit(")", 1)[1].split()[:3]
            if int(pgrp) == group and state != "Z":
                return True
    return False


class TorchServe:
    """``with TorchServe(command, store, names, folder) as ts:`` starts ``torchserve
    --foreground`` on 127.0.0.1 in its own process group and waits until every model has a
    ready worker; leaving the block stops the whole group (SIGTERM, then SIGKILL)."""

    def __init__(self, command: str, store: Path, names: Sequence[str], folder: Path) -> None:
        self.command, self.store, self.names, self.folder = command, store, list(names), folder
        self.inference_url = f"http://{HOST}:{free_port()}"
        self.management_url = f"http://{HOST}:{free_port()}"
        self.log = folder / "torchserve.out"
        self.process: subprocess.Popen[bytes] | None = None

    def start(self, ready_timeout_s: float = 300) -> TorchServe:
        self.folder.mkdir(parents=True, exist_ok=True)
        config = self.folder / "config.properties"
        config.write_text(
            "\n".join(
                [
                    f"inference_address={self.inference_url}",
                    f"management_address={self.management_url}",
                    f"metrics_address=http://{HOST}:{free_port()}",
                    f"grpc_inference_address={HOST}",
                    f"grpc_management_address={HOST}",
                    f"grpc_inference_port={free_port()}",
                    f"grpc_management_port={free_port()}",
                    f"initial_worker_port={free_port()}",
                    f"model_store={self.store}",
                    "default_workers_per_model=1",
                    "disable_system_metrics=true",
                    "",
                ]
            )
        )
        command = [
            self.command, "--start", "--foreground", "--ncs", "--disable-token-auth",
            "--ts-config", str(config), "--model-store", str(self.store),
            "--models", *(f"{name}={name}.mar" for name in self.names),
        ]  # fmt: skip
        # TMPDIR holds torchserve's pid file (one per machine otherwise: a second instance
        # refuses to start), TEMP its workers' sockets, LOG_LOCATION its logs.
        env = {
            **os.environ,
            "TMPDIR": str(self.folder),
            "TEMP": str(self.folder),
            "LOG_LOCATION": str(self.folder / "logs"),
            "METRICS_LOCATION": str(self.folder / "logs"),
        }
        with self.log.open("wb") as out:
            self.process = subprocess.Popen(
                command,
                cwd=self.folder,
                env=env,
                stdin=subprocess.DEVNULL,
                stdout=out,
                stderr=subprocess.STDOUT,
                start_new_session=True,
            )
        deadline = time.monotonic() + ready_timeout_s
        while not self.ready():
            if self.process.poll() is not None:
                raise CheckError(f"TorchServe exited during start:\n{self.tail()}")
            if time.monotonic() > deadline:
                raise CheckError(f"TorchServe not ready in {ready_timeout_s:.0f} s:\n{self.tail()}")
            time.sleep(0.5)
        return self

    def ready(self) -> bool:
        """Every model described by the management API with a READY worker."""
        for name in self.names:
            try:
                answer = httpx.get(f"{self.management_url}/models/{name}", timeout=5)
            except httpx.TransportError:
                return False
            if answer.status_code != 200:
                return False
            workers = [w for version in answer.json() for w in version.get("workers", [])]
            if not any(worker.get("status") == "READY" for worker in workers):
                return False
        return True

    def tail(self, lines: int = 40) -> str:
        return "\n".join(self.log.read_text(errors="replace").splitlines()[-lines:])

    def stop(self, timeout_s: float = 30) -> None:
        if self.process is None:
            return
        # The CLI waits on java, java on its Python workers: the group holds all of them, and
        # java, once the CLI has gone, is no child of ours to wait for: watch the group.
        group = self.process.pid
        with contextlib.suppress(ProcessLookupError):
            os.killpg(group, signal.SIGTERM)
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline and running_in_group(group):
            self.process.poll()  # reaps the CLI
            time.sleep(0.2)
        with contextlib.suppress(ProcessLookupError):
            os.killpg(group, signal.SIGKILL)  # whatever outlived the SIGTERM
        self.process.wait()
        self.process = None

    def __enter__(self) -> TorchServe:
        try:
            return self.start()
        except BaseException:
            self.stop()
            raise

    def __exit__(
        self, kind: type[BaseException] | None, exc: BaseException | None, tb: TracebackType | None
    ) -> None:
        self.stop()
