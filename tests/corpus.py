"""A corpus of bad and unusual uploads, made in code (nothing downloaded), each with the
answer the server must give."""

from __future__ import annotations

import io
import struct
import zlib
from collections.abc import Callable

import numpy as np
from PIL import Image

Case = tuple[str, bytes, int]  # name, upload, expected HTTP status


def _save(image: Image.Image, fmt: str, **params: object) -> bytes:
    buffer = io.BytesIO()
    image.save(buffer, format=fmt, **params)
    return buffer.getvalue()


def _photo(width: int = 96, height: int = 64) -> Image.Image:
    y, x = np.mgrid[0:height, 0:width]
    rgb = np.stack([x * 255 // max(1, width - 1), y * 255 // max(1, height - 1), (x + y) % 256], -1)
    return Image.fromarray(rgb.astype(np.uint8))


def _png_header_only(width: int, height: int) -> bytes:
    """A PNG that declares huge dimensions (a decompression bomb's header)."""

    def chunk(kind: bytes, data: bytes) -> bytes:
        return (
            struct.pack(">I", len(data)) + kind + data + struct.pack(">I", zlib.crc32(kind + data))
        )

    ihdr = struct.pack(">IIBBBBB", width, height, 8, 2, 0, 0, 0)
    idat = zlib.compress(b"\x00" * 64)
    return b"\x89PNG\r\n\x1a\n" + chunk(b"IHDR", ihdr) + chunk(b"IDAT", idat) + chunk(b"IEND", b"")


def _zero_png_bomb() -> bytes:
    """A real, fully decodable 8000x6000 PNG of zeros: tiny file, 48 megapixels."""
    return _save(Image.new("L", (8000, 6000)), "PNG", optimize=False)


def _animated(fmt: str) -> bytes:
    frames = [
        Image.new("RGB", (40, 30), color) for color in ((255, 0, 0), (0, 255, 0), (0, 0, 255))
    ]
    return _save(frames[0], fmt, save_all=True, append_images=frames[1:], duration=50, loop=0)


def _with_orientation(value: int) -> bytes:
    exif = Image.Exif()
    exif[0x0112] = value
    return _save(_photo(), "JPEG", exif=exif)


def _sixteen_bit() -> bytes:
    return _save(
        Image.fromarray(np.tile(np.arange(0, 65536, 512, dtype=np.uint16), (64, 1))), "PNG"
    )


def corpus() -> list[Case]:
    jpeg = _save(_photo(), "JPEG", quality=90)
    png = _save(_photo(), "PNG")
    builders: list[tuple[str, Callable[[], bytes], int]] = [
        ("empty file", lambda: b"", 400),
        ("plain text", lambda: b"hello, this is not an image\n" * 10, 400),
        ("html", lambda: b"<!doctype html><html><body>hi</body></html>", 400),
        ("json", lambda: b'{"image": "cat.jpg"}', 400),
        ("random bytes", lambda: np.random.default_rng(7).bytes(5000), 400),
        ("truncated jpeg", lambda: jpeg[: len(jpeg) // 3], 400),
        ("truncated png", lambda: png[: len(png) // 2], 400),
        ("jpeg header only", lambda: jpeg[:20], 400),
        ("png signature only", lambda: b"\x89PNG\r\n\x1a\n", 400),
        ("polyglot jpeg+zip", lambda: jpeg + b"PK\x03\x04" + b"\x00" * 100, 200),
        (
            "polyglot gif+script",
            lambda: _save(_photo(), "GIF") + b"/*<script>alert(1)</script>*/",
            200,
        ),
        ("tiff", lambda: _save(_photo(), "TIFF"), 415),
        ("ico", lambda: _save(_photo(32, 32), "ICO"), 415),
        ("psd header", lambda: b"8BPS\x00\x01" + b"\x00" * 200, 415),
        ("pdf", lambda: b"%PDF-1.4\n%\xe2\xe3\xcf\xd3\n1 0 obj\n<<>>\nendobj\n", 415),
        ("svg", lambda: b'<svg xmlns="http://www.w3.org/2000/svg" width="10" height="10"/>', 415),
        ("png bomb header 100000x100000", lambda: _png_header_only(100_000, 100_000), 413),
        ("png bomb 8000x6000 of zeros", _zero_png_bomb, 413),
        ("mode 1", lambda: _save(_photo().convert("1"), "PNG"), 200),
        ("mode L", lambda: _save(_photo().convert("L"), "PNG"), 200),
        ("mode LA", lambda: _save(_photo().convert("LA"), "PNG"), 200),
        ("mode P", lambda: _save(_photo().convert("P"), "PNG"), 200),
        (
            "mode P with transparency",
            lambda: _save(_photo().convert("P"), "PNG", transparency=0),
            200,
        ),
        ("mode RGBA", lambda: _save(_photo().convert("RGBA"), "PNG"), 200),
        ("mode CMYK jpeg", lambda: _save(_photo().convert("CMYK"), "JPEG"), 200),
        ("mode I;16 png", _sixteen_bit, 200),
        ("grayscale jpeg", lambda: _save(_photo().convert("L"), "JPEG"), 200),
        ("progressive jpeg", lambda: _save(_photo(), "JPEG", progressive=True), 200),
        ("webp lossy", lambda: _save(_photo(), "WEBP", quality=80), 200),
        ("webp lossless", lambda: _save(_photo(), "WEBP", lossless=True), 200),
        ("bmp", lambda: _save(_photo(), "BMP"), 200),
        ("gif", lambda: _save(_photo(), "GIF"), 200),
        ("animated gif", lambda: _animated("GIF"), 200),
        ("animated webp", lambda: _animated("WEBP"), 200),
        ("1x1", lambda: _save(Image.new("RGB", (1, 1), (9, 9, 9)), "PNG"), 200),
        ("10000x1", lambda: _save(Image.new("RGB", (10000, 1), (200, 0, 0)), "PNG"), 200),
        ("1x10000", lambda: _save(Image.new("RGB", (1, 10000), (0, 200, 0)), "PNG"), 200),
        ("png named .jpg", lambda: png, 200),
        ("large 4000x3000 jpeg", lambda: _save(_photo(4000, 3000), "JPEG", quality=85), 200),
    ]
    cases = [(name, build(), status) for name, build, status in builders]
    cases += [(f"exif orientation {o}", _with_orientation(o), 200) for o in range(1, 9)]
    return cases
