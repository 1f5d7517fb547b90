"""Where the Predictor decodes an upload (in its decode threads, or not at all: the worker
decodes), as its DecodePlan says, and how it keys the batch the upload joins."""

from __future__ import annotations

import asyncio
import time
from concurrent.futures import ThreadPoolExecutor
from typing import Any

import numpy as np
import pytest

from app.errors import (
    DeadlineExceeded,
    InvalidImage,
    InvalidParameter,
    PayloadTooLarge,
    UnsupportedImageFormat,
)
from app.jobs import BatchKey, EmbeddingAndTopK, ImageJob, Task, TopK
from app.manifest import FileEntry, Manifest
from app.plan import DecodePlan
from app.services.predictor import Predictor
from tests.unit.test_images import SPEC, encode, gradient

SERVER = DecodePlan(server_threads=1, worker_threads=0)
WORKERS = DecodePlan(server_threads=0, worker_threads=1)


class FakeStreamer:
    """Records what is submitted, and under which key."""

    def __init__(self) -> None:
        self.submitted: list[tuple[ImageJob, Any]] = []

    def check_admission(self, ticket: object = None) -> None:
        pass

    async def submit(self, job: ImageJob, *, key: Any, **_: Any) -> object:
        self.submitted.append((job, key))
        embedding = np.full(4, len(self.submitted), dtype=np.float32)
        top = TopK(np.arange(job.top_k), np.full(job.top_k, 0.1, dtype=np.float32))
        answers = {
            Task.EMBEDDING: embedding,
            Task.TAG: top,
            Task.EMBEDDING_AND_TAG: EmbeddingAndTopK(embedding, top),
        }
        return answers[key.task]


def _predictor(
    streamer: FakeStreamer,
    plan: DecodePlan,
    pool: ThreadPoolExecutor | None,
    max_bytes: int | None = None,
) -> Predictor:
    entry = FileEntry(path="unused", sha256="0" * 64)
    manifest = Manifest(
        arch="tiny",
        weights="random",
        input=SPEC,
        embedding_dim=4,
        num_classes=10,
        files={"embedding": entry, "classifier": entry, "classes": entry},
    )
    return Predictor(
        streamer,  # type: ignore[arg-type]
        manifest,
        [str(i) for i in range(10)],
        plan,
        pool,
        max_pixels=10**6,
        max_bytes=max_bytes,
    )


@pytest.mark.parametrize(("plan", "decoded"), [(SERVER, True), (WORKERS, False)])
def test_where_the_predictor_decodes(plan: DecodePlan, decoded: bool) -> None:
    upload = encode(gradient(48, 40), "PNG")
    streamer = FakeStreamer()
    with ThreadPoolExecutor(1) as pool:
        predictor = _predictor(streamer, plan, pool if plan.server_threads else None)
        asyncio.run(predictor.embedding(upload, time.monotonic() + 10))
    ((job, key),) = streamer.submitted
    # Decoded and encoded images never share a batch: the key tells them apart.
    assert key == BatchKey(Task.EMBEDDING, not decoded, predictor.model_id)
    if decoded:
        assert isinstance(job.image, np.ndarray) and job.image.shape == (32, 32, 3)
    else:
        assert job.image == upload


def test_a_bad_upload_decoded_here_is_refused_before_it_is_queued() -> None:
    streamer = FakeStreamer()
    with ThreadPoolExecutor(1) as pool:
        predictor = _predictor(streamer, SERVER, pool)
        with pytest.raises(InvalidImage):
            asyncio.run(predictor.embedding(b"not an image", time.monotonic() + 10))
    assert streamer.submitted == []


def _jpeg(width: int, height: int) -> bytes:
    return encode(gradient(width, height), "JPEG")


@pytest.mark.parametrize(
    ("upload", "error"),
    [
        (b"not an image", InvalidImage),
        (b"", InvalidImage),
        (b"\xff\xd8\xff\xe0 a JPEG's first bytes, then nothing", InvalidImage),
        (b"II*\x00" + bytes(60), UnsupportedImageFormat),  # TIFF: not on the allowlist
        (_jpeg(1200, 1000), PayloadTooLarge),  # a JPEG over max_pixels (10**6)
        (encode(gradient(1200, 1000), "PNG"), PayloadTooLarge),
    ],
    ids=["text", "empty", "jpeg-header-only", "tiff", "jpeg-too-many-pixels", "png-too-many"],
)
def test_an_upload_a_worker_would_decode_is_checked_before_it_is_queued(
    upload: bytes, error: type[Exception]
) -> None:
    """RELIABILITY.md: a file that is not an image never reaches a worker (where it took a
    batch's place before its 400), with the 4xx the worker's own decode would give."""
    streamer = FakeStreamer()
    predictor = _predictor(streamer, WORKERS, None)
    with pytest.raises(error):
        asyncio.run(predictor.tags([upload], 5, time.monotonic() + 10))
    assert streamer.submitted == []


