"""Decoding uploads in a worker, when batches arrive encoded (``MB_DECODE=worker|device``,
and ``auto``).

``Decoder`` decodes on the worker's CPU threads, each upload straight into its row of the
batch. A JPEG (the common upload) takes the fast path: libjpeg-turbo through ``simplejpeg``
(no GIL held), at the reduced DCT scale Pillow's ``draft`` would pick, then turned upright
and resized and centre-cropped in one antialiased pass by torch's uint8 kernel (vectorised,
where Pillow's resampling is not). Every other format, a CMYK JPEG, and a JPEG libjpeg-turbo
refuses go through the server's own ``preprocess`` (Pillow), which also gives a bad upload
its 4xx. Both resample the same window (``center_crop_box``) with the same filter; their
pixels differ by rounding detail only, which ``tests/integration/test_decode_accuracy.py``
bounds in a real model's answers. A store whose preprocessing is torchvision's resize then
crop (``InputSpec.resize``: an imported TorchServe archive) goes through ``preprocess``
whatever its format (``turbo_decodes``): its answers are the stock handler's, not nearly.

``DeviceDecoder`` (``MB_DECODE=device``) decodes JPEGs with ``torchvision.io.decode_jpeg`` on
the worker's device (nvJPEG on a GPU, in one batched call; libjpeg-turbo on the CPU), then
turns them upright, resizes and centre-crops them with tensor ops there. Pixels never cross
the PCIe bus, only the encoded bytes do. Other formats, JPEGs the decoder cannot take
(CMYK), and every upload of a store that ``turbo_decodes`` leaves to Pillow go through
``Decoder``. Its pixels differ from Pillow's by resampling detail only:
Pillow may decode a large JPEG at 1/2 to 1/8 scale (draft mode), while here the JPEG is
decoded at full size.
"""

from __future__ import annotations

import io
import logging
import traceback
import warnings
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from typing import Any

import numpy as np
import numpy.typing as npt
import simplejpeg
import torch
import torch.nn.functional as F
from PIL import Image

from app.errors import ServerError
from app.images import Header, center_crop_box, preprocess, read_header
from app.manifest import InputSpec
from app.workers.transfer import Errors

log = logging.getLogger("app.worker")


class Decoder:
    """Decodes a batch of uploads in this worker (``MB_DECODE=worker``), on ``threads``
    threads: JPEGs by ``decode_jpeg``, everything else by the server's ``preprocess``."""

    def __init__(self, spec: InputSpec, threads: int, max_pixels: int) -> None:
        self.spec = spec
        self.max_pixels = max_pixels
        # Every upload is decoded on these threads, a lone one too: the caller's thread would
        # resize on its OpenMP team, which then spins for milliseconds while the model runs
        # (OpenVINO's threads are not OpenMP's), for a hand-off that costs microseconds.
        self._pool: ThreadPoolExecutor | None = ThreadPoolExecutor(
            max(1, threads), thread_name_prefix="decode", initializer=_serial_torch
        )
        # Decoded rows land here, grown to the largest batch seen and reused.
        self._rows = np.empty((0, spec.crop_size, spec.crop_size, 3), dtype=np.uint8)

    def close(self) -> None:
        """Stop its threads (a model unloaded); idempotent."""
        if self._pool is not None:
            self._pool.shutdown(wait=False)
            self._pool = None

    def one(self, data: bytes, out: npt.NDArray[np.uint8]) -> tuple[str, str] | None:
        """Decode ``data`` into ``out`` (``[crop, crop, 3]`` uint8); ``None``, or the
        upload's ``(error class, message)``."""
        try:
            header = read_header(data, max_pixels=self.max_pixels)
            if not turbo_decodes(header, self.spec):
                out[...] = preprocess(data, self.spec, max_pixels=self.max_pixels)
                return None
            try:
                decode_jpeg(data, header, self.spec, out)
            except ValueError:  # libjpeg-turbo refused it: Pillow decodes it, or says why not
                out[...] = preprocess(data, self.spec, max_pixels=self.max_pixels)
            return None
        except ServerError as exc:  # a bad image: that item's own 4xx
            return (type(exc).__name__, str(exc))
        except Exception as exc:  # a decoder bug: this item fails alone
            log.error("decoding an upload failed:\n%s", traceback.format_exc())
            return ("InferenceError", f"{type(exc).__name__}: {exc}")

    def pixels(self, data: bytes) -> npt.NDArray[np.uint8] | tuple[str, str]:
        """One upload's ``[crop, crop, 3]`` pixels in an array of its own, or its error."""
        out = np.empty(self._rows.shape[1:], dtype=np.uint8)
        return self.one(data, out) or out

    def map(self, blobs: list[bytes]) -> Iterator[npt.NDArray[np.uint8] | tuple[str, str]]:
        """Each upload's pixels, or its ``(error class, message)``, in order."""
        return self._threads().map(self.pixels, blobs)

    def _threads(self) -> ThreadPoolExecutor:
        if self._pool is None:
            raise RuntimeError("this decoder is closed")
        return self._pool

    def decode(self, blobs: list[bytes]) -> tuple[npt.NDArray[np.uint8], Errors]:
        """``[n, crop, crop, 3]`` uint8 for the ``n`` uploads that decoded, in order (a view
        of this decoder's buffer, valid until the next call), and ``{position: (error class,
        message)}`` for the others. Each upload is decoded straight into its row: on this
        decoder's threads, or a lone upload on the caller's own where torch runs on that
        thread alone (no OpenMP team to spin there, and no hand-off: 0.1 ms less on a lone
        request, measured by ``python -m bench.lone``)."""
        if len(self._rows) < len(blobs):
            self._rows = np.empty((len(blobs), *self._rows.shape[1:]), dtype=np.uint8)
        rows = self._rows[: len(blobs)]
        if len(blobs) == 1 and torch.get_num_threads() == 1:
            self._threads()  # closed: refused here too
            results = [self.one(blobs[0], rows[0])]
        else:
            results = list(self._threads().map(self.one, blobs, rows))
        errors = {position: error for position, error in enumerate(results) if error is not None}
        if errors:  # rare: close the gaps the failed uploads left
            kept = [position for position in range(len(blobs)) if position not in errors]
            rows[: len(kept)] = rows[kept]
            rows = rows[: len(kept)]
        return rows, errors


