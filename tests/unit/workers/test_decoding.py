"""A worker's Pillow decoder: each upload's pixels in order, each bad one its own error."""

from __future__ import annotations

import numpy as np
import pytest
from PIL import Image

from app.workers.decoding import Decoder
from tests.unit.test_images import SPEC, encode, gradient


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


def test_a_decoder_bug_fails_its_upload_alone(monkeypatch: pytest.MonkeyPatch) -> None:
    good = encode(gradient(40, 40), "PNG")

    def broken(data: bytes, *args: object, **kwargs: object) -> np.ndarray:
        if data == b"boom":
            raise ZeroDivisionError("a decoder bug")
        from app.images import preprocess

        return preprocess(data, *args, **kwargs)  # type: ignore[arg-type]

    monkeypatch.setattr("app.workers.decoding.preprocess", broken)
    out, errors = Decoder(SPEC, 1, max_pixels=10**6).decode([good, b"boom"])
    assert len(out) == 1
    assert errors == {1: ("InferenceError", "ZeroDivisionError: a decoder bug")}
