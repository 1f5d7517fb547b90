"""Where uploads are decoded (MB_DECODE), without processes: packing uploads into the shared
buffer, batches that mix decoded and encoded images, decoding a batch with per-image errors,
and turning those errors back into typed ones."""

from __future__ import annotations

import asyncio
import os
import time
from collections.abc import Iterator
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import numpy as np
import numpy.typing as npt
import pytest
from PIL import Image

from app.batching import BatchItem
from app.errors import InferenceError, InvalidImage, PayloadTooLarge, UnsupportedImageFormat
from app.jobs import ImageJob, Task
from app.manifest import Manifest
from app.workers.decoding import Decoder
from app.workers.pool import (
    ENCODED_BYTES_PER_IMAGE,
    LEND_AFTER_IDLE_S,
    WorkerPool,
    _image_error,
    _wait_for_exit,
    _Worker,
)
from app.workers.process import _batch_pixels
from app.workers.protocol import InputBuffer, RunBatch, WorkerSpec
from tests.unit.test_images import SPEC, encode, gradient


@pytest.fixture
def buffer() -> Iterator[InputBuffer]:
    created = InputBuffer.create(100)
    yield created
    created.unlink()
    created.close()


def test_pack_fills_the_buffer_in_order_and_sends_the_rest_inline(buffer: InputBuffer) -> None:
    blobs = [b"a" * 60, b"b" * 60, b"c" * 40, b"d"]
    spans, inline = buffer.pack(blobs)
    assert spans == ((0, 60), None, (60, 40), None)
    assert inline == (None, b"b" * 60, None, b"d")
    assert [buffer.blob(s) if s else i for s, i in zip(spans, inline, strict=True)] == blobs


@pytest.mark.parametrize("threads", [1, 3])
def test_decoder_writes_good_rows_in_order_and_reports_each_bad_one(threads: int) -> None:
    good = [encode(gradient(80 + 8 * i, 60), "PNG") for i in range(3)]
    tiff = encode(gradient(), "TIFF")
    blobs = [good[0], b"not an image", good[1], tiff, good[2][:40]]
    out, errors = Decoder(SPEC, threads, max_pixels=10**6).decode(blobs)
    assert len(out) == 2
    assert {pos: name for pos, (name, _) in errors.items()} == {
        1: "InvalidImage",
        3: "UnsupportedImageFormat",
        4: "InvalidImage",
    }
    assert "TIFF" in errors[3][1]
    expected = Decoder(SPEC, 1, max_pixels=10**6)
    for row, blob in enumerate(good[:2]):
        single, _ = expected.decode([blob])
        assert np.array_equal(out[row], single[0])


def test_decoder_enforces_the_pixel_limit() -> None:
    big = encode(Image.new("RGB", (200, 200)), "PNG")
    out, errors = Decoder(SPEC, 1, max_pixels=10_000).decode([big])
    assert len(out) == 0 and errors[0][0] == "PayloadTooLarge"


def test_encoded_batch_is_read_from_the_buffer_and_inline() -> None:
    small = encode(gradient(40, 40), "PNG")
    buffer = InputBuffer.create(len(small) + 10)  # the second upload cannot fit
    try:
        spans, inline = buffer.pack([small, small])
        assert spans == ((0, len(small)), None)
        message = RunBatch(0, Task.EMBEDDING, (7, 8), 0, spans, inline)
        decoder = Decoder(SPEC, 1, max_pixels=10**6)
        pixels, errors = _batch_pixels(message, buffer, decoder, (32, 32, 3))
        assert errors == {} and pixels.shape == (2, 32, 32, 3)
        assert pixels[0].any() and np.array_equal(pixels[0], pixels[1])
    finally:
        buffer.unlink()
        buffer.close()


@pytest.mark.parametrize(
    ("name", "expected"),
    [
        ("InvalidImage", InvalidImage),
        ("UnsupportedImageFormat", UnsupportedImageFormat),
        ("PayloadTooLarge", PayloadTooLarge),
        ("InferenceError", InferenceError),
        ("SystemExit", InferenceError),  # nothing but the image errors is rebuilt by name
    ],
)
def test_worker_image_errors_come_back_typed(name: str, expected: type) -> None:
    error = _image_error(name, "the message")
    assert type(error) is expected
    if expected is not InferenceError:
        assert str(error) == "the message"


