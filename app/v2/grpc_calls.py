"""One gRPC call of the v2 service (``app.v2.grpc_service``), as it is recorded and said:
what it learned (``Call``), its span's attributes, its metadata, and a refusal: its message,
what it says besides (trailing metadata, or a stream's answer) and the tenant it counts
under."""

from __future__ import annotations

from typing import Any

import grpc

from app import tracing
from app.cache import CacheUse
from app.errors import RETRYABLE, QuotaExceeded, ServerError, grpc_status, retry_after
from app.services.registry import ModelVersion
from app.tenancy import Caller
from app.v2.proto import inference_pb2 as pb

SERVICE = "inference.GRPCInferenceService"
MESSAGE_CHARS = 1000  # a refusal's message, at most: it echoes what the client named


class Call:
    """What one RPC learned, for its log line and metrics: the error it ended with, if any
    (its gRPC status and the HTTP status it stands for in the metrics follow from it)."""

    def __init__(self, rpc: str) -> None:
        self.rpc = rpc
        self.version: ModelVersion | None = None
        self.inference = False
        self.batch_size: int | None = None
        self.images = 0
        self.error: ServerError | None = None
        self.caller: Caller | None = None
        self.cache: CacheUse | None = None  # how the response cache answered it


RPC_ATTRIBUTES = {"rpc.system": "grpc", "rpc.service": SERVICE}


def describe(span: Any, call: Call) -> None:
    """The call span's attributes, once it ended."""
    span.set_attribute("rpc.method", call.rpc)
    version, error = call.version, call.error
    code = grpc.StatusCode[grpc_status(error)] if error is not None else grpc.StatusCode.OK
    span.set_attribute("rpc.grpc.status_code", code.value[0])
    tenant = tenant_of(call)
    if version is not None:
        tracing.served(
            span,
            model=version.name,
            version=version.version,
            served_id=version.served_id,
            images=call.images,
            batch_size=call.batch_size,
            tenant=tenant,
        )
    elif tenant is not None:
        tracing.served(span, tenant=tenant)
    if error is not None:
        tracing.failed(span, error)


def metadata_of(context: Any) -> dict[str, str]:
    return {
        key: value for key, value in (context.invocation_metadata() or ()) if isinstance(value, str)
    }


def said(error: ServerError) -> str:
    """A refusal's message, as gRPC carries it: within ``MESSAGE_CHARS`` (a message that
    echoes a 20 KB name passed gRPC's metadata limit, and the client saw RESOURCE_EXHAUSTED
    instead of the refusal)."""
    message = error.message
    return message if len(message) <= MESSAGE_CHARS else message[: MESSAGE_CHARS - 3] + "..."


def tenant_of(call: Call) -> str | None:
    """The tenant a refusal counts under (``microbatch_tenant_refused_total``), once known."""
    return call.caller.tenant if call.caller is not None else None


def trailing_of(error: ServerError) -> tuple[tuple[str, str], ...]:
    """A unary refusal's trailing metadata: its type, when to retry (and gRPC's own pushback
    for clients that read it), and a quota's RateLimit headers."""
    trailing = [("error-type", error.code)]
    if isinstance(error, RETRYABLE):
        seconds = retry_after(error)
        trailing += [("retry-after", str(seconds)), ("grpc-retry-pushback-ms", str(seconds * 1000))]
    if isinstance(error, QuotaExceeded):
        trailing += [(name.lower(), value) for name, value in error.headers.items()]
    return tuple(trailing)


def stream_refusal(request: Any, error: ServerError) -> Any:
    """A stream's answer to a request that failed: its message, and its type and retry hint
    as parameters (a stream has no trailing metadata per request)."""
    failed = pb.ModelInferResponse(id=request.id, model_name=request.model_name)
    failed.parameters["error-type"].string_param = error.code
    if isinstance(error, RETRYABLE):
        failed.parameters["retry-after"].int64_param = retry_after(error)
    return pb.ModelStreamInferResponse(error_message=said(error), infer_response=failed)
