"""Several images in one request, binary embeddings and the model's identity on every
answer, against real worker processes."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import pytest_asyncio

from tests.answers import error_of
from tests.conftest import distinct_images, embed, expected_for, running_app
from tests.models import TINY_DIM
from tests.transports import Watched, wait_queued

pytestmark = [pytest.mark.slow, pytest.mark.asyncio(loop_scope="module")]

CAP = 8
WATCHED = Watched()  # the served app's transport, wrapped: tests see and hold its batches


@pytest_asyncio.fixture(loop_scope="module", scope="module")
async def served(tiny_store: Path) -> AsyncIterator[tuple[Any, Any]]:
    async with running_app(
        WATCHED.wrap,
        model_store=tiny_store,
        cuda_devices="cpu",
        mb_worker_num=1,
        mb_batch_size=4,
        max_images_per_request=CAP,
    ) as pair:
        yield pair


def _form(images: list[bytes], names: list[str] | None = None) -> list[tuple[str, Any]]:
    names = names or [f"img{i}.png" for i in range(len(images))]
    return [("image", (name, data)) for name, data in zip(names, images, strict=True)]


async def test_three_images_come_back_in_order_each_as_when_alone(
    served: tuple[Any, Any], tiny_store: Path
) -> None:
    _, client = served
    images = distinct_images(3)
    response = await client.post("/predict/embedding", files=_form(images))
    assert response.status_code == 200
    vectors = response.json()
    assert len(vectors) == 3
    for vector, data in zip(vectors, images, strict=True):
        np.testing.assert_allclose(vector, expected_for(data, tiny_store), atol=1e-5)
        np.testing.assert_allclose(vector, await embed(client, data), atol=1e-6)
    tags = await client.post("/predict/tag", files=_form(images), data={"k": "2"})
    assert tags.status_code == 200 and [len(t) for t in tags.json()] == [2, 2, 2]
    for answer, data in zip(tags.json(), images, strict=True):
        alone = await client.post("/predict/tag", files={"image": ("x.png", data)}, data={"k": "2"})
        # The same classes, the probabilities to float32 rounding: a batch of three and a lone
        # image go through different kernels, which round differently on some CPUs.
        assert [t["name"] for t in answer] == [t["name"] for t in alone.json()]
        np.testing.assert_allclose(
            [t["prob"] for t in answer], [t["prob"] for t in alone.json()], rtol=1e-5
        )


async def test_a_request_with_more_images_than_a_batch_comes_back_whole(
    served: tuple[Any, Any], tiny_store: Path
) -> None:
    """Batches hold 4: the 8 images of one request (with another request's beside them)
    are spread over several batches, and still come back whole and in order."""
    app, client = served
    images = distinct_images(CAP + 1)
    ran = len(WATCHED.batches)
    WATCHED.hold()
    first = asyncio.create_task(embed(client, images[-1]))
    await WATCHED.wait_entered()
    many = asyncio.create_task(client.post("/predict/embedding", files=_form(images[:CAP])))
    await wait_queued(app, CAP)
    WATCHED.release()
    await first
    response = await many
    assert response.status_code == 200
    assert [size for _, size in WATCHED.batches[ran:]] == [1, 4, 4]
    for vector, data in zip(response.json(), images[:CAP], strict=True):
        np.testing.assert_allclose(vector, expected_for(data, tiny_store), atol=1e-5)


async def test_one_bad_image_fails_the_request_naming_it(served: tuple[Any, Any]) -> None:
    _, client = served
    good = distinct_images(2)
    response = await client.post(
        "/predict/tag",
        files=_form([good[0], good[1][:60], good[1]], ["a.png", "broken.png", "c.png"]),
    )
    assert response.status_code == 400
    error = error_of(response)
    assert error["type"] == "invalid_image"
    assert error["message"].startswith("image 1 ('broken.png'): ")


async def test_more_images_than_the_cap_is_413(served: tuple[Any, Any]) -> None:
    _, client = served
    response = await client.post("/predict/embedding", files=_form(distinct_images(CAP + 1)))
    assert response.status_code == 413
    assert error_of(response)["type"] == "payload_too_large"
    assert f"at most {CAP} images" in error_of(response)["message"]


async def test_binary_embeddings_equal_the_json_ones(served: tuple[Any, Any]) -> None:
    _, client = served
    images = distinct_images(3)
    binary = {"Accept": "application/octet-stream"}
    one_json = (await client.post("/predict/embedding", files=_form(images[:1]))).json()
    one = await client.post("/predict/embedding", files=_form(images[:1]), headers=binary)
    assert one.headers["content-type"] == "application/octet-stream"
    assert one.headers["x-embedding-shape"] == str(TINY_DIM)
    np.testing.assert_array_equal(np.frombuffer(one.content, "<f4"), np.float32(one_json))
    many_json = (await client.post("/predict/embedding", files=_form(images))).json()
    many = await client.post("/predict/embedding", files=_form(images), headers=binary)
    assert many.headers["x-embedding-shape"] == f"3,{TINY_DIM}"
    rows = np.frombuffer(many.content, "<f4").reshape(3, TINY_DIM)
    np.testing.assert_array_equal(rows, np.float32(many_json))


async def test_every_answer_says_which_export_answered(served: tuple[Any, Any]) -> None:
    app, client = served
    model_id = app.state.engine.predictor.manifest.model_id
    info = (await client.get("/info")).json()
    assert info["model_id"] == model_id and model_id.startswith("tiny-test@")
    ok = await client.post("/predict/embedding", files=_form(distinct_images(1)))
    bad = await client.post("/predict/embedding", files=_form([b"junk"]))
    assert ok.headers["x-model-id"] == bad.headers["x-model-id"] == model_id
    metrics = (await client.get("/metrics")).text
    answering = f'model="tiny-test",model_id="{model_id}",version="1"'
    assert f'microbatch_model_info{{arch="tiny-test",{answering}' in metrics
    assert "process_resident_memory_bytes" in metrics and "process_open_fds" in metrics
    assert 'microbatch_worker_memory_bytes{device="cpu",worker="0"}' in metrics
