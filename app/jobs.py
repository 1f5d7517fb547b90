"""What travels from the services, through the Streamer, to the workers and back.

A leaf module (numpy only) so services and workers share these types without importing
each other.
"""

from __future__ import annotations

from dataclasses import dataclass
from enum import StrEnum

import numpy as np
import numpy.typing as npt


class Task(StrEnum):
    """What a worker does with an image. Items of different tasks never share a batch.

    ``EMBEDDING_AND_TAG`` answers both from one model pass (``EmbeddingAndTopK``), for a
    caller that wants both of the same image. New members go last: broker mode numbers its
    streams by their order (``app.broker.front.transport``).
    """

    EMBEDDING = "embedding"
    TAG = "tag"
    EMBEDDING_AND_TAG = "embedding_and_tag"


@dataclass(frozen=True, slots=True)
class BatchKey:
    """Which items may share a batch (the Streamer's ``key``): one model (its served id,
    resolved when the request was admitted: two models or versions never share a batch),
    one task, and images that travel the same way, all decoded pixels or all encoded
    uploads."""

    task: Task
    encoded: bool
    model: str = ""


@dataclass(frozen=True, slots=True)
class ImageJob:
    """One image for the workers: uint8 HxWx3 RGB pixels at the model's input size, or the
    encoded upload itself when the workers decode (``MB_DECODE``)."""

    image: npt.NDArray[np.uint8] | bytes
    top_k: int = 0
    # The response cache keeps its answer (broker mode: a worker may answer it with an
    # identical request's computation, app.broker.worker.sharing).
    shared: bool = False


@dataclass(frozen=True, slots=True)
class TopK:
    """Class indices and probabilities, most probable first."""

    indices: npt.NDArray[np.int64]
    probs: npt.NDArray[np.float32]


@dataclass(frozen=True, slots=True)
class EmbeddingAndTopK:
    """An ``EMBEDDING_AND_TAG`` result: the image's embedding and its top classes, both from
    the same model pass."""

    embedding: npt.NDArray[np.float32]
    top_k: TopK
