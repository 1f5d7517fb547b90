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
from app.workers.allocator import retain_freed_memory
from app.workers.decoding import Decoder, DeviceDecoder, Errors
from app.workers.models import LoadedModels, LoadOptions, load_models
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

# A batch of uint8 [n, H, W, 3] images: numpy from the shared buffer or Pillow, or a tensor
# already on the device (MB_DECODE=device).
Pixels = npt.NDArray[np.uint8] | torch.Tensor


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

    def to_input(self, pixels: Pixels) -> torch.Tensor:
        """uint8 [n, H, W, 3] -> normalised float32 [n, 3, H, W] (channels-last in memory)."""
        batch = pixels if isinstance(pixels, torch.Tensor) else torch.from_numpy(pixels)
        batch = batch.to(self.device, non_blocking=True)
        normalised = torch.addcmul(self._shift, batch.permute(0, 3, 1, 2).float(), self._scale)
        return normalised.to(self.models.dtype)

    def run(self, task: Task, pixels: Pixels, top_k: int) -> dict[str, Any]:
        with torch.inference_mode():
            features = self.models.embedding(self.to_input(pixels))
            if task is Task.EMBEDDING:
                return {"embedding": features.float().cpu().numpy()}
            probs = torch.softmax(self.models.classifier(features).float(), dim=1)
            values, indices = torch.topk(probs, k=top_k, dim=1)
            return {"indices": indices.cpu().numpy(), "probs": values.cpu().numpy()}


# A batch size is worth it only if it is this close to the best throughput seen: among
# near-equals, the smaller batch answers sooner.
KNEE_FRACTION = 0.95
# Stop trying bigger batches once one call takes this long: a batch that slow would add its
# whole duration to the latency of every request in it.
AUTO_BATCH_MAX_CALL_S = 1.0
# Each size is timed in this many rounds and keeps its best: workers measure at the same time
# and share the cores, so any one timing may be slowed by a neighbour (on 2 cores a lone round
# picked batch 1 or 4 from run to run), and interference only ever slows a timing down.
AUTO_BATCH_ROUNDS = 3
AUTO_BATCH_MIN_TIMING_S = 0.1


def _images_per_s(runner: BatchRunner, pixels: npt.NDArray[np.uint8]) -> tuple[float, float]:
    """Images/s of back-to-back calls for at least ``AUTO_BATCH_MIN_TIMING_S``, and the
    seconds one call took."""
    calls, started = 0, time.perf_counter()
    while calls < 1 or time.perf_counter() - started < AUTO_BATCH_MIN_TIMING_S:
        runner.run(Task.TAG, pixels, 1)
        calls += 1
    elapsed = time.perf_counter() - started
    return len(pixels) * calls / elapsed, elapsed / calls


def choose_batch_size(
    runner: BatchRunner, image_shape: tuple[int, int, int], upper: int
) -> tuple[int, dict[int, float]]:
    """Measure images/s at batch sizes 1, 2, 4, ... <= ``upper`` on this worker's device and
    return the smallest size within ``KNEE_FRACTION`` of the best, with the measurements.
    Each size is timed in ``AUTO_BATCH_ROUNDS`` rounds and keeps its best timing."""
    batches: list[npt.NDArray[np.uint8]] = []
    throughput: dict[int, float] = {}
    size, past_the_knee = 1, 0
    while size <= upper:  # the first round also finds how far to grow
        pixels = np.zeros((size, *image_shape), dtype=np.uint8)
        runner.run(Task.TAG, pixels, 1)  # first call at a new shape may be slower
        batches.append(pixels)
        throughput[size], call_s = _images_per_s(runner, pixels)
        # Two sizes in a row well below the best so far: throughput is falling (on a CPU,
        # activations outgrow the caches), and bigger batches only cost start-up time.
        below = throughput[size] < KNEE_FRACTION * max(throughput.values())
        past_the_knee = past_the_knee + 1 if below else 0
        if call_s > AUTO_BATCH_MAX_CALL_S or past_the_knee == 2:
            break
        size *= 2
    for _ in range(AUTO_BATCH_ROUNDS - 1):
        for pixels in batches:
            throughput[len(pixels)] = max(throughput[len(pixels)], _images_per_s(runner, pixels)[0])
    best = max(throughput.values())
    chosen = min(s for s, rate in throughput.items() if rate >= KNEE_FRACTION * best)
    return chosen, throughput


