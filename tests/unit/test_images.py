from __future__ import annotations

import io

import numpy as np
import pytest
from PIL import Image

import app.images
from app.errors import InvalidImage, PayloadTooLarge, UnsupportedImageFormat
from app.images import preprocess
from app.manifest import InputSpec

SPEC = InputSpec(
    crop_size=32, resize_size=36, interpolation="bilinear", mean=(0, 0, 0), std=(1, 1, 1)
)


def encode(image: Image.Image, fmt: str, **params: object) -> bytes:
    buffer = io.BytesIO()
    image.save(buffer, format=fmt, **params)
    return buffer.getvalue()


def gradient(width: int = 80, height: int = 60) -> Image.Image:
    x = np.linspace(0, 255, width, dtype=np.uint8)
    rgb = np.stack([np.tile(x, (height, 1))] * 3, axis=-1)
    rgb[..., 2] = 128
    return Image.fromarray(rgb)


@pytest.mark.parametrize("fmt", ["JPEG", "PNG", "WEBP", "BMP", "GIF"])
def test_allowed_formats_come_out_at_the_model_size(fmt: str) -> None:
    pixels = preprocess(encode(gradient(), fmt), SPEC)
    assert pixels.shape == (32, 32, 3)
    assert pixels.dtype == np.uint8
    # Left-to-right gradient survives resize and crop.
    assert pixels[16, 2, 0] < pixels[16, 29, 0]


@pytest.mark.parametrize("mode", ["L", "LA", "RGBA", "P", "CMYK", "1"])
def test_modes_convert_to_rgb(mode: str) -> None:
    image = gradient().convert(mode)
    pixels = preprocess(encode(image, "JPEG" if mode == "CMYK" else "PNG"), SPEC)
    assert pixels.shape == (32, 32, 3)
    if mode != "1":
        assert pixels[16, 2].mean() < pixels[16, 29].mean()  # the gradient is still there


def test_16_bit_grayscale_keeps_its_range() -> None:
    ramp = np.tile(np.linspace(0, 65535, 80).astype(np.uint16), (60, 1))
    pixels = preprocess(encode(Image.fromarray(ramp), "PNG"), SPEC)
    assert pixels.shape == (32, 32, 3)
    assert pixels[16, 2, 0] < 60 and pixels[16, 29, 0] > 190


def test_16_bit_grayscale_is_scaled_whatever_its_pixels_hold() -> None:
    """A dark 16-bit image (values up to 255 of 65535) is near black, as one with a single
    brighter pixel is: it was read as 8-bit (a mid-grey ramp) unless a pixel passed 255."""
    dark = np.tile(np.linspace(0, 255, 80).astype(np.uint16), (60, 1))
    brighter = dark.copy()
    brighter[0, 0] = 256
    seen = [preprocess(encode(Image.fromarray(ramp), "PNG"), SPEC) for ramp in (dark, brighter)]
    assert seen[0].max() <= 1 and seen[1].max() <= 1


def test_exif_orientation_is_applied() -> None:
    # A wide image, top half red and bottom half blue, stored with "rotate 90" orientation.
    rgb = np.zeros((40, 80, 3), dtype=np.uint8)
    rgb[:20, :, 0] = 255
    rgb[20:, :, 2] = 255
    exif = Image.Exif()
    exif[0x0112] = 6  # rotate 90 degrees clockwise when displayed
    data = encode(Image.fromarray(rgb), "JPEG", exif=exif, quality=95)
    pixels = preprocess(data, SPEC)
    # Displayed upright, red is on the right and blue on the left.
    assert pixels[16, 28, 0] > 200 and pixels[16, 28, 2] < 60
    assert pixels[16, 3, 2] > 200 and pixels[16, 3, 0] < 60


@pytest.mark.parametrize("size", [(1, 1), (10000, 1), (1, 3000)])
def test_tiny_and_extreme_aspect_ratios(size: tuple[int, int]) -> None:
    assert preprocess(encode(Image.new("RGB", size, (10, 200, 30)), "PNG"), SPEC).shape == (
        32,
        32,
        3,
    )


