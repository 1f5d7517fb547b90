"""The servers we benchmark against, built on the same model files and preprocessing.

Each is an app factory for ``uvicorn --factory``, configured by environment variables that
the benchmark sets (``BENCH_MODEL_STORE``, ``BENCH_BATCH_SIZE``, ``BENCH_MAX_LATENCY``,
``BENCH_THREADS``, ``BENCH_STATS_FILE``):

* ``streamer_app``: FastAPI + service-streamer, as the original article built it: a sync
  endpoint (run in FastAPI's thread pool) that blocks on ``streamer.predict([...])``.
* ``plain_app``: FastAPI with no batching, one model call per request: where people start.
* ``openvino_app``: the same on the store's OpenVINO IR, compiled with OpenVINO's defaults
  (on a CPU with bf16 units OpenVINO then computes in bf16, and says so nowhere), each
  upload decoded in full by Pillow and resized as the model's card says: what a user writes
  in 30 lines, and the same-runtime peer every run measures us against.
* ``noop_app``: reads the upload and answers ``[]``: the load generator's ceiling, and the
  bare cost of FastAPI plus multipart parsing.
* ``decode_app``: ``noop_app`` that also decodes each upload: the least any image server does.

Bench-only code: it reads its environment directly and is never imported by the server.
"""

from __future__ import annotations

import asyncio
import os
import threading
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Annotated, Any

import numpy as np
from fastapi import FastAPI, File, Form, UploadFile
from fastapi.responses import JSONResponse
from PIL import Image
from service_streamer import ManagedModel, Streamer

from app.images import preprocess
from app.jobs import Task
from app.manifest import read_classes, read_manifest


def _env() -> tuple[Path, int, float, int]:
    return (
        Path(os.environ["BENCH_MODEL_STORE"]),
        int(os.environ.get("BENCH_BATCH_SIZE", "32")),
        float(os.environ.get("BENCH_MAX_LATENCY", "0.005")),
        int(os.environ.get("BENCH_THREADS", str(os.cpu_count() or 1))),
    )


def _runner(store: Path, threads: int) -> Any:
    import torch

    from app.workers.models import load_models
    from app.workers.runner import BatchRunner

    torch.set_num_threads(threads)
    device = torch.device("cpu")
    return BatchRunner(load_models(store, device), device)


def _tags(classes: list[str], indices: Any, probs: Any) -> list[dict[str, Any]]:
    return [
        {"name": classes[int(i)], "prob": float(p)} for i, p in zip(indices, probs, strict=True)
    ]


class BenchModel(ManagedModel):  # type: ignore[misc]
    """service-streamer's worker-side model: the same float conversion and model calls as our
    workers (service-streamer pickles this class by reference into its spawned workers)."""

    def init_model(self, store: str, threads: int, stats_file: str) -> None:
        self.runner = _runner(Path(store), threads)
        self.stats_file = stats_file

    def predict(self, batch: list[tuple[Any, int]]) -> list[Any]:
        pixels = np.stack([item[0] for item in batch])
        top_k = max(item[1] for item in batch)
        out = self.runner.run(Task.TAG, pixels, top_k)
        with open(self.stats_file, "a") as stats:
            stats.write(f"{len(batch)}\n")
        return [
            (out["indices"][row, :k], out["probs"][row, :k]) for row, (_, k) in enumerate(batch)
        ]


def streamer_app() -> FastAPI:
    store, batch_size, max_latency, threads = _env()
    stats_file = os.environ["BENCH_STATS_FILE"]
    manifest = read_manifest(store)
    classes = read_classes(store, manifest)
    streamer = Streamer(
        BenchModel,
        batch_size=batch_size,
        max_latency=max_latency,
        worker_num=1,
        model_init_args=(str(store), threads, stats_file),
    )
    streamer._wait_for_worker_ready()
    app = FastAPI()

    @app.post("/predict/tag")
    def tag(image: Annotated[UploadFile, File()], k: Annotated[int, Form()] = 5) -> JSONResponse:
        pixels = preprocess(image.file.read(), manifest.input)
        indices, probs = streamer.predict([(pixels, k)])[0]
        return JSONResponse(_tags(classes, indices, probs))

    @app.get("/stats")
    def stats() -> dict[str, int]:
        sizes = [int(line) for line in Path(stats_file).read_text().split()]
        return {"batches": len(sizes), "items": sum(sizes)}

    return app


