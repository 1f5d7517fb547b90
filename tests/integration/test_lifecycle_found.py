"""What the model-based lifecycle test (``test_lifecycle_model.py``) and users found where
features meet, each as a plain test against real servers with the default precision
(``MB_DTYPE=auto``; the bf16 outcome forced by its test hook, so every CPU takes that path):

- a version loaded under the default precision served under an id no worker held: every
  request answered 503 ``worker_died`` while ``/readyz`` said ready (in-process, by the
  route, by SIGHUP, and after an unload and a load, where tritonclient got 409);
- an int8 export served as its fp32 source (in either mode);
- a load retried after a failure answered the last failure at once (broker mode);
- a load's failure carried this machine's paths into answers and the index (broker mode);
- the index showed one export served under two names, or republished under a new number,
  with rows that were not true;
- a restarted broker worker left the entries its last life had pending unanswered until
  their deadline (it starts holding nothing now, and takes them back once it holds its
  models);
- two loads of one name at once, a load after an unload, an unload naming a version;
- a rollback written as the next version while the old one drained was never computed
  (broker mode).
"""

from __future__ import annotations

import json
import shutil
import signal
import threading
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import numpy as np
import pytest

from app.broker.wire.keys import HEARTBEAT_S
from app.lifecycle import SWITCH_GRACE_S
from app.manifest import read_manifest
from tests.answers import error_of, metric
from tests.lifecycle import (
    ADMIN,
    IMAGES,
    NAME,
    Catalog,
    Config,
    Deployment,
    Mode,
    computed_by,
    http_embedding,
    publish,
    triton_binary,
    triton_grpc,
    until,
)

pytestmark = pytest.mark.slow


@pytest.fixture(scope="module")
def photos(tmp_path_factory: pytest.TempPathFactory) -> Path:
    from bench.systems import photo_views

    return photo_views(tmp_path_factory.mktemp("photos"), 100)


@pytest.fixture(scope="module")
def bf16(tmp_path_factory: pytest.TempPathFactory) -> Catalog:
    return Catalog(tmp_path_factory.mktemp("bf16"), "bf16")


@pytest.fixture(scope="module")
def int8(tmp_path_factory: pytest.TempPathFactory, photos: Path) -> Catalog:
    return Catalog(tmp_path_factory.mktemp("int8"), "int8", photos)


@pytest.fixture
def deploy(tmp_path: Path) -> Iterator[Any]:
    """``deploy(config, catalog, first=0)``: a deployment serving ``catalog.good[first]`` as
    version 1 of ``NAME``; stopped at the test's end."""
    started: list[Deployment] = []

    def start(config: Config, catalog: Catalog, first: int = 0, **env: str) -> Deployment:
        root = tmp_path / f"repository-{len(started)}"
        publish(root, catalog.good[first])
        deployment = Deployment(config, root, tmp_path / f"scratch-{len(started)}")
        deployment.env.update(env)
        started.append(deployment)
        return deployment.__enter__()

    yield start
    for deployment in reversed(started):
        deployment.__exit__(None, None, None)


def load(base_url: str, version: int | None = None, **parameters: Any) -> httpx.Response:
    asked = {"version": str(version)} if version is not None else {}
    body = {"parameters": {**asked, **parameters}}
    return httpx.post(
        f"{base_url}/v2/repository/models/{NAME}/load", json=body, headers=ADMIN, timeout=120
    )


def served(deployment: Deployment, catalog: Catalog, served_id: str) -> None:
    """Every protocol answers 200 with ``served_id``'s own embedding."""
    with httpx.Client(base_url=deployment.base_url, timeout=60) as http:
        answer = http_embedding(http, 0)
        assert answer.status == 200, answer
        assert answer.served_id == served_id
        assert computed_by(catalog, served_id, 0, answer.embedding) is None
        pinned = http_embedding(http, 1, pin=served_id)
        assert pinned.status == 200 and pinned.served_id == served_id, pinned
    for answer in (triton_binary(deployment.base_url, 2), triton_grpc(deployment.grpc_url, 2)):
        assert answer.status == 200, answer
        assert computed_by(catalog, served_id, 2, answer.embedding) is None
    assert httpx.get(f"{deployment.base_url}/readyz").status_code == 200


