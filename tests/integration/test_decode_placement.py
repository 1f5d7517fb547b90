"""Where uploads are decoded, with real worker processes on CPU: by default (``auto``) every
upload travels to its worker encoded, alone or in a batch, and a bad one gets its 400 from
the worker; ``MB_DECODE=server`` decodes them in the HTTP process instead. Every caller gets
its own answer either way."""

from __future__ import annotations

import asyncio
from pathlib import Path

import numpy as np
import pytest

from tests.answers import error_of
from tests.conftest import distinct_images, embed, expected_for, running_app
from tests.transports import Watched, wait_queued

pytestmark = pytest.mark.slow


@pytest.mark.parametrize(("setting", "encoded"), [("auto", True), ("server", False)])
async def test_uploads_are_decoded_where_the_plan_says(
    tiny_store: Path, setting: str, encoded: bool
) -> None:
    watched = Watched()  # the served app's transport, wrapped: the test sees its batches
    images = distinct_images(5)
    truncated = images[4][: len(images[4]) // 2]
    async with running_app(
        watched.wrap, model_store=tiny_store, cuda_devices="cpu", mb_worker_num=1,
        mb_max_latency=0.005, mb_decode=setting,
    ) as (app, client):  # fmt: skip
        plan = app.state.engine.plan.decode
        assert plan.server_decodes is not encoded and bool(plan.worker_threads) is encoded
        lone = await embed(client, images[0])
        watched.hold()  # the next uploads wait for a busy worker, and go as one batch
        first = asyncio.create_task(embed(client, images[1]))
        await watched.wait_entered()
        rest = [
            asyncio.create_task(client.post("/predict/embedding", files={"image": ("x", data)}))
            for data in (images[2], truncated, images[3])
        ]
        await wait_queued(app, 3 if encoded else 2)  # decoded here: the bad one never queues
        watched.release()
        vectors = [lone, await first]
        answers = await asyncio.gather(*rest)
    assert [key.encoded for key, _ in watched.batches] == [encoded] * len(watched.batches)
    assert [size for _, size in watched.batches] == [1, 1, 3 if encoded else 2]
    assert [answer.status_code for answer in answers] == [200, 400, 200]
    assert error_of(answers[1])["type"] == "invalid_image"
    vectors += [answers[0].json(), answers[2].json()]
    for vector, data in zip(vectors, (images[0], images[1], images[2], images[3]), strict=True):
        np.testing.assert_allclose(vector, expected_for(data, tiny_store), atol=1e-5)
