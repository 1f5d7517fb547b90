"""What the benchmark runs: bench images and models, the raw in-process pipeline, and the
servers (ours and the peers) as subprocesses on 127.0.0.1."""

from __future__ import annotations

import contextlib
import io
import os
import signal
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path

import httpx
import numpy as np
import psutil
import torch
from PIL import Image
from torch import nn

from app.export import PrecisionRequest, SplitModel, export, export_split
from app.images import DEFAULT_MAX_PIXELS, preprocess
from app.jobs import Task
from app.manifest import InputSpec, read_manifest
from app.workers.allocator import retain_freed_memory
from app.workers.decoding import Decoder
from app.workers.lineage import stop_child
from app.workers.models import LoadOptions, Runtime, load_models
from app.workers.runner import BatchRunner

REPO = Path(__file__).resolve().parents[1]


def bench_jpegs(count: int = 8) -> list[bytes]:
    """Real photos shipped with scikit-image, as JPEGs of roughly 30-60 KB each."""
    from skimage import data

    photos = [data.chelsea(), data.coffee(), data.astronaut(), data.rocket()]  # type: ignore[no-untyped-call]
    jpegs = []
    for index in range(count):
        photo = photos[index % len(photos)]
        if index >= len(photos):  # more distinct files: mirror and shift the same photos
            photo = np.ascontiguousarray(np.roll(photo[:, ::-1], 17 * index, axis=1))
        buffer = io.BytesIO()
        Image.fromarray(photo).save(buffer, format="JPEG", quality=85)
        jpegs.append(buffer.getvalue())
    return jpegs


# scikit-image's photos that ship with it (no download), colour or grey.
PHOTOS = ("astronaut", "chelsea", "coffee", "rocket", "cat")


def photo_views(folder: Path, count: int) -> Path:
    """``count`` JPEGs in ``folder``: random crops (half to all of each side) and mirror
    images of scikit-image's photos, in turn; deterministic. Calibration images for int8."""
    from skimage import data

    folder.mkdir(parents=True, exist_ok=True)
    rng = np.random.default_rng(7)
    photos = []
    for name in PHOTOS:
        array = np.asarray(getattr(data, name)())
        if array.dtype == bool:
            array = array.astype(np.uint8) * 255
        photos.append(np.stack([array] * 3, -1) if array.ndim == 2 else array[..., :3])
    for i in range(count):
        photo = photos[i % len(photos)]
        height, width, _ = photo.shape
        h, w = (int(side * rng.uniform(0.5, 1.0)) for side in (height, width))
        top, left = rng.integers(0, height - h + 1), rng.integers(0, width - w + 1)
        view = photo[top : top + h, left : left + w]
        if rng.random() < 0.5:
            view = view[:, ::-1]
        buffer = io.BytesIO()
        Image.fromarray(np.ascontiguousarray(view)).save(buffer, format="JPEG", quality=92)
        (folder / f"{i:04d}.jpg").write_bytes(buffer.getvalue())
    return folder


@dataclass(frozen=True)
class Variant:
    """One point of the runtime axis: ``runtime`` computing in ``dtype`` (MB_DTYPE) on
    ``store``; the server with it is the system ``ours+<label>``."""

    label: str
    store: Path
    runtime: Runtime
    dtype: str = "float32"


def has_bf16() -> bool:
    """Whether OpenVINO computes bf16 on this CPU (avx512_bf16 or AMX); elsewhere it would
    silently run fp32."""
    import openvino as ov

    return "BF16" in ov.Core().get_property("CPU", "OPTIMIZATION_CAPABILITIES")


def runtime_variants(name: str, store: Path, precisions: list[str]) -> list[Variant]:
    """Every other runtime ``store`` holds, in fp32, and in each of ``precisions`` (bf16
    where the CPU has it; int8 from an export of the same model calibrated on photo views,
    kept whatever its gate says, which it prints)."""
    variants = [Variant(runtime, store, runtime) for runtime in read_manifest(store).runtimes]
    if "openvino" not in read_manifest(store).runtimes:
        return variants
    if "bf16" in precisions and has_bf16():
        variants.append(Variant("openvino+bf16", store, "openvino", "bfloat16"))
    if "int8" in precisions:
        int8 = store.with_name(f"{store.name}-int8")
        photos = photo_views(store.with_name("photos"), 250)  # 50 held back
        request = PrecisionRequest("int8", photos, accept_accuracy_loss=True)
        export_bench_model(name, int8, request)
        variants.append(Variant("openvino+int8", int8, "openvino", "int8"))
    return variants