def rows(base_url: str) -> list[tuple[str, str, str | None, str, bool, int]]:
    index = httpx.get(f"{base_url}/v2/repository/index").json()
    return [
        (r["name"], r["version"], r["model_id"], r["state"], r["serving"], r["workers"])
        for r in index
    ]


def test_a_version_loaded_under_the_default_precision_serves_as_its_workers_hold_it(
    deploy: Any, bf16: Catalog
) -> None:
    """The issue's first report: after a rollout by the route, every request answered 503
    ``worker_died`` naming the fp32 id while the worker held ``+bf16``; by SIGHUP the same;
    after an unload and a load, tritonclient's infers got 409."""
    deployment = deploy(Config("inprocess", 1, "bf16"), bf16)
    v1, v2, v3 = bf16.good[:3]
    served(deployment, bf16, v1.served_id)
    publish(deployment.root, v2)
    answer = load(deployment.base_url)
    assert answer.status_code == 200 and answer.json()["model_id"] == v2.served_id, answer.text
    served(deployment, bf16, v2.served_id)
    publish(deployment.root, v3)
    deployment.sighup()
    until(lambda: rows(deployment.base_url)[2][4], "version 3 serving")
    served(deployment, bf16, v3.served_id)
    unloaded = httpx.post(
        f"{deployment.base_url}/v2/repository/models/{NAME}/unload", headers=ADMIN, timeout=60
    )
    assert unloaded.status_code == 200, unloaded.text
    assert httpx.get(f"{deployment.base_url}/readyz").status_code == 503
    assert load(deployment.base_url).status_code == 200
    served(deployment, bf16, v3.served_id)


@pytest.mark.parametrize("mode", ["inprocess", "broker"])
def test_an_int8_export_beside_its_fp32_source_answers_as_int8(
    deploy: Any, int8: Catalog, mode: Mode
) -> None:
    """Version 2 is the int8 quantization of version 1: it loads, serves under its own
    ``+int8`` id and answers with its own (int8) embeddings, not version 1's to the bit."""
    fp32, quantized = int8.good[0], int8.good[1]
    assert fp32.model_id != quantized.model_id
    deployment = deploy(Config(mode, 2 if mode == "broker" else 1, "int8"), int8)
    publish(deployment.root, quantized)
    answer = load(deployment.base_url)
    assert answer.status_code == 200 and answer.json()["model_id"] == quantized.served_id
    served(deployment, int8, quantized.served_id)
    with httpx.Client(base_url=deployment.base_url, timeout=60) as http:
        computed = np.asarray(http_embedding(http, 0).embedding)
    assert not np.array_equal(computed, fp32.references[0])  # not the fp32 model's answer


