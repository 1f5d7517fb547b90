"""``python -m bench.torchserve_check``: TorchServe itself and this server on the same
``.mar`` files and uploads, over HTTP: do they answer the same?

    python -m bench.torchserve_check --torchserve /tmp/ts-venv/bin/torchserve
    python -m bench.torchserve_check --workdir ts-check   # keep archives, repository, logs

Opt-in, not part of ``make test``: it needs TorchServe and a Java runtime, which this
project does not install. Tested with TorchServe 0.12.0 and OpenJDK 17 on Debian 12; from
the repository root, with the project's ``.venv`` built:

    apt-get install -y openjdk-17-jre-headless
    .venv/bin/python -m venv /tmp/ts-venv
    .venv/bin/python -c 'import site; print(site.getsitepackages()[0])' \\
        > /tmp/ts-venv/lib/python3.11/site-packages/project-venv.pth
    /tmp/ts-venv/bin/pip install torchserve==0.12.0 captum

The ``.pth`` line lets TorchServe's workers import the project's torch and torchvision (no
second multi-GB torch); ``captum`` is imported by the stock vision handlers but is not one
of torchserve's declared dependencies. Pass ``--torchserve`` or put that ``torchserve`` on
``PATH``; ``java`` is taken from ``JAVA_HOME``, else ``PATH``, as ``torchserve`` takes it.

The archives are the tests' (``tests.torchserve``), made by the real
``torch-model-archiver`` with the stock ``image_classifier`` handler: the pretrained
EfficientNet-Lite0, traced (``lite0``, a trained model: what the check is about), a scripted
torchvision ResNet-18 (random weights, seed 0, the 1000 ImageNet labels in
``index_to_name.json``'s list form) and a small CNN of 10 classes. TorchServe serves them
from a temporary model store (``bench.torchserve_server``: one worker per model, every
address on 127.0.0.1, in its own process group); this server serves them after ``python -m
app.export --from-mar``, twice: in fp32 (``MB_DTYPE=float32``) and with default settings
(``MB_DTYPE=auto``, its choice kept in a folder of the run). Each upload (the tests' photos
and odd uploads: very tall, very wide, tiny, greyscale, CMYK, a PNG with alpha) goes as the
request body to ``POST /predictions/{name}`` of the three.

Printed per model and upload: TorchServe's top 1 (or its status, where it fails: the
greyscale, CMYK and alpha uploads, which this server answers; they are then compared with
the tests' in-process stock handler), whether fp32's top 5 are the same labels in the same
order and the largest absolute difference in probability, the same for default settings with
its top 1, and the in-process reference against TorchServe. Then what this server refuses: a
truncated JPEG, an empty body and a TIFF, with TorchServe's status and ours. PASS (exit
status 0) when every fp32 top 5 matches within 1e-4, every default top 1 matches, every
upload TorchServe fails gets a 200 here, the broken ones a 400 and the TIFF a 415; 1 on
FAIL; 2 when a prerequisite is missing or a server fails. The servers are stopped on exit,
on an error and on Ctrl-C or SIGTERM.
"""

from __future__ import annotations

import argparse
import contextlib
import io
import math
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
from types import FrameType

import httpx
import torch
import torchvision
from PIL import Image

from bench.torchserve_server import CheckError, TorchServe, prerequisites
from tests.server import REPO, ServerProcess
from tests.torchserve import (
    LITE0,
    ODD,
    PHOTOS,
    TOLERANCE,
    archive,
    imagenet_classes,
    lite0_archive,
    stock_handler,
)
from tests.unit.test_mar import Pooled

SUMMARY = "TorchServe itself and this server on the same .mar files and uploads, over HTTP."
UPLOADS = PHOTOS | ODD
Answer = dict[str, float]


@dataclass(frozen=True)
class Model:
    name: str
    mar: Path
    scripted: Path  # the TorchScript file inside the archive, for the in-process reference
    labels: list[str]


@dataclass(frozen=True)
class Row:
    model: str
    upload: str
    torchserve: Answer | int  # its answer, or the HTTP status it failed with
    fp32: Answer
    default: Answer
    reference: Answer  # the stock handler in-process

    @property
    def target(self) -> Answer:
        """What we must answer: TorchServe's, or where it fails, the stock transform's."""
        return self.torchserve if isinstance(self.torchserve, dict) else self.reference

    @property
    def fp32_same(self) -> bool:
        return list(self.fp32) == list(self.target)

    @property
    def default_top1(self) -> bool:
        return next(iter(self.default)) == next(iter(self.target))

    @property
    def passed(self) -> bool:
        within = max_difference(self.fp32, self.target) <= TOLERANCE
        return self.fp32_same and within and self.default_top1


def max_difference(answer: Answer, target: Answer) -> float:
    """Largest |p - p_target| over the target's top 5; inf when the labels differ."""
    if set(answer) != set(target):
        return math.inf
    return max(abs(answer[label] - p) for label, p in target.items())