def _configure_threads(spec: WorkerSpec) -> None:
    torch.set_num_threads(spec.threads)
    with contextlib.suppress(RuntimeError):  # already set (only possible in-process)
        torch.set_num_interop_threads(1)


def worker_main(spec: WorkerSpec, conn: Connection) -> None:
    """Entry point of a worker process."""
    try:
        retain_freed_memory()
        _configure_threads(spec)
        device = torch.device(spec.device)
        if device.type == "cuda":
            torch.cuda.set_device(device)
        options = LoadOptions(dtype=getattr(torch, spec.dtype), optimize=spec.optimize)
        models = load_models(Path(spec.model_store), device, options)
        runner = BatchRunner(models, device)
        buffer = InputBuffer(spec.buffer_path, spec.buffer_size)
        decoder: Decoder | DeviceDecoder | None = None
        if spec.decode_threads:
            decoder = Decoder(models.manifest.input, spec.decode_threads, spec.max_pixels)
            if spec.decode_on_device:
                decoder = DeviceDecoder(models.manifest.input, device, decoder, spec.max_pixels)
                decoder.warm_up()
        warm = np.zeros((1, *spec.image_shape), dtype=np.uint8)
        for _ in range(2):  # the TorchScript executor optimises on its first calls
            runner.run(Task.TAG, warm, top_k=1)
        batch_size, throughput = spec.max_batch_size, dict[int, float]()
        if spec.auto_batch:
            batch_size, throughput = choose_batch_size(
                runner, spec.image_shape, spec.max_batch_size
            )
        if device.type == "cuda":
            torch.cuda.synchronize(device)
    except BaseException as exc:
        conn.send(StartFailed(spec.index, f"{type(exc).__name__}: {exc}"))
        conn.close()
        return
    conn.send(Ready(spec.index, spec.device, spec.threads, os.getpid(), batch_size, throughput))
    _serve(runner, buffer, decoder, spec.image_shape, conn)


def _batch_pixels(
    message: RunBatch,
    buffer: InputBuffer,
    decoder: Decoder | DeviceDecoder | None,
    image_shape: tuple[int, int, int],
) -> tuple[Pixels, Errors]:
    """The batch's uint8 pixels (decoded here where it came encoded), less the rows that
    could not be decoded, and those rows' errors."""
    count = len(message.ids)
    if not message.spans:
        return buffer.images(count, image_shape), {}
    if decoder is None:
        raise RuntimeError("an encoded batch reached a worker that does not decode")
    blobs: list[bytes] = []
    encoded: list[int] = []  # the rows the blobs belong to
    for row, (span, inline) in enumerate(zip(message.spans, message.inline, strict=True)):
        blob = buffer.blob(span) if span is not None else inline
        if blob is not None:
            blobs.append(blob)
            encoded.append(row)
    decoded, failed = decoder.decode(blobs)
    errors = {encoded[position]: error for position, error in failed.items()}
    if len(encoded) == count:
        return decoded, errors
    # Mixed: the other rows wait in the buffer as pixels, and the encoded rows' places there
    # are free (their bytes were packed after the pixel rows): decode into them.
    if isinstance(decoded, torch.Tensor):
        decoded = decoded.cpu().numpy()
    rows = buffer.images(count, image_shape)
    rows[[row for row in encoded if row not in errors]] = decoded
    return (rows[[row for row in range(count) if row not in errors]] if errors else rows), errors


def _serve(
    runner: BatchRunner,
    buffer: InputBuffer,
    decoder: Decoder | DeviceDecoder | None,
    image_shape: tuple[int, int, int],
    conn: Connection,
) -> None:
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
            if message.threads and message.threads != torch.get_num_threads():
                torch.set_num_threads(message.threads)
            pixels, errors = _batch_pixels(message, buffer, decoder, image_shape)
            outputs = runner.run(message.task, pixels, message.top_k) if len(pixels) else {}
            reply: BatchDone | BatchFailed = BatchDone(
                message.batch_id,
                message.ids,
                outputs,
                time.perf_counter() - started,
                errors,
                torch.get_num_threads(),
            )
        except Exception as exc:
            log.error("batch %d failed:\n%s", message.batch_id, traceback.format_exc())
            reply = BatchFailed(message.batch_id, message.ids, f"{type(exc).__name__}: {exc}")
        conn.send(reply)
