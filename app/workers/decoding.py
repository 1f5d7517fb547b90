"""Decoding uploads in a worker, when batches arrive encoded (``MB_DECODE=worker|device``).

``Decoder`` runs the server's own ``preprocess`` (Pillow) on the worker's decode threads.

``DeviceDecoder`` (``MB_DECODE=device``) decodes JPEGs with ``torchvision.io.decode_jpeg`` on
the worker's device (nvJPEG on a GPU, in one batched call; libjpeg-turbo on the CPU), then
turns them upright, resizes and centre-crops them with tensor ops there. Pixels never cross
the PCIe bus, only the encoded bytes do. Other formats, and JPEGs the decoder cannot take
(CMYK), go through ``Decoder``. Its pixels differ from Pillow's by resampling detail only:
Pillow may decode a large JPEG at 1/2 to 1/8 scale (draft mode) and resamples from a
sub-pixel window, while here the JPEG is decoded at full size and the window is rounded to
whole pixels.
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
import torch
import torch.nn.functional as F
from PIL import Image

from app.errors import ServerError
from app.images import Header, center_crop_box, preprocess, read_header
from app.manifest import InputSpec
from app.workers.transfer import Errors

log = logging.getLogger("app.worker")


class Decoder:
    """Decodes a batch of uploads in this worker (``MB_DECODE=worker``): the same
    ``preprocess`` as the server's, on ``threads`` threads (Pillow releases the GIL)."""

    def __init__(self, spec: InputSpec, threads: int, max_pixels: int) -> None:
        self.spec = spec
        self.max_pixels = max_pixels
        self._pool = None
        if threads > 1:
            self._pool = ThreadPoolExecutor(threads, thread_name_prefix="decode")
        # Decoded rows land here, grown to the largest batch seen and reused.
        self._rows = np.empty((0, spec.crop_size, spec.crop_size, 3), dtype=np.uint8)

    def close(self) -> None:
        """Stop its threads (a model unloaded); idempotent."""
        if self._pool is not None:
            self._pool.shutdown(wait=False)
            self._pool = None

    def _one(self, data: bytes) -> npt.NDArray[np.uint8] | tuple[str, str]:
        try:
            return preprocess(data, self.spec, max_pixels=self.max_pixels)
        except ServerError as exc:  # a bad image: that item's own 4xx
            return (type(exc).__name__, str(exc))
        except Exception as exc:  # a decoder bug: this item fails alone
            log.error("decoding an upload failed:\n%s", traceback.format_exc())
            return ("InferenceError", f"{type(exc).__name__}: {exc}")

    def map(self, blobs: list[bytes]) -> Iterator[npt.NDArray[np.uint8] | tuple[str, str]]:
        """Each upload's pixels, or its ``(error class, message)``, in order. A lone upload
        is decoded on the calling thread: no hand-off to wait for."""
        if self._pool is None or len(blobs) < 2:
            return map(self._one, blobs)
        return self._pool.map(self._one, blobs)

    def decode(self, blobs: list[bytes]) -> tuple[npt.NDArray[np.uint8], Errors]:
        """``[n, crop, crop, 3]`` uint8 for the ``n`` uploads that decoded, in order (a view
        of this decoder's buffer, valid until the next call), and ``{position: (error class,
        message)}`` for the others."""
        if len(self._rows) < len(blobs):
            self._rows = np.empty((len(blobs), *self._rows.shape[1:]), dtype=np.uint8)
        rows, errors = 0, {}
        for position, result in enumerate(self.map(blobs)):
            if isinstance(result, tuple):
                errors[position] = result
            else:
                self._rows[rows] = result
                rows += 1
        return self._rows[:rows], errors


# Pillow modes of the JPEGs decoded on the device: YCbCr (reported as RGB) and greyscale.
DEVICE_JPEG_MODES = ("RGB", "L")


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
    ``spec.resize_size`` and the centre crop, in one antialiased resampling pass."""
    height, width = image.shape[-2:]
    left, top, right, bottom = (round(v) for v in center_crop_box(width, height, spec))
    window = image[:, top:bottom, left:right].unsqueeze(0).float()
    resized = F.interpolate(
        window,
        size=(spec.crop_size, spec.crop_size),
        mode=spec.interpolation,
        antialias=True,
        align_corners=False,
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
            if header.format == "JPEG" and header.mode in DEVICE_JPEG_MODES:
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
