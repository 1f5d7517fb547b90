"""``python -m bench.torchserve_check``: TorchServe itself and this server on the same
``.mar`` files and photos, over HTTP: do they answer the same?

    python -m bench.torchserve_check --torchserve /tmp/ts-venv/bin/torchserve
    python -m bench.torchserve_check --workdir ts-check   # keep archives, repository, logs

Opt-in, not part of ``make test``: it needs TorchServe and a Java runtime, which this
project does not install. Tested with TorchServe 0.12.0 and OpenJDK 17 on Debian 12; from
the repository root, with the project's ``.venv`` built:

    apt-get install -y openjdk-17-jre-headless
    .venv/bin/python -m venv /tmp/ts-venv
    .venv/bin/python -c 'import site; print(site.getsitepackages()[0])' \\
        > /tmp/ts-venv/lib/python3.11/site-packages/project-venv.pth
    /tmp/ts-venv/bin/pip install torchserve captum

The ``.pth`` line lets TorchServe's workers import the project's torch and torchvision (no
second multi-GB torch); ``captum`` is imported by the stock vision handlers but is not one
of torchserve's declared dependencies. Pass ``--torchserve`` or put that ``torchserve`` on
``PATH``; ``java`` is taken from ``JAVA_HOME``, else ``PATH``, as ``torchserve`` takes it.

The archives are the ones tests/integration/test_mar.py builds with the real
``torch-model-archiver``: a scripted torchvision ResNet-18 (random weights, seed 0, the
1000 ImageNet labels in ``index_to_name.json``'s list form) and a small CNN of 10 classes,
both with the stock ``image_classifier`` handler. TorchServe serves them from a temporary
model store (``torchserve --foreground --ncs --disable-token-auth``, every address on
127.0.0.1, free ports, one worker per model, in its own process group); this server serves
them after ``python -m app.export --from-mar`` (``python -m app``, ``MB_DTYPE=float32``,
a free port). Each photo (chelsea, coffee and astronaut as JPEG, chelsea as PNG) goes as
the request body to both ``POST /predictions/{name}``. Printed per model and photo: whether
the top 5 are the same labels in the same order, the largest absolute difference in
probability (ours against TorchServe, and the test's written-down reference of the stock
handler against TorchServe), then PASS when every top 5 matches and every difference is
within 1e-4 (exit status 0; 1 on FAIL; 2 when a prerequisite is missing or a server
fails). Both servers are stopped on exit, on an error and on Ctrl-C or SIGTERM.
"""

from __future__ import annotations

import argparse
import contextlib
import math
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import time
import warnings
from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path
from types import FrameType, TracebackType

import httpx
import torch
import torchvision

from tests.integration.test_mar import PHOTOS, TOLERANCE, archive, stock_handler
from tests.server import REPO, ServerProcess, free_port
from tests.unit.test_mar import Pooled

HOST = "127.0.0.1"
SUMMARY = "TorchServe itself and this server on the same .mar files and photos, over HTTP."
INSTALL = """\
  apt-get install -y openjdk-17-jre-headless
  .venv/bin/python -m venv /tmp/ts-venv
  .venv/bin/python -c 'import site; print(site.getsitepackages()[0])' \\
      > /tmp/ts-venv/lib/python3.11/site-packages/project-venv.pth
  /tmp/ts-venv/bin/pip install torchserve captum
then: python -m bench.torchserve_check --torchserve /tmp/ts-venv/bin/torchserve"""


class CheckError(Exception):
    """A prerequisite is missing or a server failed: the message says which, and how."""


@dataclass(frozen=True)
class Model:
    name: str
    mar: Path
    scripted: Path  # the TorchScript file inside the archive, for the written-down reference
    labels: list[str]


@dataclass(frozen=True)
class Row:
    model: str
    photo: str
    torchserve: dict[str, float]
    ours: dict[str, float]
    reference: dict[str, float]

    @property
    def same_top5(self) -> bool:
        return list(self.ours) == list(self.torchserve)

    @property
    def ours_diff(self) -> float:
        return max_difference(self.ours, self.torchserve)

    @property
    def reference_diff(self) -> float:
        return max_difference(self.reference, self.torchserve)

    @property
    def passed(self) -> bool:
        return self.same_top5 and self.ours_diff <= TOLERANCE


def max_difference(answer: dict[str, float], torchserve: dict[str, float]) -> float:
    """Largest |p - p_TorchServe| over TorchServe's top 5; inf when the labels differ."""
    if set(answer) != set(torchserve):
        return math.inf
    return max(abs(answer[label] - p) for label, p in torchserve.items())


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


def build_archives(folder: Path) -> list[Model]:
    """The two archives of tests/integration/test_mar.py, made by torch-model-archiver."""
    torch.manual_seed(0)
    imagenet = [line.strip() for line in (REPO / "imagenet_classes.txt").read_text().splitlines()]
    resnet = torchvision.models.resnet18().eval()  # random weights, 1000 classes
    cnn = Pooled(classes=10).eval()  # no linear head: this server serves it whole
    specs: list[tuple[str, torch.nn.Module, object, list[str]]] = [
        (
            "resnet18",
            resnet,
            {str(i): [f"n{i:08d}", label] for i, label in enumerate(imagenet)},
            imagenet,
        ),
        ("cnn", cnn, {str(i): f"class {i}" for i in range(10)}, [f"class {i}" for i in range(10)]),
    ]
    return [
        Model(name, archive(folder, name, model, mapping), folder / name / f"{name}.pt", labels)
        for name, model, mapping, labels in specs
    ]


