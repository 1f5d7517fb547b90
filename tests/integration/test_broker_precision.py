"""MB_DTYPE=auto across a broker fleet: the first worker to load an export chooses its
precision and records it in Redis; every other worker loads that one, so a version has one
id fleet-wide. A host that cannot compute it (bf16 on a CPU without bf16 units) serves fp32
under an id of its own; the name routes to the variant ready on the most workers, a pin
gets exactly its id or 409, and rollouts and /backlog count both variants as the version."""

from __future__ import annotations

import asyncio
import os
import signal
import time
from pathlib import Path

import httpx
import numpy as np
import pytest

from app.manifest import read_manifest
from tests.answers import error_of
from tests.broker import PREFIX, RedisServer, Workers, broker_env
from tests.conftest import expected_for
from tests.integration.test_broker_rollout import IMAGES, holds
from tests.integration.test_repository import add_version
from tests.models import export_scaled, export_tiny
from tests.server import ServerProcess
from tests.waiting import wait_for

pytestmark = pytest.mark.slow

PRECISIONS = f"{PREFIX}:{{w}}:precisions"
ATOL = {"float32": 1e-4, "bfloat16": 2e-2}  # bf16 keeps 8 significant bits


def host(redis_server: RedisServer, repository: Path, name: str, bf16: bool) -> Workers:
    """One host of one worker, with (``bf16``) or without bf16 units, under MB_DTYPE=auto."""
    return Workers(
        redis_server, repository, count=1, MODEL_REPOSITORY=str(repository), MB_WORKER_NAME=name,
        MB_DTYPE="auto", MB_TEST_CPU_BF16="1" if bf16 else "0",
    )  # fmt: skip


def first_version(tmp_path: Path) -> tuple[Path, Path, str]:
    """A repository of the tiny model's version 1: the repository, the version, its id."""
    repository = tmp_path / "models"
    v1 = export_tiny(repository / "tiny" / "1")
    return repository, v1, read_manifest(v1).model_id


def held(workers: Workers) -> list[dict[str, object]]:
    return [model for beat in workers.own().values() for model in beat["models"]]


def answer(front: ServerProcess, index: int, pin: str | None = None) -> httpx.Response:
    headers = {"X-Model-Id": pin} if pin else {}
    files = {"image": ("x.png", IMAGES[index])}
    return httpx.post(
        f"{front.base_url}/predict/embedding", files=files, headers=headers, timeout=60
    )


def check(response: httpx.Response, store: Path, index: int, scale: float = 1.0) -> str:
    """The answer is 200, and its vector is what its X-Model-Id computes: that version's
    (``store``, ``scale``), within the precision its id names."""
    assert response.status_code == 200, response.text
    served = response.headers["X-Model-Id"]
    dtype = "bfloat16" if served.endswith("+bf16") else "float32"
    expected = scale * expected_for(IMAGES[index], store)
    np.testing.assert_allclose(response.json(), expected, atol=ATOL[dtype])
    return served


