"""A keys file on the real app (``app.testing.FakeTransport`` behind it): every route checks
its scope, a tenant over its quota gets 429 with ``Retry-After`` and the RateLimit fields on
each prediction route, and the refusals are counted under the tenant."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator, Sequence
from contextlib import asynccontextmanager
from pathlib import Path
from typing import Any

import httpx
import numpy as np
import pytest

from app.jobs import ImageJob, Task, TopK
from app.main import create_app
from app.settings import Settings
from app.testing import FakeTransport
from tests.conftest import distinct_images
from tests.models import export_tiny
from tests.unit.test_tenancy import BULK, KEYS_YAML, OPS, SHOP, bearer, write
from tests.waiting import soon

IMAGE = distinct_images(1)[0]


def answer(task: Task, jobs: Sequence[ImageJob]) -> list[object]:
    if task is Task.EMBEDDING:
        return [np.zeros(8, np.float32) for _ in jobs]
    return [TopK(np.arange(job.top_k), np.full(job.top_k, 0.5, np.float32)) for job in jobs]


@asynccontextmanager
async def serving(tmp_path: Path, keys: str) -> AsyncIterator[tuple[Any, httpx.AsyncClient]]:
    settings = Settings(
        model_store=export_tiny(tmp_path / "store"),
        mb_keys_file=write(tmp_path, keys),
        mb_priority_levels=2,  # the file's keys name priorities 1 and 2
        mb_decode="worker",
    )
    app = create_app(settings, transport=FakeTransport(answer))
    async with app.router.lifespan_context(app):
        transport = httpx.ASGITransport(app=app)
        async with httpx.AsyncClient(transport=transport, base_url="http://t") as client:
            yield app, client


def as_(key: str | None) -> dict[str, str]:
    return {"Authorization": bearer(key)} if key else {}


async def tag(client: httpx.AsyncClient, key: str | None, images: int = 1) -> httpx.Response:
    files = [("image", (f"{i}.png", IMAGE)) for i in range(images)]
    return await client.post("/predict/tag", files=files, headers=as_(key))


def test_each_route_checks_its_scope(tmp_path: Path) -> None:
    async def run() -> None:
        async with serving(tmp_path, KEYS_YAML) as (app, client):
            assert (await tag(client, SHOP)).status_code == 200
            no_key, unknown, forbidden = [await tag(client, k) for k in (None, "nope", OPS)]
            assert [no_key.status_code, unknown.status_code] == [401, 401]
            assert forbidden.status_code == 403
            assert forbidden.json()["error"]["type"] == "forbidden"
            # the file lets a request without a key read the metrics, not predict
            assert (await client.get("/metrics")).status_code == 200
            assert (await client.get("/v2/models/stats")).status_code == 200
            load = "/v2/repository/models/tiny-test/load"
            assert (await client.post(load, headers=as_(SHOP))).status_code == 403
            assert (await client.get("/healthz")).status_code == 200  # probes stay open
            schemes = app.openapi()["components"]["securitySchemes"]
            assert {"bearer", "admin"} <= set(schemes) and "metrics" not in schemes

    asyncio.run(run())


def test_without_anonymous_in_the_file_the_metrics_need_a_key(tmp_path: Path) -> None:
    shut = KEYS_YAML.split("anonymous:")[0]

    async def run() -> None:
        async with serving(tmp_path, shut) as (app, client):
            assert (await client.get("/metrics")).status_code == 401
            assert (await client.get("/metrics", headers=as_(SHOP))).status_code == 403
            assert (await client.get("/metrics", headers=as_(OPS))).status_code == 200
            assert "metrics" in app.openapi()["components"]["securitySchemes"]

    asyncio.run(run())


def test_over_quota_is_429_with_retry_after_and_ratelimit_on_every_prediction_route(
    tmp_path: Path,
) -> None:
    v2_body = {
        "inputs": [{"name": "image", "shape": [1], "datatype": "BYTES", "data": [""]}],
    }

    async def run() -> list[httpx.Response]:
        async with serving(tmp_path, KEYS_YAML) as (_, client):
            first = await tag(client, BULK, images=2)  # its whole burst of 2
            assert first.status_code == 200, first.text
            over = [
                await tag(client, BULK),
                await client.post(
                    "/predict/embedding", files={"image": ("a.png", IMAGE)}, headers=as_(BULK)
                ),
                await client.post("/predictions/tiny-test", content=IMAGE, headers=as_(BULK)),
                await client.post("/v2/models/tiny-test/infer", json=v2_body, headers=as_(BULK)),
            ]
            assert (await tag(client, SHOP)).status_code == 200  # another tenant is served
            metrics = (await client.get("/metrics")).text
            assert 'microbatch_tenant_refused_total{reason="over_quota",tenant="bulk"}' in metrics
            assert 'microbatch_rejected_total{reason="over_quota"}' in metrics
            waited = 'microbatch_tenant_queue_wait_seconds_count{tenant="shop"} 1.0'
            assert waited in metrics  # shop's one image, queued and run
            return over

    for response in asyncio.run(run()):
        assert response.status_code == 429, (response.request.url, response.text)
        assert response.headers["Retry-After"] == "1"
        assert response.headers["RateLimit-Policy"] == '"bulk";q=2;w=1'
        assert response.headers["RateLimit"].startswith('"bulk";r=0;t=')
        body = response.json()
        kind = body["type"] if "/v2/" in str(response.request.url) else body["error"]["type"]
        assert kind == "over_quota"


def test_a_request_over_its_tenants_burst_is_422(tmp_path: Path) -> None:
    async def run() -> httpx.Response:
        async with serving(tmp_path, KEYS_YAML) as (_, client):
            return await tag(client, BULK, images=3)

    response = asyncio.run(run())
    assert response.status_code == 422 and "burst of 2" in response.json()["error"]["message"]


@pytest.mark.parametrize("shape", ["yaml", "toml"])
def test_a_bad_keys_file_refuses_to_start_with_one_line(
    tmp_path: Path, shape: str, capsys: pytest.CaptureFixture[str]
) -> None:
    path = write(tmp_path, "keys: [" if shape == "yaml" else "keys = [", f"keys.{shape}")
    with pytest.raises(SystemExit) as stopped:
        create_app(Settings(model_store=export_tiny(tmp_path / "store"), mb_keys_file=path))
    assert stopped.value.code == 2
    assert f"not valid {shape}" in capsys.readouterr().err


def test_a_malformed_priority_is_422_on_every_protocol(tmp_path: Path) -> None:
    v2_body = {
        "inputs": [{"name": "image", "shape": [1], "datatype": "BYTES", "data": [""]}],
        "parameters": {"priority": "urgent"},
    }

    async def run() -> list[httpx.Response]:
        async with serving(tmp_path, KEYS_YAML) as (_, client):
            files = {"image": ("a.png", IMAGE)}
            headers = {**as_(SHOP), "X-Priority": "9"}
            return [
                await client.post("/predict/tag", files=files, headers=headers),
                await client.post("/v2/models/tiny-test/infer", json=v2_body, headers=as_(SHOP)),
            ]

    tagged, v2 = asyncio.run(run())
    assert tagged.status_code == 422
    assert "X-Priority must be an integer from 1 to 2" in tagged.json()["error"]["message"]
    assert v2.status_code == 422 and "parameters.priority must be" in v2.json()["error"]


def test_a_higher_priority_is_batched_first_and_a_key_cannot_raise_itself(
    tmp_path: Path,
) -> None:
    """The only batch slot busy; bulk (priority 2, may not ask 1) queues two images, then
    shop asks priority 1: shop's image leads the next batch, bulk's asking 1 changes nothing."""
    release = asyncio.Event()
    seen: list[list[object]] = []
    urgent_image, bulk_image = distinct_images(2)

    async def gated(task: Task, jobs: Sequence[ImageJob]) -> list[object]:
        seen.append([job.image for job in jobs])  # the uploads, left to the worker to decode
        await release.wait()
        return answer(task, jobs)

    async def run() -> None:
        settings = Settings(
            model_store=export_tiny(tmp_path / "store"),
            mb_keys_file=write(tmp_path, KEYS_YAML),
            mb_priority_levels=2,
            mb_decode="worker",
        )
        app = create_app(settings, transport=FakeTransport(gated, batch_size=8))
        async with app.router.lifespan_context(app):
            transport = httpx.ASGITransport(app=app)
            async with httpx.AsyncClient(transport=transport, base_url="http://t") as client:

                async def send(key: str, priority: str, image: bytes) -> httpx.Response:
                    headers = {**as_(key), "X-Priority": priority}
                    files = {"image": ("a.png", image)}
                    return await client.post("/predict/embedding", files=files, headers=headers)

                streamer = app.state.engine.streamer
                first = asyncio.create_task(send(SHOP, "2", IMAGE))
                await soon(lambda: len(seen) == 1)
                queued = [asyncio.create_task(send(BULK, "1", bulk_image)) for _ in range(2)]
                await soon(lambda: streamer.queue_depth == 2)
                urgent = asyncio.create_task(send(SHOP, "1", urgent_image))
                await soon(lambda: streamer.queue_depth == 3)
                release.set()
                for response in await asyncio.gather(first, *queued, urgent):
                    assert response.status_code == 200, response.text

    asyncio.run(run())
    assert seen[1] == [urgent_image, bulk_image, bulk_image]
