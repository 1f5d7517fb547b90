"""HTTP API against real worker processes running the tiny test model."""

from __future__ import annotations

import asyncio
import gc
import io
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import pytest_asyncio
from PIL import Image

from tests.answers import error_of
from tests.conftest import distinct_images, embed, expected_for, running_app
from tests.models import TINY_DIM
from tests.transports import Watched, wait_queued

pytestmark = [pytest.mark.slow, pytest.mark.asyncio(loop_scope="module")]

MAX_UPLOAD = 300_000
WATCHED = Watched()  # the served app's transport, wrapped: tests see and hold its batches


@pytest_asyncio.fixture(loop_scope="module", scope="module", params=["server", "worker"])
async def served(
    tiny_store: Path, request: pytest.FixtureRequest
) -> AsyncIterator[tuple[Any, Any]]:
    """The app, once decoding uploads in the HTTP process and once in the workers: every test
    here must pass both ways."""
    async with running_app(
        WATCHED.wrap,
        model_store=tiny_store,
        cuda_devices="cpu",
        mb_worker_num=1,
        mb_batch_size=128,
        mb_max_latency=0.005,
        max_upload_bytes=MAX_UPLOAD,
        mb_decode=request.param,
    ) as pair:
        yield pair


async def test_health_ready_and_tags(served: tuple[Any, Any]) -> None:
    _, client = served
    assert (await client.get("/healthz")).json() == {"status": "ok"}
    ready = await client.get("/readyz")
    assert ready.status_code == 200
    assert ready.json()["status"] == "ready"
    assert [w["device"] for w in ready.json()["workers"]] == ["cpu"]
    tags = (await client.get("/tags")).json()
    assert len(tags) == 1000 and tags[7] == "class_7"


async def test_objects_alive_after_start_up_are_frozen_out_of_collections(
    served: tuple[Any, Any],
) -> None:
    # FastAPI, pydantic, numpy and torch's Python side alone are over 100,000 objects.
    assert gc.get_freeze_count() > 100_000


async def test_embedding_is_the_models_output_for_this_image(
    served: tuple[Any, Any], tiny_store: Path
) -> None:
    _, client = served
    data = distinct_images(1)[0]
    vector = await embed(client, data)
    assert len(vector) == TINY_DIM
    np.testing.assert_allclose(vector, expected_for(data, tiny_store), atol=1e-5)


async def test_tag_returns_top_k_sorted(served: tuple[Any, Any]) -> None:
    _, client = served
    data = distinct_images(1)[0]
    default = (await client.post("/predict/tag", files={"image": ("x.png", data)})).json()
    assert len(default) == 5
    three = (
        await client.post("/predict/tag", files={"image": ("x.png", data)}, data={"k": "3"})
    ).json()
    assert three == default[:3]
    everything = (
        await client.post("/predict/tag", files={"image": ("x.png", data)}, data={"k": "1000"})
    ).json()
    probs = [t["prob"] for t in everything]
    assert probs == sorted(probs, reverse=True)
    assert sum(probs) == pytest.approx(1.0, abs=1e-3)
    assert len({t["name"] for t in everything}) == 1000


@pytest.mark.parametrize(
    ("files", "data", "status", "code"),
    [
        ({"image": ("a.txt", b"not an image at all")}, {}, 400, "invalid_image"),
        ({"image": ("a.png", b"")}, {}, 400, "invalid_image"),
        ({"picture": ("a.png", b"xx")}, {}, 422, "invalid_request"),
        ({"image": ("a.png", b"xx")}, {"k": "0"}, 422, "invalid_request"),
        ({"image": ("a.png", b"xx")}, {"k": "1001"}, 422, "invalid_request"),
        ({"image": ("a.png", b"xx")}, {"k": "many"}, 422, "invalid_request"),
        ({"image": ("big.png", b"\0" * (MAX_UPLOAD + 1))}, {}, 413, "payload_too_large"),
    ],
)
async def test_bad_requests_get_a_typed_json_4xx(
    served: tuple[Any, Any], files: dict[str, Any], data: dict[str, str], status: int, code: str
) -> None:
    _, client = served
    response = await client.post("/predict/tag", files=files, data=data)
    assert response.status_code == status, response.text
    body = response.json()
    assert body["error"]["type"] == code
    assert body["error"]["message"]


