"""TorchServe archives made by the real ``torch-model-archiver``, imported with
``python -m app.export --from-mar`` and served: the answers equal what TorchServe's stock
``image_classifier`` handler computes for the same photos and odd uploads (its transform,
softmax and top 5, run in-process: ``tests.torchserve``), through TorchServe's own
inference API and through ``/predict/tag``. These archives have random weights (a split
ResNet-18, a CNN served whole); a trained model's: ``test_mar_trained.py``."""

from __future__ import annotations

from collections.abc import Iterator

import httpx
import pytest
import torch
import torchvision

from app.export import main as export_main
from tests.server import ServerProcess
from tests.torchserve import ODD, PHOTOS, TOLERANCE, archive, imagenet_classes, stock_handler
from tests.unit.test_mar import Pooled

pytestmark = pytest.mark.slow

References = dict[str, tuple[torch.jit.ScriptModule, list[str]]]


@pytest.fixture(scope="module")
def served(tmp_path_factory: pytest.TempPathFactory) -> Iterator[tuple[str, References]]:
    folder = tmp_path_factory.mktemp("mar")
    torch.manual_seed(0)
    imagenet = imagenet_classes()
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
    for photo_name, photo in (PHOTOS | ODD).items():
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


def test_a_version_is_named_as_torchserve_clients_name_it(served: tuple[str, References]) -> None:
    """``/predictions/{name}/{version}`` takes the archive's own version (``1.0``, what
    torch-model-archiver was given), as well as the repository's number (it was 409)."""
    base_url, _ = served
    photo = PHOTOS["cat.jpg"]
    by_archive = httpx.post(f"{base_url}/predictions/cnn/1.0", content=photo)
    by_number = httpx.post(f"{base_url}/predictions/cnn/1", content=photo)
    assert by_archive.status_code == by_number.status_code == 200, by_archive.text
    archived, numbered = by_archive.json(), by_number.json()
    assert list(archived) == list(numbered)  # the same top 5, in order
    assert archived == pytest.approx(numbered, abs=TOLERANCE)
    assert httpx.post(f"{base_url}/predictions/cnn/2.0", content=photo).status_code == 409