@pytest.mark.parametrize("mode", ["inprocess", "broker"])
def test_a_load_retried_after_its_failure_is_tried_again_and_its_reason_has_no_paths(
    deploy: Any, bf16: Catalog, mode: Mode
) -> None:
    """A corrupt version 2 fails (422, the reason on its row of the index, without this
    machine's paths); its file restored, the same load answers 200 once it serves (it
    answered the stale 422 at once in broker mode, then rolled out anyway)."""
    workers = 2 if mode == "broker" else 1
    deployment = deploy(Config(mode, workers, "bf16"), bf16)
    number = publish(deployment.root, bf16.corrupt)
    failed = load(deployment.base_url, number)
    assert failed.status_code == 422 and error_of(failed)["type"] == "model_load_failed"
    root = str(deployment.root.resolve())
    assert root not in failed.text and "<repository>" in failed.text
    row = next(r for r in httpx.get(f"{deployment.base_url}/v2/repository/index").json()
               if r["version"] == str(number))  # fmt: skip
    assert row["state"] == "failed" and row["reason"] and root not in row["reason"]
    assert root not in httpx.get(f"{deployment.base_url}/info").text

    # Counted as a failed load, though it needed none: by each worker (broker mode: as its
    # heartbeat says, which may come after the 422 the first one's answered).
    def counted() -> float:
        scrape = httpx.get(f"{deployment.base_url}/metrics").text
        return metric(scrape, "microbatch_model_load_failures_total", step="verify")

    until(lambda: counted() >= workers, "the failure counted")
    time.sleep(2 * HEARTBEAT_S)
    assert counted() == workers
    served(deployment, bf16, bf16.good[0].served_id)  # what served before serves on
    # The operator restores the file (the copy's manifest claims version 1's export).
    good = deployment.root / NAME / str(number)
    shutil.rmtree(good)
    shutil.copytree(bf16.good[0].store, good)
    started = time.monotonic()
    try:
        retried = load(deployment.base_url, number)
    except httpx.TimeoutException:
        deployment.__exit__(None, None, None)
        raise AssertionError(deployment.output()[-6000:]) from None
    assert retried.status_code == 200, (retried.text, time.monotonic() - started)
    assert retried.json()["version"] == str(number)
    served(deployment, bf16, bf16.good[0].served_id)


def test_the_index_is_true_for_one_export_under_two_names_and_two_numbers(
    tmp_path: Path, bf16: Catalog
) -> None:
    """Names ``a`` and ``b`` serve one export: each row says its own truth (``a`` was
    listed with no worker); unloading ``b`` leaves ``a`` (``b`` stayed listed ready); a
    version republished under the next number serves under it, the old number back on disk
    (it was listed ready beside the new one, both counted in the metric)."""
    root = tmp_path / "repository"
    for name in ("a", "b"):
        publish_as(root, name, bf16.good[0].store)
    export = bf16.good[0].served_id
    config = Config("inprocess", 1, "bf16")
    with Deployment(config, root, tmp_path) as deployment:
        base = deployment.base_url
        assert rows(base) == [
            ("a", "1", export, "ready", True, 1),
            ("b", "1", export, "ready", True, 1),
        ]
        unloaded = httpx.post(f"{base}/v2/repository/models/b/unload", headers=ADMIN, timeout=60)
        assert unloaded.status_code == 200
        assert rows(base) == [
            ("a", "1", export, "ready", True, 1),
            ("b", "1", None, "unavailable", False, 0),
        ]
        assert (
            httpx.post(f"{base}/predict/embedding?model=a", files={"image": IMAGES[0]}).status_code
            == 200
        )
        publish_as(root, "a", bf16.good[0].store)  # version 2: version 1 again
        answer = httpx.post(
            f"{base}/v2/repository/models/a/load", json={}, headers=ADMIN, timeout=60
        )
        assert answer.status_code == 200 and answer.json()["version"] == "2"
        until(lambda: ("a", "1", None, "unavailable", False, 0) in rows(base), "a 1 back on disk")
        assert [r for r in rows(base) if r[0] == "a"] == [
            ("a", "1", None, "unavailable", False, 0),
            ("a", "2", export, "ready", True, 1),
        ]
        metrics = httpx.get(f"{base}/metrics").text
        assert 'microbatch_model_versions{model="a",state="ready"} 1.0' in metrics


def publish_as(root: Path, name: str, store: Path) -> int:
    """Publish ``store`` as ``name``'s next version."""
    from app.repository import publish as rename_into_place
    from app.repository import staging_folder

    staging = staging_folder(root / name)
    staging.rmdir()
    shutil.copytree(store, staging)
    return rename_into_place(staging, root / name)


