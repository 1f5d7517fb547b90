"""The batch contract, enforced loudly: a batch function answers each of its items by id,
exactly once; each caller's future is resolved once, with its own result or an error; an
unexpected exception reaches the callers as a typed ``InferenceError``; one poison input
fails itself alone, not its neighbours (``answer``)."""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Awaitable, Callable, Hashable, Mapping, Sequence
from typing import Any, Protocol, TypeVar

from app.errors import BatchContractError, InferenceError, NotReady, ServerError, Unavailable

log = logging.getLogger("app.batching.streamer")


class Waiting(Protocol):
    """An item whose caller waits on ``future``."""

    @property
    def id(self) -> int: ...
    @property
    def future(self) -> asyncio.Future[Any]: ...


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
    ``Unavailable``: that is no input's fault); a cancelled run answers ``NotReady``."""
    try:
        try:
            await run(key, batch)
        except Exception as exc:
            if len(batch) == 1 or isinstance(exc, Unavailable):
                raise
            log.warning(
                "batch of %d %r items failed (%r); retrying them one by one", len(batch), key, exc
            )
            for item in batch:
                if item.future.done():
                    continue
                try:
                    await run(key, [item])
                except Exception as alone:
                    fail(item, as_server_error(alone, key, 1))
    except asyncio.CancelledError:
        for item in batch:
            fail(item, NotReady("server is shutting down"))
        raise
    except Exception as exc:
        for item in batch:
            fail(item, as_server_error(exc, key, len(batch)))