class Passthrough(nn.Module):
    """A model with no real compute (channel means) on the usual 224 input: isolates the
    serving machinery, decoding included."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x.mean(dim=(2, 3))


def export_bench_model(name: str, out: Path, precision: PrecisionRequest | None = None) -> Path:
    """Export ``efficientnet_lite0`` (real weights), ``resnet50`` (random) or ``passthrough``
    (fp32 unless ``precision`` says otherwise)."""
    if name == "passthrough":
        torch.manual_seed(0)
        split = SplitModel(
            embedding=Passthrough(),
            classifier=nn.Linear(3, 1000),
            input=InputSpec(
                crop_size=224,
                resize_size=256,
                interpolation="bicubic",
                mean=(0.5, 0.5, 0.5),
                std=(0.5, 0.5, 0.5),
            ),
            embedding_dim=3,
            num_classes=1000,
        )
        export_split(
            split,
            arch="passthrough",
            weights="random",
            out=out,
            classes=[str(i) for i in range(1000)],
        )
    else:
        weights = "pretrained" if name == "efficientnet_lite0" else "random"
        export(name, weights, out, precision=precision)
    return out


def decode_cpu_ms(store: Path, jpegs: list[bytes], seconds: float = 1.0) -> dict[str, float]:
    """CPU milliseconds per image, on one thread, of the workers' decoder (what the default
    settings use) and of Pillow's ``preprocess`` (``MB_DECODE=server``), for ``store``'s input
    size: the least a server must spend per request on these uploads."""
    spec = read_manifest(store).input
    decoder = Decoder(spec, 1, max_pixels=DEFAULT_MAX_PIXELS)
    out = np.empty((spec.crop_size, spec.crop_size, 3), dtype=np.uint8)
    ways = {
        "workers": lambda data: decoder.one(data, out),
        "pillow": lambda data: preprocess(data, spec),
    }
    threads = torch.get_num_threads()
    torch.set_num_threads(1)  # no OpenMP helper spinning on the clock meanwhile
    try:
        return {name: _cpu_ms_per_image(way, jpegs, seconds) for name, way in ways.items()}
    finally:
        torch.set_num_threads(threads)
        decoder.close()


def _cpu_ms_per_image(work: Callable[[bytes], object], jpegs: list[bytes], seconds: float) -> float:
    for data in jpegs:  # warm-up
        work(data)
    count, started, stop = 0, time.process_time(), time.perf_counter() + seconds
    while time.perf_counter() < stop:
        for data in jpegs:
            work(data)
        count += len(jpegs)
    return 1000 * (time.process_time() - started) / count


@dataclass
class RawResult:
    batch_size: int
    images_per_s: float
    batch_p50_ms: float


class RawPipeline:
    """The server's work without HTTP: decode + preprocess + model, in one thread of control,
    in this process, with the same allocator tuning as a worker."""

    def __init__(
        self,
        store: Path,
        jpegs: list[bytes],
        threads: int,
        runtime: Runtime = "torchscript",
        dtype: str = "float32",
    ) -> None:
        retain_freed_memory()
        torch.set_num_threads(threads)
        self.jpegs = jpegs
        self.spec = read_manifest(store).input
        cpu = torch.device("cpu")
        options = LoadOptions(dtype=getattr(torch, dtype), threads=threads)
        models = load_models(store, cpu, options, runtime)
        self.runner = BatchRunner(models, cpu)
        self._next = 0

    def batch(self, batch_size: int) -> float:
        """Decode, preprocess and run the next ``batch_size`` JPEGs; the seconds it took."""
        began = time.perf_counter()
        pixels = np.stack(
            [
                preprocess(self.jpegs[(self._next + i) % len(self.jpegs)], self.spec)
                for i in range(batch_size)
            ]
        )
        self.runner.run(Task.TAG, pixels, 5)
        self._next += batch_size
        return time.perf_counter() - began

    def batch_times(self, batch_size: int, seconds: float) -> list[float]:
        """Back-to-back batches for ``seconds`` (at least 3): each one's duration."""
        times: list[float] = []
        stop = time.perf_counter() + seconds
        while time.perf_counter() < stop or len(times) < 3:
            times.append(self.batch(batch_size))
        return times

    def run(self, batch_size: int, seconds: float) -> RawResult:
        self.batch(batch_size)  # warm-up: the TorchScript executor optimises on its first calls
        self.batch(batch_size)
        times = self.batch_times(batch_size, seconds)
        return RawResult(
            batch_size, batch_size * len(times) / sum(times), 1000 * statistics.median(times)
        )


def free_port() -> int:
    import socket

    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


@dataclass
class RunningServer:
    name: str
    port: int
    process: subprocess.Popen[bytes]
    stats_path: str  # "/readyz" (ours) or "/stats" (service-streamer) or "" (none)
    start_s: float = 0.0  # from launch until it answered its probe

    def worker_rss_mb(self) -> float:
        """The resident memory of the largest process under the server: a model worker's."""
        children = psutil.Process(self.process.pid).children(recursive=True)
        sizes = []
        for process in children:
            with contextlib.suppress(psutil.NoSuchProcess):
                sizes.append(process.memory_info().rss)
        return max(sizes, default=0) / 2**20

    def serving(self) -> str:
        """This server's runtime and precision, as its first worker chose them (/info):
        "openvino+bf16"; "" for a peer."""
        info = httpx.get(f"http://127.0.0.1:{self.port}/info", timeout=10).json()
        model = info["workers"][0]["models"][0]
        tag = {"bfloat16": "+bf16", "float16": "+fp16", "int8": "+int8"}.get(model["dtype"], "")
        return f"{model['runtime']}{tag}"

    def batches_and_items(self) -> tuple[int, int] | None:
        if not self.stats_path:
            return None
        body = httpx.get(f"http://127.0.0.1:{self.port}{self.stats_path}", timeout=10).json()
        if "workers" in body:
            return sum(w["batches"] for w in body["workers"]), sum(
                w["items"] for w in body["workers"]
            )
        return body["batches"], body["items"]

    def cpu_seconds(self, *, http_only: bool = False) -> float:
        """CPU time used so far by the server and every process under it (its workers), or
        by the HTTP process alone."""
        root = psutil.Process(self.process.pid)
        total = 0.0
        for process in [root] if http_only else [root, *root.children(recursive=True)]:
            with contextlib.suppress(psutil.NoSuchProcess):
                times = process.cpu_times()
                total += times.user + times.system
        return total