def plain_app() -> FastAPI:
    store, _, _, threads = _env()
    manifest = read_manifest(store)
    classes = read_classes(store, manifest)
    runner = _runner(store, threads)
    size = manifest.input.crop_size
    runner.run(Task.TAG, np.zeros((1, size, size, 3), np.uint8), 1)  # warm up
    app = FastAPI()

    @app.post("/predict/tag")
    def tag(image: Annotated[UploadFile, File()], k: Annotated[int, Form()] = 5) -> JSONResponse:
        pixels = preprocess(image.file.read(), manifest.input)
        out = runner.run(Task.TAG, pixels[None], k)
        return JSONResponse(_tags(classes, out["indices"][0], out["probs"][0]))

    return app


def openvino_app() -> FastAPI:
    import openvino as ov

    store, _, _, _ = _env()

    manifest = read_manifest(store)
    classes = read_classes(store, manifest)
    files = manifest.runtimes["openvino"].files
    core = ov.Core()
    embed = core.compile_model(str(store / files["embedding"].path), "CPU")  # the defaults
    head = core.compile_model(str(store / files["classifier"].path), "CPU")
    mean = np.array(manifest.input.mean, np.float32)[:, None, None]
    std = np.array(manifest.input.std, np.float32)[:, None, None]
    crop = manifest.input.crop_size
    lock = threading.Lock()  # a compiled model's own infer request serves one call at a time
    app = FastAPI()

    @app.post("/predict/tag")
    def tag(image: Annotated[UploadFile, File()], k: Annotated[int, Form()] = 5) -> JSONResponse:
        picture = Image.open(image.file).convert("RGB")  # decoded as a user would: in full
        scale = manifest.input.resize_size / min(picture.size)
        size = (round(picture.width * scale), round(picture.height * scale))
        picture = picture.resize(size, Image.Resampling.BILINEAR)
        left, top = (picture.width - crop) // 2, (picture.height - crop) // 2
        pixels = np.asarray(picture.crop((left, top, left + crop, top + crop)))
        x = ((pixels.transpose(2, 0, 1).astype(np.float32) / 255 - mean) / std)[None]
        with lock:
            logits = head(embed(x)[0])[0][0]
        probs = np.exp(logits - logits.max())
        probs /= probs.sum()
        best = np.argsort(-probs)[:k]
        return JSONResponse(_tags(classes, best, probs[best]))

    return app


def noop_app() -> FastAPI:
    app = FastAPI()

    @app.post("/predict/tag")
    async def tag(image: Annotated[UploadFile, File()]) -> JSONResponse:
        await image.read()
        return JSONResponse([])

    @app.post("/predict/embedding")
    async def embedding(image: Annotated[UploadFile, File()]) -> JSONResponse:
        await image.read()
        return JSONResponse([])

    return app


def decode_app() -> FastAPI:
    """``noop_app`` plus the one piece of work no image server can skip: decoding the upload
    (``preprocess``, on a pool of ``BENCH_THREADS`` threads, off the event loop)."""
    store, _, _, threads = _env()
    spec = read_manifest(store).input
    pool = ThreadPoolExecutor(threads, thread_name_prefix="decode")
    app = FastAPI()

    @app.post("/predict/embedding")
    async def embedding(image: Annotated[UploadFile, File()]) -> JSONResponse:
        data = await image.read()
        await asyncio.get_running_loop().run_in_executor(pool, preprocess, data, spec)
        return JSONResponse([])

    return app
