"""Helpers shared by the prediction routes (``/predict`` and ``/v2``): deadlines, batch
traces, client disconnects and the error answers they document."""

from __future__ import annotations

import asyncio
import time
from collections.abc import Awaitable, Iterator
from contextlib import contextmanager
from typing import Any, TypeVar

from fastapi import Request

from app import tracing
from app.batching import Trace
from app.dependencies import header as read_header
from app.errors import ClientDisconnected, InvalidParameter
from app.schemas import ErrorResponse, ProtocolErrorResponse

T = TypeVar("T")

TIMEOUT_HEADER = "X-Request-Timeout"
ERROR_STATUSES = (400, 401, 404, 409, 413, 415, 422, 503, 504)
ERRORS: dict[int | str, dict[str, Any]] = {
    status: {"model": ErrorResponse} for status in ERROR_STATUSES
}
V2_ERRORS: dict[int | str, dict[str, Any]] = {
    status: {"model": ProtocolErrorResponse} for status in ERROR_STATUSES
}


def request_deadline(request: Request, default_timeout_s: float) -> float:
    """Monotonic deadline for this request: ``MB_REQUEST_TIMEOUT``, or sooner when the client
    sends ``X-Request-Timeout: <seconds>`` (a client can shorten the timeout, never extend it)."""
    timeout = default_timeout_s
    header = read_header(request, TIMEOUT_HEADER)
    if header is not None:
        try:
            asked = float(header)
        except ValueError:
            raise InvalidParameter(f"{TIMEOUT_HEADER} must be a number of seconds") from None
        if not asked > 0:
            raise InvalidParameter(f"{TIMEOUT_HEADER} must be positive")
        timeout = min(timeout, asked)
    return time.monotonic() + timeout


@contextmanager
def batch_trace(request: Request) -> Iterator[Trace]:
    """A ``Trace`` for the Streamer to fill; its batch size goes to the request's log line
    and span, whether the prediction succeeds or not, and its waits to the request's trace."""
    trace = Trace(link=tracing.link())
    try:
        yield trace
    finally:
        request.state.batch_size = trace.batch_size
        request.state.images = trace.images
        tracing.queued(trace.waits)


async def _disconnected(request: Request) -> None:
    # The body has been read, so the next ASGI message can only be the disconnect (servers
    # also send it once the response is done, by which time this task is gone).
    while True:
        message = await request.receive()
        if message["type"] == "http.disconnect":
            return


async def unless_disconnected(request: Request, work: Awaitable[T]) -> T:
    """Await ``work``; if the client goes away first, cancel it (so a queued item leaves the
    queue and is never computed) and raise ``ClientDisconnected``."""
    task = asyncio.ensure_future(work)
    watcher = asyncio.create_task(_disconnected(request))
    watcher.add_done_callback(lambda _: task.cancel())  # no-op once the work is done
    try:
        return await task
    except asyncio.CancelledError:
        current = asyncio.current_task()
        left = watcher.done() and not watcher.cancelled()
        if left and not (current and current.cancelling()):  # the client, not a shutdown
            raise ClientDisconnected("the client closed the connection") from None
        raise
    finally:
        watcher.cancel()