@contextmanager
def serve(
    kind: str,
    store: Path | None,
    *,
    batch_size: str,
    max_latency: float,
    threads: int,
    workers: int = 1,
    settings: dict[str, str] | None = None,
    front_ends: int = 2,
    source: Path = REPO,
) -> Iterator[RunningServer]:
    """Start ``ours``, ``cluster``, ``service-streamer``, ``plain``, ``openvino-plain``, ``noop``
    or ``decode`` and wait until it answers. ``ours`` splits the ``threads`` budget evenly over
    ``workers`` worker processes and takes any other ``settings`` (environment variables);
    ``cluster`` is the same server in broker mode (``python -m app.broker.cluster``: its own
    Redis, ``front_ends`` gunicorn front ends and ``workers`` model workers). ``source``: the
    source tree it runs from (another commit's, to compare against)."""
    port = free_port()
    env = {**os.environ, "PYTHONUNBUFFERED": "1"}
    stats_path = ""
    stop_s = 30.0
    with tempfile.TemporaryDirectory() as scratch:
        if kind in ("ours", "cluster"):
            assert store is not None
            env |= {
                "HOST": "127.0.0.1",
                "PORT": str(port),
                "MODEL_STORE": str(store),
                "CUDA_DEVICES": "cpu",
                "MB_WORKER_NUM": str(workers),
                "MB_WORKER_THREADS": str(max(1, threads // workers)),
                "MB_BATCH_SIZE": batch_size,
                "MB_MAX_LATENCY": str(max_latency),
                "MB_MAX_QUEUE": "4096",
                "LOG_LEVEL": "warning",
                **(settings or {}),
            }
            command = [sys.executable, "-m", "app"]
            stats_path, probe = "/readyz", "/readyz"
            if kind == "cluster":
                command = [sys.executable, "-m", "app.broker.cluster",
                           "--front-ends", str(front_ends), "--workers", str(workers),
                           "--redis-port", str(free_port())]  # fmt: skip
                stats_path = ""  # each front end reports only the batches it saw answered
                stop_s = 150.0  # it stops its front ends, workers and Redis one after another
        else:
            factory = {
                "service-streamer": "streamer_app",
                "plain": "plain_app",
                "openvino-plain": "openvino_app",
                "noop": "noop_app",
                "decode": "decode_app",
            }[kind]
            env |= {
                "BENCH_MODEL_STORE": str(store or ""),
                "BENCH_BATCH_SIZE": batch_size,
                "BENCH_MAX_LATENCY": str(max_latency),
                "BENCH_THREADS": str(threads),
                "BENCH_STATS_FILE": str(Path(scratch) / "batches.txt"),
            }
            (Path(scratch) / "batches.txt").touch()
            command = [
                sys.executable,
                "-m",
                "uvicorn",
                f"bench.peers:{factory}",
                "--factory",
                "--host",
                "127.0.0.1",
                "--port",
                str(port),
                "--log-level",
                "warning",
            ]
            stats_path = "/stats" if kind == "service-streamer" else ""
            probe = "/docs"
        # Its own process group: the peers' workers (service-streamer's are plain daemon
        # processes) go down with it even if the server itself does not stop cleanly.
        process = subprocess.Popen(
            command,
            cwd=source,
            env=env,
            stdout=subprocess.DEVNULL,
            stderr=subprocess.PIPE,
            start_new_session=True,
        )
        launched = time.monotonic()
        try:
            deadline = time.monotonic() + 300
            while True:
                if process.poll() is not None:
                    error = process.stderr.read().decode()[-2000:] if process.stderr else ""
                    raise RuntimeError(f"{kind} server exited: {error}")
                try:
                    if httpx.get(f"http://127.0.0.1:{port}{probe}", timeout=2).status_code == 200:
                        break
                except httpx.TransportError:
                    pass
                if time.monotonic() > deadline:
                    raise RuntimeError(f"{kind} server did not start")
                time.sleep(0.2)
            yield RunningServer(kind, port, process, stats_path, time.monotonic() - launched)
        finally:
            stop_child(process, timeout_s=stop_s)
            with contextlib.suppress(ProcessLookupError):
                os.killpg(process.pid, signal.SIGKILL)
