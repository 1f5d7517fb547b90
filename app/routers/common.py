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
ERROR_STATUSES = (400, 401, 403, 404, 409, 413, 415, 422, 429, 503, 504)
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
    """Await ``work`` in the request's own task (no task of its own: one hand-over less each
    way); if the client goes away first, cancel it (so a queued item leaves the queue and is
    never computed) and raise ``ClientDisconnected``. The watcher starts at the event loop's
    next turn: work done without waiting (an answer the response cache kept) costs none."""
    current = asyncio.current_task()
    assert current is not None, "called from a request's task"
    left = finished = False
    watcher: asyncio.Task[None] | None = None

    def on_leave(watcher: asyncio.Task[None]) -> None:
        nonlocal left
        # Not once the work is done: a disconnect heard in the same loop turn as the answer
        # would cancel the task while it sends that answer.
        if not finished and not watcher.cancelled() and watcher.exception() is None:
            left = True
            current.cancel()

    def watch() -> None:
        nonlocal watcher
        watcher = asyncio.create_task(_disconnected(request))
        watcher.add_done_callback(on_leave)

    starting = asyncio.get_running_loop().call_soon(watch)
    try:
        return await work
    except asyncio.CancelledError:
        if left and current.uncancel() == 0:  # the client's cancel alone, not a shutdown
            raise ClientDisconnected("the client closed the connection") from None
        raise
    finally:
        finished = True
        starting.cancel()
        if watcher is not None:
            watcher.cancel()
