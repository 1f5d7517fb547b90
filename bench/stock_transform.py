"""``python -m bench.stock_transform``: what an imported TorchServe archive's preprocessing
costs in CPU against this server's own, per image.

    python -m bench.stock_transform
    python -m bench.stock_transform --repeat 50

Both are timed as a worker runs them (``app.workers.decoding.Decoder.one``, on this thread's
CPU clock, ``time.thread_time``, torch on one thread as in a decode thread; the median of
``--repeat`` runs), from the upload's bytes to the ``[224, 224, 3]`` pixels of the batch
row, at the same sizes (short side 256, crop 224, bilinear):

- ours: what this server's own exports do (``InputSpec.resize`` "window"): libjpeg-turbo
  at the reduced DCT scale Pillow's ``draft`` would pick, then the crop's window resampled in
  one pass by torch's uint8 kernel;
- stock: an imported archive's (``"pil-resize-then-crop"``, ``from_mar.STOCK_INPUT``): Pillow
  decodes at full size, resizes the whole image (torchvision's ``Resize(256)``), then crops
  (``CenterCrop(224)``), as TorchServe's stock handler does.

Normalisation (in the model's graph, batched) is the same for both and left out. Photos:
``bench.systems``' JPEGs (what ``make bench`` sends), the same at camera size (2,000 pixels
on the long side) and at a phone's 12 megapixels (4,032 x 3,024). Printed per photo: both
times, and how many times ours the stock one costs; then, per set, the geometric mean of
those ratios, and the CPU's model.
"""

from __future__ import annotations

import argparse
import io
import math
import platform
from pathlib import Path

import numpy as np
import torch
from PIL import Image

from app.exporters.base import IMAGENET_MEAN, IMAGENET_STD
from app.exporters.from_mar import STOCK_INPUT
from app.manifest import InputSpec
from app.workers.decoding import Decoder
from bench.decode_stages import camera_sized, cpu_ms
from bench.systems import bench_jpegs

OURS = InputSpec(
    crop_size=224, resize_size=256, interpolation="bilinear", mean=IMAGENET_MEAN, std=IMAGENET_STD
)


def cpu_model() -> str:
    """The CPU's model name, as ``lscpu`` gives it (``/proc/cpuinfo``'s first "model name")."""
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return line.partition(":")[2].strip()
    except OSError:
        pass
    return platform.processor() or "unknown CPU"


def phone_sized(jpeg: bytes, size: tuple[int, int] = (4032, 3024), quality: int = 85) -> bytes:
    """``jpeg`` resized to a phone camera's 12 megapixels, as a JPEG again."""
    image = Image.open(io.BytesIO(jpeg)).convert("RGB").resize(size, Image.Resampling.BICUBIC)
    buffer = io.BytesIO()
    image.save(buffer, format="JPEG", quality=quality)
    return buffer.getvalue()


def per_image_ms(decoder: Decoder, jpeg: bytes, repeat: int) -> float:
    out = np.empty(decoder.spec.image_shape, dtype=np.uint8)

    def decode() -> None:
        if decoder.one(jpeg, out) is not None:
            raise RuntimeError("the bench photo did not decode")

    decode()  # the first call pays for imports and allocations
    return cpu_ms(decode, repeat)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m bench.stock_transform", description=__doc__)
    parser.add_argument("--repeat", type=int, default=20, help="runs per photo and path")
    args = parser.parse_args(argv)
    torch.set_num_threads(1)  # as in a worker's decode thread (app.workers.decoding)
    ours, stock = Decoder(OURS, 1, 10**8), Decoder(STOCK_INPUT, 1, 10**8)
    photos = bench_jpegs(4)
    sets = {
        "bench photos": photos,
        "camera-sized": [camera_sized(photo) for photo in photos],
        "12 megapixels": [phone_sized(photo) for photo in photos],
    }
    print(f"CPU: {cpu_model()}, torch {torch.__version__}, one thread, median of {args.repeat}")
    print(f"{'set':<14} {'photo':>9} {'ours ms':>8} {'stock ms':>9} {'stock/ours':>10}")
    summary = {}
    try:
        for name, jpegs in sets.items():
            ratios = []
            for jpeg in jpegs:
                size = "x".join(map(str, Image.open(io.BytesIO(jpeg)).size))
                fast, exact = (per_image_ms(d, jpeg, args.repeat) for d in (ours, stock))
                ratios.append(exact / fast)
                print(f"{name:<14} {size:>9} {fast:>8.2f} {exact:>9.2f} {exact / fast:>9.2f}x")
            summary[name] = math.exp(sum(map(math.log, ratios)) / len(ratios))
    finally:
        ours.close()
        stock.close()
    for name, ratio in summary.items():
        print(f"{name}: the stock transform costs {ratio:.2f}x ours (geometric mean)")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