def test_two_loads_of_one_name_at_once_each_get_one_answer(deploy: Any, bf16: Catalog) -> None:
    """A load asked while another of the same name runs waits for it, then runs: both
    answer 200, each naming the version it asked for."""
    deployment = deploy(Config("inprocess", 1, "bf16"), bf16)
    publish(deployment.root, bf16.good[1])
    publish(deployment.root, bf16.good[2])
    answers: dict[int, httpx.Response] = {}
    threads = [
        threading.Thread(target=lambda n=n: answers.__setitem__(n, load(deployment.base_url, n)))
        for n in (2, 3)
    ]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    assert {n: a.status_code for n, a in answers.items()} == {2: 200, 3: 200}
    assert {n: a.json()["version"] for n, a in answers.items()} == {2: "2", 3: "3"}


@pytest.mark.parametrize("mode", ["inprocess", "broker"])
def test_a_load_after_an_unload_answers_503_until_it_serves_in_both_modes(
    deploy: Any, bf16: Catalog, mode: Mode
) -> None:
    """After an unload the name is unknown (404); once a load of it is asked, it is 503
    with Retry-After until it serves (broker mode answered 404, and the client retries only
    503). An unload naming a version that does not serve is refused (422)."""
    workers = 2 if mode == "broker" else 1
    delay = "3" if mode == "inprocess" else "3,3"
    deployment = deploy(
        Config(mode, workers, "bf16"),
        bf16,
        MB_TEST_LOAD_DELAY_S=delay,
    )
    base = deployment.base_url
    wrong = httpx.post(f"{base}/v2/repository/models/{NAME}/unload", headers=ADMIN,
                       json={"parameters": {"version": "7"}}, timeout=60)  # fmt: skip
    assert wrong.status_code == 422, wrong.text
    unloaded = httpx.post(f"{base}/v2/repository/models/{NAME}/unload", headers=ADMIN,
                          json={"parameters": {"version": "1"}}, timeout=60)  # fmt: skip
    assert unloaded.status_code == 200, unloaded.text
    with httpx.Client(base_url=base, timeout=60) as http:
        assert http_embedding(http, 0).status == 404
        loading = threading.Thread(target=load, args=(base,))
        loading.start()
        # Asked until the load has begun (each worker then sleeps 3 s in it): a busy machine
        # may take a while to send the route its request. 404 until the load ends: wrong.
        deadline = time.monotonic() + 60
        while True:
            gap = http.post("/predict/embedding", params={"model": NAME},
                            files={"image": IMAGES[0]})  # fmt: skip
            if gap.status_code != 404 or not loading.is_alive() or time.monotonic() > deadline:
                break
            time.sleep(0.05)
        loading.join()
    assert gap.status_code == 503 and error_of(gap)["type"] == "not_ready", gap.text
    assert gap.headers["Retry-After"].isdigit()
    served(deployment, bf16, bf16.good[0].served_id)


@pytest.mark.parametrize("mode", ["inprocess", "broker"])
def test_a_failed_load_after_an_unload_leaves_the_name_unknown_not_coming(
    deploy: Any, bf16: Catalog, mode: Mode
) -> None:
    """Found by ``make chaos`` (kill -9 twice, a corrupt version 2, unload, a corrupt version
    3, load by the route): after the load's 422 nothing serves the name and nothing loads
    it, yet every request got 503 "no version ready now" with Retry-After, for good. It is
    404, as after the unload; the next good load serves."""
    workers = 2 if mode == "broker" else 1
    deployment = deploy(Config(mode, workers, "bf16"), bf16)
    base = deployment.base_url
    unloaded = httpx.post(f"{base}/v2/repository/models/{NAME}/unload", headers=ADMIN, timeout=60)
    assert unloaded.status_code == 200, unloaded.text
    publish(deployment.root, bf16.corrupt)
    failed = load(base)  # the newest: the corrupt one
    assert failed.status_code == 422 and error_of(failed)["type"] == "model_load_failed"
    with httpx.Client(base_url=base, timeout=60) as http:
        answer = http_embedding(http, 0)
    assert answer.status == 404 and answer.error == "model_not_found", answer
    assert load(base, 1).status_code == 200
    served(deployment, bf16, bf16.good[0].served_id)


