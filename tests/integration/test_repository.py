"""Several models in one server, and versions loaded and unloaded while it serves, against
real worker processes: choosing a model, pinning an export, the admin routes, a switch under
a waiting request, a load that fails at each step with the old version serving throughout,
SIGHUP, polling, and memory over swaps."""

from __future__ import annotations

import asyncio
import json
import os
import re
import shutil
import signal
import time
from collections.abc import AsyncIterator, Callable
from contextlib import asynccontextmanager
from pathlib import Path
from typing import Any

import httpx
import numpy as np
import pytest

from app.export import main as export_main
from app.manifest import read_manifest, sha256_file
from app.repository import publish, staging_folder
from app.testing import FakeTransport
from tests.answers import error_of
from tests.conftest import distinct_images, expected_for, running_app
from tests.models import (
    HeavyEmbedding,
    export_embedding_only,
    export_scaled,
    export_test_model,
    export_tiny,
)
from tests.server import ServerProcess
from tests.transports import Watched

pytestmark = pytest.mark.slow

ADMIN = {"Authorization": "Bearer admin-secret"}
IMAGE = distinct_images(1)[0]
FILES = {"image": ("x.png", IMAGE)}


def add_version(repository: Path, name: str, export: Callable[[Path], Path]) -> Path:
    """Export a new version of ``name`` into the repository as the export CLI does: written
    aside, then renamed into place whole. Returns its folder."""
    staging = staging_folder(repository / name)
    export(staging)
    return repository / name / str(publish(staging, repository / name))


def served_id(store: Path) -> str:
    return read_manifest(store).served_id("auto")


async def embed(client: httpx.AsyncClient, **params: str) -> httpx.Response:
    headers = {k: v for k, v in params.items() if k == "X-Model-Id"}
    query = {k: v for k, v in params.items() if k != "X-Model-Id"}
    return await client.post("/predict/embedding", params=query, files=FILES, headers=headers)


async def index(client: httpx.AsyncClient) -> list[dict[str, Any]]:
    answer = await client.get("/v2/repository/index")
    assert answer.status_code == 200, answer.text
    rows: list[dict[str, Any]] = answer.json()
    return rows


async def until(check: Callable[[], Any], what: str, timeout_s: float = 30) -> None:
    async with asyncio.timeout(timeout_s):
        while not await check():
            await asyncio.sleep(0.02)


def repository_of_two(root: Path) -> tuple[Path, Path]:
    tiny = export_tiny(root / "tiny" / "1")
    backbone = export_embedding_only(root / "backbone")  # a store directly in its folder
    return tiny, backbone


