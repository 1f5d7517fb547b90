"""The batch contract, enforced loudly: a batch function answers each of its items by id,
exactly once; each caller's future is resolved once, with its own result or an error; an
unexpected exception reaches the callers as a typed ``InferenceError``; one poison input
fails itself alone, not its neighbours (``answer``)."""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Awaitable, Callable, Hashable, Mapping, Sequence
from typing import Any, Protocol, TypeVar

from app.errors import (
    BatchContractError,
    DiedRunning,
    InferenceError,
    NotReady,
    ServerError,
    Unavailable,
    WorkerDied,
)

log = logging.getLogger("app.batching.streamer")


class Waiting(Protocol):
    """An item whose caller waits on ``future``, until ``deadline`` (monotonic; None: no
    deadline of its own)."""

    @property
    def id(self) -> int: ...
    @property
    def future(self) -> asyncio.Future[Any]: ...
    @property
    def deadline(self) -> float | None: ...


WORKER_WAIT_S = 0.25  # how often an item retried alone after a crash looks for a worker again


W = TypeVar("W", bound=Waiting)


def fail(item: Waiting, error: BaseException) -> None:
    """Answer ``item`` with ``error``, unless it has its answer already."""
    if not item.future.done():
        item.future.set_exception(error)


def as_server_error(exc: Exception, key: Hashable, size: int) -> ServerError:
    """What the callers of a failed batch get: its own domain error, or (a bug, logged)
    ``InferenceError``."""
    if isinstance(exc, ServerError):
        return exc
    log.error("batch of %d %r items failed", size, key, exc_info=exc)
    return InferenceError(f"model call failed ({type(exc).__name__})")


def deliver(batch: Sequence[Waiting], results: Mapping[int, Any]) -> None:
    """Each item's result (an exception instance fails that item alone); ``BatchContractError``
    unless ``results`` holds exactly the batch's ids."""
    expected = {item.id for item in batch}
    if not isinstance(results, Mapping) or set(results) != expected:
        got = sorted(results) if isinstance(results, Mapping) else type(results).__name__
        raise BatchContractError(
            f"batch function returned results for {got}, expected ids {sorted(expected)}"
        )
    for item in batch:
        value = results[item.id]
        if item.future.done():
            continue
        if isinstance(value, BaseException):
            item.future.set_exception(value)
        else:
            item.future.set_result(value)


async def answer(
    key: Hashable, batch: Sequence[W], run: Callable[[Hashable, Sequence[W]], Awaitable[None]]
) -> None:
    """Run ``batch`` of ``key``'s items through ``run`` (which delivers their results) so
    that each caller gets exactly one answer: when a batch of several fails, each item is
    run again alone, so only the guilty one gets the error (not when the model is
    ``Unavailable``, which is no input's fault, unless its worker crashed running it: the
    items then wait for a worker, within their deadlines, and one that crashes a worker
    alone too fails with ``InferenceError``); a cancelled run answers ``NotReady``."""
    try:
        try:
            await run(key, batch)
        except Exception as exc:
            crashed = isinstance(exc, DiedRunning)
            if len(batch) == 1 or (isinstance(exc, Unavailable) and not crashed):
                raise
            log.warning(
                "batch of %d %r items failed (%r); retrying them one by one", len(batch), key, exc
            )
            for item in batch:
                if not item.future.done():
                    await _alone(key, item, run, crashed)
    except asyncio.CancelledError:
        for item in batch:
            fail(item, NotReady("server is shutting down"))
        raise
    except Exception as exc:
        for item in batch:
            fail(item, as_server_error(exc, key, len(batch)))


async def _alone(
    key: Hashable, item: W, run: Callable[[Hashable, Sequence[W]], Awaitable[None]], crashed: bool
) -> None:
    """``item`` run again alone; after a crash, waiting for a worker (one restarting) while
    its deadline allows, and failed with ``InferenceError`` if it crashes one alone too."""
    while True:
        try:
            await run(key, [item])
            return
        except DiedRunning:
            log.error("a %r item crashed its model worker alone too: it fails alone", key)
            fail(item, InferenceError("the model worker died running this input, alone too"))
            return
        except WorkerDied as exc:  # none running (one restarts): wait for it, in time
            late = item.deadline is not None and time.monotonic() + WORKER_WAIT_S > item.deadline
            if not crashed or late or item.future.done():
                fail(item, exc)
                return
            await asyncio.sleep(WORKER_WAIT_S)
        except Exception as alone:
            fail(item, as_server_error(alone, key, 1))
            return
