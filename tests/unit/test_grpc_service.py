"""The gRPC front end shares the HTTP one's engine: a gRPC and an HTTP request share a
batch; a gRPC deadline or a cancelled call leaves the queue before compute; refusals carry
their status and retry hint. Driven through ``app.testing.FakeTransport`` (no workers)."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator, Sequence
from pathlib import Path
from typing import Any

import grpc
import httpx
import numpy as np
import pytest
import pytest_asyncio
from grpc_health.v1 import health_pb2, health_pb2_grpc

from app.jobs import ImageJob, Task
from app.main import create_app
from app.settings import Settings
from app.testing import FakeTransport
from app.v2.proto import inference_pb2 as pb
from app.v2.proto import inference_pb2_grpc as pb_grpc
from app.v2.tensors import pack_bytes
from tests.conftest import distinct_images
from tests.models import export_tiny

pytestmark = pytest.mark.asyncio(loop_scope="module")


class Gate:
    """Answers every batch once ``open`` is set: until then the one slot is busy and
    whatever else comes queues."""

    def __init__(self) -> None:
        self.open = asyncio.Event()

    async def __call__(self, task: Task, jobs: Sequence[ImageJob]) -> list[object]:
        await self.open.wait()
        return [np.zeros(4, np.float32) for _ in jobs]


@pytest_asyncio.fixture(loop_scope="module", scope="module")
async def served(tmp_path_factory: pytest.TempPathFactory) -> AsyncIterator[Any]:
    store = export_tiny(tmp_path_factory.mktemp("grpc") / "store")
    gate = Gate()
    fake = FakeTransport(gate, batch_size=8, capacity=1)
    settings = Settings(model_store=store, mb_grpc_port=0, mb_max_latency=0.5, mb_max_queue=3)
    app = create_app(settings, transport=fake)
    async with app.router.lifespan_context(app):
        client = httpx.AsyncClient(transport=httpx.ASGITransport(app=app), base_url="http://t")
        channel = grpc.aio.insecure_channel(f"127.0.0.1:{app.state.grpc_port}")
        async with client, channel:
            yield app, fake, gate, client, channel


def _request(data: bytes) -> Any:
    request = pb.ModelInferRequest(model_name="tiny-test", id="g")
    request.inputs.add(name="image", datatype="BYTES", shape=[1])
    request.outputs.add(name="embedding")
    request.raw_input_contents.append(pack_bytes([data]))
    return request


async def _post(client: httpx.AsyncClient, image: bytes) -> httpx.Response:
    return await client.post(
        "/predict/embedding", content=image, headers={"Content-Type": "image/png"}
    )


async def _occupy(
    fake: FakeTransport, gate: Gate, client: httpx.AsyncClient, image: bytes
) -> asyncio.Task[httpx.Response]:
    """A request that takes the one slot and waits at the closed gate: whatever comes next
    queues."""
    fake.batches.clear()
    gate.open.clear()
    first = asyncio.create_task(_post(client, image))
    while not fake.batches:
        await asyncio.sleep(0.01)
    return first


async def _queued(app: Any, count: int) -> None:
    for _ in range(500):
        if app.state.engine.streamer.queue_depth == count:
            return
        await asyncio.sleep(0.01)
    raise AssertionError(f"the queue never held {count}")


async def test_a_grpc_and_an_http_request_share_a_batch(served: Any) -> None:
    app, fake, gate, client, channel = served
    stub = pb_grpc.GRPCInferenceServiceStub(channel)
    image = distinct_images(1)[0]
    first = await _occupy(fake, gate, client, image)
    http = asyncio.create_task(_post(client, image))
    grpc_call = asyncio.ensure_future(stub.ModelInfer(_request(image), timeout=30))
    await _queued(app, 2)
    gate.open.set()
    answers = await asyncio.gather(first, http, grpc_call)
    assert [a.status_code for a in answers[:2]] == [200, 200]
    assert list(answers[2].outputs[0].shape) == [1, 4]
    assert [len(batch.jobs) for batch in fake.batches] == [1, 2]  # gRPC and HTTP together
    # The id that computed it, as HTTP's X-Model-Id says (gRPC answers said none).
    said = answers[2].parameters["model_id"].string_param
    assert said and said == answers[1].headers["X-Model-Id"]


async def test_a_grpc_deadline_or_cancel_leaves_the_queue_before_compute(served: Any) -> None:
    app, fake, gate, client, channel = served
    stub = pb_grpc.GRPCInferenceServiceStub(channel)
    image = distinct_images(1)[0]
    first = await _occupy(fake, gate, client, image)
    with pytest.raises(grpc.aio.AioRpcError) as late:
        await stub.ModelInfer(_request(image), timeout=0.3)
    assert late.value.code() == grpc.StatusCode.DEADLINE_EXCEEDED
    cancelled = stub.ModelInfer(_request(image), timeout=30)
    await _queued(app, 1)
    cancelled.cancel()
    await _queued(app, 0)  # the cancelled call's item left the queue
    gate.open.set()
    assert (await first).status_code == 200
    await asyncio.sleep(0.6)  # longer than MB_MAX_LATENCY: anything left would have run
    assert [len(batch.jobs) for batch in fake.batches] == [1]  # neither was computed


async def test_refusals_carry_their_status_type_and_retry_hint(served: Any) -> None:
    app, fake, gate, client, channel = served
    stub = pb_grpc.GRPCInferenceServiceStub(channel)
    image = distinct_images(1)[0]
    waiting = [await _occupy(fake, gate, client, image)]
    waiting += [asyncio.create_task(_post(client, image)) for _ in range(3)]
    await _queued(app, 3)  # one running, MB_MAX_QUEUE=3 waiting: the queue is full
    with pytest.raises(grpc.aio.AioRpcError) as full:
        await stub.ModelInfer(_request(image), timeout=30)
    assert full.value.code() == grpc.StatusCode.UNAVAILABLE
    trailing = dict(full.value.trailing_metadata() or ())
    assert trailing["error-type"] == "queue_full" and int(trailing["retry-after"]) >= 1
    assert int(trailing["grpc-retry-pushback-ms"]) == 1000 * int(trailing["retry-after"])
    gate.open.set()
    await asyncio.gather(*waiting)
    with pytest.raises(grpc.aio.AioRpcError) as pinned:
        await stub.ModelInfer(_request(image), metadata=(("x-model-id", "tiny-test@000000000000"),))
    assert pinned.value.code() == grpc.StatusCode.FAILED_PRECONDITION
    assert dict(pinned.value.trailing_metadata() or ())["error-type"] == "model_version_unavailable"
    bad = pb.ModelInferRequest(model_name="tiny-test")
    bad.inputs.add(name="pixels", datatype="FP32", shape=[1, 3, 224, 224])
    bad.raw_input_contents.append(bytes(12))
    with pytest.raises(grpc.aio.AioRpcError) as invalid:
        await stub.ModelInfer(bad)
    assert invalid.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert len(invalid.value.details() or "") < 300


async def test_health_follows_readiness(served: Any) -> None:
    app, *_, channel = served
    health: Any = health_pb2_grpc.HealthStub(channel)
    serving = health_pb2.HealthCheckResponse.SERVING
    for service in ("", "inference.GRPCInferenceService"):
        answer = await health.Check(health_pb2.HealthCheckRequest(service=service))
        assert answer.status == serving
    app.state.closing = True  # as after SIGTERM
    try:
        answer = await health.Check(health_pb2.HealthCheckRequest())
        assert answer.status == health_pb2.HealthCheckResponse.NOT_SERVING
        stub = pb_grpc.GRPCInferenceServiceStub(channel)
        assert not (await stub.ServerReady(pb.ServerReadyRequest())).ready
    finally:
        app.state.closing = False
    with pytest.raises(grpc.aio.AioRpcError) as unknown:
        await health.Check(health_pb2.HealthCheckRequest(service="nope"))
    assert unknown.value.code() == grpc.StatusCode.NOT_FOUND


async def test_grpc_is_off_unless_asked(tmp_path: Path) -> None:
    store = export_tiny(tmp_path / "store")
    app = create_app(Settings(model_store=store), transport=FakeTransport(lambda t, j: []))
    async with app.router.lifespan_context(app):
        assert getattr(app.state, "grpc_port", None) is None


async def test_a_stream_answers_each_request_and_goes_on_past_a_failed_one(served: Any) -> None:
    _, _, gate, _, channel = served
    gate.open.set()
    stub = pb_grpc.GRPCInferenceServiceStub(channel)
    good = _request(distinct_images(1)[0])
    bad = _request(distinct_images(1)[0])
    bad.id, bad.inputs[0].name = "bad", "nope"
    unknown = _request(distinct_images(1)[0])
    unknown.model_name, unknown.id = "resnet50", "unknown"
    answers = [answer async for answer in stub.ModelStreamInfer(iter([good, bad, unknown]))]
    by_id = {a.infer_response.id: a for a in answers}
    assert sorted(by_id) == ["bad", "g", "unknown"]
    assert by_id["g"].error_message == "" and list(by_id["g"].infer_response.outputs[0].shape) == [
        1,
        4,
    ]
    assert "unknown input 'nope'" in by_id["bad"].error_message
    assert "no model named 'resnet50'" in by_id["unknown"].error_message


async def test_a_stream_request_that_fails_unexpectedly_is_answered_and_the_stream_goes_on(
    served: Any, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Found by a review: a request failing with anything but a domain error (a bug; before
    the fix of its causes, a priority of non-ASCII digits) got no answer at all."""
    from app.v2.grpc_service import InferenceService

    _, _, gate, _, channel = served
    gate.open.set()
    infer = InferenceService._infer

    async def failing(self: Any, request: Any, context: Any, call: Any) -> Any:
        if request.id == "boom":
            raise RuntimeError("a bug")
        return await infer(self, request, context, call)

    monkeypatch.setattr(InferenceService, "_infer", failing)
    stub = pb_grpc.GRPCInferenceServiceStub(channel)
    good, boom = _request(distinct_images(1)[0]), _request(distinct_images(1)[0])
    boom.id = "boom"
    answers = [answer async for answer in stub.ModelStreamInfer(iter([good, boom, good]))]
    by_id = sorted((a.infer_response.id, a.error_message) for a in answers)
    assert by_id == [("boom", "internal error"), ("g", ""), ("g", "")]