async def test_a_repository_of_two_models_serves_both(tmp_path: Path) -> None:
    tiny, backbone = repository_of_two(tmp_path / "models")
    ids = {"tiny": served_id(tiny), "backbone": served_id(backbone)}
    expected = expected_for(IMAGE, tiny)
    async with running_app(
        model_repository=tmp_path / "models", cuda_devices="cpu", mb_worker_num=1
    ) as (_, client):
        for name in ("tiny", "backbone"):
            answer = await embed(client, model=name)
            assert answer.status_code == 200 and answer.headers["X-Model-Id"] == ids[name]
            np.testing.assert_allclose(answer.json(), expected, atol=1e-5)
        several = await embed(client)  # no MB_DEFAULT_MODEL, and two models
        assert several.status_code == 422 and "?model=NAME" in error_of(several)["message"]
        assert len((await client.get("/tags", params={"model": "tiny"})).json()) == 1000
        no_head = await client.post("/predict/tag", params={"model": "backbone"}, files=FILES)
        assert no_head.status_code == 404 and error_of(no_head)["type"] == "no_classifier"
        unknown = await embed(client, model="nope")
        assert unknown.status_code == 404 and error_of(unknown)["type"] == "model_not_found"
        for escape in ("..", "../tiny", "tiny/../backbone", "a" * 65):
            refused = await embed(client, model=escape)
            assert refused.status_code == 422, escape
        # A pin gets exactly that export, or 409 naming the ids that are served.
        pinned = await embed(client, **{"X-Model-Id": ids["backbone"]})
        assert pinned.status_code == 200 and pinned.headers["X-Model-Id"] == ids["backbone"]
        wrong = await embed(client, model="tiny", **{"X-Model-Id": ids["backbone"]})
        assert wrong.status_code == 409
        gone = await embed(client, **{"X-Model-Id": "tiny-test@000000000000"})
        body = error_of(gone)
        assert gone.status_code == 409 and body["type"] == "model_version_unavailable"
        assert ids["tiny"] in body["message"] and ids["backbone"] in body["message"]
        # The Open Inference Protocol: by name, by version.
        v2_input = {"inputs": [{"name": "image", "datatype": "BYTES", "shape": [1],
                                "data": [__import__("base64").b64encode(IMAGE).decode()]}]}  # fmt: skip
        for path in ("/v2/models/backbone/infer", "/v2/models/tiny/versions/1/infer"):
            answer = await client.post(path, json=v2_input)
            assert answer.status_code == 200, answer.text
            assert answer.json()["model_version"] == "1"
        other = await client.post("/v2/models/tiny/versions/2/infer", json=v2_input)
        assert other.status_code == 409
        assert (await client.get("/v2/models/tiny")).json()["versions"] == ["1"]
        assert (await client.get("/v2/models/nope/ready")).status_code == 404
        assert (await client.get("/v2/models/tiny/versions/1/ready")).status_code == 200
        assert (await client.get("/v2/models/tiny/versions/7/ready")).status_code == 409
        rows = await index(client)
        assert [(r["name"], r["version"], r["state"], r["serving"]) for r in rows] == [
            ("backbone", "1", "ready", True),
            ("tiny", "1", "ready", True),
        ]
        assert all(r["memory_bytes"] and r["workers"] == 1 for r in rows)
        info = (await client.get("/info")).json()
        assert {m["name"] for m in info["models"]} == {"tiny", "backbone"}
        metrics = (await client.get("/metrics")).text
        assert 'microbatch_model_versions{model="tiny",state="ready"} 1.0' in metrics
        assert (
            'microbatch_batch_size_count{model="backbone",task="embedding",version="1"}' in metrics
        )
        assert 'route="/predict/embedding",status="200",version="1"' in metrics


async def test_the_default_model_answers_without_a_name(tmp_path: Path) -> None:
    repository_of_two(tmp_path / "models")
    async with running_app(
        transport=lambda _: FakeTransport(
            lambda task, jobs: [np.zeros(48, np.float32)] * len(jobs)
        ),
        model_repository=tmp_path / "models",
        mb_default_model="backbone",
    ) as (_, client):
        answer = await embed(client)
        assert answer.status_code == 200
        assert answer.headers["X-Model-Id"].startswith("tiny-backbone@")
        assert (await client.get("/info")).json()["default_model"] == "backbone"


async def test_the_admin_routes_exist_only_with_the_admin_key(tiny_store: Path) -> None:
    def fake(_: object) -> FakeTransport:
        return FakeTransport(lambda task, jobs: [np.zeros(48, np.float32)] * len(jobs))

    async with running_app(fake, model_store=tiny_store) as (app, client):
        missing = await client.post("/v2/repository/models/tiny-test/load", headers=ADMIN)
        assert missing.status_code == 404
        assert "/v2/repository/models/{name}/load" not in app.openapi()["paths"]
        assert (await client.get("/v2/repository/index")).status_code == 200
    async with running_app(fake, model_store=tiny_store, admin_api_key="admin-secret",
                           api_key="user-secret") as (app, client):  # fmt: skip
        route = "/v2/repository/models/tiny-test/load"
        for headers in ({}, {"Authorization": "x"}):  # no key, or not a bearer token
            refused = await client.post(route, headers=headers)
            assert refused.status_code == 401, headers
        user = await client.post(route, headers={"Authorization": "Bearer user-secret"})
        assert user.status_code == 403, "a known key without the admin scope"
        loaded = await client.post(route, headers=ADMIN)
        assert loaded.status_code == 200 and loaded.json()["model_id"] == served_id(tiny_store)
        assert "admin" in app.openapi()["components"]["securitySchemes"]


