"""MB_DECODE=device end to end, with real worker processes on the CPU: JPEGs decoded by
torchvision in the worker give the embedding of Pillow's pixels up to resampling detail, other
formats exactly that, and a bad JPEG in a batch gets its own 400."""

from __future__ import annotations

import asyncio
from pathlib import Path
from typing import Any

import numpy as np
from skimage import data

from tests.answers import error_of
from tests.conftest import distinct_images, embed, expected_for, jpeg, running_app
from tests.transports import Watched, wait_queued


async def test_device_decode_answers_each_upload_in_a_batch(tiny_store: Path) -> None:
    photos = [jpeg(data.chelsea()), jpeg(data.coffee()), jpeg(data.astronaut())]  # type: ignore[no-untyped-call]  # skimage.data is unannotated
    png = distinct_images(1)[0]
    truncated = photos[1][:5000]
    watched = Watched()
    async with running_app(
        watched.wrap,
        model_store=tiny_store,
        cuda_devices="cpu",
        mb_worker_num=1,
        mb_batch_size=8,
        mb_decode="device",
    ) as (app, client):
        assert app.state.engine.plan.decode.on_device
        watched.hold()
        first = asyncio.create_task(embed(client, photos[0]))
        await watched.wait_entered()
        rest = [
            asyncio.create_task(client.post("/predict/embedding", files={"image": ("x", upload)}))
            for upload in (photos[1], truncated, png, photos[2])
        ]
        await wait_queued(app, 4)
        watched.release()
        answers: list[Any] = [await first, *await asyncio.gather(*rest)]
    assert [a.status_code for a in answers[1:]] == [200, 400, 200, 200]
    assert error_of(answers[2])["type"] == "invalid_image"
    assert "truncated" in error_of(answers[2])["message"]
    # The tiny model averages 8x8 pixel blocks (0-1): resampling detail moves them by < 1%.
    for vector, upload in zip(
        (answers[0], answers[1].json(), answers[4].json()),
        (
            photos[0],
            photos[1],
            photos[2],
        ),
        strict=True,
    ):
        difference = np.abs(np.asarray(vector) - expected_for(upload, tiny_store))
        assert difference.max() < 0.04 and difference.mean() < 0.01
    np.testing.assert_allclose(answers[3].json(), expected_for(png, tiny_store), atol=1e-5)
