"""A worker's CPU decoder: JPEGs through libjpeg-turbo (simplejpeg) at the reduced DCT scale
and torch's resize, everything else through Pillow's ``preprocess``; each upload's pixels in
order, each bad one its own error."""

from __future__ import annotations

import io

import numpy as np
import pytest
from PIL import Image

from app.images import preprocess, read_header
from app.manifest import InputSpec
from app.workers.decoding import Decoder, draft_factor, turbo_decodes
from tests.unit.test_images import SPEC, encode, gradient
from tests.unit.workers.test_device_decode import jpeg, mean_abs_diff, photo

MODEL_SPEC = InputSpec(
    crop_size=224, resize_size=256, interpolation="bicubic", mean=(0.5,) * 3, std=(0.5,) * 3
)


def decode_one(data: bytes, spec: InputSpec = MODEL_SPEC) -> np.ndarray:
    out, errors = Decoder(spec, 1, max_pixels=10**8).decode([data])
    assert errors == {}
    row: np.ndarray = out[0].copy()
    return row


@pytest.mark.parametrize("threads", [1, 3])
def test_decoder_writes_good_rows_in_order_and_reports_each_bad_one(threads: int) -> None:
    good = [encode(gradient(80 + 8 * i, 60), "PNG") for i in range(3)] + [jpeg(photo())]
    tiff = encode(gradient(), "TIFF")
    blobs = [good[0], b"not an image", good[1], tiff, good[3], good[2][:40], good[2]]
    out, errors = Decoder(SPEC, threads, max_pixels=10**6).decode(blobs)
    assert len(out) == 4
    assert {pos: name for pos, (name, _) in errors.items()} == {
        1: "InvalidImage",
        3: "UnsupportedImageFormat",
        5: "InvalidImage",
    }
    assert "TIFF" in errors[3][1]
    expected = Decoder(SPEC, 1, max_pixels=10**6)
    for row, blob in enumerate([good[0], good[1], good[3], good[2]]):
        single, _ = expected.decode([blob])
        assert np.array_equal(out[row], single[0]), row


def test_decoder_enforces_the_pixel_limit() -> None:
    for upload in (encode(Image.new("RGB", (200, 200)), "PNG"), jpeg(photo(200, 200))):
        out, errors = Decoder(SPEC, 1, max_pixels=10_000).decode([upload])
        assert len(out) == 0 and errors[0][0] == "PayloadTooLarge"


def test_a_decoder_bug_fails_its_upload_alone(monkeypatch: pytest.MonkeyPatch) -> None:
    good, bad = jpeg(photo(120, 80)), jpeg(photo(90, 80))

    def broken(data: bytes, *args: object) -> None:
        if data == bad:
            raise ZeroDivisionError("a decoder bug")
        decode_jpeg(data, *args)  # type: ignore[arg-type]

    from app.workers.decoding import decode_jpeg

    monkeypatch.setattr("app.workers.decoding.decode_jpeg", broken)
    out, errors = Decoder(SPEC, 1, max_pixels=10**6).decode([good, bad])
    assert len(out) == 1
    assert errors == {1: ("InferenceError", "ZeroDivisionError: a decoder bug")}


@pytest.mark.parametrize(
    "size",
    [(451, 300), (300, 451), (640, 427), (512, 512), (1600, 1064), (2000, 1330), (5000, 600)],
)
def test_jpegs_match_pillows_pixels(size: tuple[int, int]) -> None:
    """The same window, the same filter, the same DCT scale: rounding detail only (out of 255;
    the two round their intermediate pass differently, most visibly on portrait images)."""
    upload = jpeg(photo(*size))
    assert mean_abs_diff(decode_one(upload), preprocess(upload, MODEL_SPEC)) < 0.5


@pytest.mark.parametrize("orientation", range(1, 9))
def test_exif_orientation_is_applied_like_pillow(orientation: int) -> None:
    upload = jpeg(photo(451, 300), orientation=orientation)
    assert mean_abs_diff(decode_one(upload), preprocess(upload, MODEL_SPEC)) < 0.5


def test_greyscale_and_progressive_jpegs_take_the_fast_path() -> None:
    for upload in (
        jpeg(photo().convert("L")),
        encode(photo(), "JPEG", quality=90, progressive=True),
        encode(photo(), "JPEG", quality=90, subsampling=0),  # 4:4:4
    ):
        assert mean_abs_diff(decode_one(upload), preprocess(upload, MODEL_SPEC)) < 0.5


def test_what_libjpeg_turbo_leaves_goes_through_pillow(monkeypatch: pytest.MonkeyPatch) -> None:
    cmyk = encode(photo().convert("CMYK"), "JPEG")
    assert np.array_equal(decode_one(cmyk), preprocess(cmyk, MODEL_SPEC))

    def refuse(*args: object, **kwargs: object) -> None:
        raise ValueError("unsupported JPEG process")

    monkeypatch.setattr("simplejpeg.decode_jpeg", refuse)
    upload = jpeg(photo())
    assert np.array_equal(decode_one(upload), preprocess(upload, MODEL_SPEC))