async def test_a_request_admitted_before_a_switch_is_answered_by_its_own_version(
    tmp_path: Path,
) -> None:
    """A request waiting for its batch when version 2 takes over is computed by version 1,
    which drains and is unloaded only after it; later requests get version 2."""
    repository = tmp_path / "models"
    v1 = export_tiny(repository / "tiny" / "1")
    expected = expected_for(IMAGE, v1)
    watched = Watched()
    async with running_app(
        watched.wrap, model_repository=repository, admin_api_key="admin-secret",
        cuda_devices="cpu", mb_worker_num=1,
    ) as (_, client):  # fmt: skip
        watched.hold()
        first = asyncio.create_task(embed(client))
        await watched.wait_entered()
        v2 = add_version(repository, "tiny", lambda out: export_scaled(out, 2.0))
        loaded = await client.post("/v2/repository/models/tiny/load", headers=ADMIN)
        assert loaded.status_code == 200, loaded.text
        assert loaded.json() == {"name": "tiny", "version": "2", "model_id": served_id(v2),
                                 "state": "ready"}  # fmt: skip
        states = {(r["version"], r["state"], r["in_flight"]) for r in await index(client)}
        assert states == {("1", "draining", 1), ("2", "ready", 0)}
        # Triton's {"ready": true}: what infer answers (it was not read: every row).
        serving = await client.post("/v2/repository/index", json={"ready": True})
        assert [(r["version"], r["serving"]) for r in serving.json()] == [("2", True)]
        every = await client.post("/v2/repository/index")
        assert len(every.json()) == 2
        for wrong in ({"ready": 7}, {"readdy": True}, [1]):
            refused = await client.post("/v2/repository/index", json=wrong)
            assert refused.status_code == 422, wrong
        watched.release()
        answer = await first
        assert answer.status_code == 200 and answer.headers["X-Model-Id"] == served_id(v1)
        np.testing.assert_allclose(answer.json(), expected, atol=1e-5)
        later = await embed(client)
        assert later.headers["X-Model-Id"] == served_id(v2)
        np.testing.assert_allclose(later.json(), 2 * expected, atol=1e-5)

        async def unloaded() -> bool:
            return [r["state"] for r in await index(client)] == ["unavailable", "ready"]

        await until(unloaded, "version 1 unloaded")
        assert watched.inner.models.held_ids() == {served_id(v2)}  # type: ignore[attr-defined]
        worker_models = (await client.get("/info")).json()["workers"][0]["models"]
        assert [m["served_id"] for m in worker_models] == [served_id(v2)]


@asynccontextmanager
async def probing(client: httpx.AsyncClient) -> AsyncIterator[list[httpx.Response]]:
    """Requests without a pause while the block runs; their answers, for checking after."""
    answers: list[httpx.Response] = []
    stop = asyncio.Event()

    async def probe() -> None:
        while not stop.is_set():
            answers.append(await embed(client))

    task = asyncio.create_task(probe())
    try:
        yield answers
    finally:
        stop.set()
        await task


def _corrupt(store: Path) -> Path:
    with (store / "embedding.pt").open("ab") as handle:
        handle.write(b"tampered")
    return store


