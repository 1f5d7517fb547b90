"""Inputs from strangers: odd files, oversized bodies, bad parameters, credentials."""

from __future__ import annotations

import time
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import pytest
import pytest_asyncio

from tests.answers import error_of
from tests.conftest import distinct_images, running_app
from tests.corpus import corpus
from tests.transports import Watched

pytestmark = [pytest.mark.slow, pytest.mark.asyncio(loop_scope="module")]

MAX_UPLOAD = 2_000_000
API_KEY = "s3cret-test-key"
AUTH = {"Authorization": f"Bearer {API_KEY}"}


WATCHED = Watched()  # the served app's transport, wrapped: a test may hold its batches


@pytest_asyncio.fixture(loop_scope="module", scope="module")
async def served(tiny_store: Path) -> AsyncIterator[tuple[Any, Any]]:
    async with running_app(
        WATCHED.wrap,
        model_store=tiny_store,
        cuda_devices="cpu",
        mb_worker_num=1,
        max_upload_bytes=MAX_UPLOAD,
        api_key=API_KEY,
    ) as pair:
        yield pair


CORPUS = corpus()


async def test_corpus_is_large_enough() -> None:
    assert len(CORPUS) >= 30
    assert {status for _, _, status in CORPUS} == {200, 400, 413, 415}


@pytest.mark.parametrize(("name", "data", "status"), CORPUS, ids=[name for name, _, _ in CORPUS])
async def test_every_odd_file_gets_200_or_a_precise_4xx_within_a_second(
    served: tuple[Any, Any], name: str, data: bytes, status: int
) -> None:
    app, client = served
    pids = [w.pid for w in app.state.engine.transport.worker_status()]
    for task in ("tag", "embedding"):
        started = time.monotonic()
        response = await client.post(
            f"/predict/{task}", files={"image": ("upload", data)}, headers=AUTH
        )
        assert time.monotonic() - started < 1.0, f"{name} took too long"
        assert response.status_code == status, f"{name}: {response.text}"
        body = response.json()
        if status != 200:
            assert set(body) == {"error"} and body["error"]["message"]
            assert "Traceback" not in response.text and "/work" not in response.text
    workers = app.state.engine.transport.worker_status()
    assert [w.pid for w in workers] == pids and all(w.alive for w in workers)


async def test_api_key_guards_prediction_routes_only(served: tuple[Any, Any]) -> None:
    _, client = served
    image = {"image": ("x.png", distinct_images(1)[0])}
    missing = await client.post("/predict/tag", files=image)
    wrong = await client.post("/predict/tag", files=image, headers={"Authorization": "Bearer nope"})
    basic = await client.post("/predict/tag", files=image, headers={"Authorization": "Basic eDp5"})
    right = await client.post("/predict/tag", files=image, headers=AUTH)
    assert [r.status_code for r in (missing, wrong, basic)] == [401, 401, 401]
    assert error_of(missing)["type"] == "unauthorized"
    assert right.status_code == 200
    assert (await client.get("/healthz")).status_code == 200
    assert (await client.get("/readyz")).status_code == 200


async def test_upload_over_the_limit_is_413_without_reading_it_whole(
    served: tuple[Any, Any],
) -> None:
    _, client = served
    big = b"\xff" * (MAX_UPLOAD + 100_000)
    response = await client.post("/predict/tag", files={"image": ("big.jpg", big)}, headers=AUTH)
    assert response.status_code == 413
    assert error_of(response)["type"] == "payload_too_large"

    consumed = 0

    async def chunks() -> AsyncIterator[
        bytes
    ]:  # no Content-Length: the limit must count as it reads
        nonlocal consumed
        boundary = b"xYz"
        yield b'--xYz\r\nContent-Disposition: form-data; name="image"; filename="a"\r\n\r\n'
        for _ in range(100):
            consumed += 65536
            yield b"\0" * 65536
        yield b"\r\n--" + boundary + b"--\r\n"

    streamed = await client.post(
        "/predict/tag",
        content=chunks(),
        headers={**AUTH, "Content-Type": "multipart/form-data; boundary=xYz"},
    )
    assert streamed.status_code == 413
    assert error_of(streamed)["type"] == "payload_too_large"
    assert consumed < 100 * 65536, "the server read the whole oversized body"


async def test_upload_just_under_the_limit_is_read(served: tuple[Any, Any]) -> None:
    _, client = served
    data = distinct_images(1)[0]
    padded = data + b"\0" * (MAX_UPLOAD - len(data) - 10)  # trailing bytes after the PNG
    response = await client.post("/predict/tag", files={"image": ("a.png", padded)}, headers=AUTH)
    assert response.status_code == 200


async def test_a_file_in_another_field_is_rejected(served: tuple[Any, Any]) -> None:
    _, client = served
    one, two = distinct_images(2)
    wrong = await client.post("/predict/tag", files={"photo": ("a.png", one)}, headers=AUTH)
    extra = await client.post(
        "/predict/tag", files=[("image", ("a.png", one)), ("photo", ("b.png", two))], headers=AUTH
    )
    assert wrong.status_code == 422 and "'image' is missing" in error_of(wrong)["message"]
    assert extra.status_code == 422 and "'photo'" in error_of(extra)["message"]


async def test_client_timeout_header_can_shorten_but_not_extend(served: tuple[Any, Any]) -> None:
    _, client = served
    WATCHED.hold()  # the worker looks stuck: the answer can only be the deadline's
    try:
        started = time.monotonic()
        response = await client.post(
            "/predict/tag",
            files={"image": ("a.png", distinct_images(1)[0])},
            headers={**AUTH, "X-Request-Timeout": "0.2"},
        )
        elapsed = time.monotonic() - started
    finally:
        WATCHED.release()
    assert response.status_code == 504 and error_of(response)["type"] == "deadline_exceeded"
    assert elapsed < 1.5
    for bad in ("soon", "-1", "0"):
        rejected = await client.post(
            "/predict/tag",
            files={"image": ("a.png", distinct_images(1)[0])},
            headers={**AUTH, "X-Request-Timeout": bad},
        )
        assert rejected.status_code == 422, bad


async def test_unknown_route_has_the_same_error_shape(served: tuple[Any, Any]) -> None:
    _, client = served
    response = await client.get("/predict/nothing")
    assert response.status_code in (404, 405)
    assert set(response.json()) == {"error"}