async def test_raw_image_body_is_accepted_with_k_in_the_query(
    served: tuple[Any, Any], tiny_store: Path
) -> None:
    _, client = served
    data = distinct_images(1)[0]
    raw = await client.post(
        "/predict/embedding", content=data, headers={"Content-Type": "image/png"}
    )
    assert raw.status_code == 200, raw.text
    np.testing.assert_allclose(raw.json(), expected_for(data, tiny_store), atol=1e-5)
    form = (await client.post("/predict/tag", files={"image": ("x.png", data)})).json()
    tags = await client.post(
        "/predict/tag?k=3", content=data, headers={"Content-Type": "application/octet-stream"}
    )
    assert tags.status_code == 200 and tags.json() == form[:3]
    # k given both ways: with one value, that value; with two, a 422 (both are checked).
    same = await client.post("/predict/tag?k=2", files={"image": ("x", data)}, data={"k": "2"})
    assert same.status_code == 200 and len(same.json()) == 2
    both = await client.post("/predict/tag?k=3", files={"image": ("x", data)}, data={"k": "2"})
    assert both.status_code == 422 and "k is given twice" in error_of(both)["message"]
    bad = await client.post("/predict/tag?k=1001", files={"image": ("x", data)}, data={"k": "3"})
    assert bad.status_code == 422 and "k must be" in error_of(bad)["message"]


@pytest.mark.parametrize("query", ["k=0", "k=1001", "k=many", "k="])
async def test_a_bad_k_in_the_query_is_a_typed_422(served: tuple[Any, Any], query: str) -> None:
    _, client = served
    data = distinct_images(1)[0]
    response = await client.post(
        f"/predict/tag?{query}", content=data, headers={"Content-Type": "image/png"}
    )
    assert response.status_code == 422, response.text
    assert error_of(response)["type"] == "invalid_request"
    assert "k must be" in error_of(response)["message"]


@pytest.mark.parametrize(
    ("content", "content_type", "status", "code"),
    [
        (b'{"image": "x"}', "application/json", 422, "invalid_request"),
        (b"whatever", None, 422, "invalid_request"),
        (
            b"--b\r\nContent-Disposition: form-data; name=",
            "multipart/form-data",
            400,
            "bad_request",
        ),
        (
            b'--b\r\nContent-Disposition: form-data; name="image"\r\n\r\nxx',
            "multipart/form-data; boundary=b",
            400,
            "bad_request",
        ),
        (b"no boundary line at all", "multipart/form-data; boundary=b", 400, "bad_request"),
        (
            b'--b\r\nContent-Disposition: form-data; name="k"\r\n\r\n'
            + b"9" * 2000
            + b"\r\n--b--\r\n",
            "multipart/form-data; boundary=b",
            422,
            "invalid_request",
        ),
        (b"\0" * (MAX_UPLOAD + 1), "image/jpeg", 413, "payload_too_large"),
    ],
    ids=["json", "no-type", "no-boundary", "truncated", "garbage", "huge-field", "huge-raw"],
)
async def test_malformed_bodies_get_a_typed_json_4xx(
    served: tuple[Any, Any], content: bytes, content_type: str | None, status: int, code: str
) -> None:
    _, client = served
    headers = {"Content-Type": content_type} if content_type else {}
    response = await client.post("/predict/tag", content=content, headers=headers)
    assert response.status_code == status, response.text
    assert error_of(response)["type"] == code


async def test_openapi_documents_both_upload_shapes(served: tuple[Any, Any]) -> None:
    _, client = served
    spec = (await client.get("/openapi.json")).json()
    body = spec["paths"]["/predict/tag"]["post"]["requestBody"]["content"]
    assert set(body) == {"multipart/form-data", "image/*", "application/octet-stream"}
    assert set(body["multipart/form-data"]["schema"]["properties"]) == {"image", "k"}
    assert any(p["name"] == "k" for p in spec["paths"]["/predict/tag"]["post"]["parameters"])