def _serial_torch() -> None:
    """A decode thread runs its torch ops (the resize) on itself alone. Left to the default,
    each decode thread would start an OpenMP team of its own, and once GNU OpenMP manages
    more threads than there are cores it stops spinning between parallel regions everywhere:
    the model's batch-1 latency rose for the rest of the worker's life (docs/performance.md,
    2026-11-26). ``torch.set_num_threads`` sets the calling thread's OpenMP and MKL counts;
    the model's thread keeps its own."""
    torch.set_num_threads(1)


# Pillow modes of the JPEGs libjpeg-turbo decodes to RGB here and on a device: YCbCr
# (reported as RGB) and greyscale. CMYK and YCCK go through Pillow.
TURBO_JPEG_MODES = ("RGB", "L")


def turbo_decodes(header: Header, spec: InputSpec) -> bool:
    """Whether an upload takes the fast path (libjpeg-turbo, then torch's resize, on the CPU
    or a device) rather than Pillow's ``preprocess``: a JPEG libjpeg-turbo decodes to RGB,
    for a store that crops a window in one pass. A store with torchvision's resize-then-crop
    (an imported TorchServe archive) decodes and resizes with Pillow only: its pixels are
    then the stock handler's own."""
    return spec.resize == "window" and header.format == "JPEG" and header.mode in TURBO_JPEG_MODES


def draft_factor(width: int, height: int, spec: InputSpec) -> int:
    """The DCT scale divisor a JPEG is decoded at: the largest of 8, 4 and 2 that leaves both
    sides at least ``spec.resize_size``, else 1 (Pillow's ``draft`` rule). libjpeg-turbo can
    scale by other eighths too, but those decode slower, at times slower than full size
    (``python -m bench.decode_stages``)."""
    if not spec.reduced_decode:
        return 1
    scale = min(width, height) // spec.resize_size
    return next(factor for factor in (8, 4, 2) if scale >= factor) if scale >= 2 else 1


