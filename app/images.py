"""Decode an uploaded image and bring it to the model's input size, as uint8 RGB.

A leaf module (Pillow, simplejpeg and numpy only): the header checks every upload passes (the
format allowlist, the pixel limit, EXIF orientation), ``check_header`` (what the HTTP process
checks of an upload a worker will decode, before it is queued), and ``preprocess``, which the
HTTP process runs with ``MB_DECODE=server`` and the workers for every upload their JPEG path
leaves (``app.workers.decoding``); Pillow releases the GIL while it decodes and resizes. The float
conversion and normalisation happen batched in the worker.
"""

from __future__ import annotations

import io
import warnings
from dataclasses import dataclass

import numpy as np
import numpy.typing as npt
import simplejpeg
from PIL import Image, ImageOps, UnidentifiedImageError

from app.errors import InvalidImage, PayloadTooLarge, UnsupportedImageFormat
from app.manifest import InputSpec

# Explicit allowlist: exotic decoders are where most image-library CVEs live.
ALLOWED_FORMATS = ("JPEG", "PNG", "WEBP", "BMP", "GIF")
DEFAULT_MAX_PIXELS = 40_000_000
ORIENTATION_TAG = 0x0112  # EXIF
_RESAMPLE = {"bilinear": Image.Resampling.BILINEAR, "bicubic": Image.Resampling.BICUBIC}
# The most pixels the stock transform's first step (the whole image resized) may make: what
# an image up to 256 times longer than wide needs at a short side of 256.
MAX_RESIZED_PIXELS = 1 << 24


# Formats we refuse, recognised by their first bytes only: naming them needs no decoder.
_REFUSED_SIGNATURES: tuple[tuple[bytes, int, str], ...] = (
    (b"II*\x00", 0, "TIFF"),
    (b"MM\x00*", 0, "TIFF"),
    (b"\x00\x00\x01\x00", 0, "ICO"),
    (b"8BPS", 0, "PSD"),
    (b"%PDF", 0, "PDF"),
    (b"\x00\x00\x00\x0cjP  ", 0, "JPEG 2000"),
    (b"\xff\x4f\xff\x51", 0, "JPEG 2000"),
    (b"ftypheic", 4, "HEIC"),
    (b"ftypheix", 4, "HEIC"),
    (b"ftypmif1", 4, "HEIF"),
    (b"ftypavif", 4, "AVIF"),
    (b"\xff\x0a", 0, "JPEG XL"),
    (b"\x00\x00\x00\x0cJXL ", 0, "JPEG XL"),
    (b"icns", 0, "ICNS"),
    (b"qoif", 0, "QOI"),
    (b"DDS ", 0, "DDS"),
    (b"gimp xcf", 0, "XCF"),
    (b"#?RADIANCE", 0, "HDR"),
    (b"\x76\x2f\x31\x01", 0, "OpenEXR"),
)


def _refused_format(data: bytes) -> str | None:
    head = data[:32]
    for signature, offset, name in _REFUSED_SIGNATURES:
        if head[offset : offset + len(signature)] == signature:
            return name
    text = head.lstrip().lower()
    if text.startswith((b"<svg", b"<?xml")):
        return "SVG/XML"
    return None


def _open(data: bytes) -> Image.Image:
    if not data:
        raise InvalidImage("the uploaded file is empty")
    try:
        return Image.open(io.BytesIO(data), formats=ALLOWED_FORMATS)
    except UnidentifiedImageError:
        refused = _refused_format(data)
        if refused is not None:
            raise UnsupportedImageFormat(
                f"{refused} images are not accepted; send one of {', '.join(ALLOWED_FORMATS)}"
            ) from None
        raise InvalidImage("the upload is not an image this server can read") from None
    except Image.DecompressionBombError:
        raise PayloadTooLarge("the image has too many pixels") from None
    except Exception as exc:
        raise InvalidImage(f"cannot read the image: {exc}") from None