def _fails_its_self_test(store: Path) -> Path:
    """The OpenVINO IR of another model, with checksums that match: only the self-test
    against TorchScript can tell."""
    other = export_test_model(store.parent / ".other", HeavyEmbedding(1), runtimes=("openvino",))
    manifest = json.loads((store / "manifest.json").read_text())
    for role, entry in manifest["runtimes"]["openvino"]["files"].items():
        if role.startswith("embedding"):
            shutil.copy(other / entry["path"], store / entry["path"])
            entry["sha256"] = sha256_file(store / entry["path"])
    (store / "manifest.json").write_text(json.dumps(manifest))
    shutil.rmtree(other)
    return store


FAILURES: dict[str, tuple[dict[str, Any], Callable[[Path], Path], int, str]] = {
    # step: settings, how the new version is exported, the answer's status and type
    "verify": ({}, lambda out: _corrupt(export_scaled(out, 2.0)), 422, "model_load_failed"),
    "self-test": ({"mb_runtime": "openvino"},
                  lambda out: _fails_its_self_test(export_scaled(out, 2.0, ("openvino",))),
                  422, "model_load_failed"),
    "budget": ({"mb_model_memory": "100MiB"},
               lambda out: export_test_model(out, HeavyEmbedding(128)), 507,
               "model_memory_budget"),
}  # fmt: skip


@pytest.mark.parametrize("step", list(FAILURES))
async def test_a_load_that_fails_leaves_the_old_version_serving(tmp_path: Path, step: str) -> None:
    settings, export, status, kind = FAILURES[step]
    repository = tmp_path / "models"
    runtimes = ("openvino",) if step == "self-test" else ()
    v1 = export_tiny(repository / "tiny" / "1", runtimes=runtimes)
    expected = expected_for(IMAGE, v1)
    async with running_app(
        model_repository=repository, admin_api_key="admin-secret", cuda_devices="cpu",
        mb_worker_num=1, **settings,
    ) as (_, client):  # fmt: skip
        add_version(repository, "tiny", export)
        async with probing(client) as answers:
            failed = await client.post("/v2/repository/models/tiny/load", headers=ADMIN)
        assert failed.status_code == status, failed.text
        error = error_of(failed)
        assert error["type"] == kind and step in error["message"]
        assert str(tmp_path) not in error["message"]  # no paths in answers
        assert answers and all(a.status_code == 200 for a in answers)
        assert {a.headers["X-Model-Id"] for a in answers} == {served_id(v1)}
        np.testing.assert_allclose(answers[-1].json(), expected, atol=1e-5)
        rows = {r["version"]: r for r in await index(client)}
        assert rows["1"]["state"] == "ready" and rows["2"]["state"] == "failed"
        assert step in rows["2"]["reason"]
        metrics = (await client.get("/metrics")).text
        assert f'microbatch_model_load_failures_total{{model="tiny",step="{step}"}} 1.0' in metrics
        if step == "budget":
            assert re.search(r"needs 128\.\dMiB \(its model files\)", error["message"])
            assert "over MB_MODEL_MEMORY=100MiB" in error["message"]  # as it was set
        after = await embed(client)
        assert after.status_code == 200 and after.headers["X-Model-Id"] == served_id(v1)


