"""MB_DECODE=device on the CPU, up to the device boundary: JPEGs decoded by torchvision and
resized with tensor ops must match Pillow's ``preprocess`` up to resampling detail, every
other upload must take the Pillow path, and each bad one must fail alone."""

from __future__ import annotations

import io

import numpy as np
import pytest
import torch
from PIL import Image, ImageOps
from skimage import data

from app.images import ORIENTATION_TAG, _resize_center_crop, preprocess, read_header
from app.jobs import Task
from app.manifest import InputSpec
from app.workers.buffer import InputBuffer
from app.workers.decoding import Decoder, DeviceDecoder, resize_center_crop, upright
from app.workers.messages import RunBatch
from app.workers.transfer import batch_images
from tests.unit.test_images import encode

SPEC = InputSpec(
    crop_size=64, resize_size=72, interpolation="bilinear", mean=(0, 0, 0), std=(1, 1, 1)
)
CPU = torch.device("cpu")


def photo(width: int = 451, height: int = 300) -> Image.Image:
    """A real photo (the cat), resized: smooth areas and sharp edges, like real uploads."""
    return Image.fromarray(data.chelsea()).resize((width, height))  # type: ignore[no-untyped-call]  # skimage.data is unannotated


def jpeg(image: Image.Image, orientation: int = 1) -> bytes:
    exif = Image.Exif()
    if orientation != 1:
        exif[ORIENTATION_TAG] = orientation
    return encode(image, "JPEG", quality=92, exif=exif.tobytes())


def decoder(spec: InputSpec = SPEC, max_pixels: int = 10**7) -> DeviceDecoder:
    return DeviceDecoder(spec, CPU, Decoder(spec, 1, max_pixels), max_pixels)


def mean_abs_diff(a: np.ndarray, b: np.ndarray) -> float:
    return float(np.abs(a.astype(np.int16) - b.astype(np.int16)).mean())


@pytest.mark.parametrize("orientation", range(1, 9))
def test_upright_turns_like_pillows_exif_transpose(orientation: int) -> None:
    pixels = np.random.default_rng(orientation).integers(0, 256, (5, 7, 3), dtype=np.uint8)
    image = Image.open(io.BytesIO(encode(Image.fromarray(pixels), "PNG")))
    image.getexif()[ORIENTATION_TAG] = orientation
    image.info["exif"] = image.getexif().tobytes()
    expected = np.asarray(ImageOps.exif_transpose(image))
    turned = upright(torch.from_numpy(pixels).permute(2, 0, 1), orientation)
    assert np.array_equal(turned.permute(1, 2, 0).numpy(), expected)


@pytest.mark.parametrize("interpolation", ["bilinear", "bicubic"])
@pytest.mark.parametrize(
    ("size", "limit"),
    [
        ((451, 300), 1.0),
        ((300, 451), 1.0),
        ((1000, 90), 1.0),
        ((2000, 1500), 1.0),
        # Smaller than the model's input: scaled up, where a sub-pixel shift shows most.
        ((64, 64), 5.0),
    ],
)
def test_tensor_resize_and_crop_match_pillows(
    interpolation: str, size: tuple[int, int], limit: float
) -> None:
    spec = SPEC.model_copy(update={"interpolation": interpolation})
    image = photo(*size)
    expected = _resize_center_crop(image, spec)
    ours = resize_center_crop(torch.from_numpy(np.array(image)).permute(2, 0, 1), spec)
    assert ours.shape == (3, 64, 64) and ours.dtype == torch.uint8
    # The same resampling, up to the crop window's sub-pixel shift (out of 255 per value).
    assert mean_abs_diff(ours.permute(1, 2, 0).numpy(), expected) < limit


