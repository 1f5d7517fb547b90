"""Prediction service: decode the upload where the ``DecodePlan`` says, submit it to the
Streamer, shape the answer."""

from __future__ import annotations

import asyncio
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass

import numpy as np
import numpy.typing as npt

from app.batching import Streamer, Trace
from app.decode_plan import DecodePlan
from app.errors import DeadlineExceeded, InvalidParameter
from app.images import preprocess
from app.jobs import BatchKey, ImageJob, Task, TopK
from app.manifest import Manifest


@dataclass(frozen=True)
class Tag:
    name: str
    prob: float


class Predictor:
    """What the routers call. Holds no torch: the Streamer carries jobs to the workers.

    ``decode_pool`` runs the decodes the plan gives this process (``None`` when it gives it
    none). An upload left encoded is decoded by its worker, which answers a bad one itself.

    >>> # predictor = Predictor(streamer, manifest, classes, plan, decode_pool, max_pixels=10**7)
    >>> # await predictor.tag(jpeg_bytes, k=5, deadline=time.monotonic() + 30)
    >>> # [Tag(name='tabby', prob=0.61), ...]
    """

    def __init__(
        self,
        streamer: Streamer[ImageJob, object],
        manifest: Manifest,
        classes: list[str],
        plan: DecodePlan,
        decode_pool: ThreadPoolExecutor | None,
        *,
        max_pixels: int,
    ) -> None:
        if (decode_pool is None) != (plan.server_threads == 0):
            raise ValueError("a decode pool is needed exactly when the plan decodes here")
        self._streamer = streamer
        self.manifest = manifest
        self.classes = classes
        self._plan = plan
        self._decode_pool = decode_pool
        self._max_pixels = max_pixels

    async def _run(
        self, task: Task, data: bytes, top_k: int, deadline: float, trace: Trace | None
    ) -> object:
        # Refuse before decoding when the answer is already 503: overload answers stay fast.
        self._streamer.check_admission()
        image: npt.NDArray[np.uint8] | bytes = data
        encoded = not self._plan.server_decodes(idle=self._streamer.idle)
        if not encoded:
            image = await asyncio.get_running_loop().run_in_executor(
                self._decode_pool,
                lambda: preprocess(data, self.manifest.input, max_pixels=self._max_pixels),
            )
        remaining = deadline - time.monotonic()
        if remaining <= 0:
            raise DeadlineExceeded("the deadline passed while decoding the image")
        return await self._streamer.submit(
            ImageJob(image, top_k=top_k),
            key=BatchKey(task, encoded),
            timeout_s=remaining,
            trace=trace,
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