async def test_a_worker_that_dies_while_loading_leaves_the_old_version_serving(
    tmp_path: Path,
) -> None:
    """Killed in the middle of a load: the load answers with the reason, the other worker
    serves version 1 throughout, and the dead one comes back with version 1 only."""
    repository = tmp_path / "models"
    v1 = export_tiny(repository / "tiny" / "1")
    async with running_app(
        model_repository=repository, admin_api_key="admin-secret", cuda_devices="cpu",
        mb_worker_num=2, mb_worker_threads=1, mb_batch_size="auto", mb_auto_batch_max=16,
    ) as (_, client):  # fmt: skip
        add_version(repository, "tiny", lambda out: export_scaled(out, 2.0))
        async with probing(client) as answers:
            load = asyncio.create_task(
                client.post("/v2/repository/models/tiny/load", headers=ADMIN)
            )

            async def loading() -> bool:
                workers = (await client.get("/info")).json()["workers"]
                states = [m["state"] for w in workers for m in w["models"]]
                return "loading" in states

            await until(loading, "a worker loading version 2")
            workers = (await client.get("/info")).json()["workers"]
            pid = next(
                w["pid"] for w in workers if any(m["state"] == "loading" for m in w["models"])
            )
            os.kill(pid, signal.SIGKILL)
            failed = await load
        assert failed.status_code == 422, failed.text
        assert "died while loading" in error_of(failed)["message"]
        assert answers and all(a.status_code == 200 for a in answers)
        assert {a.headers["X-Model-Id"] for a in answers} == {served_id(v1)}

        async def back() -> bool:
            workers = (await client.get("/info")).json()["workers"]
            return all(w["ready"] and w["alive"] for w in workers) and len(workers) == 2

        await until(back, "the killed worker restarted", timeout_s=60)
        models = [m for w in (await client.get("/info")).json()["workers"] for m in w["models"]]
        assert {m["served_id"] for m in models if m["state"] != "failed"} == {served_id(v1)}
        # Version 2 killed a worker as it loaded: given up on every worker, not retried by
        # the one restarted (a model that kills its worker would kill it again), until an
        # explicit retry.
        assert {(m["version"], m["state"]) for m in models if m["state"] == "failed"} == {
            (2, "failed")
        }


def test_the_export_writes_the_next_version_whole(tmp_path: Path) -> None:
    repository = tmp_path / "models"
    args = ["--arch", "resnet18", "--weights", "random", "--runtimes", "none",
            "--repository", str(repository), "--name", "tagger"]  # fmt: skip
    assert export_main(args) == 0
    assert export_main(args) == 0
    folder = repository / "tagger"
    assert sorted(p.name for p in folder.iterdir()) == ["1", "2"]  # no staging left behind
    assert read_manifest(folder / "2").arch == "tagger"
    # A failing export adds nothing (and leaves nothing half-written).
    classes = tmp_path / "labels.txt"
    classes.write_text("a\nb\n")
    bad = [*args[:-4], "--weights", str(tmp_path / "missing.pth"), "--repository",
           str(repository), "--name", "tagger"]  # fmt: skip
    assert export_main(bad) == 2
    assert sorted(p.name for p in folder.iterdir()) == ["1", "2"]
    with pytest.raises(SystemExit):
        export_main([*args[:-2], "--name", "../escape"])


def test_sighup_and_polling_load_what_is_new_on_disk(tmp_path: Path) -> None:
    repository = tmp_path / "models"
    v1 = export_tiny(repository / "tiny" / "1")
    env = {"MODEL_REPOSITORY": str(repository), "MB_WORKER_NUM": "1"}
    with ServerProcess(**env) as server:
        base = server.base_url
        assert served_now(base) == served_id(v1)
        v2 = add_version(repository, "tiny", lambda out: export_scaled(out, 2.0))
        os.kill(server.pid, signal.SIGHUP)
        deadline = time.monotonic() + 60
        while served_now(base) != served_id(v2):
            assert time.monotonic() < deadline, "SIGHUP did not load version 2"
            time.sleep(0.1)
    with ServerProcess(**env, MB_REPOSITORY_POLL_S="0.2") as server:
        base = server.base_url
        assert served_now(base) == served_id(v2)  # the newest at start
        v3 = add_version(repository, "tiny", lambda out: export_scaled(out, 3.0))
        deadline = time.monotonic() + 60
        while served_now(base) != served_id(v3):
            assert time.monotonic() < deadline, "the poll did not load version 3"
            time.sleep(0.1)


def served_now(base: str) -> str:
    return httpx.post(f"{base}/predict/embedding", files=FILES).headers["X-Model-Id"]