def _pool(monkeypatch: pytest.MonkeyPatch, gpus: int, **options: Any) -> WorkerPool:
    monkeypatch.setattr("app.workers.pool.cuda_device_count", lambda: gpus)
    monkeypatch.setattr("os.cpu_count", lambda: 16)
    manifest = Manifest(
        arch="tiny",
        weights="random",
        input=SPEC,
        embedding_dim=4,
        num_classes=10,
        files={},
    )
    return WorkerPool(
        model_store=Path("unused"),
        manifest=manifest,
        devices=None,
        worker_num=options.pop("worker_num", None),
        threads_per_worker=options.pop("threads", None),
        max_batch_size=8,
        start_timeout_s=1,
        **options,
    )


class _UnstartedProcess:
    """Stands in for a worker process: ``_spawn`` builds everything but starts nothing."""

    def __init__(self, target: object, args: tuple[WorkerSpec, Any], **_: object) -> None:
        self.spec = args[0]

    def start(self) -> None:
        pass


@pytest.mark.parametrize(
    ("decode", "gpus", "in_workers", "can_decode", "on_device"),
    [
        ("auto", 0, False, True, False),  # the server decodes, an idle worker may too
        ("auto", 2, True, True, False),
        ("server", 0, False, False, False),
        ("server", 2, False, False, False),
        ("worker", 0, True, True, False),
        ("device", 0, True, True, True),
        ("device", 2, True, True, True),
    ],
)
def test_where_uploads_are_decoded(
    monkeypatch: pytest.MonkeyPatch,
    decode: str,
    gpus: int,
    in_workers: bool,
    can_decode: bool,
    on_device: bool,
) -> None:
    pool = _pool(monkeypatch, gpus, decode=decode)
    assert pool.decode_in_workers is in_workers
    assert pool.workers_can_decode is can_decode
    context = SimpleNamespace(Process=_UnstartedProcess)
    monkeypatch.setattr("app.workers.pool.mp.get_context", lambda _: context)
    worker = pool._spawn(0, pool.assigned_devices()[0], 1)
    worker.conn.close()
    worker.buffer.unlink()
    worker.buffer.close()
    assert (worker.spec.decode_threads > 0) is can_decode
    assert worker.spec.decode_on_device is on_device
    if can_decode:  # room for a batch of typical uploads, not only for their pixels
        assert worker.spec.buffer_size >= pool.max_batch_size * ENCODED_BYTES_PER_IMAGE


def _items(*images: npt.NDArray[np.uint8] | bytes) -> list[BatchItem[ImageJob]]:
    return [BatchItem(100 + row, ImageJob(image)) for row, image in enumerate(images)]


@pytest.mark.parametrize("buffer_size", [10**6, 32 * 32 * 3 * 5 + 10])  # roomy; pixels only
def test_a_batch_mixing_pixels_and_uploads_reaches_the_model_in_order(
    monkeypatch: pytest.MonkeyPatch, buffer_size: int
) -> None:
    """With ``auto`` on CPU an upload that reached an idle server travels encoded, and may
    share its batch with uploads the server decoded: each row keeps its place, a bad upload
    drops out with its error, and uploads the buffer has no room for travel inline."""
    pool = _pool(monkeypatch, 0, decode="auto")
    decoder = Decoder(SPEC, 1, max_pixels=10**6)
    uploads = [encode(gradient(40 + 8 * i, 30), "PNG") for i in range(2)]
    decoded = [decoder.decode([upload])[0][0].copy() for upload in uploads]
    rng = np.random.default_rng(0)
    pixels = [rng.integers(0, 256, pool.image_shape, dtype=np.uint8) for _ in range(2)]
    items = _items(pixels[0], uploads[0], pixels[1], b"not an image", uploads[1])
    buffer = InputBuffer.create(buffer_size)
    try:
        message = pool._write_batch(buffer, 1, Task.TAG, (1, 2, 3, 4, 5), 5, 0, items)
        sources = zip(message.spans, message.inline, strict=True)
        pixel_rows = [span is None and inline is None for span, inline in sources]
        assert pixel_rows == [True, False, True, False, False]
        rows, errors = _batch_pixels(message, buffer, decoder, pool.image_shape)
    finally:
        buffer.unlink()
        buffer.close()
    assert {row: name for row, (name, _) in errors.items()} == {3: "InvalidImage"}
    expected = [pixels[0], decoded[0], pixels[1], decoded[1]]
    assert rows.shape == (4, *pool.image_shape)
    for row, want in enumerate(expected):
        assert np.array_equal(rows[row], want), row


