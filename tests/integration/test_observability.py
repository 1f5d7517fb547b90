"""Metrics, /info, request ids and log lines, against real workers."""

from __future__ import annotations

import asyncio
import io
import json
import logging
import re
import time
from collections import Counter
from pathlib import Path

import httpx
import pytest
from PIL import Image
from prometheus_client.parser import text_string_to_metric_families

from app.logs import REPEAT_INTERVAL_S, JsonFormatter
from tests.conftest import distinct_images, running_app

pytestmark = pytest.mark.slow


def samples(text: str) -> dict[tuple[str, tuple[tuple[str, str], ...]], float]:
    out = {}
    for family in text_string_to_metric_families(text):
        for sample in family.samples:
            out[sample.name, tuple(sorted(sample.labels.items()))] = sample.value
    return out


async def test_metrics_info_and_request_ids(
    tiny_store: Path, caplog: pytest.LogCaptureFixture
) -> None:
    caplog.set_level(logging.INFO, logger="app.request")
    images = distinct_images(24)
    async with running_app(
        model_store=tiny_store,
        cuda_devices="cpu",
        mb_worker_num=1,
        mb_batch_size=8,
        mb_max_queue=64,
    ) as (_, client):
        logging.getLogger("app.request").addHandler(caplog.handler)  # app loggers don't propagate
        tagged = await asyncio.gather(
            *(client.post("/predict/tag", files={"image": ("x.png", d)}) for d in images)
        )
        mine = await client.post(
            "/predict/embedding",
            files={"image": ("x.png", images[0])},
            headers={"X-Request-ID": "client-chosen-42"},
        )
        bad = await client.post("/predict/tag", files={"image": ("x.txt", b"nope")})
        scrape = await client.get("/metrics")
        info = (await client.get("/info")).json()
    assert all(r.status_code == 200 for r in tagged) and bad.status_code == 400
    # Request ids: echoed when sane, generated otherwise, and unique.
    assert mine.headers["x-request-id"] == "client-chosen-42"
    generated = {r.headers["x-request-id"] for r in tagged}
    assert len(generated) == len(tagged) and all(len(i) == 32 for i in generated)
    # Metrics.
    assert scrape.headers["content-type"].startswith("text/plain")
    found = samples(scrape.text)
    # Request, batch and model-time figures name the model version that answered.
    model = (("model", "tiny-test"),)
    version = (("version", "1"),)
    route_ok = (
        "microbatch_http_requests_total",
        (*model, ("route", "/predict/tag"), ("status", "200"), *version),
    )
    assert found[route_ok] == len(images)
    tag, embedding = (*model, ("task", "tag"), *version), (*model, ("task", "embedding"), *version)
    assert found["microbatch_batch_size_count", tag] >= 1
    # The bad upload's header is no image's: refused before the queue, it never took a place
    # in a batch (MB_DECODE=auto on CPU leaves decoding to the workers), and is counted.
    batched = len(images)
    assert found["microbatch_batch_size_sum", tag] == batched
    assert found["microbatch_queue_wait_seconds_count", tag] == batched
    assert found["microbatch_model_seconds_count", embedding] == 1
    assert found["microbatch_rejected_total", (("reason", "bad_input"),)] == 1
    assert found["microbatch_queue_depth", ()] == 0
    assert found["microbatch_workers_alive", (("device", "cpu"),)] == 1
    assert found["microbatch_workers_ready", (("device", "cpu"),)] == 1
    sizes = found["microbatch_batch_size_count", tag]
    assert sizes < len(images), "24 concurrent requests formed batches larger than one"
    # /info.
    assert info["model"]["arch"] == "tiny-test"
    assert set(info["model"]["files"]) == {"embedding", "classifier", "classes"}
    assert info["batching"]["batch_size"] == 8 and info["batching"]["max_queue"] == 64
    assert info["workers"][0]["device"] == "cpu" and info["workers"][0]["ready"]
    logging.getLogger("app.request").removeHandler(caplog.handler)
    # One log line per request, with id, route, status, latency and batch size.
    lines = [r for r in caplog.records if r.name == "app.request"]
    line = next(r for r in lines if getattr(r, "request_id", None) == "client-chosen-42")
    assert line.route == "/predict/embedding" and line.status == 200  # type: ignore[attr-defined]
    assert line.batch_size == 1 and line.latency_ms > 0  # type: ignore[attr-defined]
    assert line.model_id == info["model_id"]  # type: ignore[attr-defined]
    assert "client-chosen-42" in line.getMessage()
    assert f"model={info['model_id']}" in line.getMessage()


def test_json_log_lines_carry_the_extra_fields() -> None:
    record = logging.makeLogRecord(
        {
            "name": "app.request",
            "levelname": "INFO",
            "msg": "POST /predict/tag 200",
            "request_id": "abc",
            "status": 200,
            "batch_size": 3,
        }
    )
    entry = json.loads(JsonFormatter().format(record))
    assert entry["message"] == "POST /predict/tag 200"
    assert (entry["request_id"], entry["status"], entry["batch_size"]) == ("abc", 200, 3)
    assert entry["level"] == "info" and entry["logger"] == "app.request"