def build_archives(folder: Path) -> list[Model]:
    """The tests' archives, made by torch-model-archiver."""
    torch.manual_seed(0)
    imagenet = imagenet_classes()
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
    models = [Model(LITE0, lite0_archive(folder), folder / LITE0 / f"{LITE0}.pt", imagenet)]
    return models + [
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


@contextlib.contextmanager
def serving(repository: Path, **env: str) -> Iterator[ServerProcess]:
    """This server (``python -m app``) on ``repository`` with ``env``, stopped on leaving."""
    server = ServerProcess(MODEL_REPOSITORY=str(repository), **env)
    try:
        try:
            server.start(ready_timeout_s=300)
        except AssertionError as error:  # how ServerProcess reports a failed start
            raise CheckError(f"this server did not start: {error}") from None
        yield server
    finally:
        if server.process is not None:
            server.stop()


def predict(base_url: str, name: str, upload: bytes, server: str) -> Answer | int:
    """The answer, or the status of a failure (TorchServe's 503 on what it cannot read)."""
    answer = httpx.post(f"{base_url}/predictions/{name}", content=upload, timeout=120)
    if answer.status_code != 200:
        if server == "TorchServe":
            return answer.status_code
        raise CheckError(f"{server} answered {answer.status_code} for {name}: {answer.text}")
    result: Answer = answer.json()
    return result


def ours(base_url: str, name: str, upload: bytes) -> Answer:
    answer = predict(base_url, name, upload, "this server")
    assert isinstance(answer, dict)
    return answer


def compare(models: Sequence[Model], torchserve_url: str, fp32: str, default: str) -> list[Row]:
    rows = []
    for model in models:
        scripted = torch.jit.load(str(model.scripted))  # type: ignore[no-untyped-call]
        for name, upload in UPLOADS.items():
            rows.append(
                Row(
                    model=model.name,
                    upload=name,
                    torchserve=predict(torchserve_url, model.name, upload, "TorchServe"),
                    fp32=ours(fp32, model.name, upload),
                    default=ours(default, model.name, upload),
                    reference=stock_handler(scripted, model.labels, upload),
                )
            )
    return rows


def refused_uploads(torchserve_url: str, ours_url: str) -> list[tuple[str, int, int, int]]:
    """``(upload, TorchServe's status, ours, ours expected)`` for uploads this server refuses:
    a truncated JPEG and an empty body (400), and a TIFF (415: not in its format allowlist)."""
    photo, tiff = PHOTOS["cat.jpg"], io.BytesIO()
    Image.open(io.BytesIO(photo)).save(tiff, "TIFF")
    uploads = (
        ("truncated JPEG", photo[: len(photo) // 3], 400),
        ("empty body", b"", 400),
        ("TIFF", tiff.getvalue(), 415),
    )
    statuses = []
    for name, upload, expected in uploads:
        theirs = httpx.post(f"{torchserve_url}/predictions/{LITE0}", content=upload, timeout=60)
        mine = httpx.post(f"{ours_url}/predictions/{LITE0}", content=upload, timeout=60)
        statuses.append((name, theirs.status_code, mine.status_code, expected))
    return statuses


def print_table(rows: Sequence[Row]) -> None:
    print(
        f"{'model':<9} {'upload':<17} {'TorchServe top 1':<20} {'fp32 top5':<9} {'fp32 max':>9}"
        f" {'default top1':<12} {'top5':<4} {'max':>9} {'ref max':>9}"
    )
    for row in rows:
        if isinstance(row.torchserve, dict):
            top1 = next(iter(row.torchserve), "")[:19]
            reference = f"{max_difference(row.reference, row.torchserve):.1e}"
        else:
            top1, reference = f"{row.torchserve} (ref: ours)", "-"
        same5 = list(row.default) == list(row.target)
        print(
            f"{row.model:<9} {row.upload:<17} {top1:<20} {'yes' if row.fp32_same else 'NO':<9}"
            f" {max_difference(row.fp32, row.target):>9.1e}"
            f" {'yes' if row.default_top1 else 'NO':<12} {'yes' if same5 else 'no':<4}"
            f" {max_difference(row.default, row.target):>9.1e} {reference:>9}"
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
    state = workdir / "state"  # where MB_DTYPE=auto keeps its choice: this run's own
    with (
        TorchServe(command, workdir, names, workdir / "torchserve") as ts,
        serving(repository, MB_DTYPE="float32") as fp32,
        serving(repository, MB_DTYPE="auto", MB_STATE_DIR=str(state)) as default,
    ):
        print(f"TorchServe and this server ready after {time.monotonic() - started:.0f} s")
        rows = compare(models, ts.inference_url, fp32.base_url, default.base_url)
        broken = refused_uploads(ts.inference_url, fp32.base_url)
        precisions = {
            model["name"]: model.get("dtype")
            for model in httpx.get(f"{default.base_url}/info").json()["workers"][0]["models"]
        }
    print_table(rows)
    print(f"default settings served: {precisions}")
    for name, theirs, mine, _ in broken:
        print(f"{name}: TorchServe {theirs}, this server {mine}")
    refused = [row for row in rows if not isinstance(row.torchserve, dict)]
    # Every upload TorchServe failed was answered here (``ours`` raises otherwise).
    passed = all(row.passed for row in rows) and all(m == e for _, _, m, e in broken)
    same = sum(row.fp32_same for row in rows)
    worst = max(max_difference(row.fp32, row.target) for row in rows)
    print(
        f"{'PASS' if passed else 'FAIL'}: fp32 top 5 the same in {same} of {len(rows)}, "
        f"probabilities within {worst:.1e} (target: all, within {TOLERANCE:.0e}); default "
        f"top 1 the same in {sum(row.default_top1 for row in rows)} of {len(rows)}; "
        f"TorchServe failed {len(refused)} ({', '.join(sorted({r.upload for r in refused}))}),"
        " all answered here; "
        f"{time.monotonic() - started:.0f} s in all"
    )
    return passed


def _exit_on_sigterm(signum: int, frame: FrameType | None) -> None:
    sys.exit(128 + signum)  # unwinds the with blocks, which stop the servers


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