def _open_checked(data: bytes, max_pixels: int) -> Image.Image:
    """The image, opened lazily (only its header is read), within the pixel limit."""
    image = _open(data)
    _check_pixels(*image.size, max_pixels)
    return image


def check_header(data: bytes, *, max_pixels: int = DEFAULT_MAX_PIXELS) -> None:
    """The 4xx ``read_header`` would give ``data`` (not an image, a refused format, too many
    pixels, an unreadable header), without decoding any pixels: what the HTTP process checks
    of an upload before it queues it for a worker to decode, so that such a file never
    takes a batch's place. A JPEG's header is read by libjpeg-turbo (microseconds; Pillow's
    parser takes ~50 us); one it cannot read, and every other format, by Pillow. A file
    whose header is sound but whose compressed data is not is found only by decoding it:
    its worker answers it, alone."""
    if data[:2] == b"\xff\xd8":
        try:
            height, width, _, _ = simplejpeg.decode_jpeg_header(data)
        except ValueError:
            pass  # Pillow reads more JPEGs than libjpeg-turbo's header parser: it decides
        else:
            _check_pixels(width, height, max_pixels)
            return
    _open_checked(data, max_pixels)


def _check_pixels(width: int, height: int, max_pixels: int) -> None:
    if width * height > max_pixels:
        raise PayloadTooLarge(f"image is {width}x{height}; at most {max_pixels} pixels allowed")


@dataclass(frozen=True)
class Header:
    """What an upload's header says, read without decoding any pixels."""

    format: str  # one of ALLOWED_FORMATS
    mode: str  # Pillow's mode: "RGB" (a YCbCr JPEG), "L", "CMYK", "P", ...
    width: int
    height: int
    orientation: int  # EXIF orientation, 1 (as stored) to 8


def read_header(data: bytes, *, max_pixels: int = DEFAULT_MAX_PIXELS) -> Header:
    """The upload's format, mode, size and EXIF orientation, with the same 4xx errors as
    ``preprocess`` for what is not an image, is refused, or has too many pixels."""
    image = _open_checked(data, max_pixels)
    try:
        orientation = int(image.getexif().get(ORIENTATION_TAG, 1))
    except Exception:  # an unreadable EXIF block: take the pixels as stored
        orientation = 1
    return Header(
        format=image.format or "",
        mode=image.mode,
        width=image.size[0],
        height=image.size[1],
        orientation=orientation if 1 <= orientation <= 8 else 1,
    )


def center_crop_box(width: int, height: int, spec: InputSpec) -> tuple[int, int, int, int]:
    """``(left, top, right, bottom)`` in source pixels of the region that becomes the centre
    crop once the shorter side is scaled to ``spec.resize_size``, rounded to whole pixels:
    every decoder (Pillow here, torch in the workers and on a device) resamples the same
    window, so an image's answer does not depend on where it was decoded."""
    scale = spec.resize_size / min(width, height)
    crop_w = min(width, spec.crop_size / scale)
    crop_h = min(height, spec.crop_size / scale)
    left, top = (width - crop_w) / 2, (height - crop_h) / 2
    return (round(left), round(top), round(left + crop_w), round(top + crop_h))


def resized_size(width: int, height: int, spec: InputSpec) -> tuple[int, int]:
    """``(width, height)`` after torchvision's ``Resize(spec.resize_size)``: the shorter side
    at ``resize_size``, the longer one scaled and truncated to whole pixels, as torchvision
    rounds it.

    >>> spec = InputSpec(crop_size=224, resize_size=256, mean=(0, 0, 0), std=(1, 1, 1))
    >>> resized_size(1600, 90, spec), resized_size(97, 1300, spec), resized_size(31, 31, spec)
    ((4551, 256), (256, 3430), (256, 256))
    """
    short, long = (width, height) if width <= height else (height, width)
    new_long = int(spec.resize_size * long / short)
    return (spec.resize_size, new_long) if width <= height else (new_long, spec.resize_size)


