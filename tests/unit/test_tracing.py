"""Traces in the HTTP (and gRPC) process, with the SDK's in-memory exporter and a fake
transport: the request span and its children, the caller's traceparent, refusals, sampling,
the log line, and what is set up from which environment (tests/integration/test_tracing.py
follows a trace into real workers, Redis and a collector)."""

from __future__ import annotations

import asyncio
import json
import logging
import subprocess
import sys
import threading
from collections.abc import AsyncIterator, Iterator, Sequence
from pathlib import Path
from typing import Any

import grpc
import httpx
import numpy as np
import pytest
import pytest_asyncio
from opentelemetry.sdk.trace import ReadableSpan
from opentelemetry.sdk.trace.export import SpanExportResult
from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter
from opentelemetry.trace import SpanKind, StatusCode

from app import tracing
from app.batching import BatchItem
from app.broker.wire.request import decode_request, encode_request
from app.errors import SettingsError
from app.jobs import EmbeddingAndTopK, ImageJob, Task, TopK
from app.logs import JsonFormatter
from app.main import create_app
from app.settings import Settings
from app.testing import FakeTransport
from app.v2.proto import inference_pb2 as pb
from app.v2.proto import inference_pb2_grpc as pb_grpc
from app.v2.tensors import pack_bytes
from tests.conftest import distinct_images

TRACE_ID = "0af7651916cd43dd8448eb211c80319c"
CALLER_SPAN = "b7ad6b7169203331"
SAMPLED = f"00-{TRACE_ID}-{CALLER_SPAN}-01"
UNSAMPLED = f"00-{TRACE_ID}-{CALLER_SPAN}-00"


class Slow:
    """Answers each batch after ``delay_s`` (0: at once)."""

    def __init__(self) -> None:
        self.delay_s = 0.0

    async def __call__(self, task: Task, jobs: Sequence[ImageJob]) -> list[object]:
        await asyncio.sleep(self.delay_s)
        top = TopK(np.array([0, 1]), np.array([0.6, 0.4], np.float32))
        vector = np.zeros(4, np.float32)
        answer = {
            Task.TAG: top,
            Task.EMBEDDING: vector,
            Task.EMBEDDING_AND_TAG: EmbeddingAndTopK(vector, top),
        }[task]
        return [answer for _ in jobs]


@pytest.fixture
def exported() -> Iterator[InMemorySpanExporter]:
    exporter = InMemorySpanExporter()
    tracing.configure("server", exporter=exporter)
    try:
        yield exporter
    finally:
        tracing.reset()


@pytest_asyncio.fixture
async def served(
    exported: InMemorySpanExporter, tiny_store: Path
) -> AsyncIterator[tuple[httpx.AsyncClient, Slow, Any]]:
    slow = Slow()
    settings = Settings(model_store=tiny_store, mb_grpc_port=0, mb_max_latency=0.001)
    app = create_app(settings, transport=FakeTransport(slow))
    async with app.router.lifespan_context(app):
        client = httpx.AsyncClient(transport=httpx.ASGITransport(app=app), base_url="http://t")
        async with client:
            yield client, slow, app


def _trace(exporter: InMemorySpanExporter) -> dict[str, ReadableSpan]:
    return {span.name: span for span in exporter.get_finished_spans()}


def _hex(value: int, width: int) -> str:
    return f"{value:0{width}x}"


async def test_a_request_is_one_span_with_its_steps_as_children_of_the_callers_trace(
    served: Any, exported: InMemorySpanExporter
) -> None:
    client, _, _ = served
    answer = await client.post(
        "/predict/tag",
        files={"image": ("a.png", distinct_images(1)[0])},
        headers={"traceparent": SAMPLED, "X-Request-ID": "order-42"},
    )
    assert answer.status_code == 200
    spans = _trace(exported)
    request = spans["POST /predict/tag"]
    assert request.kind is SpanKind.SERVER
    assert _hex(request.context.trace_id, 32) == TRACE_ID  # the caller's trace
    assert request.parent is not None and _hex(request.parent.span_id, 16) == CALLER_SPAN
    attributes = dict(request.attributes or {})
    assert attributes["microbatch.request_id"] == "order-42"
    assert attributes["http.response.status_code"] == 200
    assert attributes["microbatch.model"] == "tiny-test"
    assert attributes["microbatch.images"] == 1
    assert attributes["microbatch.batch.size"] == 1
    assert str(attributes["microbatch.served_id"]).startswith("tiny-test@")
    for step in ("admission", "read upload", "queue", "encode", "reply"):
        child = spans[step]
        assert child.parent is not None and child.parent.span_id == request.context.span_id
        assert child.context.trace_id == request.context.trace_id
        assert child.start_time is not None and request.start_time is not None
        assert request.start_time <= child.start_time
    assert request.status.status_code is StatusCode.UNSET
    # No image bytes or file names anywhere.
    for span in exported.get_finished_spans():
        assert "a.png" not in json.dumps(dict(span.attributes or {}), default=str)