def decode_jpeg(data: bytes, header: Header, spec: InputSpec, out: npt.NDArray[np.uint8]) -> None:
    """Decode a JPEG, its ``header`` already read, into ``out`` (``[crop, crop, 3]`` uint8):
    at ``draft_factor``'s scale, turned upright, resized and centre-cropped. ValueError where
    libjpeg-turbo cannot decode it."""
    factor = draft_factor(header.width, header.height, spec)
    pixels = simplejpeg.decode_jpeg(
        data,
        "RGB",
        min_height=-(-header.height // factor),
        min_width=-(-header.width // factor),
    )
    image = upright(torch.from_numpy(pixels).permute(2, 0, 1), header.orientation)
    torch.from_numpy(out).copy_(resize_center_crop(image, spec).permute(1, 2, 0))


def _decode_jpeg(data: torch.Tensor | list[torch.Tensor], device: torch.device) -> Any:
    """``torchvision.io.decode_jpeg`` to RGB, imported on first use: importing torchvision
    takes about 2 s, which no process that never decodes on a device should pay."""
    from torchvision.io import ImageReadMode, decode_jpeg

    with warnings.catch_warnings():
        # torchvision >= 0.29 warns on every call that TorchCodec supersedes its decoders;
        # they still work, and they are what the pinned release ships.
        warnings.filterwarnings("ignore", category=DeprecationWarning, module="torchvision")
        return decode_jpeg(data, mode=ImageReadMode.RGB, device=device)


def upright(image: torch.Tensor, orientation: int) -> torch.Tensor:
    """``image`` ``[C, H, W]`` turned as its EXIF ``orientation`` (1-8) says, like Pillow's
    ``ImageOps.exif_transpose``."""
    if orientation in (5, 6, 7, 8):
        image = image.transpose(-1, -2)
    flips = {2: (-1,), 3: (-1, -2), 4: (-2,), 6: (-1,), 7: (-1, -2), 8: (-2,)}
    dims = flips.get(orientation)
    return image.flip(dims) if dims else image


def resize_center_crop(image: torch.Tensor, spec: InputSpec) -> torch.Tensor:
    """uint8 ``[3, H, W]`` -> uint8 ``[3, crop, crop]``: the shorter side scaled to
    ``spec.resize_size`` and the centre crop, in one antialiased resampling pass. On the CPU
    in uint8 (torch's SIMD kernel, which wants the channels last in memory, as decoded); on a
    device in float."""
    height, width = image.shape[-2:]
    left, top, right, bottom = center_crop_box(width, height, spec)
    window = image[:, top:bottom, left:right].unsqueeze(0)
    size = (spec.crop_size, spec.crop_size)
    if window.device.type == "cpu":
        window = window.contiguous(memory_format=torch.channels_last)
        return F.interpolate(
            window, size=size, mode=spec.interpolation, antialias=True, align_corners=False
        )[0]
    resized = F.interpolate(
        window.float(), size=size, mode=spec.interpolation, antialias=True, align_corners=False
    )
    return resized.round_().clamp_(0, 255).to(torch.uint8)[0]


class DeviceDecoder:
    """Decodes a batch of uploads into uint8 pixels on ``device``, each failure its own."""

    def __init__(
        self, spec: InputSpec, device: torch.device, fallback: Decoder, max_pixels: int
    ) -> None:
        self.spec = spec
        self.device = device
        self.fallback = fallback  # Pillow, for everything that is not a plain JPEG
        self.max_pixels = max_pixels

    def close(self) -> None:
        self.fallback.close()

    def warm_up(self) -> None:
        """Decode one small JPEG, so the first batch does not pay for the decoder's set-up
        (nvJPEG's handles and buffers on a GPU)."""
        sample = io.BytesIO()
        Image.new("RGB", (64, 48), (120, 60, 200)).save(sample, format="JPEG")
        _, errors = self.decode([sample.getvalue()])
        if errors:
            raise RuntimeError(f"decoding a JPEG on {self.device} failed: {errors[0][1]}")

    def decode(self, blobs: list[bytes]) -> tuple[torch.Tensor, Errors]:
        """``[n, crop, crop, 3]`` uint8 on the device for the ``n`` uploads that decoded, in
        order, and ``{position: (error class, message)}`` for the others."""
        errors: Errors = {}
        jpegs: list[tuple[int, Header]] = []
        others: list[int] = []
        for position, blob in enumerate(blobs):
            try:
                header = read_header(blob, max_pixels=self.max_pixels)
            except ServerError as exc:
                errors[position] = (type(exc).__name__, str(exc))
                continue
            if turbo_decodes(header, self.spec):
                jpegs.append((position, header))
            else:
                others.append(position)
        images = self._decode_jpegs(blobs, jpegs, errors)
        for position, result in zip(
            others, self.fallback.map([blobs[p] for p in others]), strict=True
        ):
            if isinstance(result, tuple):
                errors[position] = result
            else:
                images[position] = torch.tensor(result, device=self.device).permute(2, 0, 1)
        size = self.spec.crop_size
        rows = [images[position] for position in sorted(images)]
        batch = (
            torch.stack(rows)
            if rows
            else torch.empty((0, 3, size, size), dtype=torch.uint8, device=self.device)
        )
        return batch.permute(0, 2, 3, 1), errors  # NHWC, as the workers' input buffers are

    def _decode_jpegs(
        self, blobs: list[bytes], jpegs: list[tuple[int, Header]], errors: Errors
    ) -> dict[int, torch.Tensor]:
        if not jpegs:
            return {}
        encoded = [
            torch.frombuffer(bytearray(blobs[position]), dtype=torch.uint8) for position, _ in jpegs
        ]
        try:
            decoded: list[torch.Tensor | None] = list(_decode_jpeg(encoded, self.device))
        except torch.OutOfMemoryError:
            raise  # the device's trouble, not the images': the batch fails
        except RuntimeError:  # one bad JPEG fails the whole call: find it
            decoded = [
                self._decode_one(data, position, errors)
                for data, (position, _) in zip(encoded, jpegs, strict=True)
            ]
        return {
            position: resize_center_crop(upright(image, header.orientation), self.spec)
            for (position, header), image in zip(jpegs, decoded, strict=True)
            if image is not None
        }

    def _decode_one(self, data: torch.Tensor, position: int, errors: Errors) -> torch.Tensor | None:
        try:
            image = _decode_jpeg(data, self.device)
        except torch.OutOfMemoryError:
            raise
        except RuntimeError as exc:
            reason = str(exc).rsplit(", ", 1)[-1]  # drop the C++ source location
            errors[position] = ("InvalidImage", f"cannot decode the image: {reason}")
            return None
        assert isinstance(image, torch.Tensor)
        return image
