"""Traces for real: ``python -m app`` (with its model worker processes) and broker mode
(redis-server, a front end, model workers in other processes), each exporting over OTLP/HTTP
to a receiver the test runs, as they would to a collector. One request is one trace across
every process; a collector that is down costs neither answers nor time."""

from __future__ import annotations

import asyncio
import os
import signal
import socket
import statistics
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest

from tests.broker import OUTLASTS_A_HEARTBEAT_S, RedisServer, Workers, broker_env, recovery_s
from tests.conftest import SlowModels, distinct_images
from tests.otlp import Received, Receiver, by_id, children, receiving, tracing_env
from tests.server import ServerProcess

pytestmark = pytest.mark.slow

TRACE_ID = "4bf92f3577b34da6a3ce929d0e0e4736"
CALLER_SPAN = "00f067aa0ba902b7"
SERVER, PRODUCER, CONSUMER = 2, 4, 5


@pytest.fixture
def receiver() -> Iterator[Receiver]:
    yield from receiving()


def traced_post(base_url: str, image: bytes, trace_id: str = TRACE_ID) -> httpx.Response:
    return httpx.post(
        f"{base_url}/predict/tag",
        files={"image": ("photo.png", image)},
        headers={"traceparent": f"00-{trace_id}-{CALLER_SPAN}-01", "X-Request-ID": "req-7"},
        timeout=60,
    )


def one_trace(receiver: Receiver, trace_id: str, names: set[str]) -> list[Received]:
    """The spans of ``trace_id``, once every name in ``names`` has arrived."""
    return [
        span
        for span in receiver.wait_for(
            lambda spans: names <= {s.name for s in spans if s.trace_id == trace_id}
        )
        if span.trace_id == trace_id
    ]


def the(spans: list[Received], name: str) -> Received:
    (found,) = [span for span in spans if span.name == name]
    return found


def test_one_request_is_one_trace_across_the_http_process_and_its_worker(
    receiver: Receiver, tiny_store: Path
) -> None:
    with ServerProcess(MODEL_STORE=str(tiny_store), **tracing_env(receiver)) as server:
        answer = traced_post(server.base_url, distinct_images(1)[0])
        assert answer.status_code == 200
        worker_pids = set(server.worker_pids())
    names = {"POST /predict/tag", "admission", "read upload", "queue", "encode", "reply", "batch"}
    spans = one_trace(receiver, TRACE_ID, names | {"decode", "model"})
    request = the(spans, "POST /predict/tag")
    assert request.parent_id == CALLER_SPAN and request.kind == SERVER
    assert request.attributes["microbatch.request_id"] == "req-7"
    assert request.attributes["microbatch.tenant"] == "anonymous"  # no API_KEY: open to all
    assert request.service == "microbatch"
    steps = {span.name for span in children(spans, request)}
    assert {"admission", "read upload", "queue", "encode", "reply", "batch"} <= steps
    # The batch ran in a worker process: its own service, linked to the request it served.
    batch = the(spans, "batch")
    assert batch.service == "microbatch-worker" and batch.kind == CONSUMER
    assert batch.attributes["process.pid"] in worker_pids
    assert batch.links == ((TRACE_ID, request.span_id),)
    assert batch.attributes["microbatch.batch.size"] == 1
    assert {span.name for span in children(spans, batch)} == {"decode", "model"}
    # Well nested in time: the worker's work inside the request.
    assert request.start_ns <= batch.start_ns <= batch.end_ns <= request.end_ns
    # The model call says what ran it: how it was compiled, on how many threads.
    model = the(spans, "model").attributes
    assert model["microbatch.images"] == 1 and model["microbatch.threads"] >= 1
    assert (model["microbatch.runtime"], model["microbatch.precision"]) == (
        "torchscript",
        "float32",
    )
    assert model["microbatch.shape"] == "dynamic"  # TorchScript compiles no shape of its own
    # No image bytes or file names in any attribute.
    assert not any("photo.png" in str(span.attributes) for span in spans)


def test_broker_mode_carries_the_trace_through_redis_to_a_worker_process(
    receiver: Receiver, tiny_store: Path
) -> None:
    env = tracing_env(receiver)
    with (
        RedisServer() as redis_server,
        Workers(redis_server, tiny_store, environment=env) as workers,
    ):
        with ServerProcess(**broker_env(redis_server.url, tiny_store, **env)) as front:
            assert traced_post(front.base_url, distinct_images(1)[0]).status_code == 200
            untraced = httpx.post(
                f"{front.base_url}/predict/embedding",
                content=distinct_images(2)[1],
                headers={"Content-Type": "image/png"},
            )
            assert untraced.status_code == 200
            worker_pids = {w["pid"] for w in workers.live().values()}
    names = {"POST /predict/tag", "broker", "broker queue", "batch", "decode", "model"}
    spans = one_trace(receiver, TRACE_ID, names)
    request, broker = the(spans, "POST /predict/tag"), the(spans, "broker")
    assert broker.parent_id == request.span_id and broker.kind == PRODUCER
    assert broker.attributes["messaging.system"] == "redis"
    batch = the(spans, "batch")
    assert batch.parent_id == broker.span_id  # on the other side of Redis
    assert batch.service == "microbatch-worker" and batch.attributes["process.pid"] in worker_pids
    assert batch.attributes["messaging.redis.delivery_count"] == 1
    assert "microbatch.retry" not in batch.attributes
    assert the(spans, "broker queue").parent_id == broker.span_id
    assert {span.name for span in children(spans, batch)} == {"decode", "model"}
    # A request without a traceparent starts a trace of its own, the worker's part in it.
    own = receiver.wait_for(
        lambda got: (
            any(s.name == "POST /predict/embedding" for s in got)
            and any(s.name == "batch" and s.trace_id != TRACE_ID for s in got)
        )
    )
    (root,) = [span for span in own if span.name == "POST /predict/embedding"]
    assert root.parent_id == ""
    assert any(s.name == "batch" for s in own if s.trace_id == root.trace_id)


