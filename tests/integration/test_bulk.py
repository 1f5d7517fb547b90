"""python -m app.bulk: every file answered once, bad files reported, crash-safe resume."""

from __future__ import annotations

import io
import json
import os
import shutil
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import numpy as np
import psutil
import pytest
from PIL import Image

from app.bulk import iter_results, list_files, main
from app.images import preprocess
from app.manifest import read_manifest
from tests.children import start
from tests.conftest import distinct_images
from tests.models import tiny_expected_embedding

pytestmark = pytest.mark.slow


@pytest.fixture
def folder(tmp_path: Path) -> Path:
    root = tmp_path / "photos"
    (root / "sub").mkdir(parents=True)
    for index, data in enumerate(distinct_images(40)):
        (root / ("sub" if index % 3 == 0 else ".") / f"img_{index:03d}.png").write_bytes(data)
    (root / "notes.txt").write_text("not an image")
    (root / "broken.jpg").write_bytes(b"\xff\xd8\xff\xe0 truncated")
    buffer = io.BytesIO()
    Image.new("RGB", (8, 8)).save(buffer, format="TIFF")
    (root / "scan.tif").write_bytes(buffer.getvalue())
    (root / ".hidden.png").write_bytes(distinct_images(1)[0])
    return root


@pytest.fixture(autouse=True)
def tiny_environment(monkeypatch: pytest.MonkeyPatch, tiny_store: Path) -> None:
    monkeypatch.setenv("MODEL_STORE", str(tiny_store))
    monkeypatch.setenv("CUDA_DEVICES", "cpu")
    monkeypatch.setenv("MB_WORKER_NUM", "1")
    monkeypatch.setenv("MB_BATCH_SIZE", "8")


def test_every_file_gets_one_line_with_its_own_result(
    folder: Path, tmp_path: Path, tiny_store: Path
) -> None:
    out = tmp_path / "out.jsonl"
    assert main([str(folder), "--task", "embedding", "--out", str(out), "--no-progress"]) == 0
    results = list(iter_results(out))
    paths = [r["path"] for r in results]
    expected = {str(p.relative_to(folder)) for p in list_files(folder)}
    assert sorted(paths) == sorted(expected) and len(paths) == 43  # 40 images + 3 bad, no hidden
    spec = read_manifest(tiny_store).input
    for entry in results:
        if entry["path"].endswith(".png"):
            pixels = preprocess((folder / entry["path"]).read_bytes(), spec)
            np.testing.assert_allclose(entry["result"], tiny_expected_embedding(pixels), atol=1e-5)
    errors = {r["path"]: r["error"]["type"] for r in results if "error" in r}
    assert errors == {
        "notes.txt": "invalid_image",
        "broken.jpg": "invalid_image",
        "scan.tif": "unsupported_image_format",
    }


