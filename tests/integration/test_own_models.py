"""Serving a user's own model: an export with its own labels (from the command line, a timm
model other than the default), and an embedding-only one."""

from __future__ import annotations

import base64
import json
from pathlib import Path

import numpy as np
import pytest

from app.export import main as export_main
from app.manifest import read_manifest
from tests.answers import error_of
from tests.conftest import distinct_images, expected_for, images_run, running_app
from tests.models import export_embedding_only, export_tiny

pytestmark = pytest.mark.slow


async def test_an_export_with_three_labels_tags_with_them(tmp_path: Path) -> None:
    labels = tmp_path / "labels.txt"
    labels.write_text("tabby\nsiamese\npersian\n")
    store = tmp_path / "store"
    code = export_main(
        ["--arch", "timm:test_resnet", "--weights", "random", "--classes", str(labels),
         "--out", str(store)]
    )  # fmt: skip
    assert code == 0
    manifest = json.loads((store / "manifest.json").read_text())
    assert manifest["num_classes"] == 3
    import timm
    from timm.data.config import resolve_model_data_config

    config = resolve_model_data_config(timm.create_model("test_resnet"))  # type: ignore[no-untyped-call]  # timm leaves it unannotated
    assert manifest["input"]["crop_size"] == config["input_size"][-1]  # its own preprocessing
    assert tuple(manifest["input"]["mean"]) == pytest.approx(config["mean"])
    async with running_app(model_store=store, cuda_devices="cpu", mb_worker_num=1) as (
        _app,
        client,
    ):
        assert (await client.get("/tags")).json() == ["tabby", "siamese", "persian"]
        answer = await client.post(
            "/predict/tag", files={"image": ("a.png", distinct_images(1)[0])}, data={"k": "3"}
        )
        too_many = await client.post(
            "/predict/tag", files={"image": ("a.png", distinct_images(1)[0])}, data={"k": "4"}
        )
        # Without k: the default (5) cut to the model's 3 classes, in both APIs.
        default = await client.post(
            "/predict/tag", files={"image": ("a.png", distinct_images(1)[0])}
        )
        image = base64.b64encode(distinct_images(1)[0]).decode()
        infer = await client.post(
            "/v2/models/timm-test_resnet/infer",
            json={
                "inputs": [{"name": "image", "shape": [1], "datatype": "BYTES", "data": [image]}],
                "outputs": [{"name": "top_k_indices"}],
            },
        )
        # k above the classes, with both outputs: refused before any image runs.
        ran = await images_run(client)
        both_too_many = await client.post(
            "/v2/models/timm-test_resnet/infer",
            json={
                "inputs": [{"name": "image", "shape": [1], "datatype": "BYTES", "data": [image]}],
                "outputs": [{"name": "embedding"}, {"name": "top_k_probs"}],
                "parameters": {"k": 4},
            },
        )
        ran_after = await images_run(client)
        info = (await client.get("/info")).json()
    assert both_too_many.status_code == 422, both_too_many.text
    assert error_of(both_too_many)["type"] == "invalid_parameter"
    assert ran_after == ran
    assert answer.status_code == 200
    assert sorted(tag["name"] for tag in answer.json()) == ["persian", "siamese", "tabby"]
    assert sum(tag["prob"] for tag in answer.json()) == pytest.approx(1.0, abs=1e-5)
    assert too_many.status_code == 422 and error_of(too_many)["type"] == "invalid_parameter"
    assert "between 1 and 3, got 4" in error_of(too_many)["message"]
    assert default.status_code == 200, default.text
    assert sorted(tag["name"] for tag in default.json()) == ["persian", "siamese", "tabby"]
    assert infer.status_code == 200, infer.text
    (indices,) = infer.json()["outputs"]
    assert indices["shape"] == [1, 3] and sorted(indices["data"]) == [0, 1, 2]
    assert info["model_id"] == read_manifest(store).model_id
    assert info["model"]["arch"] == "timm:test_resnet"


async def test_an_embedding_only_model_embeds_and_says_it_cannot_tag(tmp_path: Path) -> None:
    store = export_embedding_only(tmp_path / "backbone")
    image = distinct_images(1)[0]
    async with running_app(model_store=store, cuda_devices="cpu", mb_worker_num=1) as (
        _app,
        client,
    ):
        embedding = await client.post("/predict/embedding", files={"image": ("a.png", image)})
        tag = await client.post("/predict/tag", files={"image": ("a.png", image)})
        tags = await client.get("/tags")
        metadata = (await client.get("/v2/models/tiny-backbone")).json()
    assert embedding.status_code == 200
    np.testing.assert_allclose(embedding.json(), expected_for(image, store), atol=1e-5)
    for refused in (tag, tags):
        assert refused.status_code == 404
        assert error_of(refused)["type"] == "no_classifier"
        assert "no classifier" in error_of(refused)["message"]
    assert [output["name"] for output in metadata["outputs"]] == ["embedding"]


async def test_the_same_export_keeps_its_id_and_another_export_gets_another(
    tmp_path: Path, slow_store: Path
) -> None:
    first, other = export_tiny(tmp_path / "a"), slow_store  # another model, not its timing
    ids = []
    for store in (first, first, other):  # the first export served twice, then another
        async with running_app(model_store=store, cuda_devices="cpu", mb_worker_num=1) as (
            _,
            client,
        ):
            response = await client.post(
                "/predict/embedding", files={"image": ("a.png", distinct_images(1)[0])}
            )
            ids.append(response.headers["x-model-id"])
    assert ids[0] == ids[1] == read_manifest(first).model_id
    assert ids[2] != ids[0] and ids[2].startswith("slow-test@")
