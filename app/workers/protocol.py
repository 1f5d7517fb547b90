"""Messages between the pool (main process) and a worker process, and the shared input buffer.

Images never go through the pipe: the pool writes each batch into a buffer mapped by both
processes (one per worker; a worker runs one batch at a time), as uint8 pixels or, when the
workers decode, as the encoded uploads. Only these small messages are pickled (plus any upload
that did not fit in the buffer). Results come back in the reply (a few KB of float32).
"""

from __future__ import annotations

import asyncio
import mmap
import os
import pickle
import socket
import struct
import tempfile
from dataclasses import dataclass, field
from multiprocessing.connection import Connection
from multiprocessing.reduction import ForkingPickler
from pathlib import Path
from typing import Any

import numpy as np
import numpy.typing as npt

from app.jobs import Task


@dataclass(frozen=True)
class WorkerSpec:
    """Everything a worker needs to start, picklable for ``spawn``."""

    index: int
    device: str
    threads: int
    model_store: str
    buffer_path: str
    buffer_size: int
    max_batch_size: int
    image_shape: tuple[int, int, int]
    auto_batch: bool = False  # measure throughput per batch size and pick the knee
    dtype: str = "float32"
    optimize: bool = True
    decode_threads: int = 0  # > 0: batches arrive encoded and this many threads decode them
    decode_on_device: bool = False  # JPEGs are decoded on ``device`` (MB_DECODE=device)
    max_pixels: int = 40_000_000  # the largest image a worker decodes


@dataclass(frozen=True)
class RunBatch:
    """Run ``ids`` (one batch, in order). Decoded images sit in the buffer as pixel rows;
    encoded ones as bytes at ``spans[row] = (offset, length)``, or inline in ``inline[row]``
    when the buffer had no room left (``spans[row]`` is then ``None``). No ``spans``: every
    row is pixels; a row with neither a span nor inline bytes is pixels too."""

    batch_id: int
    task: Task
    ids: tuple[int, ...]
    top_k: int = 0
    spans: tuple[tuple[int, int] | None, ...] = ()
    inline: tuple[bytes | None, ...] = ()
    threads: int = 0  # torch threads for this batch (its own plus any lent); 0: unchanged


@dataclass(frozen=True)
class Ready:
    index: int
    device: str
    threads: int
    pid: int
    batch_size: int  # the largest batch this worker wants (its auto choice, or the maximum)
    throughput: dict[int, float] = field(default_factory=dict)  # auto: images/s per size


@dataclass(frozen=True)
class StartFailed:
    index: int
    message: str


@dataclass(frozen=True)
class BatchDone:
    batch_id: int
    ids: tuple[int, ...]
    # embedding: {"embedding": [n, dim] float32}; tag: {"indices": [n, k], "probs": [n, k]}
    # Rows are the batch's items in order, less those in ``errors``.
    outputs: dict[str, npt.NDArray[Any]] = field(default_factory=dict)
    compute_s: float = 0.0  # time the worker spent on the batch, for metrics
    # row -> (error class name, message) for images the worker could not decode
    errors: dict[int, tuple[str, str]] = field(default_factory=dict)
    threads: int = 0  # torch threads the batch ran on

    def __reduce__(self) -> tuple[Any, ...]:
        """Pickled with its arrays as raw bytes. numpy's own pickling, through its reduce
        machinery, took about 0.1 ms more per reply (pickling in the worker, unpickling in
        the server) in processes whose caches the model had just flushed: traced with lone
        EfficientNet-Lite0 requests."""
        arrays = tuple(
            (name, array.dtype.str, array.shape, array.tobytes())
            for name, array in self.outputs.items()
        )
        fields = (self.batch_id, self.ids, arrays, self.compute_s, self.errors, self.threads)
        return (_batch_done, fields)


def _batch_done(
    batch_id: int,
    ids: tuple[int, ...],
    arrays: tuple[tuple[str, str, tuple[int, ...], bytes], ...],
    compute_s: float,
    errors: dict[int, tuple[str, str]],
    threads: int,
) -> BatchDone:
    """A ``BatchDone`` from its pickled form (its arrays are read-only views of the bytes)."""
    outputs = {
        name: np.frombuffer(raw, dtype=dtype).reshape(shape) for name, dtype, shape, raw in arrays
    }
    return BatchDone(batch_id, ids, outputs, compute_s, errors, threads)


@dataclass(frozen=True)
class BatchFailed:
    batch_id: int
    ids: tuple[int, ...]
    message: str


STOP = None  # sent to a worker to make it exit cleanly


