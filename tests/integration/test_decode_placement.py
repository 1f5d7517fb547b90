"""MB_DECODE=auto on CPU workers, with real worker processes: the server decodes while the
workers are busy, an upload that reaches an idle server is decoded by its worker, and the two
kinds never share a batch. Every caller gets its own answer either way."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import pytest_asyncio

from app.batching import Streamer
from tests.conftest import distinct_images, embed, expected_for, running_app
from tests.transports import Watched, wait_queued

pytestmark = [pytest.mark.slow, pytest.mark.asyncio(loop_scope="module")]


WATCHED = Watched()  # the served app's transport, wrapped: tests see and hold its batches


@pytest_asyncio.fixture(loop_scope="module", scope="module")
async def served(tiny_store: Path) -> AsyncIterator[tuple[Any, Any]]:
    async with running_app(
        WATCHED.wrap, model_store=tiny_store, cuda_devices="cpu", mb_worker_num=1,
        mb_max_latency=0.005,
    ) as pair:  # fmt: skip
        yield pair


def batches_since(ran: int) -> list[tuple[bool, int]]:
    """Each batch given to the workers since the ``ran``-th: (images encoded?, how many)."""
    return [(key.encoded, size) for key, size in WATCHED.batches[ran:]]


async def test_auto_on_cpu_decodes_in_the_server_and_in_idle_workers(
    served: tuple[Any, Any],
) -> None:
    app, _ = served
    plan = app.state.engine.plan.decode
    assert plan.server_threads and plan.worker_threads and plan.idle_uploads_to_workers


async def test_a_lone_upload_is_decoded_by_its_worker(
    served: tuple[Any, Any], tiny_store: Path
) -> None:
    _app, client = served
    images = distinct_images(3)
    ran = len(WATCHED.batches)
    for data in images:  # one at a time: the server is idle at each
        np.testing.assert_allclose(
            await embed(client, data), expected_for(data, tiny_store), atol=1e-5
        )
    bad = await client.post("/predict/embedding", files={"image": ("x.png", images[0][:60])})
    assert batches_since(ran) == [(True, 1)] * 4
    assert bad.status_code == 400
    assert bad.json()["error"]["type"] == "invalid_image"


async def test_uploads_that_wait_for_a_busy_worker_are_decoded_by_the_server(
    served: tuple[Any, Any], tiny_store: Path
) -> None:
    app, client = served
    images = distinct_images(4)
    ran = len(WATCHED.batches)
    WATCHED.hold()
    first = asyncio.create_task(embed(client, images[0]))
    await WATCHED.wait_entered()
    rest = [asyncio.create_task(embed(client, data)) for data in images[1:]]
    await wait_queued(app, 3)
    WATCHED.release()
    vectors = await asyncio.gather(first, *rest)
    assert batches_since(ran) == [(True, 1), (False, 3)]
    for vector, data in zip(vectors, images, strict=True):
        np.testing.assert_allclose(vector, expected_for(data, tiny_store), atol=1e-5)


async def test_encoded_and_decoded_uploads_never_share_a_batch(
    served: tuple[Any, Any], tiny_store: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Two requests can both find the server idle: one is queued encoded, the other decoded
    here once its decode ends. Forced here, request by request: each kind forms its own
    batch, and a truncated upload gets its 400 from whichever side decodes it."""
    app, client = served
    images = distinct_images(5)
    truncated = images[4][: len(images[4]) // 2]
    seen_idle = [True]

    def post(data: bytes) -> Any:
        return client.post("/predict/embedding", files={"image": ("x", data)})

    ran = len(WATCHED.batches)
    WATCHED.hold()
    first = asyncio.create_task(embed(client, images[0]))
    await WATCHED.wait_entered()
    monkeypatch.setattr(Streamer, "idle", property(lambda _: seen_idle[0]))
    queued = []
    for data, idle in ((images[1], True), (images[2], False), (images[3], True)):
        seen_idle[0] = idle
        queued.append(asyncio.create_task(post(data)))
        await wait_queued(app, len(queued))
    seen_idle[0] = False  # decoded here: refused before it is queued
    refused_here = await post(truncated)
    seen_idle[0] = True  # left encoded: its worker refuses it
    queued.append(asyncio.create_task(post(truncated)))
    await wait_queued(app, 4)
    monkeypatch.undo()
    WATCHED.release()
    await first
    answers = await asyncio.gather(*queued)
    batched = batches_since(ran)
    assert batched[0] == (True, 1)
    assert sorted(batched[1:]) == [(False, 1), (True, 3)]
    assert [a.status_code for a in answers] == [200, 200, 200, 400]
    for bad in (refused_here, answers[3]):
        assert bad.status_code == 400 and bad.json()["error"]["type"] == "invalid_image"
    for answer, data in zip(answers[:3], images[1:4], strict=True):
        np.testing.assert_allclose(answer.json(), expected_for(data, tiny_store), atol=1e-5)
