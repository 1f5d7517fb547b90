"""Prediction service: decode the upload where the ``DecodePlan`` says, submit it to the
Streamer, shape the answer."""

from __future__ import annotations

import asyncio
import copy
import time
from collections.abc import Awaitable, Callable, Sequence
from concurrent.futures import ThreadPoolExecutor
from contextlib import suppress
from dataclasses import dataclass

import numpy as np
import numpy.typing as npt

from app.batching import Streamer, Ticket, Trace
from app.cache import CacheUse, ResponseCache, cache_key
from app.errors import (
    ClientError,
    DeadlineExceeded,
    InvalidParameter,
    InvalidRequest,
    NoClassifier,
    NoEmbedding,
    PayloadTooLarge,
)
from app.images import check_header, preprocess
from app.jobs import BatchKey, EmbeddingAndTopK, ImageJob, Task, TopK
from app.manifest import Manifest
from app.plan import DecodePlan

# Draws a request's images from its ticket's tenant's quota (``Tenancy.charge``).
Charge = Callable[[Ticket, int], Awaitable[None]]

# An image as the services take it: encoded (an upload), or uint8 pixels at the model's
# input size, ``[crop, crop, 3]`` RGB (preprocessed by the client: v2's FP32 input).
Image = bytes | npt.NDArray[np.uint8]

DEFAULT_K = 5  # labels a tag request gets unless it asks, or every class of a smaller model
MAX_K = 1000  # the most labels a request may ask for (the Predictor refuses more than classes)


def parse_k(value: object, where: str = "k") -> int | None:
    """``k`` as the request gave it (a form field, a query parameter or a JSON value), checked
    against the API's fixed bounds; None when absent (the Predictor picks the default).

    >>> parse_k("3"), parse_k(None), parse_k(7, "parameters.k")
    (3, None, 7)
    >>> parse_k("x")
    Traceback (most recent call last):
    app.errors.InvalidRequest: k must be an integer from 1 to 1000, got 'x'
    """
    if value is None:
        return None
    k: int | None = None
    if isinstance(value, int) and not isinstance(value, bool):
        k = value
    elif isinstance(value, str):
        with suppress(ValueError):
            k = int(value)
    if k is None or not 1 <= k <= MAX_K:
        shown = value[:20] if isinstance(value, str) else value
        raise InvalidRequest(f"{where} must be an integer from 1 to {MAX_K}, got {shown!r}")
    return k


@dataclass(frozen=True)
class Tag:
    name: str
    prob: float


@dataclass(frozen=True)
class Inference:
    """What ``Predictor.infer`` answers, in image order: the outputs asked for, ``None``
    for those not asked."""

    embeddings: npt.NDArray[np.float32] | None  # [n, dim]
    top_k: list[TopK] | None


@dataclass(frozen=True, slots=True)
class _Ask:
    """One image of a request, as the Predictor runs it."""

    task: Task
    data: Image
    top_k: int
    deadline: float  # monotonic
    trace: Trace | None
    ticket: Ticket | None  # where it queues (None: the server's own work)


