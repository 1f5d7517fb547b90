"""Broker mode across hosts: several models, and a version rolled out worker by worker under
load, by SIGHUP and by restarting one host at a time. Nothing dropped, nothing mixed: every
answer is 200 and its vector is the one its X-Model-Id's version computes."""

from __future__ import annotations

import asyncio
import os
import shutil
import signal
from collections import Counter
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from functools import partial
from pathlib import Path
from typing import Any

import httpx
import numpy as np
import psutil
import pytest

from app.manifest import read_manifest
from tests.broker import PREFIX, RedisServer, Workers, broker_env
from tests.conftest import distinct_images, expected_for
from tests.integration.test_repository import add_version
from tests.models import export_embedding_only, export_scaled, export_tiny
from tests.server import ServerProcess
from tests.waiting import wait_for

pytestmark = pytest.mark.slow

IMAGES = distinct_images(16)


def served_id(store: Path) -> str:
    return read_manifest(store).served_id("auto")


def host(redis_server: RedisServer, repository: Path, name: str) -> Workers:
    """One host's worker supervisor (one worker) serving the repository."""
    return Workers(
        redis_server, repository, count=1, MODEL_REPOSITORY=str(repository), MB_WORKER_NAME=name
    )


class Checked:
    """Answers, each checked against the reference vector of the version that says it
    answered (``X-Model-Id``): ``scales`` maps a served id to its model's scale."""

    def __init__(self, base: Path, scales: dict[str, float]) -> None:
        self.scales = scales
        self.expected = [expected_for(image, base) for image in IMAGES]
        self.statuses: Counter[int] = Counter()
        self.ids: Counter[str] = Counter()
        self.mismatched = 0
        self.refused: list[str] = []  # the bodies of answers other than 200

    def check(self, index: int, answer: httpx.Response) -> None:
        self.statuses[answer.status_code] += 1
        if answer.status_code != 200:
            self.refused.append(answer.text)
            return
        served = answer.headers["X-Model-Id"]
        self.ids[served] += 1
        scale = self.scales.get(served)
        if scale is None or not np.allclose(answer.json(), scale * self.expected[index], atol=1e-4):
            self.mismatched += 1


@asynccontextmanager
async def load(base_url: str, checked: Checked, clients: int = 8) -> AsyncIterator[None]:
    stop = asyncio.Event()

    async def client(offset: int) -> None:
        async with httpx.AsyncClient(base_url=base_url, timeout=60) as http:
            sent = offset
            while not stop.is_set():
                index = sent % len(IMAGES)
                files = {"image": ("x.png", IMAGES[index])}
                checked.check(index, await http.post("/predict/embedding", files=files))
                sent += clients

    tasks = [asyncio.create_task(client(i)) for i in range(clients)]
    try:
        yield
    finally:
        stop.set()
        await asyncio.gather(*tasks)


def holds(workers: Workers, *ids: str) -> bool:
    """Whether this host's live worker holds exactly ``ids``, ready (and only them)."""
    beats = list(workers.own().values())
    return bool(beats) and all(
        sorted(m["served_id"] for m in beat["models"]) == sorted(ids)
        and all(m["state"] == "ready" for m in beat["models"])
        for beat in beats
    )


def ready_on(workers: Workers, served: str) -> bool:
    """Whether this host's live worker holds ``served`` ready (among others, maybe)."""
    beats = list(workers.own().values())
    return bool(beats) and all(
        any(m["served_id"] == served and m["state"] == "ready" for m in beat["models"])
        for beat in beats
    )


def worker_pid(workers: Workers) -> int | None:
    beats = list(workers.own().values())
    return int(beats[0]["pid"]) if beats else None


def streams_of(redis_server: RedisServer, served: str) -> list[bytes]:
    version = served.rsplit("@", 1)[1]
    return list(redis_server.client().scan_iter(f"{PREFIX}:{{q}}:{version}:*"))