def test_not_an_image() -> None:
    with pytest.raises(InvalidImage):
        preprocess(b"hello, I am text", SPEC)


def test_empty_upload() -> None:
    with pytest.raises(InvalidImage, match="empty"):
        preprocess(b"", SPEC)


def test_truncated_jpeg() -> None:
    data = encode(gradient(400, 300), "JPEG")
    with pytest.raises(InvalidImage):
        preprocess(data[: len(data) // 2], SPEC)


def test_unsupported_format_is_named() -> None:
    with pytest.raises(UnsupportedImageFormat, match="TIFF"):
        preprocess(encode(gradient(), "TIFF"), SPEC)


def test_pixel_limit_is_checked_before_decoding() -> None:
    data = encode(Image.new("RGB", (2000, 2000)), "PNG")
    with pytest.raises(PayloadTooLarge):
        preprocess(data, SPEC, max_pixels=1_000_000)


def test_same_bytes_same_pixels() -> None:
    data = encode(gradient(), "JPEG")
    assert np.array_equal(preprocess(data, SPEC), preprocess(data, SPEC))


STOCK = InputSpec(
    crop_size=224,
    resize_size=256,
    mean=(0, 0, 0),
    std=(1, 1, 1),
    reduced_decode=False,
    resize="pil-resize-then-crop",
)


def noise(width: int, height: int, seed: int = 0) -> Image.Image:
    rng = np.random.default_rng(seed)
    return Image.fromarray(rng.integers(0, 256, (height, width, 3), dtype=np.uint8))


@pytest.mark.parametrize(
    "size",
    [(451, 300), (300, 451), (1600, 90), (97, 1300), (31, 31), (257, 700), (333, 257), (900, 601)],
)
@pytest.mark.parametrize("interpolation", ["bilinear", "bicubic"])
def test_the_stock_resize_is_torchvisions_resize_and_center_crop_to_the_pixel(
    size: tuple[int, int], interpolation: str
) -> None:
    """torchvision's Resize then CenterCrop on the Pillow image (TorchServe's stock
    transform), its rounding of the long side and of the offsets included."""
    from torchvision import transforms

    mode = transforms.InterpolationMode(interpolation)
    stock = transforms.Compose([transforms.Resize(256, mode), transforms.CenterCrop(224)])
    image = noise(*size)
    spec = STOCK.model_copy(update={"interpolation": interpolation})
    for data in (encode(image, "PNG"), encode(image, "JPEG", quality=90)):
        expected = np.asarray(stock(Image.open(io.BytesIO(data))))
        assert np.array_equal(preprocess(data, spec), expected), (size, interpolation)


def test_an_image_too_long_to_resize_whole_is_resampled_in_its_window(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """4000x1: resized whole, it would be a billion pixels; Pillow resamples the crop's window
    instead, at the same geometry, which differs from the whole resize by rounding only."""
    from torchvision import transforms

    assert preprocess(encode(noise(4000, 1), "PNG"), STOCK).shape == (224, 224, 3)
    narrow = encode(noise(4000, 60), "PNG")  # small enough to compare with the whole resize
    stock = transforms.Compose([transforms.Resize(256), transforms.CenterCrop(224)])
    expected = np.asarray(stock(Image.open(io.BytesIO(narrow)))).astype(int)
    assert np.array_equal(preprocess(narrow, STOCK), expected)
    monkeypatch.setattr(app.images, "MAX_RESIZED_PIXELS", 0)
    assert np.abs(preprocess(narrow, STOCK).astype(int) - expected).max() <= 1


def test_the_stock_resize_needs_a_full_size_decode() -> None:
    with pytest.raises(ValueError, match="full size"):
        InputSpec(
            crop_size=224,
            resize_size=256,
            mean=(0, 0, 0),
            std=(1, 1, 1),
            resize="pil-resize-then-crop",
        )