class Predictor:
    """What the routers call, for one model version. Holds no torch: the Streamer carries
    jobs to the workers, keyed by this version's served id (``model_id``), so its images
    never share a batch with another version's.

    ``decode_pool`` runs the decodes the plan gives this process (``None`` when it gives it
    none). An upload left encoded is decoded by its worker: its header is checked here first
    (``check_header``: not an image, a refused format, too many pixels never reach a worker);
    one whose compressed data is corrupt past a sound header its worker answers itself.

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
        max_bytes: int | None = None,
        model_id: str | None = None,
        charge: Charge | None = None,
        cache: ResponseCache | None = None,
    ) -> None:
        if (decode_pool is None) != (plan.server_threads == 0):
            raise ValueError("a decode pool is needed exactly when the plan decodes here")
        self._streamer = streamer
        self.manifest = manifest
        # What answers: the export, computed at the workers' precision (Manifest.served_id).
        self.model_id = model_id or manifest.model_id
        self.classes = classes
        self._plan = plan
        self._decode_pool = decode_pool
        self._max_pixels = max_pixels
        self._max_bytes = max_bytes  # one encoded image's bound (MAX_UPLOAD_BYTES)
        self._charge = charge  # draws a request's images from its tenant's quota
        self._cache = cache  # answers kept by content and served id (app.cache)

    def check_admission(self, ticket: Ticket | None) -> None:
        """``QueueFull`` (503) or ``Shed`` (429) now, before an upload is read, when the
        queue cannot take it and no response cache could answer it instead (a hit answers
        even when the queue is full): under overload a 10 MB upload was read whole, and held
        in memory, to be refused."""
        if self._cache is None:
            self._streamer.check_admission(ticket)

    async def _run(self, ask: _Ask, use: CacheUse | None) -> object:
        """One image's answer: from the cache when it keeps it (before admission: a hit
        answers even when the queue is full), else computed."""
        if self._cache is None:
            return await self._compute(ask)
        ticket = ask.ticket or Ticket()
        return await self._cache.answer(
            cache_key(self.model_id, ask.task, ask.top_k, ask.data),
            lambda: self._compute(ask, shared=use is None or not use.fresh),
            use,
            deadline=ask.deadline,
            level=ticket.level,
            tenant=ticket.tenant,
            patience_s=self._streamer.queue_timeout_s(ask.ticket),
        )

    async def _compute(self, ask: _Ask, shared: bool = False) -> object:
        """``ask`` computed; ``shared``: its answer is kept for identical requests, whose
        computation may answer it (broker mode: ``app.broker.worker.sharing``)."""
        data = ask.data
        # Refuse before decoding when the answer is already 503: overload answers stay fast.
        self._streamer.check_admission(ask.ticket)
        image: Image = data
        encoded = not self._plan.server_decodes and isinstance(data, bytes)
        if encoded and isinstance(data, bytes):  # its worker decodes it: checked here first
            check_header(data, max_pixels=self._max_pixels)
        if isinstance(data, bytes) and not encoded:
            decoding = asyncio.get_running_loop().run_in_executor(
                self._decode_pool,
                lambda: preprocess(data, self.manifest.input, max_pixels=self._max_pixels),
            )
            try:  # the caller's deadline holds behind a backlog of decodes too
                image = await asyncio.wait_for(decoding, ask.deadline - time.monotonic())
            except TimeoutError:
                raise DeadlineExceeded("the deadline passed while decoding the image") from None
        remaining = ask.deadline - time.monotonic()
        if remaining <= 0:
            raise DeadlineExceeded("the deadline passed while decoding the image")
        return await self._streamer.submit(
            ImageJob(image, top_k=ask.top_k, shared=shared),
            key=BatchKey(ask.task, encoded, self.model_id),
            timeout_s=remaining,
            trace=ask.trace,
            ticket=ask.ticket,
        )

    def require_classifier(self) -> None:
        """``NoClassifier`` (404) when the served model is embedding-only."""
        if not self.manifest.has_classifier:
            raise NoClassifier(
                f"the served model ({self.manifest.model_id}) has no classifier: it answers "
                "/predict/embedding only"
            )

    def require_embedding(self) -> None:
        """``NoEmbedding`` (404) when the served model answers tags only."""
        if not self.manifest.embedding_served:
            raise NoEmbedding(
                f"the served model ({self.manifest.model_id}) serves no embedding: it was "
                "imported whole, its only features are its logits; it answers /predict/tag"
            )

    async def _many(
        self,
        task: Task,
        images: Sequence[Image],
        top_k: int,
        deadline: float,
        trace: Trace | None,
        names: Sequence[str],
        ticket: Ticket | None,
        use: CacheUse | None,
    ) -> list[object]:
        """Each image's result, in order; each image travels as an item of its own, so they
        may be split over batches, queued by their ``ticket`` (its tenant's turn and its
        priority), drawn from the tenant's quota first (no ticket: the server's own work, the
        batch job). The first image that fails fails them all (the others are cancelled,
        and leave the queue): a client error names the image. ``use``: how the response
        cache answered each (``X-Cache``)."""
        if self._max_bytes is not None:  # as /predict's form bounds each upload
            for index, data in enumerate(images):
                if isinstance(data, bytes) and len(data) > self._max_bytes:
                    raise PayloadTooLarge(
                        f"image {index}: {len(data)} bytes, over MAX_UPLOAD_BYTES "
                        f"({self._max_bytes}) for one image"
                    )
        if ticket is not None and self._charge is not None:
            await self._charge(ticket, len(images))
        asks = [_Ask(task, data, top_k, deadline, trace, ticket) for data in images]
        if len(asks) == 1:
            return [await self._run(asks[0], use)]
        runs = [asyncio.ensure_future(self._run(ask, use)) for ask in asks]
        try:
            await asyncio.wait(runs, return_when=asyncio.FIRST_EXCEPTION)
            failed = [
                i
                for i, run in enumerate(runs)
                if run.done() and not run.cancelled() and run.exception()
            ]
            if failed:
                index = failed[0]
                error = runs[index].exception()
                if isinstance(error, ClientError):
                    name = names[index] if index < len(names) else ""
                    which = f"image {index}" + (f" ({name!r})" if name else "")
                    said = copy.copy(error)  # its kind, Retry-After and RateLimit headers kept
                    said.message = f"{which}: {error.message}"
                    said.args = (said.message,)
                    raise said from None
                assert error is not None
                raise error
            return [run.result() for run in runs]
        finally:
            for run in runs:
                run.cancel()
            await asyncio.gather(*runs, return_exceptions=True)

    async def embeddings(
        self,
        images: Sequence[Image],
        deadline: float,
        trace: Trace | None = None,
        names: Sequence[str] = (),
        *,
        ticket: Ticket | None = None,
        cache: CacheUse | None = None,
    ) -> npt.NDArray[np.float32]:
        """The embeddings of encoded images, ``[len(images), dim]`` float32 in order,
        answered before ``deadline`` (monotonic)."""
        self.require_embedding()
        results = await self._many(Task.EMBEDDING, images, 0, deadline, trace, names, ticket, cache)
        return np.stack([np.asarray(result, dtype=np.float32) for result in results])

    async def embedding(
        self, data: bytes, deadline: float, trace: Trace | None = None
    ) -> npt.NDArray[np.float32]:
        """The embedding of one encoded image, answered before ``deadline`` (monotonic)."""
        vector: npt.NDArray[np.float32] = (await self.embeddings([data], deadline, trace))[0]
        return vector

    def labels_to_return(self, k: int | None) -> int:
        """``k`` checked against the model's classes; ``None`` means the default, which is
        ``DEFAULT_K`` or every class of a model with fewer."""
        self.require_classifier()
        if k is None:
            return min(DEFAULT_K, len(self.classes))
        if not 1 <= k <= len(self.classes):
            raise InvalidParameter(f"k must be between 1 and {len(self.classes)}, got {k}")
        return k

    async def top_k(
        self,
        images: Sequence[Image],
        k: int | None,
        deadline: float,
        trace: Trace | None = None,
        names: Sequence[str] = (),
        *,
        ticket: Ticket | None = None,
        cache: CacheUse | None = None,
    ) -> list[TopK]:
        """The ``k`` (``None``: the default) most probable class indices of each encoded
        image, with their probabilities, in order, before ``deadline``."""
        k = self.labels_to_return(k)
        results = await self._many(Task.TAG, images, k, deadline, trace, names, ticket, cache)
        assert all(isinstance(result, TopK) for result in results)
        return results  # type: ignore[return-value]

    async def infer(
        self,
        images: Sequence[Image],
        k: int | None,
        deadline: float,
        trace: Trace | None = None,
        *,
        embedding: bool,
        top_k: bool,
        ticket: Ticket | None = None,
        cache: CacheUse | None = None,
    ) -> Inference:
        """The embeddings and/or the top ``k`` (``None``: the default) classes of encoded
        images, in order, before ``deadline``: each image runs through the model once,
        whichever are asked. ``k`` is checked before any image runs."""
        if not (embedding or top_k):
            raise ValueError("ask for the embedding, the top k, or both")
        if not top_k:
            vectors = await self.embeddings(images, deadline, trace, ticket=ticket, cache=cache)
            return Inference(vectors, None)
        if not embedding:
            tops = await self.top_k(images, k, deadline, trace, ticket=ticket, cache=cache)
            return Inference(None, tops)
        self.require_embedding()
        k = self.labels_to_return(k)
        results = await self._many(
            Task.EMBEDDING_AND_TAG, images, k, deadline, trace, (), ticket, cache
        )
        assert all(isinstance(result, EmbeddingAndTopK) for result in results)
        both: list[EmbeddingAndTopK] = results  # type: ignore[assignment]
        vectors = np.stack([np.asarray(result.embedding, dtype=np.float32) for result in both])
        return Inference(vectors, [result.top_k for result in both])

    async def tags(
        self,
        images: Sequence[Image],
        k: int | None,
        deadline: float,
        trace: Trace | None = None,
        names: Sequence[str] = (),
        *,
        ticket: Ticket | None = None,
        cache: CacheUse | None = None,
    ) -> list[list[Tag]]:
        """The top-``k`` classes of each encoded image, in order, before ``deadline``."""
        return [
            [
                Tag(self.classes[int(index)], float(prob))
                for index, prob in zip(result.indices, result.probs, strict=True)
            ]
            for result in await self.top_k(
                images, k, deadline, trace, names, ticket=ticket, cache=cache
            )
        ]

    async def tag(
        self, data: bytes, k: int | None, deadline: float, trace: Trace | None = None
    ) -> list[Tag]:
        """The top-``k`` classes of one encoded image, answered before ``deadline``."""
        return (await self.tags([data], k, deadline, trace))[0]
