"""Running one batch in a worker process: the one function every worker runs a batch with,
whatever brought it (``run_batch``): a pool's worker, from its shared buffer
(``run_message``), or a broker's consumer, from the stream entries it read."""

from __future__ import annotations

import os
import time
from collections.abc import Sequence
from contextlib import AbstractContextManager
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import numpy.typing as npt
import torch

from app import tracing
from app.jobs import Task
from app.workers.buffer import InputBuffer
from app.workers.messages import BatchDone, RunBatch
from app.workers.runner import Pixels
from app.workers.transfer import Errors, batch_images

if TYPE_CHECKING:
    from app.workers.models import LoadedModels
    from app.workers.process import PreparedWorker


@dataclass(frozen=True)
class Computed:
    """One batch's outputs (rows: the images that decoded, in order), the errors of those
    that did not (by position), the torch threads it ran on, how long it took and the model
    that ran it."""

    outputs: dict[str, npt.NDArray[Any]]
    errors: Errors
    threads: int
    seconds: float
    served_id: str


def run_batch(
    worker: PreparedWorker,
    served_id: str,
    task: Task,
    images: Pixels | Sequence[bytes | memoryview],
    top_k: int,
    threads: int = 0,
) -> Computed:
    """Run ``images`` (uint8 pixels, or encoded uploads the model's decoder decodes here) as
    one batch of ``task`` on the model ``served_id`` names, on ``threads`` torch threads (0:
    as they are). Raises if the batch as a whole fails (``KeyError``: no such model here)."""
    started = time.perf_counter()
    prepared = worker.model(served_id)
    # A model that takes the pixels runs no torch op of its own here (its runtime has its
    # threads): torch on this thread alone, which then decodes a lone upload itself.
    threads = 1 if prepared.runner.models.pixels_in else threads
    if threads and threads != torch.get_num_threads():
        torch.set_num_threads(threads)
    errors: Errors = {}
    if isinstance(images, Sequence):  # encoded uploads
        if prepared.decoder is None:
            raise RuntimeError("an encoded batch reached a worker that does not decode")
        with tracing.span("decode"):
            pixels, errors = prepared.decoder.decode(list(images))  # type: ignore[arg-type]
    else:
        pixels = images
    with tracing.span("model", _model_attributes(worker, prepared.runner.models, len(pixels))):
        outputs = prepared.runner.run(task, pixels, top_k) if len(pixels) else {}
    seconds = time.perf_counter() - started
    return Computed(outputs, errors, torch.get_num_threads(), seconds, prepared.spec.served_id)


def _model_attributes(worker: PreparedWorker, models: LoadedModels, images: int) -> dict[str, Any]:
    """What the ``model`` span says of its call (built only when tracing is on)."""
    if not tracing.on():
        return {}
    return {
        "microbatch.images": images,
        "microbatch.runtime": models.runtime,
        "microbatch.precision": models.precision,
        "microbatch.threads": worker.threads,
        "microbatch.shape": "static" if images in models.static_batches else "dynamic",
    }


def batch_span(
    served_id: str, task: Task, carriers: Sequence[str | None], **more: Any
) -> AbstractContextManager[Any]:
    """A batch's span (``app.tracing.batch``) with what ran and where, when any of its items
    is traced (``carriers``: a traceparent per item, or none); nothing otherwise, not even
    its attributes."""
    if not tracing.on() or not any(carriers):
        return tracing.OFF
    attributes = {
        "microbatch.served_id": served_id,
        "microbatch.task": task.value,
        "process.pid": os.getpid(),
        **more,
    }
    return tracing.batch(carriers, attributes)


def run_message(worker: PreparedWorker, buffer: InputBuffer, message: RunBatch) -> BatchDone:
    """A pool worker's batch, from its shared buffer."""
    prepared = worker.model(message.model)
    images = batch_images(message, buffer, prepared.runner.image_shape)
    with batch_span(message.model, message.task, message.traces):
        done = run_batch(
            worker, message.model, message.task, images, message.top_k, message.threads
        )
    return BatchDone(
        message.batch_id,
        message.ids,
        done.outputs,
        done.seconds,
        done.errors,
        done.threads,
        done.served_id,
    )