class Channel:
    """The pool's end of a worker's socket pair, on asyncio streams.

    Reading a message never blocks the event loop, whatever the loop does to the socket's
    blocking mode (uvloop makes sockets it watches non-blocking, which breaks
    ``Connection.recv`` on large messages). The framing is ``multiprocessing.Connection``'s,
    so the worker keeps a plain blocking ``Connection`` on its end.
    """

    def __init__(self, sock: socket.socket) -> None:
        self._sock = sock
        self._reader: asyncio.StreamReader | None = None
        self._writer: asyncio.StreamWriter | None = None

    async def open(self) -> None:
        if self._reader is None:
            self._reader, self._writer = await asyncio.open_connection(sock=self._sock)

    async def recv(self) -> object:
        """The next message; ``asyncio.IncompleteReadError`` once the worker is gone."""
        assert self._reader is not None, "open() first"
        (size,) = struct.unpack("!i", await self._reader.readexactly(4))
        if size == -1:
            (size,) = struct.unpack("!Q", await self._reader.readexactly(8))
        return pickle.loads(await self._reader.readexactly(size))

    def send(self, message: object) -> None:
        """Queue ``message`` for the worker (buffered by the transport: never blocks)."""
        assert self._writer is not None, "open() first"
        payload = bytes(ForkingPickler.dumps(message))
        if len(payload) > 0x7FFFFFFF:
            header = struct.pack("!iQ", -1, len(payload))
        else:
            header = struct.pack("!i", len(payload))
        self._writer.write(header + payload)

    def close(self) -> None:
        if self._writer is not None:
            self._writer.close()
        else:
            self._sock.close()


def channel_pair() -> tuple[Channel, Connection]:
    """A connected (pool channel, worker connection) pair; the connection goes to the
    worker process (spawn passes its file descriptor along)."""
    parent, child = socket.socketpair()
    return Channel(parent), Connection(child.detach())


def _shm_dir(size: int) -> str | None:
    """/dev/shm when it has room (containers often cap it at 64 MB), else the temp dir:
    writing past a full tmpfs would kill the process with SIGBUS instead of an error."""
    try:
        stats = os.statvfs("/dev/shm")
    except OSError:
        return None
    return "/dev/shm" if stats.f_bavail * stats.f_frsize >= 2 * size else None


class InputBuffer:
    """A file-backed buffer of ``size`` bytes shared by the pool and one worker: a batch's
    uint8 pixels (``images``) or its encoded uploads packed end to end (``pack``).

    The creator (the pool) unlinks the file once the worker has mapped it, so nothing is left
    behind even if a process is killed.
    """

    def __init__(self, path: str, size: int) -> None:
        self.path = path
        self.size = size
        with open(path, "r+b") as handle:
            self._map = mmap.mmap(handle.fileno(), size)
        self.raw: npt.NDArray[np.uint8] = np.frombuffer(self._map, dtype=np.uint8)

    @classmethod
    def create(cls, size: int) -> InputBuffer:
        fd, path = tempfile.mkstemp(prefix="microbatch-", suffix=".buf", dir=_shm_dir(size))
        try:
            os.ftruncate(fd, size)
        finally:
            os.close(fd)
        return cls(path, size)

    def images(self, count: int, image_shape: tuple[int, int, int]) -> npt.NDArray[np.uint8]:
        """The first ``count`` images, as a ``[count, H, W, 3]`` view."""
        return self.raw[: count * int(np.prod(image_shape))].reshape(count, *image_shape)

    def pack(
        self, blobs: list[bytes], start: int = 0
    ) -> tuple[tuple[tuple[int, int] | None, ...], tuple[bytes | None, ...]]:
        """Copy ``blobs`` in end to end from ``start``; those that no longer fit travel inline
        instead. Returns ``RunBatch``'s ``spans`` and ``inline``."""
        spans: list[tuple[int, int] | None] = []
        inline: list[bytes | None] = []
        offset = start
        for blob in blobs:
            if offset + len(blob) <= self.size:
                self.raw[offset : offset + len(blob)] = np.frombuffer(blob, dtype=np.uint8)
                spans.append((offset, len(blob)))
                inline.append(None)
                offset += len(blob)
            else:
                spans.append(None)
                inline.append(blob)
        return tuple(spans), tuple(inline)

    def blob(self, span: tuple[int, int]) -> bytes:
        offset, length = span
        return self._map[offset : offset + length]

    def unlink(self) -> None:
        Path(self.path).unlink(missing_ok=True)

    def close(self) -> None:
        """Unmap the buffer (idempotent)."""
        if not self._map.closed:
            del self.raw
            self._map.close()
