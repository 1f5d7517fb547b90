"""The Open Inference Protocol's gRPC service (``inference.GRPCInferenceService``, as Triton
and KServe serve it): every RPC against the running server's engine (``app.v2.grpc_server``
serves it on ``MB_GRPC_PORT``).

- Inputs and outputs as over HTTP (``app.v2.inference``); outputs travel as
  ``raw_output_contents``, inputs as ``raw_input_contents`` or typed contents
  (``app.v2.grpc_messages``).
- ``authorization: Bearer <key>`` metadata, checked as HTTP checks it (``app.tenancy``):
  inference needs the ``infer`` scope (``API_KEY``), the repository's load and unload the
  ``admin`` scope (``ADMIN_API_KEY``; refused without one), statistics the ``metrics``
  scope; a tenant over its quota gets ``RESOURCE_EXHAUSTED``. Metadata ``x-model-id`` pins
  the exact export, as the HTTP header does.
- The call's deadline is the request's (it can shorten ``MB_REQUEST_TIMEOUT``, not extend
  it); a call the client cancels leaves the queue before it is computed.
- A refusal ends the call with the status ``app.errors.GRPC_STATUS`` gives, its message,
  and trailing metadata ``error-type`` (this server's type) and, for one worth retrying,
  ``retry-after`` (seconds) and ``grpc-retry-pushback-ms``.
- Each call is timed, logged and counted as an HTTP request is, and traced when tracing is
  on.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import AsyncIterator, Awaitable, Callable
from contextlib import asynccontextmanager
from functools import partial
from typing import TYPE_CHECKING, Any, TypeVar

import grpc
from google.protobuf import json_format

from app import tracing
from app.batching import Trace
from app.cache import CacheUse
from app.errors import (
    ClientDisconnected,
    ClientError,
    Forbidden,
    NotReady,
    ServerError,
    Unauthorized,
    Unavailable,
    grpc_status,
    http_status,
)
from app.services.registry import ModelVersion
from app.settings import Settings
from app.tenancy import Caller, Scope, Tenancy
from app.v2 import inference
from app.v2.grpc_calls import (
    RPC_ATTRIBUTES,
    SERVICE,
    Call,
    describe,
    metadata_of,
    said,
    stream_refusal,
    tenant_of,
    trailing_of,
)
from app.v2.grpc_messages import infer_call, infer_response, parameter
from app.v2.inference import PRIORITY_PARAMETER
from app.v2.proto import inference_pb2 as pb
from app.v2.proto import inference_pb2_grpc as pb_grpc
from app.v2.server import (
    EXTENSIONS,
    SERVER,
    config_of,
    load_asked,
    statistics_of,
    unload_asked,
)

if TYPE_CHECKING:  # the engine is wired by app.main, which hands it over
    from app.engine import Engine

log = logging.getLogger("app.request")
T = TypeVar("T")
PIN_METADATA = "x-model-id"
STREAM_IN_FLIGHT = 128  # a stream's requests unanswered at once; past them it is not read
CLOSING_LOOK_S = 0.5  # how often an idle stream looks whether the server is stopping
CACHE_METADATA = "x-cache"  # a unary call's trailing metadata: hit, coalesced or miss


class InferenceService(pb_grpc.GRPCInferenceServiceServicer):
    """Every RPC of the v2 service, against the engine of the running server."""

    def __init__(
        self,
        engine: Engine,
        settings: Settings,
        tenancy: Tenancy,
        ready: Callable[[], bool],
        closing: Callable[[], bool] = lambda: False,
    ) -> None:
        self.engine = engine
        self.settings = settings
        self.tenancy = tenancy
        self.ready = ready
        self.closing = closing  # SIGTERM came: new inference is refused, streams end

    # -- what every call shares ------------------------------------------------------------

    async def _answer(
        self,
        context: grpc.aio.ServicerContext[Any, Any],
        rpc: str,
        work: Callable[[Call], Awaitable[T]],
        *,
        scope: Scope | None = None,
    ) -> T:
        """``work(call)``, timed, logged and counted as HTTP requests are; a domain error
        ends the call with its status. ``scope``: what the caller's key must allow."""
        started = time.perf_counter()
        call = Call(rpc)
        with tracing.request(
            f"{SERVICE}/{rpc}", lambda: metadata_of(context), RPC_ATTRIBUTES
        ) as span:
            try:
                if scope is not None:
                    call.caller = self._authorize(context, scope)
                return await work(call)
            except ServerError as error:
                call.error = error
                await self._refuse(context, error, call)
                raise AssertionError("unreachable: abort raises") from None
            except asyncio.CancelledError:
                self._cancelled(call)
                raise
            except Exception:  # a bug: grpc answers UNKNOWN and logs it; counted as a 500 here
                call.error = ServerError("internal error")
                raise
            finally:
                self._observe(call, time.perf_counter() - started, span)

    def _cancelled(self, call: Call) -> None:
        """The client cancelled ``call`` (or its deadline passed, or its stream ended): a
        499, counted as HTTP counts a client that left."""
        call.error = ClientDisconnected("the client cancelled the call")
        self._count_refusal(call.error, call)

    def _count_refusal(self, error: ServerError, call: Call) -> None:
        """``error`` counted under its reason, and its caller's tenant once known."""
        if self.engine.metrics is not None:
            self.engine.metrics.on_error(error, tenant_of(call))

    def _observe(self, call: Call, seconds: float, span: Any = None) -> None:
        """The call's metrics, log line and span (when traced)."""
        version, error = call.version, call.error
        model, number = (version.name, str(version.version)) if version else ("", "")
        if span is not None:
            describe(span, call)
        if self.engine.metrics is not None:
            status = http_status(error) if error is not None else 200
            route = f"grpc {call.rpc}"
            self.engine.metrics.on_request(
                route, status, seconds, model, number, inference=call.inference
            )
        log.info(
            "grpc %s %s %.1f ms%s%s",
            call.rpc,
            grpc_status(error) if error is not None else "OK",
            seconds * 1000,
            f" model={version.served_id}" if version else "",
            f" batch={call.batch_size}" if call.batch_size else "",
            extra=tracing.log_fields(),
        )

    def _authorize(self, context: grpc.aio.ServicerContext[Any, Any], scope: Scope) -> Caller:
        sent = metadata_of(context).get("authorization")
        return self.tenancy.caller(sent, scope, where="metadata")

    async def _refuse(
        self, context: grpc.aio.ServicerContext[Any, Any], error: ServerError, call: Call
    ) -> None:
        self._count_refusal(error, call)
        code = getattr(grpc.StatusCode, grpc_status(error))
        await context.abort(code, said(error), trailing_of(error))

    @asynccontextmanager
    async def _admitted(
        self,
        context: grpc.aio.ServicerContext[Any, Any],
        call: Call,
        name: str,
        number: str,
    ) -> AsyncIterator[ModelVersion]:
        """The version a call gets (``Engine.admitted``): ``name``, pinned by metadata
        ``x-model-id`` or a ``number`` ("": the serving one)."""
        pinned = (metadata_of(context).get(PIN_METADATA) or "").strip() or None
        async with self.engine.admitted(name or None, pinned, number or None) as version:
            call.version = version
            yield version

    # -- health and metadata ---------------------------------------------------------------

    async def ServerLive(self, request: Any, context: Any) -> Any:
        return pb.ServerLiveResponse(live=True)

    async def ServerReady(self, request: Any, context: Any) -> Any:
        return pb.ServerReadyResponse(ready=self.ready())

    async def ServerMetadata(self, request: Any, context: Any) -> Any:
        return pb.ServerMetadataResponse(**SERVER, extensions=EXTENSIONS)

    async def ModelReady(self, request: Any, context: Any) -> Any:
        """Ready or not, never an error (as Triton answers, and tritonclient expects): a
        name or version not served is not ready."""

        async def work(call: Call) -> Any:
            try:
                async with self._admitted(context, call, request.name, request.version) as v:
                    ready = self.engine.answers_for(v) and not self.closing()
                    return pb.ModelReadyResponse(ready=ready)
            except (ClientError, Unavailable):
                return pb.ModelReadyResponse(ready=False)

        return await self._answer(context, "ModelReady", work)

    async def ModelMetadata(self, request: Any, context: Any) -> Any:
        async def work(call: Call) -> Any:
            async with self._admitted(context, call, request.name, request.version) as served:
                metadata = inference.metadata(served)
            return json_format.ParseDict(metadata, pb.ModelMetadataResponse())

        return await self._answer(context, "ModelMetadata", work)

    async def ModelConfig(self, request: Any, context: Any) -> Any:
        async def work(call: Call) -> Any:
            async with self._admitted(context, call, request.name, request.version) as served:
                config = config_of(self.engine, served)
            message = pb.ModelConfigResponse()
            return json_format.ParseDict({"config": config}, message, ignore_unknown_fields=True)

        return await self._answer(context, "ModelConfig", work)

    async def ModelStatistics(self, request: Any, context: Any) -> Any:
        async def work(call: Call) -> Any:
            stats = statistics_of(self.engine, request.name or None, request.version or None)
            message = pb.ModelStatisticsResponse()
            return json_format.ParseDict({"model_stats": stats}, message)

        return await self._answer(context, "ModelStatistics", work, scope=Scope.METRICS)

    # -- the repository --------------------------------------------------------------------

    async def RepositoryIndex(self, request: Any, context: Any) -> Any:
        async def work(call: Call) -> Any:
            rows = self.engine.models.index(self.engine.transport.worker_status())
            response = pb.RepositoryIndexResponse()
            for row in rows:
                if request.ready and not row["serving"]:  # what infer answers: serving
                    continue
                response.models.add(
                    name=row["name"],
                    version=str(row["version"]),
                    state=str(row["state"]).upper(),
                    reason=row.get("reason") or "",
                )
            return response

        return await self._answer(context, "RepositoryIndex", work)

    async def RepositoryModelLoad(self, request: Any, context: Any) -> Any:
        async def work(call: Call) -> Any:
            parameters = {key: parameter(value) for key, value in request.parameters.items()}
            if isinstance(parameters.get("version"), int):  # as an int64_param: the number
                parameters["version"] = str(parameters["version"])
            asked = load_asked({"parameters": parameters})
            number = int(asked.version) if asked.version is not None else None
            await self.engine.models.load(request.model_name, number, replace=asked.replace)
            return pb.RepositoryModelLoadResponse()

        return await self._answer(context, "RepositoryModelLoad", work, scope=Scope.ADMIN)

    async def RepositoryModelUnload(self, request: Any, context: Any) -> Any:
        async def work(call: Call) -> Any:
            parameters = {key: parameter(value) for key, value in request.parameters.items()}
            if isinstance(parameters.get("version"), int):  # as an int64_param: the number
                parameters["version"] = str(parameters["version"])
            number = unload_asked({"parameters": parameters})
            await self.engine.models.unload(request.model_name, number)
            return pb.RepositoryModelUnloadResponse()

        return await self._answer(context, "RepositoryModelUnload", work, scope=Scope.ADMIN)

    # -- inference -------------------------------------------------------------------------

    async def ModelInfer(self, request: Any, context: Any) -> Any:
        async def work(call: Call) -> Any:
            response = await self._infer(request, context, call)
            hint = call.cache.header if call.cache is not None else None
            if hint is not None:
                context.set_trailing_metadata(((CACHE_METADATA, hint),))
            return response

        return await self._answer(context, "ModelInfer", work, scope=Scope.INFER)

    async def ModelStreamInfer(
        self, requests: AsyncIterator[Any], context: Any
    ) -> AsyncIterator[Any]:
        """Each request of the stream answered as it completes (they run concurrently, up to
        ``STREAM_IN_FLIGHT`` unanswered at once: past that the stream is read no further,
        and the client is held back, and batch like any other). One that fails answers its
        ``error_message`` (and its type and retry hint in the answer's parameters), and the
        stream goes on; the key is checked for each (a key revoked by SIGHUP stops working
        on a stream already open). Once the server stops, the stream ends, UNAVAILABLE, when
        what it asked is answered; a stream whose messages cannot be read ends with that."""
        try:
            self._authorize(context, Scope.INFER)
        except (Unauthorized, Forbidden) as error:  # logged and counted as a unary refusal
            refused = Call("ModelStreamInfer")
            refused.error = error
            self._observe(refused, 0.0)
            await self._refuse(context, error, refused)
        answers: asyncio.Queue[Any] = asyncio.Queue()
        room = asyncio.Semaphore(STREAM_IN_FLIGHT)
        running: set[asyncio.Task[None]] = set()

        async def one(request: Any) -> None:
            call = Call("ModelStreamInfer")
            started = time.perf_counter()
            name = f"{SERVICE}/ModelStreamInfer"
            with tracing.request(name, partial(metadata_of, context), RPC_ATTRIBUTES) as span:
                try:
                    call.caller = self._authorize(context, Scope.INFER)
                    response = await self._infer(request, context, call)
                    answer = pb.ModelStreamInferResponse(infer_response=response)
                except ServerError as error:
                    call.error = error
                    answer = self._stream_refusal(request, error, call)
                except asyncio.CancelledError:  # the stream ended: no answer is sent
                    self._cancelled(call)
                    raise
                except Exception:  # a bug: this request's answer says so, the stream goes on
                    log.exception("a request of a gRPC stream failed")
                    call.error = ServerError("internal error")
                    answer = self._stream_refusal(request, call.error, call)
                finally:
                    self._observe(call, time.perf_counter() - started, span)
            answers.put_nowait(answer)

        async def read() -> None:
            try:
                async for request in requests:
                    await room.acquire()
                    task = asyncio.create_task(one(request))
                    running.add(task)
                    task.add_done_callback(running.discard)
                while running:
                    await asyncio.gather(*list(running), return_exceptions=True)
            finally:  # the stream's end, or its reading failed: the answers end too
                answers.put_nowait(None)

        reader = asyncio.create_task(read())
        try:
            while True:
                try:
                    answer = await asyncio.wait_for(answers.get(), CLOSING_LOOK_S)
                except TimeoutError:
                    if self.closing() and not running:
                        await context.abort(grpc.StatusCode.UNAVAILABLE, "the server is stopping")
                    continue
                if answer is None:
                    break
                yield answer
                room.release()
            await reader  # raises why the stream could not be read, if it could not
        finally:
            reader.cancel()
            for task in list(running):
                task.cancel()

    def _stream_refusal(self, request: Any, error: ServerError, call: Call) -> Any:
        """A stream's answer to a request that failed: its message, and its type and retry
        hint as parameters (a stream has no trailing metadata per request)."""
        self._count_refusal(error, call)
        return stream_refusal(request, error)

    async def _infer(self, request: Any, context: Any, call: Call) -> Any:
        if self.closing():
            raise NotReady("the server is stopping")
        with tracing.span("read upload"):
            infer = infer_call(request)
        timeout = self.settings.mb_request_timeout
        remaining = context.time_remaining()
        if remaining is not None:  # the client's gRPC deadline
            timeout = min(timeout, max(remaining, 0.0))
        deadline = inference.shortened(time.monotonic() + timeout, infer.parameters)
        number = request.model_version
        if self.engine.cache is not None:  # cache-control metadata as HTTP's header
            call.cache = CacheUse.asked(metadata_of(context).get("cache-control"))
        async with self._admitted(context, call, request.model_name, number) as served:
            admitted_as = served.version  # as the metrics count it, whatever comes
            trace = Trace(link=tracing.link())
            call.inference = True
            try:
                outputs = await inference.infer(
                    served,
                    infer,
                    deadline,
                    trace,
                    max_images=self.settings.max_images_per_request,
                    ticket=self.tenancy.ticket(
                        call.caller, infer.parameters.get("priority"), PRIORITY_PARAMETER
                    ),
                    cache=call.cache,
                )
            finally:
                call.batch_size, call.images = trace.batch_size, trace.images
                tracing.queued(trace.waits)
        with tracing.span("reply"):
            return infer_response(served, admitted_as, request.id, outputs)
