"""The shared-memory buffer through which a batch's images reach one worker."""

from __future__ import annotations

import mmap
import os
import tempfile
from pathlib import Path

import numpy as np
import numpy.typing as npt

# Where RunBatch finds an encoded upload: in the buffer at (offset, length), or inline.
Spans = tuple[tuple[int, int] | None, ...]
Inline = tuple[bytes | None, ...]


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

    >>> buffer = InputBuffer.create(16)
    >>> spans, inline = buffer.pack([b"abcdefgh", b"0123456789"])
    >>> spans, inline
    (((0, 8), None), (None, b'0123456789'))
    >>> buffer.blob((0, 8))
    b'abcdefgh'
    >>> buffer.unlink(); buffer.close()
    """

    def __init__(self, path: str, size: int) -> None:
        self.path = path
        self.size = size
        with open(path, "r+b") as handle:
            self._map = mmap.mmap(handle.fileno(), size)
        self.raw: npt.NDArray[np.uint8] = np.frombuffer(self._map, dtype=np.uint8)

    @classmethod
    def create(cls, size: int) -> InputBuffer:
        # Named after the process that made it, so that a leftover says whose it was.
        prefix = f"microbatch-{os.getpid()}-"
        fd, path = tempfile.mkstemp(prefix=prefix, suffix=".buf", dir=_shm_dir(size))
        try:
            os.ftruncate(fd, size)
        finally:
            os.close(fd)
        return cls(path, size)

    def images(self, count: int, image_shape: tuple[int, int, int]) -> npt.NDArray[np.uint8]:
        """The first ``count`` images, as a ``[count, H, W, 3]`` view."""
        return self.raw[: count * int(np.prod(image_shape))].reshape(count, *image_shape)

    def pack(self, blobs: list[bytes]) -> tuple[Spans, Inline]:
        """Copy ``blobs`` in end to end; those that no longer fit travel inline instead.
        Returns ``RunBatch``'s ``spans`` and ``inline``."""
        spans: list[tuple[int, int] | None] = []
        inline: list[bytes | None] = []
        offset = 0
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