async def test_a_fleet_of_mixed_cpus_serves_a_version_in_two_precisions_knowingly(
    tmp_path: Path,
) -> None:
    repository, v1, model_id = first_version(tmp_path)
    with RedisServer() as redis_server:
        # As if a worker with bf16 units had chosen bf16 by measurement before: a timing of
        # the tiny model is noise, the rule that follows it is not.
        redis_server.client().hset(PRECISIONS, model_id, "bfloat16")
        with (
            host(redis_server, repository, "a", bf16=True) as a,
            host(redis_server, repository, "b", bf16=False) as b,
            ServerProcess(
                **broker_env(
                    redis_server.url, v1, MODEL_REPOSITORY=str(repository), MB_DTYPE="auto"
                )
            ) as front,
        ):
            # a adopts the fleet's bf16; b cannot compute it and serves fp32, its own id.
            assert [(m["served_id"], m["dtype"]) for m in held(a)] == [
                (f"{model_id}+bf16", "bfloat16")
            ]
            assert [(m["served_id"], m["dtype"]) for m in held(b)] == [(model_id, "float32")]
            # Unpinned: one variant (ready on as many workers: the rule's tie-break), every
            # answer its own precision's and saying which.
            ids = {check(answer(front, i % 16), v1, i % 16) for i in range(24)}
            assert ids == {f"{model_id}+bf16"}
            # Pinned: exactly that id, or 409 naming what is served; never a substitute.
            assert check(answer(front, 0, f"{model_id}+bf16"), v1, 0) == f"{model_id}+bf16"
            refused = answer(front, 0, model_id)
            assert refused.status_code == 409, refused.text
            assert error_of(refused)["type"] == "model_version_unavailable"
            assert f"{model_id}+bf16" in error_of(refused)["message"]
            backlog = httpx.get(f"{front.base_url}/backlog", timeout=10).json()
            assert backlog["backlog"] == 0 and backlog["streams"]
            # A rollout counts both variants as the version: version 2 loads on both hosts
            # (its own precision chosen, then adopted), the name switches, version 1 goes.
            v2 = add_version(repository, "tiny", lambda out: export_scaled(out, 2.0))
            v2_id = read_manifest(v2).model_id
            for workers in (a, b):
                os.kill(workers.process.pid, signal.SIGHUP)  # type: ignore[union-attr]
            deadline = time.monotonic() + 120
            while not (len(held(a)) == len(held(b)) == 1 and held(b)[0]["served_id"] == v2_id):
                assert time.monotonic() < deadline, (held(a), held(b))
                await asyncio.sleep(0.2)
            fleet = redis_server.client().hget(PRECISIONS, v2_id)
            assert fleet in (b"float32", b"bfloat16")
            a_id = v2_id + ("+bf16" if fleet == b"bfloat16" else "")
            await wait_for(
                lambda: holds(a, a_id), 90, "host a on version 2 in the fleet's precision"
            )
            answered = {check(answer(front, i % 16), v2, i % 16, 2.0) for i in range(8)}
            assert answered <= {v2_id, f"{v2_id}+bf16"} and len(answered) == 1


async def test_capable_workers_adopt_the_precision_the_first_one_recorded(
    tmp_path: Path,
) -> None:
    repository, _, model_id = first_version(tmp_path)
    with RedisServer() as redis_server:
        with host(redis_server, repository, "a", bf16=True) as a:
            recorded = redis_server.client().hget(PRECISIONS, model_id)
            assert recorded in (b"float32", b"bfloat16")  # what a measured to be faster
            with host(redis_server, repository, "b", bf16=True) as b:
                ids = {m["served_id"] for m in held(a) + held(b)}
    tag = "+bf16" if recorded == b"bfloat16" else ""
    assert ids == {model_id + tag}


async def test_a_front_end_up_before_the_workers_serves_the_precision_they_chose(
    tmp_path: Path,
) -> None:
    """The usual order on Kubernetes: the front end reads its store (an fp32 id) before any
    worker is up; the workers come with bf16. It routes the id they serve (a front end that
    kept its own reading answered 503 "no live model worker holds" here)."""
    repository, v1, model_id = first_version(tmp_path)
    with RedisServer() as redis_server:
        redis_server.client().hset(PRECISIONS, model_id, "bfloat16")
        front = ServerProcess(**broker_env(redis_server.url, v1, MODEL_REPOSITORY=str(repository)))
        starting = asyncio.create_task(asyncio.to_thread(front.start))  # ready once workers are
        try:
            await asyncio.sleep(3)  # the front end is up, and sees no worker
            with host(redis_server, repository, "a", bf16=True) as a:
                assert [m["served_id"] for m in held(a)] == [f"{model_id}+bf16"]
                await starting
                for i in range(4):
                    assert check(answer(front, i), v1, i) == f"{model_id}+bf16"
        finally:
            await asyncio.gather(starting, return_exceptions=True)
            front.stop()
