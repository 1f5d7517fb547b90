"""The Open Inference Protocol (KServe v2) routes, against real worker processes."""

from __future__ import annotations

import base64
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import pytest_asyncio

from tests.conftest import distinct_images, expected_for, images_run, running_app
from tests.models import TINY_DIM

pytestmark = [pytest.mark.slow, pytest.mark.asyncio(loop_scope="module")]


@pytest_asyncio.fixture(loop_scope="module", scope="module")
async def served(tiny_store: Path) -> AsyncIterator[tuple[Any, Any]]:
    async with running_app(model_store=tiny_store, cuda_devices="cpu", mb_worker_num=1) as pair:
        yield pair


def _infer_body(images: list[bytes], **extra: Any) -> dict[str, Any]:
    data = [base64.b64encode(image).decode() for image in images]
    inputs = [{"name": "image", "datatype": "BYTES", "shape": [len(data)], "data": data}]
    return {"inputs": inputs, **extra}


async def test_health_and_readiness(served: tuple[Any, Any]) -> None:
    app, client = served
    assert (await client.get("/v2/health/live")).status_code == 200
    assert (await client.get("/v2/health/ready")).json() == {"ready": True}
    assert (await client.get("/v2/models/tiny-test/ready")).status_code == 200
    app.state.closing = True  # as after SIGTERM
    try:
        assert (await client.get("/v2/health/ready")).status_code == 503
        assert (await client.get("/v2/models/tiny-test/ready")).status_code == 503
    finally:
        app.state.closing = False
    assert (await client.get("/v2")).json()["name"] == "microbatch-server"


async def test_model_metadata_shows_shapes_and_datatypes(served: tuple[Any, Any]) -> None:
    _, client = served
    metadata = (await client.get("/v2/models/tiny-test")).json()
    assert metadata["name"] == "tiny-test"
    assert metadata["versions"] == ["1"]  # a lone store: version 1 of its model
    assert metadata["inputs"] == [{"name": "image", "datatype": "BYTES", "shape": [-1]}]
    outputs = {o["name"]: (o["datatype"], o["shape"]) for o in metadata["outputs"]}
    assert outputs == {
        "embedding": ("FP32", [-1, TINY_DIM]),
        "top_k_probs": ("FP32", [-1, -1]),
        "top_k_indices": ("INT64", [-1, -1]),
    }
    missing = await client.get("/v2/models/resnet50")
    assert missing.status_code == 404 and missing.json()["error"]["type"] == "model_not_found"


async def test_infer_answers_what_the_rest_routes_answer(
    served: tuple[Any, Any], tiny_store: Path
) -> None:
    _, client = served
    images = distinct_images(2)
    body = _infer_body(
        images,
        id="req-1",
        outputs=[{"name": "embedding"}, {"name": "top_k_indices"}, {"name": "top_k_probs"}],
        parameters={"k": 3},
    )
    response = await client.post("/v2/models/tiny-test/infer", json=body)
    assert response.status_code == 200, response.text
    answer = response.json()
    assert answer["id"] == "req-1" and answer["model_name"] == "tiny-test"
    outputs = {o["name"]: o for o in answer["outputs"]}
    embedding = outputs["embedding"]
    assert embedding["datatype"] == "FP32" and embedding["shape"] == [2, TINY_DIM]
    rows = np.array(embedding["data"], dtype=np.float32).reshape(2, TINY_DIM)
    for row, image in zip(rows, images, strict=True):
        np.testing.assert_allclose(row, expected_for(image, tiny_store), atol=1e-5)
    files = [("image", ("a.png", images[0])), ("image", ("b.png", images[1]))]
    vectors = await client.post("/predict/embedding", files=files)
    np.testing.assert_allclose(rows, vectors.json(), rtol=1e-6, atol=1e-6)
    tags = await client.post("/predict/tag", files=files, data={"k": "3"})
    classes = (await client.get("/tags")).json()
    assert outputs["top_k_indices"]["datatype"] == "INT64"
    assert outputs["top_k_indices"]["shape"] == outputs["top_k_probs"]["shape"] == [2, 3]
    indices = np.array(outputs["top_k_indices"]["data"]).reshape(2, 3)
    assert [[classes[i] for i in row] for row in indices] == [
        [t["name"] for t in row] for row in tags.json()
    ]
    probs = np.array(outputs["top_k_probs"]["data"]).reshape(2, 3)
    np.testing.assert_allclose(probs, [[t["prob"] for t in row] for row in tags.json()], atol=1e-6)


@pytest.mark.parametrize(
    "asked",
    [
        ["embedding"],
        ["top_k_indices"],
        ["top_k_probs", "top_k_indices"],
        ["embedding", "top_k_probs", "top_k_indices"],
    ],
)
async def test_infer_runs_each_image_through_the_model_once_whatever_outputs_are_asked(
    served: tuple[Any, Any], asked: list[str]
) -> None:
    _, client = served
    images = distinct_images(3)
    before = await images_run(client)
    body = _infer_body(images, outputs=[{"name": name} for name in asked])
    response = await client.post("/v2/models/tiny-test/infer", json=body)
    assert response.status_code == 200, response.text
    assert [output["name"] for output in response.json()["outputs"]] == [
        name for name in ("embedding", "top_k_probs", "top_k_indices") if name in asked
    ]
    ran = await images_run(client) - before
    assert ran == len(images), f"{ran:.0f} images went through the model for {len(images)}"


@pytest.mark.parametrize(
    ("body", "status", "kind"),
    [
        ({"inputs": []}, 422, "invalid_request"),
        (
            {"inputs": [{"name": "image", "datatype": "FP32", "shape": [1], "data": ["x"]}]},
            422,
            "invalid_request",
        ),
        (
            _infer_body([b"x"]) | {"parameters": {"k": 0}, "outputs": [{"name": "top_k_probs"}]},
            422,
            "invalid_request",
        ),
        (
            {
                "inputs": [
                    {"name": "image", "datatype": "BYTES", "shape": [1], "data": ["not base64!"]}
                ]
            },
            422,
            "invalid_request",
        ),
        (
            {"inputs": [{"name": "image", "datatype": "BYTES", "shape": [2], "data": ["eA=="]}]},
            422,
            "invalid_request",
        ),
        (_infer_body([b"not an image"]), 400, "invalid_image"),
        (_infer_body([b"x"] * 65), 413, "payload_too_large"),  # MAX_IMAGES_PER_REQUEST is 64
    ],
)
async def test_bad_infer_requests_get_the_usual_error_shape(
    served: tuple[Any, Any], body: dict[str, Any], status: int, kind: str
) -> None:
    _, client = served
    response = await client.post("/v2/models/tiny-test/infer", json=body)
    assert response.status_code == status
    assert response.json()["error"]["type"] == kind
