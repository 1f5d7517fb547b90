"""The per-request log line, request ids and HTTP metrics (pure ASGI middleware)."""

from __future__ import annotations

import inspect
import logging
import os
import re
import time
from functools import partial
from typing import Any

from starlette.requests import Request
from starlette.types import ASGIApp, Message, Receive, Scope, Send

from app import tracing
from app.metrics import Metrics

log = logging.getLogger("app.request")

REQUEST_ID_HEADER = "x-request-id"
_REQUEST_ID_KEY = REQUEST_ID_HEADER.encode()
MODEL_ID_HEADER = b"x-model-id"
CACHE_HEADER = b"x-cache"
# Probes and scrapes: a trace every few seconds from each, of nothing worth seeing.
UNTRACED = frozenset({"/healthz", "/readyz", "/metrics"})
_VALID_ID = re.compile(r"^[A-Za-z0-9._:-]{1,128}$")


class RequestLog:
    """Pure ASGI middleware: a request id (``X-Request-ID`` if the client sent a sane one,
    else a new one) echoed in the response, one log line per request, and HTTP metrics.
    Every response also says which export answered it (``X-Model-Id``): the version the
    request was admitted for (``model_id`` in ``request.state``, put there at admission),
    else the default model's, so answers of two exports never mix unknowingly.

    Handlers may put ``batch_size`` into ``request.state`` for the log line, at admission
    ``model_id``, ``model`` and ``model_version`` for it and the metrics, and ``cache``
    (``app.cache.CacheUse``), which answers ``X-Cache``.

    What a route raises unexpectedly is answered here, by the app's handler of
    ``Exception``, so that its 500 carries these headers too (Starlette answers it outside
    every middleware, with none of them)."""

    def __init__(self, app: ASGIApp, metrics: Metrics) -> None:
        self.app = app
        self.metrics = metrics

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        started = time.perf_counter()
        sent = dict(scope["headers"]).get(_REQUEST_ID_KEY, b"").decode("latin-1")
        request_id = sent if _VALID_ID.match(sent) else os.urandom(16).hex()
        state = scope.setdefault("state", {})
        state["request_id"] = request_id
        status = 500
        app = scope.get("app")
        app_state = app.state if app is not None else None
        reply_started = 0
        began = False

        async def send_with_id(message: Message) -> None:
            nonlocal status, reply_started, began
            if message["type"] == "http.response.start":
                began = True
                status = message["status"]
                headers = list(message.get("headers", []))
                headers.append((_REQUEST_ID_KEY, request_id.encode()))
                model_id = state.get("model_id") or _default_model_id(app_state)
                if model_id:
                    headers.append((MODEL_ID_HEADER, model_id.encode()))
                cache = state.get("cache")
                if cache is not None and cache.header is not None:
                    headers.append((CACHE_HEADER, cache.header.encode()))
                message = {**message, "headers": headers}
                if traced:
                    reply_started = tracing.now_ns()
            await send(message)
            if traced and message["type"] == "http.response.body" and not message.get("more_body"):
                tracing.record("reply", reply_started, tracing.now_ns())

        method = scope["method"]
        attributes = {"microbatch.request_id": request_id}
        traced_path = tracing.on() and scope["path"] not in UNTRACED
        traced_span = (
            tracing.request(method, partial(_carrier, scope), attributes)
            if traced_path
            else tracing.OFF
        )
        with traced_span as span:
            traced = span is not None
            try:
                await self.app(scope, receive, send_with_id)
            except Exception as exc:
                handler = app.exception_handlers.get(Exception) if app is not None else None
                if began or handler is None:
                    raise
                answer = handler(Request(scope, receive), exc)
                if inspect.isawaitable(answer):
                    answer = await answer
                await answer(scope, receive, send_with_id)
            finally:
                seconds = time.perf_counter() - started
                route = getattr(scope.get("route"), "path", None) or "unmatched"
                if span is not None:
                    _describe(span, method, route, status, state)
                self._done(method, state, request_id, route, status, seconds)

    def _done(
        self,
        method: str,
        state: dict[str, Any],
        request_id: str,
        route: str,
        status: int,
        seconds: float,
    ) -> None:
        """The request's metrics and its log line (with its trace, when traced)."""
        model, version = state.get("model", ""), state.get("model_version", "")
        inference = "batch_size" in state  # set by the routes that run a model
        self.metrics.on_request(route, status, seconds, model, str(version), inference=inference)
        if not log.isEnabledFor(logging.INFO):
            return
        batch_size = state.get("batch_size")
        served = state.get("model_id")
        log.info(
            "%s %s %s %d %.1f ms%s%s",
            request_id,
            method,
            route,
            status,
            seconds * 1000,
            f" model={served}" if served else "",
            f" batch={batch_size}" if batch_size else "",
            extra={
                "request_id": request_id,
                "method": method,
                "route": route,
                "status": status,
                "latency_ms": round(seconds * 1000, 2),
                "model_id": served,
                "batch_size": batch_size,
                **tracing.log_fields(),
            },
        )


def _carrier(scope: Scope) -> dict[str, str]:
    """The request's trace context headers (W3C ``traceparent`` and ``tracestate``)."""
    return {
        name.decode("latin-1"): value.decode("latin-1")
        for name, value in scope["headers"]
        if name in (b"traceparent", b"tracestate")
    }


def _describe(span: Any, method: str, route: str, status: int, state: dict[str, Any]) -> None:
    """The request span's name and attributes, once the route and the answer are known."""
    span.update_name(f"{method} {route}")
    span.set_attribute("http.request.method", method)
    span.set_attribute("http.route", route)
    span.set_attribute("http.response.status_code", status)
    tracing.served(
        span,
        model=state.get("model"),
        version=state.get("model_version"),
        served_id=state.get("model_id"),
        images=state.get("images"),
        batch_size=state.get("batch_size"),
        tenant=getattr(state.get("caller"), "tenant", None),
    )
    if status >= 500:
        tracing.set_error(span, status)


def _default_model_id(app_state: object) -> str | None:
    """The default model's serving id (``app.state.default_model_id()``), once there is one."""
    read = getattr(app_state, "default_model_id", None)
    return read() if callable(read) else None