def test_a_truncated_jpeg_gets_pillows_error() -> None:
    out, errors = Decoder(MODEL_SPEC, 1, max_pixels=10**7).decode([jpeg(photo())[:3000]])
    assert len(out) == 0 and errors[0][0] == "InvalidImage"
    assert "truncated" in errors[0][1]


@pytest.mark.parametrize("size", [(255, 300), (512, 700), (1100, 800), (2100, 3000), (9000, 2050)])
def test_the_dct_scale_is_the_one_pillows_draft_picks(size: tuple[int, int]) -> None:
    upload = jpeg(Image.new("RGB", size, (90, 120, 200)))
    image = Image.open(io.BytesIO(upload))
    image.draft("RGB", (MODEL_SPEC.resize_size, MODEL_SPEC.resize_size))
    factor = draft_factor(*size, MODEL_SPEC)
    assert image.size == (-(-size[0] // factor), -(-size[1] // factor))
    assert read_header(upload).width == size[0]


def test_a_store_with_torchvisions_resize_decodes_every_upload_with_pillow() -> None:
    """An imported TorchServe archive's store: JPEGs too go through Pillow's ``preprocess``
    (the stock transform, to the pixel), never libjpeg-turbo and torch's resize."""
    stock = MODEL_SPEC.model_copy(
        update={
            "interpolation": "bilinear",
            "reduced_decode": False,
            "resize": "pil-resize-then-crop",
        }
    )
    uploads = [jpeg(photo(451, 300)), jpeg(photo().convert("L")), encode(photo(), "PNG")]
    for upload in uploads:
        assert not turbo_decodes(read_header(upload), stock)
        assert np.array_equal(decode_one(upload, stock), preprocess(upload, stock))
    assert turbo_decodes(read_header(uploads[0]), MODEL_SPEC)


@pytest.mark.parametrize(("torch_threads", "uploads"), [(1, 1), (2, 1), (1, 2)])
def test_a_lone_upload_is_decoded_on_the_callers_thread_where_torch_runs_alone_there(
    torch_threads: int, uploads: int, monkeypatch: pytest.MonkeyPatch
) -> None:
    """No hand-off to a decode thread for a lone upload when the caller's torch runs on one
    thread (as a decode thread's does): the same pixels, decoded here; otherwise, and for a
    batch, on the decoder's threads."""
    import threading

    import torch

    decoder = Decoder(MODEL_SPEC, 2, max_pixels=10**8)
    where: list[str] = []
    one = decoder.one

    def recording(data: bytes, out: np.ndarray) -> tuple[str, str] | None:
        where.append(threading.current_thread().name)
        return one(data, out)

    monkeypatch.setattr(decoder, "one", recording)
    blobs = [jpeg(photo(300 + 20 * i, 200)) for i in range(uploads)]
    before = torch.get_num_threads()
    torch.set_num_threads(torch_threads)
    try:
        out, errors = decoder.decode(blobs)
    finally:
        torch.set_num_threads(before)
        decoder.close()
    assert errors == {} and len(out) == uploads
    here = torch_threads == 1 and uploads == 1
    assert all((name == threading.current_thread().name) == here for name in where), where
    for row, blob in enumerate(blobs):
        assert np.array_equal(out[row], decode_one(blob))


def test_a_closed_decoder_refuses_a_lone_upload_too() -> None:
    import torch

    decoder = Decoder(MODEL_SPEC, 1, max_pixels=10**8)
    decoder.close()
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        with pytest.raises(RuntimeError, match="closed"):
            decoder.decode([jpeg(photo())])
    finally:
        torch.set_num_threads(before)


@pytest.mark.parametrize("kind", ["GIF", "WEBP", "PNG"])
def test_an_animated_upload_is_its_first_frame_in_both_decoders(kind: str) -> None:
    """An animated GIF, WebP or PNG (red, green, blue frames) answers for its first frame,
    as RELIABILITY.md says, wherever it is decoded (the corpus test only saw a 200)."""
    frames = [
        Image.new("RGB", (40, 40), colour) for colour in ((255, 0, 0), (0, 255, 0), (0, 0, 255))
    ]
    buffer = io.BytesIO()
    frames[0].save(buffer, format=kind, save_all=True, append_images=frames[1:], duration=100)
    data = buffer.getvalue()
    assert getattr(Image.open(io.BytesIO(data)), "n_frames", 1) == 3
    for pixels in (preprocess(data, SPEC), decode_one(data, SPEC)):
        red, green, blue = (int(v) for v in pixels[16, 16])
        assert red > 240 and green < 10 and blue < 10, (kind, red, green, blue)
