"""Prediction service: decode off the event loop (or leave it to the workers), submit to the
Streamer, shape the answer.

Where an upload is decoded: in this process's decode threads, where that work overlaps the
batch the workers are running, or in the worker (``decode_pool`` is None: ``MB_DECODE=worker``
or a GPU). With ``idle_workers_decode`` (``MB_DECODE=auto`` on CPU) the server decodes, except
for an upload that arrives while the server is idle: there is nothing to overlap, so it goes to
the worker encoded, and the worker decodes it right before running it. That saves the
hand-off to a decode thread and back: with EfficientNet-Lite0 on 2 cores, lone requests went
from 1.15-1.19x the raw pipeline's latency to 1.13-1.15x (four alternated pairs).
"""

from __future__ import annotations

import asyncio
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass

import numpy as np
import numpy.typing as npt

from app.batching import Streamer, Trace
from app.errors import DeadlineExceeded, InvalidParameter
from app.images import preprocess
from app.jobs import ImageJob, Task, TopK
from app.manifest import Manifest


@dataclass(frozen=True)
class Tag:
    name: str
    prob: float


class Predictor:
    """What the routers call. Holds no torch: the Streamer carries jobs to the workers.

    >>> # predictor = Predictor(streamer, manifest, classes, decode_pool, max_pixels=10**7)
    >>> # (see the module docstring for ``idle_workers_decode``)
    >>> # await predictor.tag(jpeg_bytes, k=5, deadline=time.monotonic() + 30)
    >>> # [Tag(name='tabby', prob=0.61), ...]
    """

    def __init__(
        self,
        streamer: Streamer[ImageJob, object],
        manifest: Manifest,
        classes: list[str],
        decode_pool: ThreadPoolExecutor | None,
        *,
        max_pixels: int,
        idle_workers_decode: bool = False,
    ) -> None:
        self._streamer = streamer
        self.manifest = manifest
        self.classes = classes
        self._decode_pool = decode_pool
        self._max_pixels = max_pixels
        self._idle_workers_decode = idle_workers_decode

    async def _run(
        self, task: Task, data: bytes, top_k: int, deadline: float, trace: Trace | None
    ) -> object:
        # Refuse before decoding when the answer is already 503: overload answers stay fast.
        self._streamer.check_admission()
        image: npt.NDArray[np.uint8] | bytes = data
        # Left encoded, the worker decodes it (and answers a bad image).
        encoded = self._decode_pool is None or (self._idle_workers_decode and self._streamer.idle)
        if not encoded:
            image = await asyncio.get_running_loop().run_in_executor(
                self._decode_pool,
                lambda: preprocess(data, self.manifest.input, max_pixels=self._max_pixels),
            )
        remaining = deadline - time.monotonic()
        if remaining <= 0:
            raise DeadlineExceeded("the deadline passed while decoding the image")
        return await self._streamer.submit(
            ImageJob(image, top_k=top_k), key=task, timeout_s=remaining, trace=trace
        )

    async def embedding(
        self, data: bytes, deadline: float, trace: Trace | None = None
    ) -> list[float]:
        """The embedding of one encoded image, answered before ``deadline`` (monotonic)."""
        result = await self._run(Task.EMBEDDING, data, 0, deadline, trace)
        return result.tolist()  # type: ignore[attr-defined,no-any-return]

    async def tag(
        self, data: bytes, k: int, deadline: float, trace: Trace | None = None
    ) -> list[Tag]:
        """The top-``k`` classes of one encoded image, answered before ``deadline``."""
        if not 1 <= k <= len(self.classes):
            raise InvalidParameter(f"k must be between 1 and {len(self.classes)}, got {k}")
        result = await self._run(Task.TAG, data, k, deadline, trace)
        assert isinstance(result, TopK)
        return [
            Tag(self.classes[int(index)], float(prob))
            for index, prob in zip(result.indices, result.probs, strict=True)
        ]