async def test_memory_stays_flat_over_swaps(tmp_path: Path) -> None:
    """Ten swaps between two versions that hold 64 MB each: the worker gives back what each
    unloaded version took (its RSS after the last swap within 10% of after the second; a
    version kept would add 64 MB a swap)."""
    repository = tmp_path / "models"
    v1 = export_test_model(repository / "tiny" / "1", HeavyEmbedding(64))
    v2 = add_version(
        repository, "tiny", lambda out: export_test_model(out, HeavyEmbedding(64), "heavy-2")
    )
    async with running_app(
        model_repository=repository, admin_api_key="admin-secret", cuda_devices="cpu",
        mb_worker_num=1, mb_model_versions="tiny=1",
    ) as (_, client):  # fmt: skip
        rss = []
        for swap in range(10):
            number = "2" if swap % 2 == 0 else "1"
            answer = await client.post(
                "/v2/repository/models/tiny/load", headers=ADMIN,
                json={"parameters": {"version": number}},
            )  # fmt: skip
            assert answer.status_code == 200, answer.text

            async def one_version() -> bool:
                loaded = [r for r in await index(client) if r["state"] != "unavailable"]
                return len(loaded) == 1

            await until(one_version, "the old version unloaded")
            assert (await embed(client)).headers["X-Model-Id"] == served_id(
                v2 if number == "2" else v1
            )
            rss.append((await client.get("/info")).json()["workers"][0]["rss_bytes"])
        assert rss[-1] <= 1.10 * rss[1], [r >> 20 for r in rss]


async def test_unload_gives_the_memory_back_and_replace_trades_a_gap_for_it(
    tmp_path: Path,
) -> None:
    """Unload: the name is no longer served (404), its memory is back when the call answers.
    A load with ``replace``: the old version goes first, the name answers 503 with
    Retry-After until the new one serves, then the new one answers."""
    repository = tmp_path / "models"
    v1 = export_tiny(repository / "tiny" / "1")
    export_embedding_only(repository / "backbone")
    watched = Watched()
    async with running_app(
        watched.wrap, model_repository=repository, admin_api_key="admin-secret",
        cuda_devices="cpu", mb_worker_num=1, mb_default_model="tiny",
    ) as (_, client):  # fmt: skip
        unloaded = await client.post("/v2/repository/models/backbone/unload", headers=ADMIN)
        assert unloaded.status_code == 200 and unloaded.json()["state"] == "unloaded"
        assert watched.inner.models.held_ids() == {served_id(v1)}  # type: ignore[attr-defined]
        gone = await embed(client, model="backbone")
        assert gone.status_code == 404 and error_of(gone)["type"] == "model_not_found"
        again = await client.post("/v2/repository/models/backbone/unload", headers=ADMIN)
        assert again.status_code == 404
        v2 = add_version(repository, "tiny", lambda out: export_scaled(out, 2.0))
        watched.hold()  # the old version's last request holds the gap open
        first = asyncio.create_task(embed(client))
        await watched.wait_entered()
        replace = {"parameters": {"replace": True}}
        load = asyncio.create_task(
            client.post("/v2/repository/models/tiny/load", headers=ADMIN, json=replace)
        )

        async def draining() -> bool:
            return any(r["state"] == "draining" for r in await index(client))

        await until(draining, "version 1 draining")
        gap = await embed(client)
        assert gap.status_code == 503 and error_of(gap)["type"] == "not_ready"
        assert gap.headers["Retry-After"].isdigit()
        watched.release()
        assert (await first).headers["X-Model-Id"] == served_id(v1)
        assert (await load).status_code == 200
        assert (await embed(client)).headers["X-Model-Id"] == served_id(v2)
        assert watched.inner.models.held_ids() == {served_id(v2)}  # type: ignore[attr-defined]


