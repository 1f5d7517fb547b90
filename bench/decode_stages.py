"""``python -m bench.decode_stages``: the CPU one image costs before the model, stage by stage.

    python -m bench.decode_stages                 # the bench photos, and camera-sized ones
    python -m bench.decode_stages --repeat 200

For each photo, each stage of the path ``app.images.preprocess`` takes is timed on this
thread's CPU clock (``time.thread_time``), the median of ``--repeat`` runs, one stage at a time
on the output of the one before: reading the header, decoding (at the reduced DCT scale
Pillow's ``draft`` picks), EXIF rotation, conversion to RGB, the fused resize and centre crop
(one resampling pass over the crop's source box), the array, and the copy into a batch
buffer's slot. The whole of ``preprocess`` is timed too, and set against the sum. Two
variants show what the cuts already made are worth: decoding at full scale (no ``draft``),
and resizing the whole image and then cropping (two passes). Then the workers' path
(``app.workers.decoding``): libjpeg-turbo at the same scale, torch's resize and crop into the
batch's row, and the whole of it; and a variant, libjpeg-turbo at the nearest eighth of a
scale that covers the target (what it picks by default), which decodes slower here.
Entropy decoding, the IDCT and colour conversion happen inside one libjpeg-turbo call and are
not timed apart; the decode at full scale against the draft scale shows what the reduced
IDCT and upsampling save. Photos: ``bench.systems``'
JPEGs (what ``make bench`` sends), and the same photos at camera size (2,000 pixels on the
long side) where the reduced DCT scale applies.
"""

from __future__ import annotations

import argparse
import io
import statistics
import time
from collections.abc import Callable
from typing import Any

import numpy as np
import simplejpeg
import torch
from PIL import Image, ImageOps

from app.images import _RESAMPLE, DEFAULT_MAX_PIXELS, center_crop_box, preprocess, read_header
from app.manifest import InputSpec
from app.workers.decoding import Decoder, draft_factor, resize_center_crop

SPEC = InputSpec(
    crop_size=224, resize_size=256, interpolation="bicubic", mean=(0.5,) * 3, std=(0.5,) * 3
)


def cpu_ms(work: Callable[[], Any], repeat: int) -> float:
    """Median CPU milliseconds of ``work()`` on this thread."""
    times = []
    for _ in range(repeat):
        began = time.thread_time()
        work()
        times.append(time.thread_time() - began)
    return 1000 * statistics.median(times)


def camera_sized(jpeg: bytes, long_side: int = 2000, quality: int = 85) -> bytes:
    """``jpeg`` scaled (bicubic) to ``long_side`` pixels on its long side, as a JPEG again."""
    image = Image.open(io.BytesIO(jpeg))
    scale = long_side / max(image.size)
    big = image.resize(
        (round(image.width * scale), round(image.height * scale)), Image.Resampling.BICUBIC
    )
    buffer = io.BytesIO()
    big.save(buffer, format="JPEG", quality=quality)
    return buffer.getvalue()


def stages(jpeg: bytes, repeat: int) -> dict[str, float]:
    """Milliseconds of CPU per stage, each on the output of the one before."""
    resample = _RESAMPLE[SPEC.interpolation]

    def opened() -> Image.Image:
        image = Image.open(io.BytesIO(jpeg))
        image.size  # noqa: B018 (the header is read here)
        return image

    def decoded(full: bool = False) -> Image.Image:
        image = opened()
        if not full:
            image.draft("RGB", (SPEC.resize_size, SPEC.resize_size))
        image.load()
        return image

    image = decoded()
    rotated = ImageOps.exif_transpose(image)
    rgb = rotated.convert("RGB") if rotated.mode != "RGB" else rotated
    box = center_crop_box(*rgb.size, SPEC)
    cropped = rgb.resize((SPEC.crop_size, SPEC.crop_size), resample, box=box)
    array = np.asarray(cropped, dtype=np.uint8)
    batch = np.empty((8, SPEC.crop_size, SPEC.crop_size, 3), dtype=np.uint8)

    def resize_then_crop() -> Any:
        scale = SPEC.resize_size / min(rgb.size)
        size = (round(rgb.width * scale), round(rgb.height * scale))
        resized = rgb.resize(size, resample)
        left, top = (size[0] - SPEC.crop_size) // 2, (size[1] - SPEC.crop_size) // 2
        return resized.crop((left, top, left + SPEC.crop_size, top + SPEC.crop_size)).load()

    figures = {
        "header": cpu_ms(opened, repeat),
        "decode": cpu_ms(decoded, repeat) - cpu_ms(opened, repeat),
        "exif rotation": cpu_ms(lambda: ImageOps.exif_transpose(image), repeat),
        "to RGB": cpu_ms(lambda: rotated.convert("RGB") if rotated.mode != "RGB" else None, repeat),
        "resize + crop (one pass)": cpu_ms(
            lambda: rgb.resize((SPEC.crop_size, SPEC.crop_size), resample, box=box), repeat
        ),
        "to array": cpu_ms(lambda: np.asarray(cropped, dtype=np.uint8), repeat),
        "into the batch slot": cpu_ms(lambda: np.copyto(batch[3], array), repeat),
    }
    figures["sum of stages"] = sum(figures.values())
    figures["preprocess()"] = cpu_ms(lambda: preprocess(jpeg, SPEC), repeat)
    figures["variant: decode at full scale"] = cpu_ms(lambda: decoded(full=True), repeat) - cpu_ms(
        opened, repeat
    )
    figures["variant: resize, then crop"] = cpu_ms(resize_then_crop, repeat)
    figures.update(worker_stages(jpeg, repeat))
    return figures


