"""The HTTP edge of the error hierarchy: one JSON shape for every error, every refusal
answered by ``refusal`` (status from ``app.errors.HTTP_STATUS``, ``Retry-After`` on a 503,
counted in ``microbatch_rejected_total``), and the body limit.

The shape: ``{"error": {"type": ..., "message": ...}}``; on the Open Inference Protocol's
routes (``/v2``) the protocol's own, ``{"error": "<message>", "type": ...}``, which its
clients (tritonclient, KServe's) print."""

from __future__ import annotations

import logging
from collections.abc import Mapping

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse
from starlette.exceptions import HTTPException as StarletteHTTPException
from starlette.requests import ClientDisconnect
from starlette.routing import Match
from starlette.types import ASGIApp, Message, Receive, Scope, Send

from app import tracing
from app.dependencies import caller_of
from app.errors import (
    RETRYABLE,
    ClientDisconnected,
    ClientError,
    InvalidRequest,
    PayloadTooLarge,
    QuotaExceeded,
    ServerError,
    http_status,
    retry_after,
    validation_message,
)
from app.metrics import Metrics

log = logging.getLogger("app")


V2_PREFIX = "/v2"


def error_response(
    status: int,
    code: str,
    message: str,
    headers: Mapping[str, str] | None = None,
    path: str = "",
) -> JSONResponse:
    """An error answer, in the shape of the route at ``path``."""
    if path == V2_PREFIX or path.startswith(V2_PREFIX + "/"):
        return JSONResponse({"error": message, "type": code}, status, headers=headers)
    return JSONResponse({"error": {"type": code, "message": message}}, status, headers=headers)


def refusal(
    error: ServerError,
    metrics: Metrics,
    headers: Mapping[str, str] | None = None,
    path: str = "",
    tenant: str | None = None,
) -> JSONResponse:
    """The answer to a domain error, counted under its reason (and its caller's
    ``tenant``) and marked on the request's span: the one way a refusal leaves."""
    metrics.on_error(error, tenant)
    tracing.failed(tracing.current(), error)
    extra = dict(headers or {})
    if isinstance(error, RETRYABLE):
        extra["Retry-After"] = str(retry_after(error))
    if isinstance(error, QuotaExceeded):
        extra |= error.headers
    return error_response(http_status(error), error.code, error.message, extra or None, path)


# Refusals Starlette makes itself (a malformed body, the body limit) answer and count as the
# domain error each stands for.
HTTP_ERROR_KINDS: dict[int, type[ServerError]] = {400: ClientError, 413: PayloadTooLarge}
HTTP_ERROR_CODES = {
    404: "not_found",
    405: "method_not_allowed",
    **{status: kind.code for status, kind in HTTP_ERROR_KINDS.items()},
}

# Room for the multipart envelope and the small form fields around the file itself.
MULTIPART_OVERHEAD_BYTES = 64 * 1024


def install_error_handlers(app: FastAPI, metrics: Metrics) -> None:
    """Answer every error with the same JSON shape; status from ``app.errors.HTTP_STATUS``."""

    @app.exception_handler(ServerError)
    async def server_error(request: Request, exc: ServerError) -> JSONResponse:
        caller = caller_of(request)
        tenant = caller.tenant if caller is not None else None
        return refusal(exc, metrics, path=request.url.path, tenant=tenant)

    @app.exception_handler(ClientDisconnect)
    async def client_left(request: Request, exc: ClientDisconnect) -> JSONResponse:
        # A client that left while its body was read by any route (a /v2 infer, a load):
        # 499, as /predict's uploads answer it, never a 500 with a traceback.
        return await server_error(request, ClientDisconnected("the client left mid-upload"))

    @app.exception_handler(StarletteHTTPException)
    async def http_error(request: Request, exc: StarletteHTTPException) -> JSONResponse:
        # Raised by Starlette/FastAPI themselves: unknown route, body over the limit, a
        # malformed multipart body. Same JSON shape as everything else.
        code = HTTP_ERROR_CODES.get(exc.status_code, "http_error")
        kind = HTTP_ERROR_KINDS.get(exc.status_code)
        if kind is not None:
            metrics.on_error(kind)
        headers = exc.headers
        if exc.status_code == 405:  # every method of the path, not the first route's alone
            headers = {**(headers or {}), "Allow": ", ".join(_allowed(request))}
        return error_response(exc.status_code, code, str(exc.detail), headers, request.url.path)

    @app.exception_handler(RequestValidationError)
    async def invalid_request(request: Request, exc: RequestValidationError) -> JSONResponse:
        metrics.on_error(InvalidRequest)
        problems = validation_message(exc.errors())
        return error_response(422, InvalidRequest.code, problems, path=request.url.path)

    @app.exception_handler(Exception)
    async def unexpected(request: Request, exc: Exception) -> JSONResponse:
        log.exception("unhandled error on %s %s", request.method, request.url.path)
        tracing.failed(tracing.current(), exc)
        path = request.url.path
        return error_response(500, "internal_error", "internal server error", path=path)


def _allowed(request: Request) -> list[str]:
    """The methods the routes matching ``request``'s path take (Starlette's own 405 names
    those of the first such route only)."""
    methods: set[str] = set()
    for route in request.app.routes:
        match, _ = route.matches({**request.scope, "method": "__ANY__"})
        if match is not Match.NONE:
            methods |= set(getattr(route, "methods", None) or ())
    return sorted(methods)


class BodySizeLimit:
    """Pure ASGI middleware: 413 for a request body over ``max_body_bytes``, decided from
    Content-Length before reading, or while the body streams in when there is none."""

    def __init__(self, app: ASGIApp, max_body_bytes: int, metrics: Metrics) -> None:
        self.app = app
        self.max_body_bytes = max_body_bytes
        self.metrics = metrics

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        limit = self.max_body_bytes
        message = f"request body is over {limit} bytes"
        for name, value in scope["headers"]:
            if name == b"content-length" and value.isdigit() and int(value) > limit:
                too_large = PayloadTooLarge(message)
                closing = {"Connection": "close"}
                response = refusal(too_large, self.metrics, closing, scope.get("path", ""))
                await response(scope, receive, send)
                return
        received = 0

        async def limited_receive() -> Message:
            nonlocal received
            incoming = await receive()
            if incoming["type"] == "http.request":
                received += len(incoming.get("body", b""))
                if received > limit:
                    # An HTTPException passes through FastAPI's body parsing untouched and
                    # reaches the handler above, which answers in our JSON shape.
                    raise StarletteHTTPException(413, message)
            return incoming

        await self.app(scope, limited_receive, send)
