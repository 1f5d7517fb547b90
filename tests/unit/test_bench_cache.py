"""bench/cache.py's pieces that need no server: a distinct upload is the same image in
other bytes, and a trace repeats the share of requests it says, with a run's own images."""

from __future__ import annotations

import io

import numpy as np
import pytest
from PIL import Image

from bench.cache import distinct, trace


def jpeg(seed: int = 0) -> bytes:
    pixels = np.random.default_rng(seed).integers(0, 256, (32, 48, 3), dtype=np.uint8)
    buffer = io.BytesIO()
    Image.fromarray(pixels).save(buffer, format="JPEG")
    return buffer.getvalue()


def test_a_distinct_upload_is_the_same_image_in_other_bytes() -> None:
    photo = jpeg()
    one, two = distinct(photo, "run-1"), distinct(photo, "run-2")
    assert len({photo, one, two}) == 3
    decoded = [np.asarray(Image.open(io.BytesIO(data)).convert("RGB")) for data in (photo, one)]
    assert np.array_equal(decoded[0], decoded[1])


@pytest.mark.parametrize("share", [0.0, 0.5, 0.8, 0.95])
def test_a_trace_repeats_its_share_and_never_another_run_s_images(share: float) -> None:
    photos = [jpeg(0), jpeg(1)]
    requests, images = trace(photos, share, 2000, "a")
    assert len(requests) == 2000 and len(set(requests)) == images
    assert 2000 - images == min(round(share * 2000), 1999)  # exactly its share
    other, _ = trace(photos, share, 2000, "b")
    assert not set(requests) & set(other)
    assert trace(photos, share, 2000, "a")[0] == requests  # the same trace every time