async def test_a_batch_reclaimed_after_its_worker_died_says_it_is_a_retry(
    receiver: Receiver, slow_models: SlowModels
) -> None:
    # Each batch outlasts a heartbeat, so that one shows a worker running its batch, and the
    # kill lands in the middle of it.
    slow = slow_models(OUTLASTS_A_HEARTBEAT_S)
    images = distinct_images(8)
    # A deadline past the longest the victim's entries wait (as test_broker.py's kill test
    # sets it): they are answered, not dropped unrun at their deadline.
    deadline_s = recovery_s(OUTLASTS_A_HEARTBEAT_S, len(images)) + 10
    env = tracing_env(receiver)
    with (
        RedisServer() as redis_server,
        Workers(redis_server, slow, count=2, environment=env) as workers,
    ):
        front_env = broker_env(redis_server.url, slow, MB_REQUEST_TIMEOUT=f"{deadline_s:.1f}")
        with ServerProcess(**front_env, **env) as front:
            await asyncio.to_thread(traced_post, front.base_url, distinct_images(1)[0], "1" * 32)
            trace_ids = [f"{index + 2:032x}" for index in range(len(images))]
            requests = [
                asyncio.create_task(asyncio.to_thread(traced_post, front.base_url, image, trace))
                for image, trace in zip(images, trace_ids, strict=True)
            ]
            deadline = time.monotonic() + 30
            while not (busy := [w for w in workers.live().values() if w.get("running", 0) >= 2]):
                assert time.monotonic() < deadline, "no worker ever ran a batch"
                await asyncio.sleep(0.02)
            os.kill(busy[0]["pid"], signal.SIGKILL)
            answers = await asyncio.gather(*requests)
    assert [answer.status_code for answer in answers] == [200] * len(images)
    spans = receiver.wait_for(
        lambda got: any(s.name == "batch" and s.attributes.get("microbatch.retry") for s in got)
    )
    retried = [s for s in spans if s.name == "batch" and s.attributes.get("microbatch.retry")]
    for batch in retried:
        assert batch.attributes["messaging.redis.delivery_count"] >= 2
        assert batch.trace_id in trace_ids  # in the trace of the request it served
        broker = by_id(spans).get(batch.parent_id)
        assert broker is not None and broker.name == "broker"


def _blackhole() -> socket.socket:
    """A collector that accepts connections and never answers."""
    listener = socket.socket()
    listener.bind(("127.0.0.1", 0))
    listener.listen(64)
    return listener


def test_a_collector_that_is_down_neither_fails_nor_slows_requests(tiny_store: Path) -> None:
    listener = _blackhole()
    port = listener.getsockname()[1]
    image = distinct_images(1)[0]
    env: dict[str, Any] = {
        "OTEL_EXPORTER_OTLP_ENDPOINT": f"http://127.0.0.1:{port}",
        "OTEL_EXPORTER_OTLP_TIMEOUT": "3",
        "OTEL_BSP_SCHEDULE_DELAY": "50",
    }
    try:
        with ServerProcess(MODEL_STORE=str(tiny_store), **env) as server:
            latencies = []
            for _ in range(40):
                started = time.perf_counter()
                answer = traced_post(server.base_url, image)
                latencies.append(time.perf_counter() - started)
                assert answer.status_code == 200
            # Each export waits 3 s for an answer that never comes: a request that waited
            # on it would take seconds. They took what requests take.
            assert max(latencies) < 2.5, latencies
            assert statistics.median(latencies) < 0.5
            deadline = time.monotonic() + 20
            while True:
                metrics = httpx.get(f"{server.base_url}/metrics").text
                failed = [
                    line
                    for line in metrics.splitlines()
                    if line.startswith(
                        'microbatch_trace_spans_dropped_total{reason="export_failed"}'
                    )
                ]
                if failed and float(failed[0].split()[-1]) > 0:
                    break
                assert time.monotonic() < deadline, "the failed exports were never counted"
                time.sleep(0.5)
    finally:
        listener.close()
