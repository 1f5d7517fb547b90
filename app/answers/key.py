"""The cache key: everything an answer depends on, and nothing else."""

from __future__ import annotations

import hashlib

import numpy as np
import numpy.typing as npt

from app.jobs import Task

KEY_VERSION = b"k1"  # bump when what the key covers changes: old entries then never match


def cache_key(
    served_id: str, task: Task, top_k: int, image: bytes | npt.NDArray[np.uint8]
) -> bytes:
    """SHA-256 (32 bytes) of what an image's answer depends on: the served id (the export
    and its precision: a rollout or a rollback changes it, so no entry outlives its model),
    the task, the labels asked (``top_k``; 0 for an embedding) and the image as it reaches
    the model: the upload's bytes, or (a v2 client's FP32 input) the pixels it was turned
    into, with their shape. The fields are separated by NUL, which none of them holds, so
    no two different requests share a key.

    >>> a = cache_key("m@1", Task.TAG, 5, b"jpeg")
    >>> a == cache_key("m@1", Task.TAG, 5, b"jpeg"), a == cache_key("m@1", Task.TAG, 3, b"jpeg")
    (True, False)
    >>> a == cache_key("m@1", Task.EMBEDDING_AND_TAG, 5, b"jpeg"), len(a)
    (False, 32)
    """
    if isinstance(image, bytes):
        kind, data = b"encoded", image
    else:
        pixels = np.ascontiguousarray(image, dtype=np.uint8)
        kind = ("u8:" + "x".join(map(str, pixels.shape))).encode()
        data = pixels.data  # type: ignore[assignment]
    digest = hashlib.sha256(
        b"\0".join((KEY_VERSION, served_id.encode(), task.value.encode(), b"%d" % top_k, kind))
        + b"\0"
    )
    digest.update(data)
    return digest.digest()
