"""The per-request log line, request ids and HTTP metrics (pure ASGI middleware)."""

from __future__ import annotations

import logging
import os
import re
import time

from starlette.types import ASGIApp, Message, Receive, Scope, Send

from app.metrics import Metrics

log = logging.getLogger("app.request")

REQUEST_ID_HEADER = "x-request-id"
MODEL_ID_HEADER = b"x-model-id"
_VALID_ID = re.compile(r"^[A-Za-z0-9._:-]{1,128}$")


class RequestLog:
    """Pure ASGI middleware: a request id (``X-Request-ID`` if the client sent a sane one,
    else a new one) echoed in the response, one log line per request, and HTTP metrics.
    Every response also says which export answered it (``X-Model-Id``): the version the
    request was admitted for (``model_id`` in ``request.state``, put there at admission),
    else the default model's, so answers of two exports never mix unknowingly.

    Handlers may put ``batch_size`` into ``request.state`` for the log line, and at
    admission ``model_id``, ``model`` and ``model_version`` for it and the metrics."""

    def __init__(self, app: ASGIApp, metrics: Metrics) -> None:
        self.app = app
        self.metrics = metrics

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        started = time.perf_counter()
        sent = dict(scope["headers"]).get(REQUEST_ID_HEADER.encode(), b"").decode("latin-1")
        request_id = sent if _VALID_ID.match(sent) else os.urandom(16).hex()
        state = scope.setdefault("state", {})
        state["request_id"] = request_id
        status = 500
        app_state = scope["app"].state if "app" in scope else None

        async def send_with_id(message: Message) -> None:
            nonlocal status
            if message["type"] == "http.response.start":
                status = message["status"]
                headers = list(message.get("headers", []))
                headers.append((REQUEST_ID_HEADER.encode(), request_id.encode()))
                model_id = state.get("model_id") or _default_model_id(app_state)
                if model_id:
                    headers.append((MODEL_ID_HEADER, model_id.encode()))
                message = {**message, "headers": headers}
            await send(message)

        try:
            await self.app(scope, receive, send_with_id)
        finally:
            seconds = time.perf_counter() - started
            route = getattr(scope.get("route"), "path", None) or "unmatched"
            model, version = state.get("model", ""), state.get("model_version", "")
            inference = "batch_size" in state  # set by the routes that run a model
            self.metrics.on_request(
                route, status, seconds, model, str(version), inference=inference
            )
            batch_size = state.get("batch_size")
            served = state.get("model_id")
            log.info(
                "%s %s %s %d %.1f ms%s%s",
                request_id,
                scope["method"],
                route,
                status,
                seconds * 1000,
                f" model={served}" if served else "",
                f" batch={batch_size}" if batch_size else "",
                extra={
                    "request_id": request_id,
                    "method": scope["method"],
                    "route": route,
                    "status": status,
                    "latency_ms": round(seconds * 1000, 2),
                    "model_id": served,
                    "batch_size": batch_size,
                },
            )


def _default_model_id(app_state: object) -> str | None:
    """The default model's serving id (``app.state.default_model_id()``), once there is one."""
    read = getattr(app_state, "default_model_id", None)
    return read() if callable(read) else None
