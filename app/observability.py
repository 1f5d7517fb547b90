"""Logging set-up (text or JSON lines) and the per-request log line + HTTP metrics."""

from __future__ import annotations

import json
import logging
import re
import time
import uuid
from typing import Any

from starlette.types import ASGIApp, Message, Receive, Scope, Send

from app.metrics import Metrics

log = logging.getLogger("app.request")

REQUEST_ID_HEADER = "x-request-id"
_VALID_ID = re.compile(r"^[A-Za-z0-9._:-]{1,128}$")
_STANDARD_FIELDS = set(vars(logging.makeLogRecord({}))) | {"message", "asctime"}


class JsonFormatter(logging.Formatter):
    """One JSON object per line: time, level, logger, message, plus any ``extra`` fields."""

    def format(self, record: logging.LogRecord) -> str:
        entry: dict[str, Any] = {
            "time": self.formatTime(record, "%Y-%m-%dT%H:%M:%S"),
            "level": record.levelname.lower(),
            "logger": record.name,
            "message": record.getMessage(),
        }
        entry.update({k: v for k, v in vars(record).items() if k not in _STANDARD_FIELDS})
        if record.exc_info:
            entry["exception"] = self.formatException(record.exc_info)
        return json.dumps(entry, default=str)


def configure_logging(level: str, fmt: str) -> None:
    """Route our loggers (and uvicorn's) to stderr in ``text`` or ``json`` format."""
    handler = logging.StreamHandler()
    if fmt == "json":
        handler.setFormatter(JsonFormatter())
    else:
        handler.setFormatter(logging.Formatter("%(asctime)s %(levelname)s %(name)s: %(message)s"))
    for name in ("app", "uvicorn", "uvicorn.error"):
        logger = logging.getLogger(name)
        logger.handlers[:] = [handler]
        logger.setLevel(level.upper())
        logger.propagate = False
    # Our request log replaces uvicorn's access log (it has the request id and batch size).
    logging.getLogger("uvicorn.access").disabled = True


class RequestLog:
    """Pure ASGI middleware: a request id (``X-Request-ID`` if the client sent a sane one,
    else a new one) echoed in the response, one log line per request, and HTTP metrics.

    Handlers may put ``batch_size`` into ``request.state`` for the log line."""

    def __init__(self, app: ASGIApp, metrics: Metrics) -> None:
        self.app = app
        self.metrics = metrics

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        started = time.perf_counter()
        sent = dict(scope["headers"]).get(REQUEST_ID_HEADER.encode(), b"").decode("latin-1")
        request_id = sent if _VALID_ID.match(sent) else uuid.uuid4().hex
        scope.setdefault("state", {})["request_id"] = request_id
        status = 500

        async def send_with_id(message: Message) -> None:
            nonlocal status
            if message["type"] == "http.response.start":
                status = message["status"]
                headers = list(message.get("headers", []))
                headers.append((REQUEST_ID_HEADER.encode(), request_id.encode()))
                message = {**message, "headers": headers}
            await send(message)

        try:
            await self.app(scope, receive, send_with_id)
        finally:
            seconds = time.perf_counter() - started
            route = getattr(scope.get("route"), "path", None) or "unmatched"
            self.metrics.on_request(route, status, seconds)
            batch_size = scope["state"].get("batch_size")
            log.info(
                "%s %s %s %d %.1f ms%s",
                request_id,
                scope["method"],
                route,
                status,
                seconds * 1000,
                f" batch={batch_size}" if batch_size else "",
                extra={
                    "request_id": request_id,
                    "method": scope["method"],
                    "route": route,
                    "status": status,
                    "latency_ms": round(seconds * 1000, 2),
                    "batch_size": batch_size,
                },
            )