@pytest.mark.parametrize("published", ["corrupt", "good"])
def test_a_restarted_lone_worker_serves_what_served_not_the_newest_on_disk(
    deploy: Any, bf16: Catalog, published: str
) -> None:
    """Found by ``make chaos`` (inprocess-1-int8: a corrupt version published, no reload,
    ``kill -9`` of the only worker): restarted, the worker loaded the newest version on disk,
    not what served. A corrupt one failed, and nothing served (503) until a reload; a good
    one would have rolled out with no reload asked. It serves version 1 again, and loads
    nothing else."""
    deployment = deploy(Config("inprocess", 1, "bf16"), bf16)
    newer = bf16.good[1] if published == "good" else bf16.corrupt
    publish(deployment.root, newer)
    pid = deployment.kill_worker()
    until(lambda: deployment.worker_pids() not in ([], [pid]), "the worker back", timeout_s=120)
    with httpx.Client(base_url=deployment.base_url, timeout=60) as http:
        until(lambda: http_embedding(http, 0).status == 200, "version 1 served again")
    served(deployment, bf16, bf16.good[0].served_id)
    states = {r[1]: (r[3], r[4], r[5]) for r in rows(deployment.base_url) if r[0] == NAME}
    assert states["1"] == ("ready", True, 1), states
    assert states["2"][0] == "unavailable", states  # on disk, never loaded


def test_a_restarted_broker_worker_answers_what_its_last_life_left_pending(
    deploy: Any, bf16: Catalog
) -> None:
    """``kill -9`` of a broker worker with requests pending at it: restarted under its
    name, it takes them back once it holds its models again; every request is answered
    200, none at its deadline (one got 504: the restarted worker took them back before it
    held a model, and left them)."""
    deployment = deploy(Config("broker", 2, "bf16"), bf16, MB_REQUEST_TIMEOUT="20")
    assert deployment.workers is not None
    results: list[int] = []

    def send() -> None:
        with httpx.Client(base_url=deployment.base_url, timeout=60) as http:
            for i in range(40):
                results.append(http_embedding(http, i % 3).status)

    clients = [threading.Thread(target=send) for _ in range(4)]
    for client in clients:
        client.start()
    time.sleep(0.5)
    victim = sorted(deployment.worker_pids())[0]
    import os

    os.kill(victim, signal.SIGKILL)
    for client in clients:
        client.join()
    assert len(results) == 160
    assert set(results) <= {200, 503}, sorted(set(results))
    assert 504 not in results


def test_a_restart_keeps_every_served_id_and_says_so_when_it_changes(
    tmp_path: Path, bf16: Catalog
) -> None:
    """The precision MB_DTYPE=auto chose is kept for the export on this class of host
    (``MB_STATE_DIR``): a restart measures again, keeps it unless another precision is
    decisively faster, and says so when it changes. Here the second start has fp32 timed
    a thousand times faster (decisive): it changes, with a warning; a third start keeps it."""
    root = tmp_path / "repository"
    publish(root, bf16.good[0])
    export = bf16.good[0]
    config = Config("inprocess", 1, "bf16")
    ids = []
    for fastest in ("bfloat16", "bfloat16", "float32", "float32"):
        deployment = Deployment(config, root, tmp_path)
        deployment.env["MB_TEST_FASTEST_DTYPE"] = fastest
        with deployment:
            with httpx.Client(base_url=deployment.base_url, timeout=60) as http:
                ids.append(http_embedding(http, 0).served_id)
        if fastest == "float32" and ids[-2] != ids[-1]:
            assert "chosen on this host class before: serving in float32" in deployment.output()
    assert ids == [export.served_id, export.served_id, export.model_id, export.model_id]
    recorded = json.loads((tmp_path / "state" / "precisions.json").read_text())
    assert list(recorded.values()) == [{export.model_id: "float32"}]
    assert read_manifest(export.store).model_id == export.model_id


