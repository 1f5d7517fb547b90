"""app.client against a real server process (`python -m app`, one real worker, an API key)."""

from __future__ import annotations

import asyncio
import io
import os
import signal
import time
from collections.abc import Iterator
from pathlib import Path

import httpx
import numpy as np
import pytest

from app.client import AsyncClient, Client, Image, ServerReplyError, Tag
from tests.conftest import distinct_images, expected_for
from tests.models import TINY_DIM
from tests.server import ServerProcess

pytestmark = pytest.mark.slow

API_KEY = "client-test-key"


@pytest.fixture(scope="module")
def server(tiny_store: Path) -> Iterator[ServerProcess]:
    # One worker, so killing it leaves none until the server restarts it.
    with ServerProcess(MODEL_STORE=str(tiny_store), MB_WORKER_NUM="1", API_KEY=API_KEY) as s:
        yield s


class Recording(httpx.HTTPTransport):
    """The real network, remembering the status of every answer (retries included)."""

    def __init__(self) -> None:
        super().__init__()
        self.statuses: list[int] = []

    def handle_request(self, request: httpx.Request) -> httpx.Response:
        response = super().handle_request(request)
        self.statuses.append(response.status_code)
        return response


def wait_ready(client: Client, timeout_s: float = 60) -> None:
    deadline = time.monotonic() + timeout_s
    while not client.ready():
        assert time.monotonic() < deadline, "the worker was never restarted"
        time.sleep(0.05)


def test_embed_one_and_several_images_as_the_model_computes_them(
    server: ServerProcess, tiny_store: Path
) -> None:
    images = distinct_images(3)
    uploads: list[Image] = list(images)  # the client takes a list[Image] (lists are invariant)
    with Client(server.base_url, api_key=API_KEY) as client:
        one = client.embed(images[0])
        several = client.embed(uploads)
        info = client.info()
        assert client.model_id == info["model_id"]
    assert one.shape == (TINY_DIM,) and one.dtype == np.float32
    np.testing.assert_allclose(one, expected_for(images[0], tiny_store), atol=1e-5)
    assert several.shape == (3, TINY_DIM)
    for row, data in zip(several, images, strict=True):
        np.testing.assert_allclose(row, expected_for(data, tiny_store), atol=1e-5)


def test_tag_tags_and_ready(server: ServerProcess) -> None:
    images: list[Image] = list(distinct_images(2))  # the client takes a list[Image] (invariant)
    with Client(server.base_url, api_key=API_KEY) as client:
        top = client.tag(images[0], k=3)
        both = client.tag(images, k=2)
        names = client.tags()
        assert client.ready() is True
    assert len(top) == 3 and all(isinstance(t, Tag) for t in top)
    assert [t.prob for t in top] == sorted((t.prob for t in top), reverse=True)
    assert {t.name for t in top} <= set(names) and len(names) == 1000
    assert [len(tags) for tags in both] == [2, 2]
    # The same tags as alone; the probabilities to float32 rounding (a batch of two computes
    # them along another path), as the embeddings are compared.
    assert [t.name for t in both[0]] == [t.name for t in top[:2]]
    assert [t.prob for t in both[0]] == pytest.approx([t.prob for t in top[:2]], abs=1e-6)


def test_a_path_and_a_file_object_are_images(
    server: ServerProcess, tiny_store: Path, tmp_path: Path
) -> None:
    data = distinct_images(1)[0]
    path = tmp_path / "photo.png"
    path.write_bytes(data)
    with Client(server.base_url, api_key=API_KEY) as client:
        from_path = client.embed(str(path))
        from_pathlike = client.embed(path)
        with open(path, "rb") as file:
            from_file = client.embed(file)
        mixed = client.embed([path, io.BytesIO(data), data])
        listed = client.embed([path])
        tags = client.tag([path], k=2)
    expected = expected_for(data, tiny_store)
    assert listed.shape == (1, expected.shape[0])
    assert len(tags) == 1 and len(tags[0]) == 2
    for vector in (from_path, from_pathlike, from_file, *mixed, *listed):
        np.testing.assert_allclose(vector, expected, atol=1e-5)


async def test_async_client_embeds_and_tags_concurrently(
    server: ServerProcess, tiny_store: Path
) -> None:
    images = distinct_images(4)
    uploads: list[Image] = list(images)  # the client takes a list[Image] (lists are invariant)
    async with AsyncClient(server.base_url, api_key=API_KEY) as client:
        vectors = await asyncio.gather(*(client.embed(data) for data in images))
        rows = await client.embed(tuple(images))
        tags = await client.tag(uploads[:2], k=4)
        info = await client.info()
        assert client.model_id == info["model_id"]
        assert await client.ready() is True
    for vector, row, data in zip(vectors, rows, images, strict=True):
        np.testing.assert_allclose(vector, expected_for(data, tiny_store), atol=1e-5)
        np.testing.assert_allclose(row, vector, atol=1e-6)
    assert [len(t) for t in tags] == [4, 4] and isinstance(tags[0][0], Tag)


def test_an_invalid_image_raises_the_servers_error(server: ServerProcess) -> None:
    with Client(server.base_url, api_key=API_KEY) as client:
        with pytest.raises(ServerReplyError) as caught:
            client.embed(b"not an image at all", request_id="junk-1")
        assert client.model_id is not None  # error answers say which export refused them
    error = caught.value
    assert (error.status, error.type) == (400, "invalid_image")
    assert error.request_id == "junk-1" and error.retry_after_s is None


def test_the_api_key_is_required(server: ServerProcess) -> None:
    data = distinct_images(1)[0]
    with Client(server.base_url) as client, pytest.raises(ServerReplyError) as caught:
        client.embed(data)
    assert (caught.value.status, caught.value.type) == (401, "unauthorized")
    with Client(server.base_url, api_key="wrong") as client, pytest.raises(ServerReplyError):
        client.tag(data)


def test_a_dead_worker_is_waited_out_through_retry_after(
    server: ServerProcess, tiny_store: Path
) -> None:
    data = distinct_images(1)[0]
    recording = Recording()
    with Client(server.base_url, api_key=API_KEY, retries=30, transport=recording) as client:
        wait_ready(client)
        os.kill(server.worker_pids()[0], signal.SIGKILL)
        before = len(recording.statuses)
        vector = client.embed(data)
    np.testing.assert_allclose(vector, expected_for(data, tiny_store), atol=1e-5)
    embeds = recording.statuses[before:]
    print(f"\nanswers while the only worker restarted: {embeds}")
    assert embeds[-1] == 200 and len(embeds) >= 2 and set(embeds[:-1]) == {503}


def test_without_retries_a_dead_worker_raises_worker_died(server: ServerProcess) -> None:
    with Client(server.base_url, api_key=API_KEY, retries=0) as client:
        wait_ready(client)
        os.kill(server.worker_pids()[0], signal.SIGKILL)
        with pytest.raises(ServerReplyError) as caught:
            client.embed(distinct_images(1)[0])
        wait_ready(client)  # leave the server as the next test expects it
    error = caught.value
    assert (error.status, error.type) == (503, "worker_died")
    assert error.retry_after_s is not None and error.retry_after_s >= 1
