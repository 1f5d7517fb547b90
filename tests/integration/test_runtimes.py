"""Runtimes beside TorchScript: the export derives OpenVINO IR and vouches for it in the
manifest; a worker serves with the fastest runtime that passes its self-test, falls back to
TorchScript otherwise, and says which in /info."""

from __future__ import annotations

import json
import logging
from pathlib import Path

import numpy as np
import pytest
import torch

from app.errors import ModelStoreError, WorkerStartError
from app.images import preprocess
from app.jobs import Task
from app.manifest import read_manifest
from app.workers import models as models_module
from app.workers.models import LoadOptions, load_models
from app.workers.runner import BatchRunner
from app.workers.runtimes import choose_runtime
from tests.conftest import (
    assert_cat_then_espresso,
    distinct_images,
    embed,
    expected_for,
    photo_pixels,
    running_app,
    served_with_runtime,
)
from tests.models import export_tiny

pytestmark = pytest.mark.slow

CPU = torch.device("cpu")


@pytest.fixture(scope="module")
def tiny_openvino(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return export_tiny(tmp_path_factory.mktemp("tiny_openvino"), runtimes=("openvino",))


def test_the_export_derives_openvino_ir_and_vouches_for_it(
    tiny_openvino: Path, tmp_path: Path
) -> None:
    manifest = read_manifest(tiny_openvino)
    artifact = manifest.runtimes["openvino"]
    assert set(artifact.files) == {"embedding", "embedding.bin", "classifier", "classifier.bin"}
    assert artifact.precision == "fp32" and artifact.max_abs_diff < 1e-3
    assert artifact.source == "program"  # converted from the torch.export programs
    assert artifact.versions["openvino"].startswith("2026.")
    # A changed IR file is refused like a changed TorchScript file.
    copy = tmp_path / "store"
    copy.mkdir()
    for file in tiny_openvino.rglob("*"):
        if file.is_file():
            target = copy / file.relative_to(tiny_openvino)
            target.parent.mkdir(exist_ok=True)
            target.write_bytes(file.read_bytes())
    xml = copy / artifact.files["embedding"].path
    xml.write_text(xml.read_text().replace("<net ", "<net  ", 1))
    with pytest.raises(ModelStoreError, match=r"openvino embedding file .* does not match"):
        read_manifest(copy)


def test_openvino_agrees_with_torchscript_batch_one_included(tiny_openvino: Path) -> None:
    reference = BatchRunner(load_models(tiny_openvino, CPU), CPU)
    ir = BatchRunner(load_models(tiny_openvino, CPU, LoadOptions(threads=1), "openvino"), CPU)
    # The IR normalises the uint8 pixels in its own graph: no torch op runs before it.
    assert ir.models.pixels_in and not reference.models.pixels_in
    images = distinct_images(3)
    spec = read_manifest(tiny_openvino).input
    for count in (1, 3):
        pixels = np.stack([preprocess(data, spec) for data in images[:count]])
        for task in (Task.EMBEDDING, Task.TAG):
            expected, got = reference.run(task, pixels, 5), ir.run(task, pixels, 5)
            for key, value in expected.items():
                np.testing.assert_allclose(got[key], value, atol=1e-5)


def test_openvino_runs_the_embedding_and_its_head_in_one_inference(tiny_openvino: Path) -> None:
    """One graph of both (``LoadedModels.joint``): the features and logits of one call equal
    the embedding's and the separately compiled head's, at every batch size compiled."""
    options = LoadOptions(threads=1, static_batches=(1, 4))
    models = load_models(tiny_openvino, CPU, options, "openvino")
    assert models.joint is not None and models.classifier is not None
    spec = read_manifest(tiny_openvino).input
    images = distinct_images(4)
    for count in (1, 3, 4):  # static at 1 and 4, the dynamic graph at 3
        pixels = torch.from_numpy(np.stack([preprocess(d, spec) for d in images[:count]]))
        features, logits = models.joint(pixels)
        assert logits.shape == (count, models.manifest.num_classes)
        np.testing.assert_array_equal(features.numpy(), models.embedding(pixels).numpy())
        separate = models.classifier(features).numpy()
        np.testing.assert_allclose(logits.numpy(), separate, rtol=1e-5, atol=1e-5)
    # TorchScript has no joint call: the head runs on the features, as before.
    assert load_models(tiny_openvino, CPU).joint is None


def test_auto_times_the_runtimes_that_pass_and_serves_the_fastest(tiny_openvino: Path) -> None:
    choice = choose_runtime(tiny_openvino, CPU, LoadOptions(threads=1), "auto")
    assert set(choice.images_per_s) == {"torchscript", "openvino"} and choice.skipped == {}
    fastest = max(choice.images_per_s, key=lambda name: choice.images_per_s[name])
    assert choice.models.runtime == fastest


def test_a_runtime_that_fails_its_self_test_is_skipped_or_refused(
    tiny_openvino: Path, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    real = models_module.LOADERS["openvino"]

    def off_by_a_little(path: Path, device: torch.device, options: LoadOptions) -> object:
        model = real(path, device, options)
        return lambda x: model(x) * 1.01 + 0.05  # runs, but does not agree

    monkeypatch.setitem(models_module.LOADERS, "openvino", off_by_a_little)
    with caplog.at_level(logging.WARNING, logger="app.worker"):
        choice = choose_runtime(tiny_openvino, CPU, LoadOptions(threads=1), "auto")
    assert choice.models.runtime == "torchscript"
    assert "cosine" in choice.skipped["openvino"] or "top-5" in choice.skipped["openvino"]
    assert "openvino skipped on this host" in caplog.text
    with pytest.raises(WorkerStartError, match="MB_RUNTIME=openvino failed its self-test"):
        choose_runtime(tiny_openvino, CPU, LoadOptions(threads=1), "openvino")

    def crashes(path: Path, device: torch.device, options: LoadOptions) -> object:
        raise RuntimeError("compile_model crashed")

    monkeypatch.setitem(models_module.LOADERS, "openvino", crashes)
    choice = choose_runtime(tiny_openvino, CPU, LoadOptions(threads=1), "auto")
    assert choice.models.runtime == "torchscript"
    assert "compile_model crashed" in choice.skipped["openvino"]


def test_a_store_without_other_runtimes_serves_with_torchscript(tiny_store: Path) -> None:
    assert read_manifest(tiny_store).runtimes == {}
    assert choose_runtime(tiny_store, CPU, LoadOptions(), "auto").models.runtime == "torchscript"
    with pytest.raises(WorkerStartError, match="holds no openvino models"):
        choose_runtime(tiny_store, CPU, LoadOptions(), "openvino")


def test_a_store_from_before_runtimes_still_loads(tiny_store: Path, tmp_path: Path) -> None:
    """A manifest written before ``runtimes`` existed has no such key."""
    manifest = json.loads((tiny_store / "manifest.json").read_text())
    manifest.pop("runtimes", None)
    manifest.pop("program", None)  # nor programs
    for name in ("embedding.pt", "classifier.pt", "classes.txt"):
        (tmp_path / name).write_bytes((tiny_store / name).read_bytes())
    (tmp_path / "manifest.json").write_text(json.dumps(manifest))
    assert choose_runtime(tmp_path, CPU, LoadOptions(), "auto").models.runtime == "torchscript"


async def test_the_app_serves_with_openvino_and_says_so(tiny_openvino: Path) -> None:
    runtimes, metrics = await served_with_runtime(tiny_openvino, "openvino")
    assert runtimes == ["openvino"]
    served = read_manifest(tiny_openvino).model_id
    line = f'microbatch_worker_runtime{{device="cpu",model_id="{served}",runtime="openvino",'
    assert line + 'worker="0"} 1.0' in metrics


def test_the_real_model_tags_the_photos_alike_on_every_runtime(
    default_store: Path, cat_jpeg: bytes, coffee_jpeg: bytes
) -> None:
    pixels = photo_pixels(default_store, cat_jpeg, coffee_jpeg)
    reference = BatchRunner(load_models(default_store, CPU), CPU)
    assert "openvino" in read_manifest(default_store).runtimes
    ir = BatchRunner(load_models(default_store, CPU, LoadOptions(threads=2), "openvino"), CPU)
    tags, ir_tags = (runner.run(Task.TAG, pixels, 5) for runner in (reference, ir))
    assert (tags["indices"] == ir_tags["indices"]).all()
    assert_cat_then_espresso(default_store, ir_tags["indices"])
    embeddings = (runner.run(Task.EMBEDDING, pixels, 0)["embedding"] for runner in (reference, ir))
    first, second = (torch.from_numpy(e) for e in embeddings)
    assert float(torch.nn.functional.cosine_similarity(first, second).min()) >= 0.9999
    # bf16 (computed in bf16 where the CPU has it): the same tags, within its gate.
    bf16 = LoadOptions(dtype=torch.bfloat16, threads=2)
    for runtime in ("torchscript", "openvino"):
        lower = BatchRunner(load_models(default_store, CPU, bf16, runtime), CPU)
        lower_tags = lower.run(Task.TAG, pixels, 1)
        assert (lower_tags["indices"][:, 0] == tags["indices"][:, 0]).all(), runtime
        vectors = torch.from_numpy(lower.run(Task.EMBEDDING, pixels, 0)["embedding"])
        assert float(torch.nn.functional.cosine_similarity(vectors, first).min()) >= 0.99


async def test_broker_workers_choose_their_runtime_on_their_own_host(tiny_openvino: Path) -> None:
    """Broker mode: each worker chooses (here is told) its runtime where it runs, says so in
    its heartbeat, and the front end's /info shows it; answers are the model's."""
    import httpx

    from tests.broker import RedisServer, Workers, broker_env
    from tests.server import ServerProcess

    with (
        RedisServer() as redis_server,
        Workers(redis_server, tiny_openvino, count=1, MB_RUNTIME="openvino") as workers,
        ServerProcess(**broker_env(redis_server.url, tiny_openvino)) as front,
    ):
        image = distinct_images(1)[0]
        async with httpx.AsyncClient(base_url=front.base_url, timeout=30) as client:
            vector = await embed(client, image)
            info = (await client.get("/info")).json()
        heartbeats = list(workers.live().values())
    np.testing.assert_allclose(vector, expected_for(image, tiny_openvino), atol=1e-5)
    assert [beat["runtime"] for beat in heartbeats] == ["openvino"]
    assert [worker["runtime"] for worker in info["workers"]] == ["openvino"]


def test_the_batch_job_serves_with_the_runtime_asked_for_and_says_so(
    tiny_openvino: Path,
    tmp_path: Path,
    monkeypatch: pytest.MonkeyPatch,
    capsys: pytest.CaptureFixture[str],
) -> None:
    from app.bulk import iter_results, main

    folder = tmp_path / "photos"
    folder.mkdir()
    images = distinct_images(6)
    for index, data in enumerate(images):
        (folder / f"{index}.png").write_bytes(data)
    for name, value in {
        "MODEL_STORE": str(tiny_openvino), "CUDA_DEVICES": "cpu", "MB_WORKER_NUM": "1",
        "MB_RUNTIME": "openvino",
    }.items():  # fmt: skip
        monkeypatch.setenv(name, value)
    out = tmp_path / "out.jsonl"
    assert main([str(folder), "--task", "embedding", "--out", str(out), "--no-progress"]) == 0
    summary = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    assert summary["ok"] == 6 and summary["runtimes"] == ["openvino"]
    for entry in iter_results(out):
        data = images[int(entry["path"].split(".")[0])]
        np.testing.assert_allclose(entry["result"], expected_for(data, tiny_openvino), atol=1e-5)


# Fault injection for worker processes: a sitecustomize (imported by every interpreter that
# has it on its path) that makes loading OpenVINO abort the process, as native code that
# crashes on a host does. No exception: nothing in the worker can catch it.
ABORT_ON_OPENVINO = """
import os
import app.workers.models as models

def crash(*args, **kwargs):
    os.abort()

models.LOADERS["openvino"] = crash
"""


@pytest.fixture
def openvino_aborts(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    from tests.server import REPO

    (tmp_path / "sitecustomize.py").write_text(ABORT_ON_OPENVINO)
    monkeypatch.setenv("PYTHONPATH", f"{tmp_path}:{REPO}")


@pytest.mark.usefixtures("openvino_aborts")
async def test_a_runtime_that_crashes_the_worker_is_left_out_under_auto(
    tiny_openvino: Path, capfd: pytest.CaptureFixture[str]
) -> None:
    runtimes, _ = await served_with_runtime(tiny_openvino, "auto")
    assert runtimes == ["torchscript"]
    assert "crashed while loading its runtimes" in capfd.readouterr().err


@pytest.mark.usefixtures("openvino_aborts")
async def test_a_runtime_asked_for_by_name_that_crashes_stops_the_start(
    tiny_openvino: Path,
) -> None:
    with pytest.raises(WorkerStartError, match="exited during start-up"):
        async with running_app(
            model_store=tiny_openvino, cuda_devices="cpu", mb_worker_num=1, mb_runtime="openvino"
        ):
            pass


def test_a_broker_worker_that_crashes_on_a_runtime_is_restarted_without_it(
    tiny_openvino: Path, tmp_path: Path
) -> None:
    """The broker supervisor does as the pool does: under ``auto``, a worker that crashed
    before its models loaded comes back with TorchScript alone."""
    from tests.broker import RedisServer, Workers
    from tests.server import REPO

    (tmp_path / "sitecustomize.py").write_text(ABORT_ON_OPENVINO)
    with (
        RedisServer() as redis_server,
        Workers(
            redis_server, tiny_openvino, count=1, MB_RUNTIME="auto",
            PYTHONPATH=f"{tmp_path}:{REPO}",
        ) as workers,
    ):  # fmt: skip
        heartbeats = list(workers.live().values())
    assert [beat["runtime"] for beat in heartbeats] == ["torchscript"]
    assert "crashed while loading its runtimes" in workers.output


# Load, unload and load the same version again, each time followed by a signal handled in
# Python (a broker worker's SIGHUP): 20 cycles.
LOAD_UNLOAD_SIGNAL = """
import os, signal, sys
from pathlib import Path
from app.plan import WorkerConfig
from app.repository import Repository
from app.workers.process import PreparedWorker

store, runtime = Path(sys.argv[1]), sys.argv[2]
spec = Repository.of_store(store).read(Repository.of_store(store).names()[0], 1, "auto").spec
worker = PreparedWorker(WorkerConfig(max_batch_size=2, runtime=runtime), "cpu", threads=1)
handled = []
signal.signal(signal.SIGHUP, lambda *_: handled.append(1))
for _ in range(20):
    assert worker.load(spec).runner.models.runtime == runtime  # no reference kept: unloaded,
    worker.unload(spec.served_id)                              # it is freed
    os.kill(os.getpid(), signal.SIGHUP)
assert len(handled) == 20
"""


@pytest.mark.parametrize("runtime", ["openvino", "torchscript"])
def test_a_version_loads_and_unloads_twenty_times_and_signals_still_land(
    tiny_openvino: Path, runtime: str
) -> None:
    """OpenVINO's CPU plugin (one per ``Core``) gives the thread that makes it an alternate
    signal stack, and unmaps it when destroyed: with a ``Core`` per model file, unloading a
    model could leave the thread's alternate stack unmapped, and the next signal killed the
    worker with SIGSEGV (both broker workers, at the SIGHUP that loaded a version again)."""
    import subprocess
    import sys

    from tests.children import dies_with_run
    from tests.server import REPO

    done = subprocess.run(
        [sys.executable, "-c", LOAD_UNLOAD_SIGNAL, str(tiny_openvino), runtime],
        cwd=REPO, capture_output=True, text=True, timeout=300, preexec_fn=dies_with_run(),
    )  # fmt: skip
    assert done.returncode == 0, f"exit code {done.returncode}: {done.stderr[-2000:]}"


def _with_broken_openvino(source: Path, out: Path, speeds: dict[str, float]) -> Path:
    """A copy of ``source`` whose OpenVINO embedding weights are garbage, their sha256
    rewritten to match (the files verify), and whose export measured ``speeds``."""
    import shutil

    from app.manifest import sha256_file

    shutil.copytree(source, out)
    manifest = json.loads((out / "manifest.json").read_text())
    files = manifest["runtimes"]["openvino"]["files"]
    weights = out / files["embedding.bin"]["path"]
    weights.write_bytes(bytes(255 - b for b in weights.read_bytes()))
    files["embedding.bin"]["sha256"] = sha256_file(weights)
    manifest["speeds"] = {"images_per_s": speeds, "batch_size": 8, "cpu": "the export's CPU"}
    (out / "manifest.json").write_text(json.dumps(manifest))
    return out


def test_a_version_on_a_slower_runtime_says_how_much_slower(
    tiny_openvino: Path, tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    """OpenVINO's weights broken under a rewritten checksum: the version serves on
    TorchScript, and says so: the runtime that failed and why, and how much slower the one
    serving is, by the speeds the export measured (one WARNING)."""
    store = _with_broken_openvino(
        tiny_openvino, tmp_path / "store", {"torchscript": 100.0, "openvino": 710.0}
    )
    with caplog.at_level(logging.WARNING, logger="app.worker"):
        choice = choose_runtime(store, CPU, LoadOptions(threads=1), "auto")
    assert choice.models.runtime == "torchscript" and "openvino" in choice.skipped
    assert choice.slowdown == 7.1
    assert "serving with torchscript, 7.1x slower than openvino" in caplog.text


async def test_the_index_and_metrics_name_the_runtime_that_failed_and_the_cost(
    tiny_openvino: Path, tmp_path: Path
) -> None:
    store = _with_broken_openvino(
        tiny_openvino, tmp_path / "store", {"torchscript": 100.0, "openvino": 710.0}
    )
    async with running_app(model_store=store, cuda_devices="cpu", mb_worker_num=1) as (_, client):
        (row,) = (await client.get("/v2/repository/index")).json()
        metrics = (await client.get("/metrics")).text
    assert (row["state"], row["serving"], row["runtime"]) == ("ready", True, "torchscript")
    assert set(row["runtimes_failed"]) == {"openvino"} and row["runtimes_failed"]["openvino"]
    assert row["slowdown"] == 7.1
    assert (
        'microbatch_model_runtime_slowdown{model="tiny-test",runtime="torchscript",version="1"} 7.1'
        in metrics
    )