def import_archives(models: Sequence[Model], repository: Path) -> None:
    for model in models:
        command = [
            sys.executable, "-m", "app.export", "--from-mar", str(model.mar),
            "--repository", str(repository), "--name", model.name,
        ]  # fmt: skip
        done = subprocess.run(command, cwd=REPO, capture_output=True, text=True, timeout=600)
        if done.returncode != 0:
            raise CheckError(f"{' '.join(command)} failed:\n{done.stdout}{done.stderr}")


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


@contextlib.contextmanager
def serving(repository: Path) -> Iterator[ServerProcess]:
    """This server (``python -m app``) on ``repository`` in fp32, stopped on leaving."""
    server = ServerProcess(MODEL_REPOSITORY=str(repository), MB_DTYPE="float32")
    try:
        try:
            server.start()
        except AssertionError as error:  # how ServerProcess reports a failed start
            raise CheckError(f"this server did not start: {error}") from None
        yield server
    finally:
        if server.process is not None:
            server.stop()


def predict(base_url: str, name: str, photo: bytes, server: str) -> dict[str, float]:
    answer = httpx.post(f"{base_url}/predictions/{name}", content=photo, timeout=120)
    if answer.status_code != 200:
        raise CheckError(f"{server} answered {answer.status_code} for {name}: {answer.text}")
    result: dict[str, float] = answer.json()
    return result


def compare(models: Sequence[Model], torchserve_url: str, ours_url: str) -> list[Row]:
    rows = []
    for model in models:
        scripted = torch.jit.load(str(model.scripted))  # type: ignore[no-untyped-call]
        for photo_name, photo in PHOTOS.items():
            rows.append(
                Row(
                    model=model.name,
                    photo=photo_name,
                    torchserve=predict(torchserve_url, model.name, photo, "TorchServe"),
                    ours=predict(ours_url, model.name, photo, "this server"),
                    reference=stock_handler(scripted, model.labels, photo),
                )
            )
    return rows


def print_table(rows: Sequence[Row]) -> None:
    print(
        f"{'model':<9} {'photo':<14} {'TorchServe top 1':<22} {'top 5 same':<11}"
        f" {'max|ours-TS|':>12} {'max|ref-TS|':>12}"
    )
    for row in rows:
        top1 = next(iter(row.torchserve), "")[:21]
        print(
            f"{row.model:<9} {row.photo:<14} {top1:<22} {'yes' if row.same_top5 else 'NO':<11}"
            f" {row.ours_diff:>12.2e} {row.reference_diff:>12.2e}"
        )


def run(torchserve: str | None, workdir: Path) -> bool:
    started = time.monotonic()
    command, versions = prerequisites(torchserve)
    print(versions)
    models = build_archives(workdir)
    repository = workdir / "repository"
    import_archives(models, repository)
    print(f"archives built and imported in {time.monotonic() - started:.0f} s")
    names = [model.name for model in models]
    with (
        TorchServe(command, workdir, names, workdir / "torchserve") as ts,
        serving(repository) as ours,
    ):
        print(f"TorchServe and this server ready after {time.monotonic() - started:.0f} s")
        rows = compare(models, ts.inference_url, ours.base_url)
    print_table(rows)
    worst = max(row.ours_diff for row in rows)
    passed = all(row.passed for row in rows)
    same = sum(row.same_top5 for row in rows)
    print(
        f"{'PASS' if passed else 'FAIL'}: top 5 the same in {same} of {len(rows)}, probabilities"
        f" within {worst:.1e} of TorchServe's (target: all, within {TOLERANCE:.0e});"
        f" {time.monotonic() - started:.0f} s in all"
    )
    if any(row.reference_diff > TOLERANCE for row in rows):
        print("note: tests/integration/test_mar.py's reference differs from TorchServe here")
    return passed


def _exit_on_sigterm(signum: int, frame: FrameType | None) -> None:
    sys.exit(128 + signum)  # unwinds the with blocks, which stop both servers


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m bench.torchserve_check", description=SUMMARY)
    parser.add_argument(
        "--torchserve",
        default=shutil.which("torchserve"),
        help="the torchserve command (default: the one on PATH)",
    )
    parser.add_argument(
        "--workdir",
        type=Path,
        help="keep archives, the imported repository and TorchServe's logs here"
        " (default: a temporary folder, removed)",
    )
    args = parser.parse_args(argv)
    # torch deprecates torch.jit; TorchServe's archives are TorchScript, so this check is too.
    warnings.filterwarnings("ignore", r"`torch\.jit\.\w+` is deprecated", FutureWarning)
    signal.signal(signal.SIGTERM, _exit_on_sigterm)
    if args.workdir is not None and args.workdir.exists() and any(args.workdir.iterdir()):
        print(f"torchserve_check: --workdir {args.workdir} is not empty", file=sys.stderr)
        return 2
    workdir = args.workdir or Path(tempfile.mkdtemp(prefix="torchserve-check-"))
    workdir.mkdir(parents=True, exist_ok=True)
    try:
        return 0 if run(args.torchserve, workdir.resolve()) else 1
    except CheckError as error:
        print(f"torchserve_check: {error}", file=sys.stderr)
        return 2
    finally:
        if args.workdir is None:
            shutil.rmtree(workdir, ignore_errors=True)


if __name__ == "__main__":
    sys.exit(main())
