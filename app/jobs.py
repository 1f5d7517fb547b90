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
    """What a worker does with an image. Items of different tasks never share a batch."""

    EMBEDDING = "embedding"
    TAG = "tag"


@dataclass(frozen=True, slots=True)
class ImageJob:
    """A preprocessed image: ``pixels`` is uint8 HxWx3 RGB at the model's input size."""

    pixels: npt.NDArray[np.uint8]
    top_k: int = 0


@dataclass(frozen=True, slots=True)
class TopK:
    """Class indices and probabilities, most probable first."""

    indices: npt.NDArray[np.int64]
    probs: npt.NDArray[np.float32]
