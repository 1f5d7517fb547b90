"""TorchServe archives made by the real ``torch-model-archiver``, imported with
``python -m app.export --from-mar`` and served: the answers equal what TorchServe's stock
``image_classifier`` handler computes for the same photos (its documented transform,
softmax and top 5, written below from its documentation), through TorchServe's own
inference API and through ``/predict/tag``."""

from __future__ import annotations

import io
import json
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import httpx
import numpy as np
import pytest
import torch
import torchvision
from PIL import Image
from skimage import data
from torchvision import transforms

from app.export import main as export_main
from tests.children import dies_with_run
from tests.conftest import jpeg
from tests.server import REPO, ServerProcess
from tests.unit.test_mar import Pooled

pytestmark = pytest.mark.slow

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
References = dict[str, tuple[torch.jit.ScriptModule, list[str]]]


def png(pixels: np.ndarray) -> bytes:
    buffer = io.BytesIO()
    Image.fromarray(pixels).save(buffer, "PNG")
    return buffer.getvalue()


PHOTOS = {
    "cat.jpg": jpeg(data.chelsea()),  # type: ignore[no-untyped-call]
    "espresso.jpg": jpeg(data.coffee()),  # type: ignore[no-untyped-call]
    "astronaut.jpg": jpeg(data.astronaut()),  # type: ignore[no-untyped-call]  # 512 px: 1/2 DCT
    "cat.png": png(data.chelsea()),  # type: ignore[no-untyped-call]
}


def stock_handler(
    model: torch.jit.ScriptModule, classes: list[str], photo: bytes
) -> dict[str, float]:
    """What TorchServe's image_classifier answers: PIL, its transform, softmax, top 5."""
    image = Image.open(io.BytesIO(photo)).convert("RGB")
    with torch.inference_mode():
        probabilities = torch.softmax(model(STOCK_TRANSFORM(image).unsqueeze(0)), dim=1)[0]
    values, indices = probabilities.topk(min(5, len(classes)))
    return {classes[int(i)]: float(v) for v, i in zip(values, indices, strict=True)}


def archive(folder: Path, name: str, model: torch.nn.Module, classes: object) -> Path:
    """A .mar made by torch-model-archiver from ``model`` scripted, with its classes."""
    work = folder / name
    work.mkdir()
    torch.jit.save(torch.jit.script(model.eval()), str(work / f"{name}.pt"))
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


@pytest.fixture(scope="module")
def served(tmp_path_factory: pytest.TempPathFactory) -> Iterator[tuple[str, References]]:
    folder = tmp_path_factory.mktemp("mar")
    torch.manual_seed(0)
    imagenet = [line.strip() for line in (REPO / "imagenet_classes.txt").read_text().splitlines()]
    resnet = torchvision.models.resnet18().eval()  # random weights, 1000 classes
    cnn = Pooled(classes=10).eval()  # no linear head: served whole
    models = {
        "resnet18": (
            resnet,
            {str(i): [f"n{i:08d}", label] for i, label in enumerate(imagenet)},
            imagenet,
        ),
        "cnn": (cnn, {str(i): f"class {i}" for i in range(10)}, [f"class {i}" for i in range(10)]),
    }
    repository = folder / "repository"
    for name, (model, mapping, _) in models.items():
        mar = archive(folder, name, model, mapping)
        args = ["--from-mar", str(mar), "--repository", str(repository), "--name", name]
        assert export_main(args) == 0
    env = {"MODEL_REPOSITORY": str(repository), "MB_DTYPE": "float32"}
    with ServerProcess(**env) as server:
        references = {
            name: (torch.jit.load(str(folder / name / f"{name}.pt")), labels)  # type: ignore[no-untyped-call]
            for name, (_, _, labels) in models.items()
        }
        yield server.base_url, references


@pytest.mark.parametrize("name", ["resnet18", "cnn"])
def test_the_predictions_api_answers_as_the_stock_handler(
    served: tuple[str, References], name: str
) -> None:
    base_url, references = served
    model, classes = references[name]
    for photo_name, photo in PHOTOS.items():
        expected = stock_handler(model, classes, photo)
        for answer in (
            httpx.post(f"{base_url}/predictions/{name}", content=photo),  # curl --data-binary
            httpx.put(f"{base_url}/predictions/{name}", content=photo),  # curl -T
            httpx.post(f"{base_url}/predictions/{name}", files={"data": ("p", photo)}),
        ):
            assert answer.status_code == 200, answer.text
            got = answer.json()
            assert list(got) == list(expected), photo_name  # the same top 5, in order
            for label, probability in expected.items():
                assert got[label] == pytest.approx(probability, abs=TOLERANCE), photo_name
        tagged = httpx.post(
            f"{base_url}/predict/tag?model={name}&k=5", files={"image": ("p", photo)}
        ).json()
        assert [tag["name"] for tag in tagged] == list(expected)


def test_a_split_import_embeds_and_a_whole_one_says_it_cannot(
    served: tuple[str, References],
) -> None:
    base_url, _ = served
    photo = PHOTOS["cat.jpg"]
    headers = {"Content-Type": "image/jpeg"}
    split = httpx.post(
        f"{base_url}/predict/embedding?model=resnet18", content=photo, headers=headers
    )
    assert split.status_code == 200 and len(split.json()) == 512
    whole = httpx.post(f"{base_url}/predict/embedding?model=cnn", content=photo, headers=headers)
    assert whole.status_code == 404
    assert whole.json()["error"]["type"] == "no_embedding"
    outputs = httpx.get(f"{base_url}/v2/models/cnn").json()["outputs"]
    assert [output["name"] for output in outputs] == ["top_k_probs", "top_k_indices"]
    info = httpx.get(f"{base_url}/v2/models/resnet18").json()["outputs"]
    assert info[0]["name"] == "embedding"


def test_torchserves_health_and_model_list_forms(served: tuple[str, References]) -> None:
    base_url, _ = served
    assert httpx.get(f"{base_url}/ping").json() == {"status": "Healthy"}
    assert httpx.get(f"{base_url}/models").json() == {
        "models": [
            {"modelName": "cnn", "modelUrl": "cnn.mar"},
            {"modelName": "resnet18", "modelUrl": "resnet18.mar"},
        ]
    }
    missing = httpx.post(f"{base_url}/predictions/nobody", content=PHOTOS["cat.jpg"])
    assert missing.status_code == 404
