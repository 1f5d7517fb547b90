"""MB_DECODE=auto on CPU workers, with real worker processes: the server decodes while the
workers are busy, an upload that reaches an idle server is decoded by its worker, and a batch
may mix both. Every caller gets its own answer either way."""

from __future__ import annotations

import asyncio
import itertools
from collections.abc import AsyncIterator, Hashable, Sequence
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import pytest_asyncio

from app.batching import BatchItem, Streamer
from app.jobs import ImageJob
from tests.conftest import BatchGate, distinct_images, embed, expected_for, running_app

pytestmark = [pytest.mark.slow, pytest.mark.asyncio(loop_scope="module")]


@pytest_asyncio.fixture(loop_scope="module", scope="module")
async def served(tiny_store: Path) -> AsyncIterator[tuple[Any, Any]]:
    async with running_app(
        model_store=tiny_store, cuda_devices="cpu", mb_worker_num=1, mb_max_latency=0.005
    ) as pair:
        yield pair


class BatchLog:
    """Records, for each batch the app's Streamer dispatches, whether each image in it
    travels encoded (True) or as pixels (False)."""

    def __init__(self, streamer: Streamer[ImageJob, object]) -> None:
        self.streamer = streamer
        self.batches: list[list[bool]] = []
        self._real = streamer._batch_fn

    async def _logged(self, key: Hashable, items: Sequence[BatchItem[ImageJob]]) -> Any:
        self.batches.append([isinstance(item.payload.image, bytes) for item in items])
        return await self._real(key, items)

    def __enter__(self) -> BatchLog:
        self.streamer._batch_fn = self._logged
        return self

    def __exit__(self, *exc_info: object) -> None:
        self.streamer._batch_fn = self._real


async def test_auto_on_cpu_decodes_in_the_server_and_in_idle_workers(
    served: tuple[Any, Any],
) -> None:
    app, _ = served
    assert app.state.pool.workers_can_decode and not app.state.pool.decode_in_workers


async def test_a_lone_upload_is_decoded_by_its_worker(
    served: tuple[Any, Any], tiny_store: Path
) -> None:
    app, client = served
    images = distinct_images(3)
    with BatchLog(app.state.streamer) as log:
        for data in images:  # one at a time: the server is idle at each
            np.testing.assert_allclose(
                await embed(client, data), expected_for(data, tiny_store), atol=1e-5
            )
        bad = await client.post("/predict/embedding", files={"image": ("x.png", images[0][:60])})
    assert log.batches == [[True]] * 4
    assert bad.status_code == 400
    assert bad.json()["error"]["type"] == "invalid_image"


async def test_uploads_that_wait_for_a_busy_worker_are_decoded_by_the_server(
    served: tuple[Any, Any], tiny_store: Path
) -> None:
    app, client = served
    images = distinct_images(4)
    with BatchLog(app.state.streamer) as log, BatchGate(app.state.streamer) as gate:
        first = asyncio.create_task(embed(client, images[0]))
        await gate.wait_entered()
        rest = [asyncio.create_task(embed(client, data)) for data in images[1:]]
        await gate.wait_queued(3)
        gate.open()
        vectors = await asyncio.gather(first, *rest)
    assert log.batches == [[True], [False, False, False]]
    for vector, data in zip(vectors, images, strict=True):
        np.testing.assert_allclose(vector, expected_for(data, tiny_store), atol=1e-5)


async def test_a_batch_mixing_encoded_and_decoded_uploads_answers_each_caller(
    served: tuple[Any, Any], tiny_store: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Two requests can both find the server idle; one is queued before the other's decode
    ends, and they share a batch. Forced here: every other request sees an idle server."""
    app, client = served
    images = distinct_images(6)
    truncated = images[4][: len(images[4]) // 2]
    uploads = [*images[:4], truncated, images[5]]
    seen_idle = itertools.cycle([True, False])
    with BatchLog(app.state.streamer) as log, BatchGate(app.state.streamer) as gate:
        first = asyncio.create_task(embed(client, images[0]))
        await gate.wait_entered()
        monkeypatch.setattr(Streamer, "idle", property(lambda _: next(seen_idle)))
        rest = [
            asyncio.create_task(client.post("/predict/embedding", files={"image": ("x", data)}))
            for data in uploads[1:]
        ]
        # The truncated upload is either queued encoded or refused by the server's decode.
        await gate.wait_queued(4)
        await asyncio.sleep(0.2)  # let a server-side decode of it finish and fail
        monkeypatch.undo()
        gate.open()
        await first
        answers = await asyncio.gather(*rest)
    assert len(log.batches) == 2 and len(set(log.batches[1])) == 2  # mixed
    assert [a.status_code for a in answers] == [200, 200, 200, 400, 200]
    assert answers[3].json()["error"]["type"] == "invalid_image"
    for answer, data in zip(answers, uploads[1:], strict=True):
        if answer.status_code == 200:
            np.testing.assert_allclose(answer.json(), expected_for(data, tiny_store), atol=1e-5)