def center_crop_offsets(width: int, height: int, spec: InputSpec) -> tuple[int, int]:
    """``(left, top)`` of torchvision's ``CenterCrop(spec.crop_size)`` in a ``width`` x
    ``height`` image: half the margin, rounded as torchvision rounds it (Python's ``round``,
    halves to even).

    >>> spec = InputSpec(crop_size=224, resize_size=256, mean=(0, 0, 0), std=(1, 1, 1))
    >>> center_crop_offsets(341, 256, spec), center_crop_offsets(343, 256, spec)
    ((58, 16), (60, 16))
    """
    return round((width - spec.crop_size) / 2.0), round((height - spec.crop_size) / 2.0)


def preprocess(
    data: bytes, spec: InputSpec, *, max_pixels: int = DEFAULT_MAX_PIXELS
) -> npt.NDArray[np.uint8]:
    """Encoded image bytes -> uint8 array ``[crop, crop, 3]``: resize the shorter side to
    ``spec.resize_size`` and take the centre crop, in one resampling pass, or as
    torchvision's Resize and CenterCrop do on a Pillow image (``spec.resize``)."""
    image = _open_checked(data, max_pixels)
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("error", Image.DecompressionBombWarning)
            # JPEG only: let the decoder scale down by 1/2..1/8 while staying >= the target.
            if spec.reduced_decode:
                image.draft("RGB", (spec.resize_size, spec.resize_size))
            ImageOps.exif_transpose(image, in_place=True)  # copies nothing unless it turns
            image = _to_rgb(image)
            if spec.resize == "pil-resize-then-crop":
                return _resize_then_crop(image, spec)
            return _resize_center_crop(image, spec)
    except (Image.DecompressionBombError, Image.DecompressionBombWarning):
        raise PayloadTooLarge("the image has too many pixels") from None
    except (OSError, SyntaxError, ValueError, EOFError) as exc:
        raise InvalidImage(f"cannot decode the image: {exc}") from None


def _to_rgb(image: Image.Image) -> Image.Image:
    if image.mode == "RGB":
        return image
    if image.mode == "P":  # palette, maybe with transparency: expand it first
        return image.convert("RGBA").convert("RGB")
    if image.mode.startswith("I"):
        # 16-bit grey (PNG's; 32-bit read as 16): Pillow's own conversion clips at 255, so
        # scale 0..65535 to 0..255, whatever the pixels hold (a dark image stays dark).
        values = np.asarray(image).astype(np.float32)
        grey = np.clip(values * (255.0 / 65535.0) + 0.5, 0, 255).astype(np.uint8)
        return Image.fromarray(grey).convert("RGB")
    return image.convert("RGB")


def _resize_center_crop(image: Image.Image, spec: InputSpec) -> npt.NDArray[np.uint8]:
    resized = image.resize(
        (spec.crop_size, spec.crop_size),
        _RESAMPLE[spec.interpolation],
        box=center_crop_box(*image.size, spec),
    )
    return np.asarray(resized, dtype=np.uint8)


def _resize_then_crop(image: Image.Image, spec: InputSpec) -> npt.NDArray[np.uint8]:
    """torchvision's ``Resize(resize_size)`` then ``CenterCrop(crop_size)`` on ``image``: the
    whole image resized by Pillow, then cropped. Where the resized image would be larger than
    ``MAX_RESIZED_PIXELS`` (an image far longer than wide), Pillow resamples only the crop's
    window, at the same geometry to a fraction of a pixel, instead."""
    width, height = resized_size(*image.size, spec)
    left, top = center_crop_offsets(width, height, spec)
    crop = spec.crop_size
    if width * height <= MAX_RESIZED_PIXELS:
        resized = image.resize((width, height), _RESAMPLE[spec.interpolation])
        return np.asarray(resized.crop((left, top, left + crop, top + crop)), dtype=np.uint8)
    scale_x, scale_y = image.size[0] / width, image.size[1] / height
    box = (left * scale_x, top * scale_y, (left + crop) * scale_x, (top + crop) * scale_y)
    window = image.resize((crop, crop), _RESAMPLE[spec.interpolation], box=box)
    return np.asarray(window, dtype=np.uint8)
