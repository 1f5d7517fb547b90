"""What the pool and a worker process say to each other over their socket.

Only these small messages are pickled (both ends are our own processes, started by the
pool). Images travel through the worker's shared buffer (``app.workers.buffer``); an upload
that did not fit there travels inline in ``RunBatch``.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import numpy as np
import numpy.typing as npt

from app.batching import Trial
from app.jobs import Task
from app.lifecycle import ModelSpec
from app.plan import WorkerConfig


@dataclass(frozen=True)
class WorkerSpec:
    """Everything one worker process needs to start, picklable for ``spawn``. It holds no
    model when it says ``Ready``: its host has it load each (``LoadModel``), start-up or
    not."""

    index: int
    device: str
    threads: int
    config: WorkerConfig
    buffer_path: str
    buffer_size: int
    parent_pid: int = 0  # the pool's process: the worker dies with it (app.workers.lineage)


@dataclass(frozen=True)
class RunBatch:
    """Run ``ids`` (one batch, in order). Without ``spans``, the batch's pixels fill the
    buffer's first rows. With them, every image is an encoded upload: in the buffer at
    ``spans[row] = (offset, length)``, or in ``inline[row]`` when it had no room there
    (``spans[row]`` is then ``None``)."""

    batch_id: int
    task: Task
    ids: tuple[int, ...]
    top_k: int = 0
    spans: tuple[tuple[int, int] | None, ...] = ()
    inline: tuple[bytes | None, ...] = ()
    threads: int = 0  # torch threads for this batch (its own plus any lent); 0: unchanged
    model: str = ""  # the served id of the model to run it on (the worker may hold several)
    traces: tuple[str | None, ...] = ()  # each item's traceparent (app.tracing), if any traced


@dataclass(frozen=True)
class ModelLoaded:
    """A model a worker holds, ready: what it chose and measured for it."""

    served_id: str
    batch_size: int  # the largest batch it wants of this model
    runtime: str  # what runs it (MB_RUNTIME)
    memory_bytes: int  # what it costs the worker (measured growth, at least its files)
    throughput: dict[int, float] = field(default_factory=dict)  # auto: images/s per size
    name: str = ""
    version: int = 0
    skipped: tuple[tuple[str, str], ...] = ()  # runtimes that failed here, and why
    slowdown: float | None = None  # how many times slower than a skipped runtime
    dtype: str = "float32"  # the precision that computes it (MB_DTYPE=auto: chosen here)
    trials: tuple[Trial, ...] = ()  # the runtimes and precisions tried, with their figures


@dataclass(frozen=True)
class LoadModel:
    """Load ``spec`` beside the models held (verify, self-test, warm up), in a thread while
    batches go on; answered with ``LoadDone``, or ``LoadFailed`` (step ``timeout`` once
    ``timeout_s`` passed; 0: no deadline), carrying the same ``batch_id`` (every request to
    a worker is numbered from one counter, batches and these alike)."""

    batch_id: int
    spec: ModelSpec
    timeout_s: float = 0.0
    delay_s: float = 0.0  # testing only (MB_TEST_LOAD_DELAY_S): the load sleeps this long


@dataclass(frozen=True)
class LoadDone:
    batch_id: int
    model: ModelLoaded


@dataclass(frozen=True)
class LoadFailed:
    batch_id: int
    served_id: str
    step: str  # verify, load, self-test, warm-up, budget
    message: str


@dataclass(frozen=True)
class UnloadModel:
    """Drop a model and give its memory back; answered with ``ModelUnloaded``."""

    batch_id: int
    served_id: str


@dataclass(frozen=True)
class ModelUnloaded:
    batch_id: int
    served_id: str
    rss_bytes: int  # the worker's resident memory once the model's is given back


@dataclass(frozen=True)
class Ready:
    index: int
    device: str
    threads: int
    pid: int


@dataclass(frozen=True)
class StartFailed:
    index: int
    message: str


@dataclass(frozen=True)
class BatchDone:
    batch_id: int
    ids: tuple[int, ...]
    # embedding: {"embedding": [n, dim] float32}; tag: {"indices": [n, k], "probs": [n, k]};
    # embedding_and_tag: all three. Rows are the batch's items in order, less ``errors``.
    outputs: dict[str, npt.NDArray[Any]] = field(default_factory=dict)
    compute_s: float = 0.0  # time the worker spent on the batch, for metrics
    # row -> (error class name, message) for images the worker could not decode
    errors: dict[int, tuple[str, str]] = field(default_factory=dict)
    threads: int = 0  # torch threads the batch ran on
    model: str = ""  # the served id of the model that ran it (the pool checks it)

    def __reduce__(self) -> tuple[Any, ...]:
        """Pickled with its arrays as raw bytes: cheaper at both ends than numpy's own
        pickling, which goes through its reduce machinery."""
        arrays = tuple(
            (name, array.dtype.str, array.shape, array.tobytes())
            for name, array in self.outputs.items()
        )
        fields = (
            self.batch_id, self.ids, arrays, self.compute_s, self.errors, self.threads, self.model
        )  # fmt: skip
        return (_batch_done, fields)


def _batch_done(
    batch_id: int,
    ids: tuple[int, ...],
    arrays: tuple[tuple[str, str, tuple[int, ...], bytes], ...],
    compute_s: float,
    errors: dict[int, tuple[str, str]],
    threads: int,
    model: str,
) -> BatchDone:
    """A ``BatchDone`` from its pickled form (its arrays are read-only views of the bytes)."""
    outputs = {
        name: np.frombuffer(raw, dtype=dtype).reshape(shape) for name, dtype, shape, raw in arrays
    }
    return BatchDone(batch_id, ids, outputs, compute_s, errors, threads, model)


@dataclass(frozen=True)
class BatchFailed:
    batch_id: int
    ids: tuple[int, ...]
    message: str


STOP = None  # sent to a worker to make it exit cleanly