async def test_without_a_traceparent_a_request_starts_its_own_trace(
    served: Any, exported: InMemorySpanExporter
) -> None:
    client, _, _ = served
    image = distinct_images(1)[0]
    await client.post("/predict/embedding", content=image, headers={"Content-Type": "image/png"})
    await client.post("/predict/embedding", content=image, headers={"Content-Type": "image/png"})
    roots = [s for s in exported.get_finished_spans() if s.name == "POST /predict/embedding"]
    assert len(roots) == 2 and all(root.parent is None for root in roots)
    assert roots[0].context.trace_id != roots[1].context.trace_id


async def test_probes_and_scrapes_make_no_traces(
    served: Any, exported: InMemorySpanExporter
) -> None:
    client, _, _ = served
    for path in ("/healthz", "/readyz", "/metrics"):
        assert (await client.get(path)).status_code == 200
    assert exported.get_finished_spans() == ()


async def test_a_refusal_sets_the_error_type_and_a_server_side_one_the_error_status(
    served: Any, exported: InMemorySpanExporter
) -> None:
    client, slow, _ = served
    headers = {"traceparent": SAMPLED, "Content-Type": "image/png"}
    image = distinct_images(1)[0]
    bad = await client.post("/predict/tag?model=nobody", content=image, headers=headers)
    assert bad.status_code == 404
    refused = _trace(exported)["POST /predict/tag"]
    assert refused.attributes is not None
    assert refused.attributes["error.type"] == bad.json()["error"]["type"]
    assert refused.status.status_code is StatusCode.UNSET  # the caller's fault: not an error
    exported.clear()
    slow.delay_s = 1.0
    late = await client.post(
        "/predict/tag",
        content=distinct_images(1)[0],
        headers={"Content-Type": "image/png", "X-Request-Timeout": "0.05"},
    )
    assert late.status_code == 504
    spans = _trace(exported)
    timed_out = spans["POST /predict/tag"]
    assert timed_out.status.status_code is StatusCode.ERROR
    assert timed_out.attributes is not None
    assert timed_out.attributes["error.type"] == late.json()["error"]["type"]
    assert timed_out.attributes["http.response.status_code"] == 504
    assert "queue" in spans  # its wait is there too, marked as dispatched or not


async def test_v2_and_grpc_requests_are_traced_as_predict_ones_are(
    served: Any, exported: InMemorySpanExporter
) -> None:
    client, _, app = served
    image = distinct_images(1)[0]
    body = {"inputs": [{"name": "image", "datatype": "BYTES", "shape": [1], "data": []}]}
    import base64

    body["inputs"][0]["data"] = [base64.b64encode(image).decode()]
    v2 = await client.post(
        "/v2/models/tiny-test/infer", json=body, headers={"traceparent": SAMPLED}
    )
    assert v2.status_code == 200, v2.text
    http_spans = _trace(exported)
    assert {"admission", "read upload", "queue", "reply"} <= set(http_spans)
    request = http_spans["POST /v2/models/{name}/infer"]
    assert _hex(request.context.trace_id, 32) == TRACE_ID
    exported.clear()

    call = pb.ModelInferRequest(model_name="tiny-test", id="g")
    call.inputs.add(name="image", datatype="BYTES", shape=[1])
    call.raw_input_contents.append(pack_bytes([image]))
    async with grpc.aio.insecure_channel(f"127.0.0.1:{app.state.grpc_port}") as channel:
        stub = pb_grpc.GRPCInferenceServiceStub(channel)
        await stub.ModelInfer(call, metadata=(("traceparent", SAMPLED),))
        with pytest.raises(grpc.aio.AioRpcError):
            await stub.ModelInfer(pb.ModelInferRequest(model_name="nobody"))
    spans = exported.get_finished_spans()
    calls = [s for s in spans if s.name == "inference.GRPCInferenceService/ModelInfer"]
    assert len(calls) == 2
    served_call, unknown = calls
    assert served_call.kind is SpanKind.SERVER
    assert _hex(served_call.context.trace_id, 32) == TRACE_ID
    assert served_call.parent is not None and _hex(served_call.parent.span_id, 16) == CALLER_SPAN
    assert served_call.attributes is not None and unknown.attributes is not None
    assert served_call.attributes["rpc.grpc.status_code"] == 0
    assert served_call.attributes["microbatch.images"] == 1
    steps = {s.name for s in spans if s.parent and s.parent.span_id == served_call.context.span_id}
    assert steps == {"read upload", "admission", "queue", "reply"}
    assert unknown.attributes["rpc.grpc.status_code"] == grpc.StatusCode.NOT_FOUND.value[0]
    assert unknown.attributes["error.type"] == "model_not_found"