def test_resume_after_a_crash_mid_line_finishes_without_duplicates(
    folder: Path, tmp_path: Path
) -> None:
    out = tmp_path / "tags.jsonl"
    assert main([str(folder), "--task", "tag", "-k", "3", "--out", str(out), "--no-progress"]) == 0
    lines = out.read_bytes().splitlines(keepends=True)
    # A crash after 10 whole lines and half of the 11th.
    out.write_bytes(b"".join(lines[:10]) + lines[10][: len(lines[10]) // 2])
    assert (
        main(
            [
                str(folder),
                "--task",
                "tag",
                "-k",
                "3",
                "--out",
                str(out),
                "--resume",
                "--no-progress",
            ]
        )
        == 0
    )
    results = list(iter_results(out))  # every line parses: the half line is gone
    assert len(results) == 43 and len({r["path"] for r in results}) == 43
    assert all(len(r["result"]) == 3 for r in results if "result" in r)
    assert [json.loads(line) for line in lines[:10]] == results[:10]  # kept, not redone


def test_refuses_to_clobber_or_read_a_missing_folder(folder: Path, tmp_path: Path) -> None:
    out = tmp_path / "out.jsonl"
    out.write_text("")
    assert main([str(folder), "--task", "tag", "--out", str(out)]) == 2
    assert main([str(tmp_path / "nope"), "--task", "tag", "--out", str(tmp_path / "x")]) == 2
    shutil.rmtree(folder)


def test_the_batch_job_runs_the_model_it_is_given(
    folder: Path,
    tmp_path: Path,
    monkeypatch: pytest.MonkeyPatch,
    capsys: pytest.CaptureFixture[str],
) -> None:
    """With a repository of two models: ``--model`` chooses one (every line says which);
    none, with no default, or one not there, is a clear error."""
    from tests.models import export_embedding_only, export_tiny

    repository = tmp_path / "models"
    export_tiny(repository / "tiny" / "1")
    backbone = export_embedding_only(repository / "backbone" / "1")
    monkeypatch.setenv("MODEL_REPOSITORY", str(repository))
    out = tmp_path / "out.jsonl"
    args = [str(folder), "--task", "embedding", "--out", str(out), "--no-progress", "--overwrite"]
    assert main([*args, "--model", "backbone"]) == 0
    ids = {entry["model_id"] for entry in iter_results(out)}
    assert ids == {read_manifest(backbone).model_id}
    assert main([*args, "--model", "nope"]) == 2
    assert "no model named 'nope'" in capsys.readouterr().err
    assert main(args) == 2
    assert "several models" in capsys.readouterr().err


def test_a_worker_killed_mid_job_costs_no_file(
    folder: Path, tmp_path: Path, slow_store: Path
) -> None:
    """``kill -9`` of the only worker while the job runs: the batch it held and the files
    sent while it restarts are tried again once it is back (they were written as
    ``worker_died`` lines, and ``--resume`` then skipped them); every image is answered and
    the job exits 0."""
    out = tmp_path / "out.jsonl"
    env = {**os.environ, "MODEL_STORE": str(slow_store), "MB_BATCH_SIZE": "4"}
    command = [sys.executable, "-m", "app.bulk", str(folder), "--task", "embedding",
               "--out", str(out), "--no-progress"]  # fmt: skip
    job = start(command, env=env, stderr=subprocess.PIPE, text=True)  # dies with the run
    try:
        deadline = time.monotonic() + 120
        while not (out.exists() and out.read_bytes().count(b"\n") >= 4):
            assert job.poll() is None and time.monotonic() < deadline, "no answer came"
            time.sleep(0.05)
        workers = psutil.Process(job.pid).children(recursive=True)
        victims = [w for w in workers if "resource_tracker" not in " ".join(w.cmdline())]
        assert victims, workers
        for victim in victims:
            victim.kill()
        _, err = job.communicate(timeout=180)
    finally:
        job.kill()
    assert job.returncode == 0, err
    results = list(iter_results(out))
    assert len(results) == 43 and len({r["path"] for r in results}) == 43
    errors = {r["path"]: r["error"]["type"] for r in results if "error" in r}
    assert set(errors) == {"notes.txt", "broken.jpg", "scan.tif"}, errors


def test_resume_tries_again_what_the_server_failed_and_keeps_what_the_file_did(
    folder: Path, tmp_path: Path
) -> None:
    out = tmp_path / "tags.jsonl"
    args = [str(folder), "--task", "tag", "-k", "3", "--out", str(out), "--no-progress"]
    assert main(args) == 0
    results = list(iter_results(out))
    failed = next(r for r in results if "result" in r)
    # As a job that met a dead worker and gave up on the file wrote it.
    failed.pop("result")
    failed["error"] = {"type": "worker_died", "message": "the worker died"}
    out.write_text("".join(json.dumps(r) + "\n" for r in results))
    assert main([*args, "--resume"]) == 0
    again = list(iter_results(out))
    assert len(again) == 43 and len({r["path"] for r in again}) == 43
    redone = [r for r in again if r["path"] == failed["path"]]
    assert len(redone) == 1 and len(redone[0]["result"]) == 3
    errors = {r["path"]: r["error"]["type"] for r in again if "error" in r}
    assert errors == {"notes.txt": "invalid_image", "broken.jpg": "invalid_image",
                      "scan.tif": "unsupported_image_format"}  # fmt: skip


@pytest.mark.parametrize(
    ("asked", "why"),
    [
        (["--task", "tag", "-k", "2"], "answered as tag with k=3, and this run asks tag with k=2"),
        (["--task", "embedding"], "answered as tag with k=3, and this run asks embedding"),
    ],
)
def test_resume_refuses_a_file_of_another_task_k_or_export(
    folder: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str], asked: list[str], why: str
) -> None:
    out = tmp_path / "tags.jsonl"
    assert main([str(folder), "--task", "tag", "-k", "3", "--out", str(out), "--no-progress"]) == 0
    lines = out.read_bytes().splitlines(keepends=True)
    out.write_bytes(b"".join(lines[:10]))
    args = [str(folder), *asked, "--out", str(out), "--no-progress", "--resume"]
    assert main(args) == 2
    assert why in capsys.readouterr().err
    assert out.read_bytes() == b"".join(lines[:10])  # untouched
    # Another export wrote it (a rollout, another MB_DTYPE, another model).
    other = [json.loads(line) | {"model_id": "tiny-test@0123456789ab"} for line in lines[:10]]
    out.write_text("".join(json.dumps(entry) + "\n" for entry in other))
    assert main([str(folder), "--task", "tag", "-k", "3", "--out", str(out), "--resume"]) == 2
    assert "resuming would mix two exports" in capsys.readouterr().err


@pytest.mark.parametrize("k", ["0", "1001"])
def test_a_k_the_model_cannot_answer_is_refused_before_anything_is_written(
    folder: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str], k: str
) -> None:
    out = tmp_path / "tags.jsonl"
    out.write_text('{"path": "kept.png"}\n')
    args = [str(folder), "--task", "tag", "-k", k, "--out", str(out), "--overwrite"]
    assert main(args) == 2
    assert "k must be between 1 and" in capsys.readouterr().err
    assert out.read_text() == '{"path": "kept.png"}\n'


def test_the_job_queues_at_the_lowest_priority_level(
    folder: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Background work behind every caller: in broker mode the job shares the fleet, and it
    went in at the highest level, ahead of interactive traffic and outside any quota."""
    from app.batching.streamer import Streamer

    levels: list[int] = []
    submit = Streamer.submit

    async def spied(self: Streamer[Any, Any], payload: Any, **kwargs: Any) -> Any:
        levels.append(kwargs["ticket"].level)
        return await submit(self, payload, **kwargs)

    monkeypatch.setattr(Streamer, "submit", spied)
    monkeypatch.setenv("MB_PRIORITY_LEVELS", "3")
    out = tmp_path / "out.jsonl"
    assert main([str(folder), "--task", "tag", "--out", str(out), "--no-progress"]) == 0
    # Each image (the three files that are no image are refused before the queue).
    assert len(levels) == 40 and set(levels) == {2}