def test_batch_keeps_order_decodes_jpegs_on_the_device_and_the_rest_with_pillow() -> None:
    grey = photo().convert("L")
    uploads = [
        jpeg(photo()),  # 0: on the device
        encode(photo(200, 260), "PNG"),  # 1: Pillow
        b"not an image",  # 2: 400
        jpeg(photo())[:3000],  # 3: truncated JPEG: its header reads, its pixels do not
        encode(photo().convert("CMYK"), "JPEG"),  # 4: CMYK JPEG: Pillow
        jpeg(grey),  # 5: greyscale JPEG on the device
        jpeg(photo(300, 451).transpose(Image.Transpose.ROTATE_90), orientation=6),  # 6: EXIF
        encode(photo(), "TIFF"),  # 7: refused format
    ]
    pixels, errors = decoder().decode(uploads)
    assert {pos: name for pos, (name, _) in errors.items()} == {
        2: "InvalidImage",
        3: "InvalidImage",
        7: "UnsupportedImageFormat",
    }
    assert "truncated" in errors[3][1] and "decode_jpeg.cpp" not in errors[3][1]
    assert isinstance(pixels, torch.Tensor) and pixels.device == CPU
    assert pixels.shape == (5, 64, 64, 3) and pixels.dtype == torch.uint8
    good = [0, 1, 4, 5, 6]
    for row, position in enumerate(good):
        expected = preprocess(uploads[position], SPEC)
        # Pillow decodes these JPEGs at 1/4 scale (draft mode), torchvision at full size.
        assert mean_abs_diff(pixels[row].numpy(), expected) < 3.0, position
    # The Pillow fallback is Pillow's own result, bit for bit.
    assert np.array_equal(pixels[1].numpy(), preprocess(uploads[1], SPEC))


def test_a_batch_with_no_good_upload_is_empty() -> None:
    pixels, errors = decoder().decode([b"", b"junk"])
    assert pixels.shape == (0, 64, 64, 3) and set(errors) == {0, 1}


def test_pixel_limit_applies_before_decoding() -> None:
    pixels, errors = decoder(max_pixels=10_000).decode([jpeg(photo(200, 200))])
    assert len(pixels) == 0 and errors[0][0] == "PayloadTooLarge"


def test_header_is_read_without_decoding() -> None:
    header = read_header(jpeg(photo(120, 80), orientation=3))
    assert (header.format, header.mode, header.width, header.height) == ("JPEG", "RGB", 120, 80)
    assert header.orientation == 3


def test_encoded_batch_becomes_a_device_tensor_the_runner_takes() -> None:
    upload = jpeg(photo())
    buffer = InputBuffer.create(len(upload) + 10)
    try:
        spans, inline = buffer.pack([upload, upload])  # the second travels inline
        message = RunBatch(0, Task.EMBEDDING, (1, 2), 0, spans, inline)
        blobs = batch_images(message, buffer, (64, 64, 3))
        assert isinstance(blobs, list)
        pixels, errors = decoder().decode(blobs)
    finally:
        buffer.unlink()
        buffer.close()
    assert errors == {} and isinstance(pixels, torch.Tensor)
    assert torch.equal(pixels[0], pixels[1])


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_gpu_decode_matches_cpu_decode() -> None:  # pragma: no cover - GPU machines only
    gpu = torch.device("cuda:0")
    uploads = [jpeg(photo()), jpeg(photo(640, 480)), encode(photo(), "PNG")]
    on_gpu, gpu_errors = DeviceDecoder(SPEC, gpu, Decoder(SPEC, 1, 10**7), 10**7).decode(uploads)
    on_cpu, _ = decoder().decode(uploads)
    assert gpu_errors == {} and on_gpu.device.type == "cuda"
    # nvJPEG's IDCT and upsampling differ from libjpeg-turbo's by a little.
    assert mean_abs_diff(on_gpu.cpu().numpy(), on_cpu.numpy()) < 2.0


def test_a_store_with_torchvisions_resize_leaves_every_upload_to_pillow() -> None:
    """MB_DECODE=device on an imported TorchServe archive's store: no JPEG is decoded on the
    device; every row is Pillow's stock transform, bit for bit."""
    stock = SPEC.model_copy(
        update={
            "reduced_decode": False,
            "resize": "pil-resize-then-crop",
            "interpolation": "bilinear",
        }
    )
    uploads = [jpeg(photo()), jpeg(photo().convert("L")), encode(photo(200, 260), "PNG")]
    pixels, errors = decoder(stock).decode(uploads)
    assert errors == {}
    for row, upload in enumerate(uploads):
        assert np.array_equal(pixels[row].numpy(), preprocess(upload, stock)), row