async def test_the_json_log_line_of_a_request_carries_its_trace(
    served: Any, exported: InMemorySpanExporter
) -> None:
    client, _, _ = served
    lines: list[str] = []

    class Keep(logging.Handler):
        def emit(self, record: logging.LogRecord) -> None:
            lines.append(JsonFormatter().format(record))

    logger = logging.getLogger("app.request")
    keep = Keep()
    logger.addHandler(keep)
    try:
        await client.post(
            "/predict/embedding",
            content=distinct_images(1)[0],
            headers={"Content-Type": "image/png", "traceparent": SAMPLED},
        )
    finally:
        logger.removeHandler(keep)
    (line,) = [json.loads(line) for line in lines if "/predict/embedding" in line]
    request = _trace(exported)["POST /predict/embedding"]
    assert line["trace_id"] == TRACE_ID
    assert line["span_id"] == _hex(request.context.span_id, 16)


async def test_parent_based_sampling_at_a_ratio_of_zero_keeps_only_sampled_callers(
    monkeypatch: pytest.MonkeyPatch, tiny_store: Path
) -> None:
    monkeypatch.setenv("OTEL_TRACES_SAMPLER", "parentbased_traceidratio")
    monkeypatch.setenv("OTEL_TRACES_SAMPLER_ARG", "0")
    exporter = InMemorySpanExporter()
    tracing.configure("server", exporter=exporter)
    try:
        batches: list[tuple[str | None, ...]] = []
        fake = FakeTransport(Slow())
        run_batch = fake.run_batch

        async def carried(key: Any, items: Sequence[BatchItem[ImageJob]]) -> Any:
            batches.append(tracing.carried(items))  # what a worker would be sent
            return await run_batch(key, items)

        fake.run_batch = carried  # type: ignore[method-assign]
        app = create_app(Settings(model_store=tiny_store), transport=fake)
        async with app.router.lifespan_context(app):
            transport = httpx.ASGITransport(app=app)
            async with httpx.AsyncClient(transport=transport, base_url="http://t") as client:
                image = distinct_images(1)[0]
                for headers in ({}, {"traceparent": UNSAMPLED}, {"traceparent": SAMPLED}):
                    await client.post(
                        "/predict/embedding",
                        content=image,
                        headers={"Content-Type": "image/png", **headers},
                    )
        names = [span.name for span in exporter.get_finished_spans()]
        assert names.count("POST /predict/embedding") == 1  # the sampled caller's only
        assert batches[:2] == [(), ()]  # unsampled: the worker is sent nothing to trace
        assert batches[2] and batches[2][0] is not None
        assert batches[2][0].split("-")[1] == TRACE_ID
    finally:
        tracing.reset()


def test_tracing_is_on_only_when_the_environment_asks() -> None:
    assert tracing.wanted({}) is None
    assert tracing.wanted({"OTEL_SERVICE_NAME": "x"}) is None
    assert tracing.wanted({"OTEL_EXPORTER_OTLP_ENDPOINT": "http://c:4318"}) == "otlp"
    assert tracing.wanted({"OTEL_EXPORTER_OTLP_TRACES_ENDPOINT": "http://c:4318"}) == "otlp"
    assert tracing.wanted({"OTEL_TRACES_EXPORTER": "console"}) == "console"
    on = {"OTEL_EXPORTER_OTLP_ENDPOINT": "http://c:4318"}
    assert tracing.wanted({**on, "OTEL_TRACES_EXPORTER": "none"}) is None
    assert tracing.wanted({**on, "OTEL_SDK_DISABLED": "true"}) is None
    with pytest.raises(SettingsError, match="http/protobuf"):
        tracing.wanted({**on, "OTEL_EXPORTER_OTLP_PROTOCOL": "grpc"})
    with pytest.raises(SettingsError, match="otlp, console"):
        tracing.wanted({"OTEL_TRACES_EXPORTER": "zipkin"})


