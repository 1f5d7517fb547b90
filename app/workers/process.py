"""The worker process: load the models once, then run batches until told to stop.

Started with ``spawn`` by ``app.workers.pool``; talks over one duplex pipe (see
``app.workers.protocol``).
"""

from __future__ import annotations

import contextlib
import logging
import os
import time
import traceback
from multiprocessing.connection import Connection
from pathlib import Path
from typing import Any

import numpy as np
import numpy.typing as npt
import torch

from app.jobs import Task
from app.manifest import InputSpec
from app.workers.models import LoadedModels, load_models
from app.workers.protocol import (
    STOP,
    BatchDone,
    BatchFailed,
    InputBuffer,
    Ready,
    RunBatch,
    StartFailed,
    WorkerSpec,
)

log = logging.getLogger("app.worker")


class BatchRunner:
    """Turns a uint8 NHWC batch into model outputs on one device. Also usable in-process
    (tests, the benchmark) without any pipe or buffer."""

    def __init__(self, models: LoadedModels, device: torch.device) -> None:
        self.models = models
        self.device = device
        spec: InputSpec = models.manifest.input
        # (x / 255 - mean) / std == x * scale + shift, folded into one fused op per channel.
        std = torch.tensor(spec.std, dtype=torch.float32)
        mean = torch.tensor(spec.mean, dtype=torch.float32)
        self._scale = (1.0 / (255.0 * std)).view(1, 3, 1, 1).to(device)
        self._shift = (-mean / std).view(1, 3, 1, 1).to(device)

    def to_input(self, pixels: npt.NDArray[np.uint8]) -> torch.Tensor:
        """uint8 [n, H, W, 3] -> normalised float32 [n, 3, H, W] (channels-last in memory)."""
        batch = torch.from_numpy(pixels).to(self.device, non_blocking=True)
        return torch.addcmul(self._shift, batch.permute(0, 3, 1, 2).float(), self._scale)

    def run(self, task: Task, pixels: npt.NDArray[np.uint8], top_k: int) -> dict[str, Any]:
        with torch.inference_mode():
            features = self.models.embedding(self.to_input(pixels))
            if task is Task.EMBEDDING:
                return {"embedding": features.float().cpu().numpy()}
            probs = torch.softmax(self.models.classifier(features).float(), dim=1)
            values, indices = torch.topk(probs, k=top_k, dim=1)
            return {"indices": indices.cpu().numpy(), "probs": values.cpu().numpy()}


def _configure_threads(spec: WorkerSpec) -> None:
    torch.set_num_threads(spec.threads)
    with contextlib.suppress(RuntimeError):  # already set (only possible in-process)
        torch.set_num_interop_threads(1)


def worker_main(spec: WorkerSpec, conn: Connection) -> None:
    """Entry point of a worker process."""
    try:
        _configure_threads(spec)
        device = torch.device(spec.device)
        if device.type == "cuda":
            torch.cuda.set_device(device)
        runner = BatchRunner(load_models(Path(spec.model_store), device), device)
        buffer = InputBuffer(spec.buffer_path, spec.max_batch_size, spec.image_shape)
        warm = np.zeros((1, *spec.image_shape), dtype=np.uint8)
        for _ in range(2):  # the TorchScript executor optimises on its first calls
            runner.run(Task.TAG, warm, top_k=1)
        if device.type == "cuda":
            torch.cuda.synchronize(device)
    except BaseException as exc:
        conn.send(StartFailed(spec.index, f"{type(exc).__name__}: {exc}"))
        conn.close()
        return
    conn.send(Ready(spec.index, spec.device, spec.threads, os.getpid()))
    _serve(runner, buffer, conn)


def _serve(runner: BatchRunner, buffer: InputBuffer, conn: Connection) -> None:
    while True:
        try:
            message = conn.recv()
        except (EOFError, OSError):  # the pool went away: nothing left to serve
            return
        if message is STOP:
            conn.close()
            return
        assert isinstance(message, RunBatch)
        try:
            started = time.perf_counter()
            outputs = runner.run(message.task, buffer.array[: len(message.ids)], message.top_k)
            reply: BatchDone | BatchFailed = BatchDone(
                message.batch_id, message.ids, outputs, time.perf_counter() - started
            )
        except Exception as exc:
            log.error("batch %d failed:\n%s", message.batch_id, traceback.format_exc())
            reply = BatchFailed(message.batch_id, message.ids, f"{type(exc).__name__}: {exc}")
        conn.send(reply)
