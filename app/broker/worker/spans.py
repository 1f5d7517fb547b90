"""The spans a broker worker adds to its requests' traces (``app.tracing``): one ``batch``
span per batch, the child of its first traced request and linked to each, marked as a retry
after a reclaim; and each traced entry's wait in its stream, as ``broker queue``."""

from __future__ import annotations

from collections.abc import Sequence
from contextlib import AbstractContextManager
from typing import Any

from app import tracing
from app.broker.wire.request import Request, entry_time_ms
from app.broker.worker.replies import EntryId
from app.jobs import Task
from app.workers.compute import batch_span


def batch(
    served_id: str, task: Task, requests: Sequence[Request], worker: str, delivery: int
) -> AbstractContextManager[Any]:
    """The batch's span, when any of its requests is traced; ``delivery`` over 1: claimed
    from a worker that died."""
    if not tracing.on():  # not even the list of carriers
        return tracing.OFF
    retry = {"microbatch.retry": True} if delivery > 1 else {}
    return batch_span(
        served_id,
        task,
        [request.traceparent for request in requests],
        **{"microbatch.worker": worker, "messaging.redis.delivery_count": delivery},
        **retry,
    )


def queued(runnable: Sequence[tuple[EntryId, Request]], now_ms: int) -> None:
    """Each traced entry's wait in its stream, from its id's time (Redis's clock) to this
    read."""
    if not tracing.on():
        return
    read_ns = now_ms * 1_000_000
    for entry_id, request in runnable:
        if request.traceparent is not None:
            enqueued_ns = entry_time_ms(entry_id) * 1_000_000
            tracing.record("broker queue", enqueued_ns, read_ns, parent=request.traceparent)
