"""The workers' JPEG decoder (libjpeg-turbo at the reduced DCT scale, torch's resize) against
Pillow's, through the real EfficientNet-Lite0 on real photos: changing the decoder must not
change the model's answers.

Two references: the server's Pillow ``preprocess``, which resamples the same crop window, and
the decode of the release before this decoder (Pillow with the window's sub-pixel edges). The
first must agree at the fp32 level the runtime self-test asks of a runtime; the second differs
by the half pixel the window was rounded by, which is bounded here at the int8 gate and which
Pillow itself shows with the rounded window."""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path

import numpy as np
import pytest
import torch
from PIL import ImageOps

from app.exporters.precision import GATES
from app.images import _RESAMPLE, _open_checked, _to_rgb, preprocess
from app.manifest import Agreement, InputSpec, read_manifest
from app.workers.agreement import measure_pixels
from app.workers.decoding import Decoder
from app.workers.models import LoadOptions, load_models
from app.workers.runtimes import MIN_COSINE_FP32
from bench.decode_stages import camera_sized
from bench.systems import photo_views

pytestmark = pytest.mark.slow


def previous_release(data: bytes, spec: InputSpec) -> np.ndarray:
    """The decode this server shipped before: Pillow, the window's edges not rounded."""
    image = _open_checked(data, 10**8)
    image.draft("RGB", (spec.resize_size, spec.resize_size))
    ImageOps.exif_transpose(image, in_place=True)
    image = _to_rgb(image)
    width, height = image.size
    scale = spec.resize_size / min(width, height)
    crop_w, crop_h = min(width, spec.crop_size / scale), min(height, spec.crop_size / scale)
    left, top = (width - crop_w) / 2, (height - crop_h) / 2
    box = (left, top, left + crop_w, top + crop_h)
    size = (spec.crop_size, spec.crop_size)
    return np.asarray(image.resize(size, _RESAMPLE[spec.interpolation], box=box))


@pytest.fixture(scope="module")
def photos(tmp_path_factory: pytest.TempPathFactory) -> list[bytes]:
    """60 views of scikit-image's photos (random crops, mirrored), and 20 of them at camera
    size, where the reduced DCT scale applies."""
    folder = photo_views(tmp_path_factory.mktemp("views"), 60)
    views = [path.read_bytes() for path in sorted(folder.glob("*.jpg"))]
    return views + [camera_sized(view, 1600, quality=90) for view in views[:20]]


def agreement(
    store: Path, photos: list[bytes], reference: Callable[[bytes, InputSpec], np.ndarray]
) -> Agreement:
    spec = read_manifest(store).input
    ours, errors = Decoder(spec, 1, max_pixels=10**8).decode(photos)
    assert errors == {}
    theirs = np.stack([reference(data, spec) for data in photos])
    models = load_models(store, torch.device("cpu"), LoadOptions(threads=2), "torchscript")
    return measure_pixels(models, theirs, ours)


def test_the_new_decode_answers_as_pillow_does(default_store: Path, photos: list[bytes]) -> None:
    measured = agreement(default_store, photos, preprocess)
    assert measured.top1 == 1.0, measured
    assert measured.cosine_mean >= MIN_COSINE_FP32, measured
    assert measured.cosine_min >= 0.999, measured


def test_the_new_decode_stays_within_the_gate_of_the_previous_one(
    default_store: Path, photos: list[bytes]
) -> None:
    measured = agreement(default_store, photos, previous_release)
    assert GATES["int8"].failures(measured) == [], measured
    assert measured.cosine_mean >= GATES["bf16"].cosine_mean, measured