async def test_a_stream_whose_messages_cannot_be_read_ends_with_an_error(served: Any) -> None:
    """Found by a review: a message that does not parse left the stream open forever (its
    reader died before it said the answers were over)."""
    _, _, gate, _, channel = served
    gate.open.set()
    raw = channel.stream_stream(
        "/inference.GRPCInferenceService/ModelStreamInfer",
        request_serializer=lambda message: message,
        response_deserializer=pb.ModelStreamInferResponse.FromString,
    )
    good = _request(distinct_images(1)[0]).SerializeToString()
    call = raw(iter([good, b"\xff\xff\xff\xff"]))

    async def drained() -> list[Any]:
        return [answer async for answer in call]

    with pytest.raises(grpc.aio.AioRpcError):
        await asyncio.wait_for(drained(), 10)


async def test_a_stream_is_read_no_further_than_its_answers_allow(
    served: Any, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Found by a review: a stream whose client sent without reading answers grew the
    server's memory without bound (a task and an answer per request)."""
    import app.v2.grpc_service as grpc_service

    app, fake, gate, client, channel = served
    monkeypatch.setattr(grpc_service, "STREAM_IN_FLIGHT", 2)
    image = distinct_images(1)[0]
    first = await _occupy(fake, gate, client, image)  # the one slot: the stream's requests queue
    stub = pb_grpc.GRPCInferenceServiceStub(channel)
    call = stub.ModelStreamInfer(iter([_request(image) for _ in range(6)]))
    await _queued(app, 2)
    await asyncio.sleep(0.3)
    assert app.state.engine.streamer.queue_depth == 2, "read past its 2 unanswered requests"
    gate.open.set()
    answers = [answer async for answer in call]
    assert [a.error_message for a in answers] == [""] * 6
    assert (await first).status_code == 200


def _sample(app: Any, line: str) -> float:
    """The value of the metrics line that starts with ``line`` (0 if none does)."""
    for said in app.state.metrics.render().decode().splitlines():
        if said.startswith(line):
            return float(said.rsplit(" ", 1)[1])
    return 0.0


async def test_a_cancelled_call_or_stream_counts_as_a_client_that_left(served: Any) -> None:
    """As HTTP's 499: ``microbatch_rejected{reason="client_disconnected"}`` counts it, and a
    stream's request cancelled with its stream is not counted as answered (it was a 200)."""
    app, fake, gate, client, channel = served
    stub = pb_grpc.GRPCInferenceServiceStub(channel)
    image = distinct_images(1)[0]
    left = 'microbatch_rejected_total{reason="client_disconnected"}'
    streamed_ok = 'microbatch_http_requests_total{model="tiny-test",route="grpc ModelStreamInfer",status="200"'
    before, answered = _sample(app, left), _sample(app, streamed_ok)
    first = await _occupy(fake, gate, client, image)
    cancelled = stub.ModelInfer(_request(image), timeout=30)
    await _queued(app, 1)
    cancelled.cancel()
    await _queued(app, 0)
    stream = stub.ModelStreamInfer(iter([_request(image)]))
    await _queued(app, 1)
    stream.cancel()
    await _queued(app, 0)
    for _ in range(100):  # the server hears of the stream's end a little later
        if _sample(app, left) >= before + 2:
            break
        await asyncio.sleep(0.02)
    assert _sample(app, left) == before + 2
    assert _sample(app, streamed_ok) == answered
    gate.open.set()
    assert (await first).status_code == 200


async def test_once_the_server_stops_a_stream_ends_and_new_requests_are_refused(
    served: Any,
) -> None:
    """Found by a review: after SIGTERM, gRPC went on computing what came, and an idle
    stream held the shutdown for the whole drain time."""
    app, _, gate, _, channel = served
    gate.open.set()
    stub = pb_grpc.GRPCInferenceServiceStub(channel)
    sending: asyncio.Queue[Any] = asyncio.Queue()

    async def requests() -> AsyncIterator[Any]:
        while (request := await sending.get()) is not None:
            yield request

    call = stub.ModelStreamInfer(requests())
    sending.put_nowait(_request(distinct_images(1)[0]))
    assert (await call.read()).error_message == ""
    app.state.closing = True  # as after SIGTERM
    try:
        with pytest.raises(grpc.aio.AioRpcError) as refused:
            await stub.ModelInfer(_request(distinct_images(1)[0]), timeout=10)
        assert refused.value.code() == grpc.StatusCode.UNAVAILABLE
        with pytest.raises(grpc.aio.AioRpcError) as ended:
            await asyncio.wait_for(call.read(), 5)
        assert ended.value.code() == grpc.StatusCode.UNAVAILABLE
    finally:
        app.state.closing = False
        sending.put_nowait(None)


async def test_a_refusal_that_echoes_a_long_name_stays_invalid_argument(served: Any) -> None:
    """Found by a review: the message echoed a 20 KB input name, past gRPC's 16 KB of
    metadata, and the client saw RESOURCE_EXHAUSTED instead of the refusal."""
    _, _, gate, _, channel = served
    gate.open.set()
    stub = pb_grpc.GRPCInferenceServiceStub(channel)
    request = _request(distinct_images(1)[0])
    request.inputs[0].name = "n" * 20_000
    with pytest.raises(grpc.aio.AioRpcError) as invalid:
        await stub.ModelInfer(request, timeout=10)
    assert invalid.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert len(invalid.value.details() or "") <= 1000