async def test_a_version_rolls_out_host_by_host_under_load(tmp_path: Path) -> None:
    repository = tmp_path / "models"
    v1 = export_tiny(repository / "tiny" / "1")
    scales = {served_id(v1): 1.0}
    checked = Checked(v1, scales)
    with (
        RedisServer() as redis_server,
        host(redis_server, repository, "a") as a,
        host(redis_server, repository, "b") as b,
        ServerProcess(
            **broker_env(redis_server.url, v1, MODEL_REPOSITORY=str(repository))
        ) as front,
    ):
        async with load(front.base_url, checked):
            await wait_for(lambda: checked.ids[served_id(v1)] > 20, 90, "answers from version 1")
            # By SIGHUP: each host loads version 2 beside 1; the name moves once both have it.
            v2 = add_version(repository, "tiny", lambda out: export_scaled(out, 2.0))
            scales[served_id(v2)] = 2.0
            os.kill(a.process.pid, signal.SIGHUP)  # type: ignore[union-attr]
            await wait_for(
                lambda: holds(a, served_id(v1), served_id(v2)), 90, "host a holding both"
            )
            before = checked.ids[served_id(v2)]
            await asyncio.sleep(2)  # ready on one worker of two: the name stays on version 1
            assert checked.ids[served_id(v2)] == before == 0
            os.kill(b.process.pid, signal.SIGHUP)  # type: ignore[union-attr]
            await wait_for(
                lambda: holds(a, served_id(v2)) and holds(b, served_id(v2)), 90, "v1 unloaded"
            )
            assert checked.ids[served_id(v2)] > 0
            await wait_for(
                lambda: not streams_of(redis_server, served_id(v1)), 90, "v1's streams gone"
            )
            # A worker that dies now comes back with version 2, chosen at its restart (not
            # version 1, what its supervisor found at its own start).
            (worker,) = [p for p in psutil.Process(a.process.pid).children()  # type: ignore[union-attr]
                         if "spawn_main" in " ".join(p.cmdline())]  # fmt: skip
            worker.kill()
            await wait_for(
                lambda: worker_pid(a) not in (None, worker.pid), 90, "host a's worker back"
            )
            await wait_for(
                partial(holds, a, served_id(v2)), 90, "the restarted worker on version 2"
            )
            # By restarting one host at a time with version 3 on disk.
            v3 = add_version(repository, "tiny", lambda out: export_scaled(out, 3.0))
            v3_id = served_id(v3)  # before its folder goes
            scales[v3_id] = 3.0
            for workers in (a, b):  # in threads: the clients go on meanwhile
                assert await asyncio.to_thread(workers.stop, signal.SIGTERM) == 0
                await asyncio.to_thread(workers.start)
                # Back with version 3, and with version 2 too while the other host serves
                # it (it serves at once); version 2 goes once every host has version 3.
                await wait_for(partial(ready_on, workers, v3_id), 90, "the host back on v3")
            await wait_for(lambda: holds(a, v3_id) and holds(b, v3_id), 90, "v3 everywhere")
            at_v3 = checked.ids[v3_id]
            await wait_for(lambda: checked.ids[v3_id] > at_v3 + 20, 90, "answers from version 3")
            # Version 3 removed from disk: a SIGHUP rolls every host back to version 2.
            shutil.rmtree(v3)
            for workers in (a, b):
                os.kill(workers.process.pid, signal.SIGHUP)  # type: ignore[union-attr]
            await wait_for(
                lambda: holds(a, served_id(v2)) and holds(b, served_id(v2)), 90, "v3 gone"
            )
            at_v2 = checked.ids[served_id(v2)]
            await wait_for(
                lambda: checked.ids[served_id(v2)] > at_v2 + 20, 90, "answers from version 2"
            )

            def index() -> list[tuple[str, str]]:
                rows = httpx.get(f"{front.base_url}/v2/repository/index").json()
                return [(r["version"], r["state"]) for r in rows if r["state"] != "unavailable"]

            # The front end sees the workers' heartbeats at its next look (a second at most).
            await wait_for(
                lambda: index() == [("2", "ready")], 90, "the index showing version 2 only"
            )
    print(f"\nbroker rollout: statuses {dict(checked.statuses)}, answers by id {dict(checked.ids)}")
    assert checked.statuses.keys() == {200}, checked.refused
    assert checked.mismatched == 0
    assert all(checked.ids[i] > 0 for i in (served_id(v1), served_id(v2), v3_id))


async def test_two_models_over_the_broker(tmp_path: Path) -> None:
    repository = tmp_path / "models"
    tiny = export_tiny(repository / "tiny" / "1")
    backbone = export_embedding_only(repository / "backbone" / "1")
    with (
        RedisServer() as redis_server,
        host(redis_server, repository, "a"),
        ServerProcess(
            **broker_env(redis_server.url, tiny, MODEL_REPOSITORY=str(repository))
        ) as front,
    ):
        files = {"image": ("x.png", IMAGES[0])}
        answers: dict[str, Any] = {}
        for name in ("tiny", "backbone"):
            answers[name] = httpx.post(
                f"{front.base_url}/predict/embedding", params={"model": name}, files=files
            )
        tags = httpx.post(f"{front.base_url}/predict/tag", params={"model": "tiny"}, files=files)
        index = httpx.get(f"{front.base_url}/v2/repository/index").json()
    assert answers["tiny"].headers["X-Model-Id"] == served_id(tiny)
    assert answers["backbone"].headers["X-Model-Id"] == served_id(backbone)
    for answer in answers.values():
        np.testing.assert_allclose(answer.json(), expected_for(IMAGES[0], tiny), atol=1e-5)
    assert tags.status_code == 200 and len(tags.json()) == 5
    assert [(r["name"], r["state"], r["workers"]) for r in index] == [
        ("backbone", "ready", 1),
        ("tiny", "ready", 1),
    ]