def test_batches_of_one_kind_travel_as_before(monkeypatch: pytest.MonkeyPatch) -> None:
    pool = _pool(monkeypatch, 0, decode="auto")
    upload = encode(gradient(40, 30), "PNG")
    pixels = np.full(pool.image_shape, 7, dtype=np.uint8)
    buffer = InputBuffer.create(10**5)
    try:
        decoded = pool._write_batch(buffer, 1, Task.TAG, (1, 2), 5, 0, _items(pixels, pixels))
        assert decoded.spans == ()
        assert np.array_equal(buffer.images(2, pool.image_shape)[1], pixels)
        encoded = pool._write_batch(buffer, 2, Task.TAG, (1, 2), 5, 0, _items(upload, upload))
        assert encoded.spans == ((0, len(upload)), (len(upload), len(upload)))
    finally:
        buffer.unlink()
        buffer.close()


def test_workers_that_do_not_decode_refuse_an_upload(monkeypatch: pytest.MonkeyPatch) -> None:
    pool = _pool(monkeypatch, 0, decode="server")
    buffer = InputBuffer.create(10**5)
    try:
        with pytest.raises(TypeError, match="do not decode"):
            pool._write_batch(buffer, 1, Task.TAG, (1,), 5, 0, _items(b"jpeg bytes"))
        message = RunBatch(1, Task.TAG, (1,), 5, ((0, 4),), (None,))
        with pytest.raises(RuntimeError, match="does not decode"):
            _batch_pixels(message, buffer, None, (8, 8, 3))
    finally:
        buffer.unlink()
        buffer.close()


def test_decode_threads_per_worker(monkeypatch: pytest.MonkeyPatch) -> None:
    cpu = _pool(monkeypatch, 0, decode="worker", worker_num=4)
    assert cpu._decode_threads_for("cpu", 4) == 4  # the worker's own torch threads (16 / 4)
    gpu = _pool(monkeypatch, 2, decode="auto", worker_num=4)
    assert gpu._threads_for("cuda:0", 4) == 1
    assert gpu._decode_threads_for("cuda:0", 4) == 4  # the cores, shared by the workers
    fixed = _pool(monkeypatch, 2, decode="worker", decode_threads=3)
    assert fixed._decode_threads_for("cuda:1", 2) == 3
    server = _pool(monkeypatch, 0, decode="server")
    assert server._decode_threads_for("cpu", 1) == 0  # batches arrive decoded


def test_only_workers_idle_for_a_while_lend_their_threads(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    pool = _pool(monkeypatch, 0)

    def worker(index: int, device: str, idle_for: float, busy: bool = False) -> _Worker:
        spec = WorkerSpec(index, device, 2, "unused", "unused", 0, 8, (8, 8, 3))
        w = _Worker(spec, process=None, conn=None, buffer=None)  # type: ignore[arg-type]
        w.ready, w.idle_since = True, time.monotonic() - idle_for
        w.pending = object() if busy else None  # type: ignore[assignment]
        return w

    def threads(*others: _Worker) -> int:
        runner = worker(0, "cpu", 0.0)
        pool._workers = [runner, *others]
        return pool._batch_threads(runner)

    long_idle = 10 * LEND_AFTER_IDLE_S
    assert threads(worker(1, "cpu", long_idle)) == 4
    assert threads(worker(1, "cpu", long_idle), worker(2, "cpu", long_idle)) == 6
    # Idle only between two batches (under load), busy, or a GPU worker: nothing to lend.
    assert threads(worker(1, "cpu", 0.0)) == 2
    assert threads(worker(1, "cpu", long_idle, busy=True)) == 2
    assert threads(worker(1, "cuda:0", long_idle)) == 2


def test_waiting_for_a_worker_to_exit_outlasts_its_sentinel() -> None:
    """A process closes its sentinel while it exits, a moment before it can be reaped: the
    pool must not take it for one that did not stop (and kill it)."""
    read_end, write_end = os.pipe()

    class Exiting:
        sentinel = read_end
        closed = False  # the sentinel's write end, as at exit
        polls_after_close = 3  # then it can be reaped

        def is_alive(self) -> bool:
            if self.closed:
                self.polls_after_close = max(0, self.polls_after_close - 1)
            return self.polls_after_close > 0

        def close_sentinel(self) -> None:
            os.close(write_end)
            self.closed = True

    async def scenario() -> float:
        process = Exiting()
        loop = asyncio.get_running_loop()
        loop.call_later(0.01, process.close_sentinel)
        started = loop.time()
        await _wait_for_exit(process, 5.0)  # type: ignore[arg-type]
        assert not process.is_alive()
        return loop.time() - started

    try:
        assert asyncio.run(scenario()) < 1.0
    finally:
        os.close(read_end)