def test_a_tracing_setting_the_server_cannot_honour_stops_it_at_start(tiny_store: Path) -> None:
    env = {"MODEL_STORE": str(tiny_store), "OTEL_TRACES_EXPORTER": "zipkin", "PATH": ""}
    code = "from app.main import create_app; create_app()"
    done = subprocess.run(
        [sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=60
    )
    assert done.returncode == 2
    assert "OTEL_TRACES_EXPORTER='zipkin'" in done.stderr
    assert "Traceback" not in done.stderr


def test_off_the_server_loads_no_tracing_sdk_or_exporter(tiny_store: Path) -> None:
    """(FastAPI imports OpenTelemetry's API when it is installed; its hooks are off.)"""
    code = """
import sys
from fastapi.testclient import TestClient
from app.main import create_app
from app.settings import Settings
from app.testing import FakeTransport
import numpy as np
fake = FakeTransport(lambda task, jobs: [np.zeros(4, np.float32) for _ in jobs])
with TestClient(create_app(Settings(model_store=sys.argv[1]), transport=fake)) as client:
    sent = client.post("/predict/embedding", content=open(sys.argv[2], "rb").read(),
                       headers={"Content-Type": "image/png"})
    assert sent.status_code == 200, sent.text
from app import tracing
assert not tracing.on()
print(sorted(m for m in sys.modules if m.startswith(("opentelemetry.sdk", "opentelemetry.exporter"))))
"""
    image = tiny_store.parent / "off.png"
    image.write_bytes(distinct_images(1)[0])
    done = subprocess.run(
        [sys.executable, "-c", code, str(tiny_store), str(image)],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert done.returncode == 0, done.stderr
    assert done.stdout.strip().splitlines()[-1] == "[]"


def test_the_trace_context_crosses_the_broker_in_the_entry_header() -> None:
    def read(fields: dict[str, bytes]) -> dict[bytes, bytes]:  # as Redis gives them back
        return {key.encode(): value for key, value in fields.items()}

    fields = encode_request("r-1", "fe", Task.TAG, 3, 1000, b"jpeg", SAMPLED)
    assert decode_request(read(fields), 1 << 20).traceparent == SAMPLED
    untraced = encode_request("r-2", "fe", Task.TAG, 3, 1000, b"jpeg")
    assert b"tp" not in untraced["h"]
    assert decode_request(read(untraced), 1 << 20).traceparent is None
    # A mangled context costs the trace, never the request.
    header = json.loads(fields["h"])
    header["tp"] = {"not": "a traceparent"}
    mangled = {**fields, "h": json.dumps(header).encode()}
    assert decode_request(read(mangled), 1 << 20).traceparent is None


def test_a_worker_batch_is_the_child_of_its_first_traced_request_and_linked_to_each(
    exported: InMemorySpanExporter,
) -> None:
    other = f"00-{'1' * 32}-{'2' * 16}-01"
    with tracing.batch([SAMPLED, None, other, SAMPLED], {"microbatch.task": "tag"}):
        with tracing.span("model"):
            pass
    spans = _trace(exported)
    batch, model = spans["batch"], spans["model"]
    assert batch.kind is SpanKind.CONSUMER
    assert batch.parent is not None and _hex(batch.parent.span_id, 16) == CALLER_SPAN
    linked = {(_hex(ln.context.trace_id, 32), _hex(ln.context.span_id, 16)) for ln in batch.links}
    assert linked == {(TRACE_ID, CALLER_SPAN), ("1" * 32, "2" * 16)}
    assert batch.attributes is not None and batch.attributes["microbatch.batch.size"] == 4
    assert model.parent is not None and model.parent.span_id == batch.context.span_id
    exported.clear()
    with tracing.batch([None, None], {}):  # nobody traced: no span
        pass
    assert exported.get_finished_spans() == ()


def test_spans_the_exporter_cannot_take_are_dropped_and_counted(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """A collector that is down (the export fails) or slow (the queue fills): spans are
    dropped and counted, and ending a span never waits for the exporter."""
    monkeypatch.setenv("OTEL_BSP_MAX_QUEUE_SIZE", "4")
    monkeypatch.setenv("OTEL_BSP_MAX_EXPORT_BATCH_SIZE", "2")
    monkeypatch.setenv("OTEL_BSP_SCHEDULE_DELAY", "10")
    release = threading.Event()

    class Stuck(InMemorySpanExporter):
        def export(self, spans: Sequence[ReadableSpan]) -> SpanExportResult:
            release.wait(10)  # a collector that does not answer
            return SpanExportResult.FAILURE

    before = tracing.spans_dropped()
    monkeypatch.setattr(tracing.configuration, "_exporter", lambda kind: Stuck())
    assert tracing.configure("server", environ={"OTEL_TRACES_EXPORTER": "otlp"})
    try:
        import time

        started = time.perf_counter()
        for _ in range(40):
            with tracing.request("GET /x", dict, {}):
                pass
        assert time.perf_counter() - started < 2  # never waited 10 s for the exporter
        release.set()
        tracing.flush()
    finally:
        tracing.reset()
    after = tracing.spans_dropped()
    assert after["queue_full"] - before["queue_full"] > 0
    assert after["export_failed"] - before["export_failed"] > 0
