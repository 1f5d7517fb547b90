"""The batch contract, enforced loudly: a batch function answers each of its items by id,
exactly once; each caller's future is resolved once, with its own result or an error; an
unexpected exception reaches the callers as a typed ``InferenceError``."""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Hashable, Mapping, Sequence
from typing import Any, Protocol

from app.errors import BatchContractError, InferenceError, ServerError

log = logging.getLogger("app.batching.streamer")


class Waiting(Protocol):
    """An item whose caller waits on ``future``."""

    @property
    def id(self) -> int: ...
    @property
    def future(self) -> asyncio.Future[Any]: ...


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