async def test_unsupported_format_is_415(served: tuple[Any, Any]) -> None:
    _, client = served
    buffer = io.BytesIO()
    Image.new("RGB", (20, 20)).save(buffer, format="TIFF")
    response = await client.post(
        "/predict/embedding", files={"image": ("a.tif", buffer.getvalue())}
    )
    assert response.status_code == 415
    assert "TIFF" in error_of(response)["message"]


async def test_concurrent_requests_each_get_their_own_result(
    served: tuple[Any, Any], tiny_store: Path
) -> None:
    app, client = served
    images = distinct_images(64)
    ran = len(WATCHED.batches)

    async def one(index: int) -> tuple[int, Any]:
        data = images[index]
        if index % 2:
            return index, await embed(client, data)
        response = await client.post(
            "/predict/tag", files={"image": ("x.png", data)}, data={"k": "2"}
        )
        assert response.status_code == 200
        return index, response.json()

    # The workers look busy until every request has queued: they must then share batches.
    WATCHED.hold()
    tasks = [asyncio.create_task(one(0))]
    await WATCHED.wait_entered()  # the first request, alone in its batch, holds the worker
    tasks += [asyncio.create_task(one(i)) for i in range(1, len(images))]
    await wait_queued(app, len(images) - 1)
    WATCHED.release()
    results = await asyncio.gather(*tasks)
    sizes = [size for _, size in WATCHED.batches[ran:]]
    singles = {}
    for index, result in results:
        if index % 2:
            np.testing.assert_allclose(result, expected_for(images[index], tiny_store), atol=1e-5)
        else:
            singles[index] = result
    # Tags computed alone must equal the tags computed in the concurrent batches.
    for index, batched in singles.items():
        alone = await client.post(
            "/predict/tag", files={"image": ("x.png", images[index])}, data={"k": "2"}
        )
        assert [t["name"] for t in alone.json()] == [t["name"] for t in batched]
        np.testing.assert_allclose(
            [t["prob"] for t in alone.json()], [t["prob"] for t in batched], atol=1e-5
        )
    # The first request (a tag) alone, then each task's others in one batch: 31 tags, 32
    # embeddings.
    assert sorted(sizes) == [1, 31, 32]


async def test_128_concurrent_http_requests_form_one_batch_of_128(served: tuple[Any, Any]) -> None:
    """No thread is held per waiting request, so nothing caps the batch (service-streamer
    behind FastAPI was stuck at 40, the threadpool size)."""
    app, client = served
    ran = len(WATCHED.batches)
    WATCHED.hold()
    images = distinct_images(129)
    first = asyncio.create_task(embed(client, images[0]))
    await WATCHED.wait_entered()
    rest = [asyncio.create_task(embed(client, data)) for data in images[1:]]
    await wait_queued(app, 128)
    assert app.state.engine.streamer.queue_depth == 128
    WATCHED.release()
    results = await asyncio.gather(first, *rest)
    assert len(results) == 129
    assert [size for _, size in WATCHED.batches[ran:]] == [1, 128]


async def test_a_bad_image_in_a_batch_fails_alone(
    served: tuple[Any, Any], tiny_store: Path
) -> None:
    """Batch-mates of an image that cannot be decoded get their own results; it gets a 400.
    (When the workers decode, the bad image really is in the batch.)"""
    app, client = served
    good = distinct_images(4)
    truncated = good[3][: len(good[3]) // 2]
    WATCHED.hold()
    first = asyncio.create_task(embed(client, good[0]))
    await WATCHED.wait_entered()
    rest = [
        asyncio.create_task(client.post("/predict/embedding", files={"image": ("x.png", data)}))
        for data in (good[1], truncated, good[2])
    ]
    await wait_queued(app, 2 if app.state.engine.plan.decode.server_threads else 3)
    WATCHED.release()
    await first
    answers = await asyncio.gather(*rest)
    assert [a.status_code for a in answers] == [200, 400, 200]
    assert error_of(answers[1])["type"] == "invalid_image"
    for answer, data in ((answers[0], good[1]), (answers[2], good[2])):
        np.testing.assert_allclose(answer.json(), expected_for(data, tiny_store), atol=1e-5)