def test_settings_accept_log_format(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    from app.errors import SettingsError
    from app.settings import load_settings

    monkeypatch.chdir(tmp_path)
    monkeypatch.setenv("LOG_FORMAT", "json")
    assert load_settings().log_format == "json"
    monkeypatch.setenv("LOG_FORMAT", "xml")
    with pytest.raises(SettingsError, match="LOG_FORMAT"):
        load_settings()


async def test_json_logs_cover_the_worker_processes(poison_store: Path) -> None:
    """With LOG_FORMAT=json every line the server and its workers write is one JSON object,
    a worker's traceback included (the poison model raises in the worker)."""
    from tests.models import POISON_RGB
    from tests.server import ServerProcess

    buffer = io.BytesIO()
    Image.new("RGB", (40, 40), POISON_RGB).save(buffer, format="PNG")
    with ServerProcess(
        MODEL_STORE=str(poison_store), LOG_FORMAT="json", LOG_LEVEL="info", MB_WORKER_NUM="1"
    ) as server:
        response = httpx.post(
            f"{server.base_url}/predict/embedding",
            files={"image": ("p.png", buffer.getvalue())},
            timeout=30,
        )
        server.stop()
    assert response.status_code == 500
    lines = [line for line in server.output.splitlines() if line.strip()]
    records = [json.loads(line) for line in lines]  # every line parses
    worker = [r for r in records if r["logger"] == "app.worker" and "poison image" in r["message"]]
    assert worker, "the worker's traceback is missing"
    assert "Traceback" in worker[0]["message"]


def test_json_logs_cover_the_libraries_and_hold_back_their_repeats(tiny_store: Path) -> None:
    """With tracing on and the collector down, the OpenTelemetry exporter of the server and of
    its worker fails every second or two: every line is still JSON, and each message comes at
    most once an interval from each process."""
    from tests.server import ServerProcess, free_port

    env = {
        "LOG_FORMAT": "json",
        "MB_WORKER_NUM": "1",
        "OTEL_EXPORTER_OTLP_ENDPOINT": f"http://127.0.0.1:{free_port()}",  # nothing listens
        "OTEL_EXPORTER_OTLP_TIMEOUT": "2",  # an export retries once, then gives up
        "OTEL_BSP_SCHEDULE_DELAY": "200",
    }
    image = distinct_images(1)[0]
    started = time.monotonic()
    with ServerProcess(MODEL_STORE=str(tiny_store), **env) as server:
        until = time.monotonic() + 8  # spans to export all along: failures every 2 s or so
        while time.monotonic() < until:
            answer = httpx.post(
                f"{server.base_url}/predict/tag", files={"image": ("x.png", image)}, timeout=30
            )
            assert answer.status_code == 200
            time.sleep(0.2)
        server.stop()
    intervals = 1 + int((time.monotonic() - started) // REPEAT_INTERVAL_S)
    records = [json.loads(line) for line in server.output.splitlines() if line.strip()]
    exporter = [r for r in records if r["logger"].startswith("opentelemetry.exporter")]
    transient = [r for r in exporter if r["message"].startswith("Transient error")]
    assert transient, "the exporter's failures are missing"
    processes = 2  # the server and its worker, each with its own exporter
    assert len(transient) <= processes * intervals, transient
    # A library's message differs from its repeats in its numbers (the delay before a retry).
    libraries = [r for r in records if r["logger"].partition(".")[0] not in ("app", "uvicorn")]
    same = Counter(
        (r["logger"], re.sub(r"0x[0-9a-fA-F]+|\d+", "#", r["message"])) for r in libraries
    )
    assert max(same.values()) <= processes * intervals, same.most_common(3)


def test_json_logs_cover_the_batch_job(tiny_store: Path, tmp_path: Path) -> None:
    import subprocess
    import sys

    from tests.children import dies_with_run
    from tests.server import REPO

    photos = tmp_path / "photos"
    photos.mkdir()
    (photos / "a.png").write_bytes(distinct_images(1)[0])
    env = {
        "PATH": "/usr/bin:/bin",
        "MODEL_STORE": str(tiny_store),
        "CUDA_DEVICES": "cpu",
        "MB_WORKER_NUM": "1",
        "LOG_FORMAT": "json",
    }
    done = subprocess.run(
        [sys.executable, "-m", "app.bulk", str(photos), "--task", "embedding",
         "--out", str(tmp_path / "out.jsonl"), "--no-progress"],
        cwd=REPO, env=env, capture_output=True, text=True, timeout=120,
        preexec_fn=dies_with_run(),
    )  # fmt: skip
    assert done.returncode == 0, done.stderr
    records = [json.loads(line) for line in done.stderr.splitlines() if line.strip()]
    assert any(r["logger"].startswith("app") for r in records)
    (line,) = (tmp_path / "out.jsonl").read_text().splitlines()
    assert json.loads(line)["model_id"].startswith("tiny-test@")