@pytest.mark.parametrize("outcome", ["serves", "fails"])
async def test_a_slow_load_runs_beside_the_batches_of_the_version_serving(
    tmp_path: Path, outcome: str
) -> None:
    """One worker, a load made 6 s slower on purpose (in its self-test step): the worker
    loads in a thread of its own and answers the serving version's requests meanwhile, each
    within a bound far below the delay; the load then serves, or fails (a corrupted file
    behind the delay) and leaves the version before serving, untouched."""
    repository = tmp_path / "models"
    v1 = export_tiny(repository / "tiny" / "1")
    async with running_app(
        model_repository=repository, admin_api_key="admin-secret", cuda_devices="cpu",
        mb_worker_num=1, mb_test_load_delay_s="6",
    ) as (_, client):  # fmt: skip
        if outcome == "serves":
            v2 = add_version(repository, "tiny", lambda out: export_scaled(out, 2.0))
        else:  # the sha256 checks pass (rewritten): the module digest fails, after the delay
            v2 = add_version(repository, "tiny", lambda out: export_scaled(out, 2.0))
            (v2 / "embedding.pt").write_bytes((v1 / "embedding.pt").read_bytes())
            manifest = json.loads((v2 / "manifest.json").read_text())
            manifest["files"]["embedding"]["sha256"] = sha256_file(v2 / "embedding.pt")
            (v2 / "manifest.json").write_text(json.dumps(manifest))
        async with probing(client) as answers:
            started = time.monotonic()
            loaded = await client.post("/v2/repository/models/tiny/load", headers=ADMIN)
            took = time.monotonic() - started
        after = await embed(client)
    assert took >= 6, f"the load took {took:.1f} s: the delay did not apply"
    assert answers and all(a.status_code == 200 for a in answers)
    during = [a for a in answers if a.headers["X-Model-Id"] == served_id(v1)]
    assert len(during) >= 10, f"only {len(during)} answers while it loaded for {took:.1f} s"
    slowest = max(a.elapsed.total_seconds() for a in during)
    assert slowest < 4, f"an answer waited {slowest:.1f} s while the worker loaded"
    if outcome == "serves":
        assert loaded.status_code == 200 and after.headers["X-Model-Id"] == served_id(v2)
    else:
        assert loaded.status_code == 422 and error_of(loaded)["type"] == "model_load_failed"
        assert "does not compute what its manifest's id says" in error_of(loaded)["message"]
        assert after.headers["X-Model-Id"] == served_id(v1)


@pytest.mark.parametrize("runtime", ["openvino", "torchscript"])
async def test_versions_load_unload_and_load_again_twenty_times(
    tmp_path: Path, runtime: str
) -> None:
    """Through the admin route, in-process: versions 1 and 2 in turn, 20 loads, each of a
    version its worker had unloaded: every load answers 200, the worker never dies, and
    each answer is its version's. (A broker worker's signals after such cycles:
    ``test_runtimes.py``.)"""
    repository = tmp_path / "models"
    runtimes = ("openvino",) if runtime == "openvino" else ()
    v1 = export_tiny(repository / "tiny" / "1", runtimes=runtimes)
    v2 = add_version(repository, "tiny", lambda out: export_scaled(out, 2.0, runtimes))
    expected = expected_for(IMAGE, v1)
    async with running_app(
        model_repository=repository, admin_api_key="admin-secret", cuda_devices="cpu",
        mb_worker_num=1, mb_runtime=runtime, mb_model_versions="tiny=1",
    ) as (app, client):  # fmt: skip
        (pid,) = [w.pid for w in app.state.engine.transport.worker_status()]
        for cycle in range(20):
            number = 2 if cycle % 2 == 0 else 1
            loaded = await client.post(
                "/v2/repository/models/tiny/load", headers=ADMIN,
                json={"parameters": {"version": str(number)}},
            )  # fmt: skip
            assert loaded.status_code == 200, f"cycle {cycle}: {loaded.text}"
            answer = await embed(client)
            assert answer.headers["X-Model-Id"] == served_id(v2 if number == 2 else v1)
            np.testing.assert_allclose(answer.json(), number * expected, atol=1e-5)
        (worker,) = app.state.engine.transport.worker_status()
    assert (worker.pid, worker.restarts, worker.alive) == (pid, 0, True)
