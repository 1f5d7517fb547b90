"""Prediction service: decode off the event loop, submit to the Streamer, shape the answer."""

from __future__ import annotations

import asyncio
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass

from app.batching import Streamer
from app.errors import InvalidParameter
from app.jobs import ImageJob, Task, TopK
from app.manifest import Manifest
from app.services.images import preprocess


@dataclass(frozen=True)
class Tag:
    name: str
    prob: float


class Predictor:
    """What the routers call. Holds no torch: the Streamer carries jobs to the workers.

    >>> # predictor = Predictor(streamer, manifest, classes, decode_pool, timeout_s=30)
    >>> # await predictor.tag(jpeg_bytes, k=5) -> [Tag(name='tabby', prob=0.61), ...]
    """

    def __init__(
        self,
        streamer: Streamer[ImageJob, object],
        manifest: Manifest,
        classes: list[str],
        decode_pool: ThreadPoolExecutor,
        *,
        max_pixels: int,
    ) -> None:
        self._streamer = streamer
        self.manifest = manifest
        self.classes = classes
        self._decode_pool = decode_pool
        self._max_pixels = max_pixels

    async def _pixels(self, data: bytes) -> ImageJob:
        loop = asyncio.get_running_loop()
        pixels = await loop.run_in_executor(
            self._decode_pool,
            lambda: preprocess(data, self.manifest.input, max_pixels=self._max_pixels),
        )
        return ImageJob(pixels)

    async def embedding(self, data: bytes) -> list[float]:
        job = await self._pixels(data)
        result = await self._streamer.submit(job, key=Task.EMBEDDING)
        return result.tolist()  # type: ignore[attr-defined,no-any-return]

    async def tag(self, data: bytes, k: int) -> list[Tag]:
        if not 1 <= k <= len(self.classes):
            raise InvalidParameter(f"k must be between 1 and {len(self.classes)}, got {k}")
        job = await self._pixels(data)
        result = await self._streamer.submit(ImageJob(job.pixels, top_k=k), key=Task.TAG)
        assert isinstance(result, TopK)
        return [
            Tag(self.classes[int(index)], float(prob))
            for index, prob in zip(result.indices, result.probs, strict=True)
        ]