def worker_stages(jpeg: bytes, repeat: int) -> dict[str, float]:
    """The workers' path (``app.workers.decoding``), stage by stage: libjpeg-turbo at the
    draft scale, torch's resize and crop into the batch's row, and the whole of it; and
    libjpeg-turbo at the nearest eighth that still covers the target (its default choice)."""
    header = read_header(jpeg)
    factor = draft_factor(header.width, header.height, SPEC)
    low = {"min_height": -(-header.height // factor), "min_width": -(-header.width // factor)}
    pixels = simplejpeg.decode_jpeg(jpeg, "RGB", **low)
    image = torch.from_numpy(pixels).permute(2, 0, 1)
    row = np.empty((SPEC.crop_size, SPEC.crop_size, 3), dtype=np.uint8)
    decoder = Decoder(SPEC, 1, DEFAULT_MAX_PIXELS)
    short = min(header.width, header.height)
    eighth = {"min_height": 0, "min_width": 0, "min_factor": 1.0}
    eighth["min_height" if header.height == short else "min_width"] = SPEC.resize_size
    try:
        return {
            "workers: header (Pillow)": cpu_ms(lambda: read_header(jpeg), repeat),
            "workers: decode (libjpeg-turbo)": cpu_ms(
                lambda: simplejpeg.decode_jpeg(jpeg, "RGB", **low), repeat
            ),
            "workers: resize + crop (torch uint8)": cpu_ms(
                lambda: torch.from_numpy(row).copy_(
                    resize_center_crop(image, SPEC).permute(1, 2, 0)
                ),
                repeat,
            ),
            "workers: whole path": cpu_ms(lambda: decoder.one(jpeg, row), repeat),
            "variant: libjpeg-turbo at the nearest eighth": cpu_ms(
                lambda: simplejpeg.decode_jpeg(jpeg, "RGB", **eighth), repeat
            ),
        }
    finally:
        decoder.close()


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m bench.decode_stages", description=__doc__)
    parser.add_argument("--repeat", type=int, default=50, help="runs per stage (median)")
    args = parser.parse_args(argv)
    from bench.systems import bench_jpegs

    torch.set_num_threads(1)  # one thread's CPU clock sees all of the resize
    photos = bench_jpegs(4)
    sets = {"bench photos": photos, "camera-sized": [camera_sized(p) for p in photos]}
    for title, jpegs in sets.items():
        sizes = [Image.open(io.BytesIO(j)).size for j in jpegs]
        shown = [f"{w}x{h} {len(j) // 1024} KB" for (w, h), j in zip(sizes, jpegs, strict=True)]
        print(f"\n{title}: {', '.join(shown)}")
        rows = [stages(jpeg, args.repeat) for jpeg in jpegs]
        header = " | ".join(f"{w}x{h}" for w, h in sizes)
        print(f"| stage (ms of CPU per image) | {header} | mean |")
        print("|---|" + "---|" * (len(jpegs) + 1))
        for stage in rows[0]:
            values = [row[stage] for row in rows]
            cells = " | ".join(f"{v:.3f}" for v in values)
            print(f"| {stage} | {cells} | {statistics.mean(values):.3f} |")
        ratio = statistics.mean(r["preprocess()"] for r in rows) / statistics.mean(
            r["sum of stages"] for r in rows
        )
        print(f"preprocess() / sum of stages: {ratio:.2f}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
