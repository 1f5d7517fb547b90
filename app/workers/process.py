"""A model worker: load the models once (``prepare``), then run batches until told to stop.

``worker_main`` is the entry point of the pool's worker processes (started with ``spawn`` by
``app.workers.pool``; they talk over one socket, see ``app.workers.channel``, and receive
images through their shared buffer, see ``app.workers.transfer``). ``prepare`` is the part
any worker process runs first, whatever feeds it batches.
"""

from __future__ import annotations

import contextlib
import logging
import os
import time
import traceback
from dataclasses import dataclass, field
from multiprocessing.connection import Connection
from pathlib import Path

import torch

from app.logs import configure_logging
from app.manifest import read_manifest
from app.plan import WorkerConfig
from app.workers.allocator import ResidentBound, retain_freed_memory
from app.workers.buffer import InputBuffer
from app.workers.decoding import Decoder, DeviceDecoder
from app.workers.messages import (
    STOP,
    BatchDone,
    BatchFailed,
    Ready,
    RunBatch,
    StartFailed,
    WorkerSpec,
)
from app.workers.models import LoadOptions
from app.workers.runner import BatchRunner, choose_batch_size
from app.workers.runtimes import choose_runtime
from app.workers.transfer import read_images

log = logging.getLogger("app.worker")


@dataclass
class PreparedWorker:
    """A worker's models, loaded, warmed up and measured; its decoder, if it decodes."""

    runner: BatchRunner
    decoder: Decoder | DeviceDecoder | None
    batch_size: int  # the largest batch it wants: its auto choice, or the maximum
    throughput: dict[int, float] = field(default_factory=dict)  # auto: images/s per size
    # Its memory's level once warmed up; serving loops call after_batch() once answered.
    memory: ResidentBound = field(default_factory=ResidentBound)


def _configure_threads(threads: int) -> None:
    torch.set_num_threads(threads)
    with contextlib.suppress(RuntimeError):  # already set (only possible in-process)
        torch.set_num_interop_threads(1)


def prepare(config: WorkerConfig, device_name: str, threads: int) -> PreparedWorker:
    """Tune this process for serving, verify and load the models onto ``device_name``,
    warm them up and (``auto_batch``) measure the batch size to use. Raises whatever stops
    it; the caller reports it."""
    retain_freed_memory()  # first: every allocation after it benefits
    _configure_threads(threads)
    device = torch.device(device_name)
    if device.type == "cuda":
        torch.cuda.set_device(device)
    store = Path(config.model_store)
    dtype = read_manifest(store, verify=False).serving_dtype(config.dtype)
    options = LoadOptions(dtype=getattr(torch, dtype), optimize=config.optimize, threads=threads)
    choice = choose_runtime(store, device, options, config.runtime)
    if choice.images_per_s:
        measured = ", ".join(f"{name}: {rate:.1f}" for name, rate in choice.images_per_s.items())
        log.info(
            "on %s, %s serves (images/s by runtime: %s)", device, choice.models.runtime, measured
        )
    models = choice.models
    runner = BatchRunner(models, device)
    decoder: Decoder | DeviceDecoder | None = None
    if config.decode_threads:
        decoder = Decoder(models.manifest.input, config.decode_threads, config.max_pixels)
        if config.decode_on_device:
            decoder = DeviceDecoder(models.manifest.input, device, decoder, config.max_pixels)
            decoder.warm_up()
    prepared = PreparedWorker(runner, decoder, config.max_batch_size)
    if config.auto_batch:  # measuring runs every size up to the one it chooses
        runner.warm_up()
        prepared.batch_size, prepared.throughput = choose_batch_size(
            runner, runner.image_shape, config.max_batch_size
        )
    else:
        runner.warm_up(largest=config.max_batch_size)
    if device.type == "cuda":
        torch.cuda.synchronize(device)
    prepared.memory.settle()
    return prepared


def worker_main(spec: WorkerSpec, conn: Connection) -> None:
    """Entry point of a pool's worker process."""
    configure_logging(spec.config.log_level, spec.config.log_format)
    try:
        prepared = prepare(spec.config, spec.device, spec.threads)
        buffer = InputBuffer(spec.buffer_path, spec.buffer_size)
    except BaseException as exc:
        conn.send(StartFailed(spec.index, f"{type(exc).__name__}: {exc}"))
        conn.close()
        return
    conn.send(
        Ready(
            spec.index,
            spec.device,
            spec.threads,
            os.getpid(),
            prepared.batch_size,
            prepared.throughput,
            prepared.runner.models.runtime,
        )
    )
    _serve(prepared, buffer, conn)


def run_message(prepared: PreparedWorker, buffer: InputBuffer, message: RunBatch) -> BatchDone:
    """Run one batch from the buffer; raises if the batch as a whole fails."""
    started = time.perf_counter()
    if message.threads and message.threads != torch.get_num_threads():
        torch.set_num_threads(message.threads)
    runner = prepared.runner
    pixels, errors = read_images(message, buffer, prepared.decoder, runner.image_shape)
    outputs = runner.run(message.task, pixels, message.top_k) if len(pixels) else {}
    return BatchDone(
        message.batch_id,
        message.ids,
        outputs,
        time.perf_counter() - started,
        errors,
        torch.get_num_threads(),
    )


def _serve(prepared: PreparedWorker, buffer: InputBuffer, conn: Connection) -> None:
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
            reply: BatchDone | BatchFailed = run_message(prepared, buffer, message)
        except Exception as exc:
            log.error("batch %d failed:\n%s", message.batch_id, traceback.format_exc())
            reply = BatchFailed(message.batch_id, message.ids, f"{type(exc).__name__}: {exc}")
        conn.send(reply)
        prepared.memory.after_batch()
