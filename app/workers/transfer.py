"""One batch's trip through a worker's shared buffer, both ways.

The pool writes a batch's images into the buffer (``write_images``) and turns the worker's
reply into each item's result (``results``); the worker reads the images back
(``batch_images``), and decodes them when they came encoded (``app.workers.compute``). A
batch is all pixels or all encoded uploads: the Streamer never mixes the two
(``app.jobs.BatchKey``).
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

import numpy as np
import numpy.typing as npt

from app.errors import IMAGE_ERRORS, InferenceError, ServerError
from app.jobs import EmbeddingAndTopK, Task, TopK
from app.workers.buffer import Inline, InputBuffer, Spans
from app.workers.messages import RunBatch

# position in the batch -> (error class name, message), for uploads a worker could not decode
Errors = dict[int, tuple[str, str]]


def write_images(
    buffer: InputBuffer,
    images: Sequence[npt.NDArray[np.uint8] | bytes],
    image_shape: tuple[int, int, int],
) -> tuple[Spans, Inline]:
    """Put one batch's images into ``buffer``: pixels as its first rows, or encoded uploads
    packed end to end (those that do not fit travel inline). Returns ``RunBatch``'s
    ``spans`` and ``inline``, both empty for pixels."""
    blobs = [image for image in images if isinstance(image, bytes)]
    if len(blobs) == len(images):
        return buffer.pack(blobs)
    if blobs:
        raise TypeError("a batch holds pixels or encoded uploads, not both")
    np.stack(images, out=buffer.images(len(images), image_shape))
    return (), ()


def batch_images(
    message: RunBatch, buffer: InputBuffer, image_shape: tuple[int, int, int]
) -> npt.NDArray[np.uint8] | list[bytes]:
    """The batch's images as they came: its uint8 pixels (the buffer's first rows), or its
    encoded uploads (from the buffer, or inline) for the worker to decode."""
    if not message.spans:
        return buffer.images(len(message.ids), image_shape)
    blobs = [
        buffer.blob(span) if span is not None else inline
        for span, inline in zip(message.spans, message.inline, strict=True)
    ]
    if any(blob is None for blob in blobs):
        raise ValueError("an encoded row has neither a span nor inline bytes")
    return blobs  # type: ignore[return-value]  # None ruled out above


def image_error(name: str, message: str) -> ServerError:
    """The typed error for an image a worker could not decode (its 4xx), or a plain
    inference error for anything else (the worker logs the details)."""
    error = IMAGE_ERRORS.get(name)
    return error(message) if error is not None else InferenceError("could not decode the image")


def results(
    task: Task,
    top_ks: Sequence[int],
    ids: Sequence[int],
    outputs: Mapping[str, npt.NDArray[Any]],
    errors: Errors,
) -> dict[int, Any]:
    """Each item's result from a worker's outputs: ``ids[row]`` gets its row of them (its
    embedding, its top ``top_ks[row]`` classes as ``TopK``, or both as ``EmbeddingAndTopK``),
    or the error its upload met."""
    computed = [row for row in range(len(ids)) if row not in errors]
    answers: dict[int, Any] = {ids[row]: image_error(*error) for row, error in errors.items()}
    if not computed:
        return answers
    embeddings: npt.NDArray[Any] = np.empty((0,))
    if task is not Task.TAG:
        embeddings = outputs["embedding"]
        if len(embeddings) != len(computed):
            raise InferenceError(f"{len(embeddings)} embeddings for {len(computed)} images")
    tops: list[TopK] = []
    if task is not Task.EMBEDDING:
        indices, probs = outputs["indices"], outputs["probs"]
        if len(indices) != len(computed) or len(probs) != len(computed):
            raise InferenceError(f"{len(indices)} tag rows for {len(computed)} images")
        tops = [
            TopK(indices[out, : top_ks[row]], probs[out, : top_ks[row]])
            for out, row in enumerate(computed)
        ]
    for out, row in enumerate(computed):
        if task is Task.EMBEDDING:
            answers[ids[row]] = embeddings[out]
        elif task is Task.TAG:
            answers[ids[row]] = tops[out]
        else:
            answers[ids[row]] = EmbeddingAndTopK(embeddings[out], tops[out])
    return answers