def test_a_broker_worker_loads_the_precision_the_fleet_recorded_without_measuring(
    deploy: Any, bf16: Catalog
) -> None:
    """Of a host's two workers, the first to load the export measures the precisions and
    records its choice; the second reads the record before it loads, and loads that one
    alone (it measured its own, then loaded again in the fleet's: 9 s + 6 s)."""
    deployment = deploy(Config("broker", 2, "bf16"), bf16)
    assert deployment.workers is not None
    trials = [
        {trial["label"] for model in beat["models"] for trial in model["trials"]}
        for beat in deployment.workers.own().values()
    ]
    measured = [labels for labels in trials if "torchscript+bf16" in labels]
    assert len(measured) == 1, trials  # fp32 and bf16 tried: the first to load
    (other,) = [labels for labels in trials if labels not in measured]
    assert other == {"torchscript"}, trials  # bf16 only, the fleet's: its one candidate


def test_a_rollback_written_as_the_next_version_while_the_old_one_drains_is_computed(
    deploy: Any, bf16: Catalog
) -> None:
    """Found by ``make chaos`` (broker-2-bf16-poll): version 1's export, written again as
    version 3 after its workers had stopped reading version 1 (drained) but before they
    unloaded it, was held with no load and routed to, and nobody read its work: every
    request the cache could not answer waited its 30 s and got 504. The window between the
    two (2.5 s) is held open here (``MB_TEST_RETIRE_S``)."""
    deployment = deploy(Config("broker", 2, "bf16"), bf16, MB_TEST_RETIRE_S="120")
    first, second = bf16.good[0].served_id, bf16.good[1].served_id
    with httpx.Client(base_url=deployment.base_url, timeout=60) as http:
        publish(deployment.root, bf16.good[1])
        deployment.sighup()
        until(lambda: http_embedding(http, 0).served_id == second, "version 2 serving")
        time.sleep(SWITCH_GRACE_S + 8)  # version 1 drained: no longer read, still loaded
        assert publish(deployment.root, bf16.good[0]) == 3
        deployment.sighup()
        until(lambda: http_embedding(http, 0).served_id == first, "version 3 serving")
        answer = http_embedding(http, 3, fresh=True)  # past the cache: a worker computes it
        assert answer.status == 200 and answer.served_id == first, answer
        assert computed_by(bf16, first, 3, answer.embedding) is None
    states = {r[1]: (r[3], r[4]) for r in rows(deployment.base_url) if r[0] == NAME}
    assert states["3"] == ("ready", True), states


def test_restarted_broker_workers_serve_what_served_not_the_newest_on_disk(
    deploy: Any, bf16: Catalog
) -> None:
    """Found by ``make chaos`` (broker-2-int8: a version published with no reload, then
    ``kill -9`` of each worker in turn): each restarted worker loaded what the other served
    and then the newest on disk, so once both had restarted the fleet switched to a version
    nobody asked for. They serve version 1, and load nothing else."""
    deployment = deploy(Config("broker", 2, "bf16"), bf16)
    first = bf16.good[0].served_id
    publish(deployment.root, bf16.good[1])
    for _ in range(2):
        restart_one(deployment)
    time.sleep(3)  # a load of version 2 would have begun by now
    with httpx.Client(base_url=deployment.base_url, timeout=60) as http:
        answer = http_embedding(http, 3, fresh=True)
    assert answer.status == 200 and answer.served_id == first, answer
    states = {r[1]: r[3:] for r in rows(deployment.base_url) if r[0] == NAME}
    assert states == {"1": ("ready", True, 2), "2": ("unavailable", False, 0)}, states


def restart_one(deployment: Deployment) -> None:
    """``kill -9`` of a broker worker; back once it restarted and version 1 is ready on
    every worker."""
    before = deployment.worker_pids()
    pid = deployment.kill_worker()
    until(lambda: pid not in deployment.worker_pids(), "the dead worker gone")
    until(lambda: len(set(deployment.worker_pids()) - set(before)) == 1, "it restarted",
          timeout_s=120)  # fmt: skip
    until(lambda: [r[3:] for r in rows(deployment.base_url) if r[1] == "1"]
          == [("ready", True, 2)], "version 1 on both workers", timeout_s=120)  # fmt: skip