def test_an_upload_with_a_sound_header_goes_to_its_worker_to_be_decoded() -> None:
    """Only decoding finds corrupt data past a sound header: that is the worker's (alone)."""
    streamer = FakeStreamer()
    predictor = _predictor(streamer, WORKERS, None)
    good = _jpeg(64, 48)
    corrupt = good[: len(good) // 2] + bytes(len(good) // 2)
    for upload in (good, corrupt):
        asyncio.run(predictor.tags([upload], 5, time.monotonic() + 10))
    assert [job.image for job, _ in streamer.submitted] == [good, corrupt]


def test_a_decode_here_answers_by_the_deadline_behind_a_backlog(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """MB_DECODE=server: two uploads behind one decode thread, each decode 0.5 s, each
    caller's deadline 0.2 s away: both get 504 by their deadline (they waited for the whole
    backlog: 0.5 and 1.0 s)."""
    import app.services.predictor as predictor_module

    def slow(data: bytes, spec: object, **_: object) -> np.ndarray:
        time.sleep(0.5)
        return np.zeros((32, 32, 3), np.uint8)

    monkeypatch.setattr(predictor_module, "preprocess", slow)
    streamer = FakeStreamer()

    async def both(predictor: Predictor) -> list[object]:
        deadline = time.monotonic() + 0.2
        calls = [predictor.embedding(b"jpeg", deadline) for _ in range(2)]
        return await asyncio.gather(*calls, return_exceptions=True)

    with ThreadPoolExecutor(1) as pool:
        started = time.monotonic()
        answers = asyncio.run(both(_predictor(streamer, SERVER, pool)))
        took = time.monotonic() - started
    assert all(isinstance(answer, DeadlineExceeded) for answer in answers), answers
    assert took < 0.45 and streamer.submitted == []


def test_an_image_over_the_upload_limit_is_413_before_it_is_queued() -> None:
    """A regression: a v2 body may be a little over MAX_UPLOAD_BYTES (its JSON or binary
    framing), and so one image in it; a broker worker dropped that entry as malformed, with
    no answer: the caller waited for its 504."""
    streamer = FakeStreamer()
    predictor = _predictor(streamer, WORKERS, None, max_bytes=1000)
    with pytest.raises(PayloadTooLarge, match="image 1: 1001 bytes"):
        asyncio.run(predictor.embeddings([b"x" * 1000, b"x" * 1001], time.monotonic() + 10))
    assert streamer.submitted == []


def test_a_decode_pool_comes_with_a_plan_that_decodes_here() -> None:
    with ThreadPoolExecutor(1) as pool, pytest.raises(ValueError, match="decode pool"):
        _predictor(FakeStreamer(), WORKERS, pool)
    with pytest.raises(ValueError, match="decode pool"):
        _predictor(FakeStreamer(), SERVER, None)


@pytest.mark.parametrize(
    ("embedding", "top_k", "task"),
    [
        (True, False, Task.EMBEDDING),
        (False, True, Task.TAG),
        (True, True, Task.EMBEDDING_AND_TAG),  # one model pass for both
    ],
)
def test_infer_runs_each_image_once_as_one_task(embedding: bool, top_k: bool, task: Task) -> None:
    streamer = FakeStreamer()
    predictor = _predictor(streamer, WORKERS, None)
    uploads = [_jpeg(width, 32) for width in (30, 40, 50)]
    inferred = asyncio.run(
        predictor.infer(uploads, None, time.monotonic() + 10, embedding=embedding, top_k=top_k)
    )
    assert [key for _, key in streamer.submitted] == [BatchKey(task, True, predictor.model_id)] * 3
    assert sorted(job.image for job, _ in streamer.submitted) == sorted(uploads)
    if embedding:
        assert inferred.embeddings is not None and inferred.embeddings.shape == (3, 4)
    else:
        assert inferred.embeddings is None
    if top_k:
        assert inferred.top_k is not None and len(inferred.top_k) == 3
        assert all(job.top_k == 5 for job, _ in streamer.submitted)  # the default k
        assert [len(top.indices) for top in inferred.top_k] == [5, 5, 5]
    else:
        assert inferred.top_k is None


@pytest.mark.parametrize("embedding", [True, False])
def test_infer_refuses_k_above_the_classes_before_any_image_runs(embedding: bool) -> None:
    streamer = FakeStreamer()
    predictor = _predictor(streamer, WORKERS, None)
    with pytest.raises(InvalidParameter, match="between 1 and 10, got 11"):
        asyncio.run(
            predictor.infer([b"x"], 11, time.monotonic() + 10, embedding=embedding, top_k=True)
        )
    assert streamer.submitted == []


def test_an_image_of_several_shed_keeps_its_kind_and_retry_after() -> None:
    """Found by a review: the refusal of one image of a request of several was rebuilt with
    its message alone, and lost its Retry-After (1 s instead) and its RateLimit headers."""
    from app.errors import Shed

    first, second = _jpeg(30, 32), _jpeg(40, 32)

    class Shedding(FakeStreamer):
        async def submit(self, job: ImageJob, *, key: Any, **_: Any) -> object:
            if job.image == second:
                raise Shed("priority 2 is full", retry_after_s=7)
            return await super().submit(job, key=key)

    predictor = _predictor(Shedding(), WORKERS, None)
    with pytest.raises(Shed) as shed:
        asyncio.run(
            predictor.infer(
                [first, second], None, time.monotonic() + 10, embedding=True, top_k=False
            )
        )
    assert shed.value.retry_after_s == 7
    assert shed.value.message.startswith("image 1") and "priority 2 is full" in shed.value.message
