"""A batch's trip through the shared buffer, both ways: what the pool writes, what the worker
reads back (and decodes, for encoded uploads), and each item's result from the worker's
reply."""

from __future__ import annotations

from collections.abc import Iterator
from types import SimpleNamespace
from typing import Any

import numpy as np
import numpy.typing as npt
import pytest

from app.errors import InferenceError, InvalidImage, PayloadTooLarge, UnsupportedImageFormat
from app.jobs import EmbeddingAndTopK, Task, TopK
from app.workers.buffer import InputBuffer
from app.workers.compute import run_batch
from app.workers.decoding import Decoder
from app.workers.messages import BatchDone, RunBatch
from app.workers.transfer import batch_images, image_error, results, write_images
from tests.unit.test_images import SPEC, encode, gradient

SHAPE = (32, 32, 3)


@pytest.fixture
def buffer() -> Iterator[InputBuffer]:
    created = InputBuffer.create(10**5)
    yield created
    created.unlink()
    created.close()


def _message(
    spans: tuple[tuple[int, int] | None, ...] = (),
    inline: tuple[bytes | None, ...] = (),
    count: int = 2,
) -> RunBatch:
    return RunBatch(1, Task.TAG, tuple(range(10, 10 + count)), 5, spans, inline)


def test_pixels_travel_as_the_buffers_first_rows(buffer: InputBuffer) -> None:
    rng = np.random.default_rng(0)
    pixels = [rng.integers(0, 256, SHAPE, dtype=np.uint8) for _ in range(3)]
    spans, inline = write_images(buffer, pixels, SHAPE)
    assert (spans, inline) == ((), ())
    rows = batch_images(_message(count=3), buffer, SHAPE)
    assert isinstance(rows, np.ndarray)
    for row, want in enumerate(pixels):
        assert np.array_equal(rows[row], want)


def test_uploads_travel_encoded_and_come_back_decoded_in_order(buffer: InputBuffer) -> None:
    uploads = [encode(gradient(40 + 8 * i, 30), "PNG") for i in range(3)]
    decoder = Decoder(SPEC, 1, max_pixels=10**6)
    spans, inline = write_images(buffer, [uploads[0], b"not an image", uploads[2]], SHAPE)
    message = _message(spans, inline, count=3)
    blobs = batch_images(message, buffer, SHAPE)
    assert isinstance(blobs, list)
    rows, errors = decoder.decode(blobs)
    assert {row: name for row, (name, _) in errors.items()} == {1: "InvalidImage"}
    assert rows.shape == (2, *SHAPE)
    for row, upload in zip((0, 1), (uploads[0], uploads[2]), strict=True):
        assert np.array_equal(rows[row], decoder.decode([upload])[0][0])


def test_uploads_the_buffer_has_no_room_for_travel_inline() -> None:
    small = encode(gradient(40, 40), "PNG")
    buffer = InputBuffer.create(len(small) + 10)  # the second upload cannot fit
    try:
        spans, inline = write_images(buffer, [small, small], SHAPE)
        assert spans == ((0, len(small)), None) and inline == (None, small)
        decoder = Decoder(SPEC, 1, max_pixels=10**6)
        blobs = batch_images(_message(spans, inline), buffer, SHAPE)
        assert isinstance(blobs, list)
        pixels, errors = decoder.decode(blobs)
        assert errors == {} and pixels.shape == (2, *SHAPE)
        assert pixels[0].any() and np.array_equal(pixels[0], pixels[1])
    finally:
        buffer.unlink()
        buffer.close()


def test_a_batch_never_mixes_pixels_and_uploads(buffer: InputBuffer) -> None:
    with pytest.raises(TypeError, match="not both"):
        write_images(buffer, [np.zeros(SHAPE, np.uint8), b"jpeg bytes"], SHAPE)


def test_a_worker_that_does_not_decode_refuses_an_encoded_batch() -> None:
    model = SimpleNamespace(
        decoder=None, runner=SimpleNamespace(models=SimpleNamespace(pixels_in=False))
    )
    worker: Any = SimpleNamespace(model=lambda served_id: model)
    with pytest.raises(RuntimeError, match="does not decode"):
        run_batch(worker, "t@1", Task.TAG, [b"jpeg bytes"], 5)


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
    error = image_error(name, "the message")
    assert type(error) is expected
    if expected is not InferenceError:
        assert str(error) == "the message"


def test_each_item_gets_its_own_row_or_its_own_error() -> None:
    indices = np.array([[3, 1, 2], [7, 8, 9]], dtype=np.int64)
    probs = np.array([[0.5, 0.3, 0.2], [0.6, 0.3, 0.1]], dtype=np.float32)
    reply = BatchDone(
        1, (10, 11, 12), {"indices": indices, "probs": probs}, 0.1, {1: ("InvalidImage", "bad")}
    )
    answers = results(Task.TAG, [3, 2, 1], (10, 11, 12), reply.outputs, reply.errors)
    assert isinstance(answers[11], InvalidImage)
    first, third = answers[10], answers[12]
    assert isinstance(first, TopK) and isinstance(third, TopK)
    assert first.indices.tolist() == [3, 1, 2]
    assert third.indices.tolist() == [7]  # its own k, from the third row of the reply


def test_embeddings_are_matched_to_the_items_that_computed() -> None:
    embedding = np.arange(6, dtype=np.float32).reshape(2, 3)
    reply = BatchDone(1, (5, 6, 7), {"embedding": embedding}, 0.1, {0: ("PayloadTooLarge", "big")})
    answers = results(Task.EMBEDDING, [0, 0, 0], (5, 6, 7), reply.outputs, reply.errors)
    assert isinstance(answers[5], PayloadTooLarge)
    assert answers[6].tolist() == [0, 1, 2] and answers[7].tolist() == [3, 4, 5]


def test_an_item_asking_for_both_gets_its_embedding_and_its_top_k() -> None:
    embedding = np.arange(6, dtype=np.float32).reshape(2, 3)
    indices = np.array([[3, 1], [7, 8]], dtype=np.int64)
    probs = np.array([[0.5, 0.3], [0.6, 0.3]], dtype=np.float32)
    outputs: dict[str, npt.NDArray[Any]] = {
        "embedding": embedding,
        "indices": indices,
        "probs": probs,
    }
    reply = BatchDone(1, (5, 6, 7), outputs, 0.1, {1: ("InvalidImage", "bad")})
    answers = results(Task.EMBEDDING_AND_TAG, [2, 2, 1], (5, 6, 7), reply.outputs, reply.errors)
    assert isinstance(answers[6], InvalidImage)
    first, third = answers[5], answers[7]
    assert isinstance(first, EmbeddingAndTopK) and isinstance(third, EmbeddingAndTopK)
    assert first.embedding.tolist() == [0, 1, 2] and third.embedding.tolist() == [3, 4, 5]
    assert first.top_k.indices.tolist() == [3, 1] and third.top_k.indices.tolist() == [7]


def test_a_reply_with_the_wrong_number_of_rows_fails_loudly() -> None:
    reply = BatchDone(1, (5, 6), {"embedding": np.zeros((1, 3), np.float32)})
    with pytest.raises(InferenceError, match="1 embeddings for 2 images"):
        results(Task.EMBEDDING, [0, 0], (5, 6), reply.outputs, reply.errors)
