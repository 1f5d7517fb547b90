"""The Streamer: groups concurrent ``submit`` calls into batches for an async batch function.

Dispatch policy (the reason this exists instead of service-streamer):

* A batch is sent when a batch slot (a worker) is free **and** one of these holds: the queue
  has a full batch; no other batch is running (an idle server never makes a lone request
  wait); or the oldest queued item has waited ``max_latency_s``.
* While every slot is busy, items accumulate, so batches grow with load by themselves.
* Items carry a ``key`` (e.g. the endpoint); one batch only ever holds items of one key.
* Items carry a ``Ticket``: a batch takes the highest priority level first, and the tenants
  of a level in turn (``app.batching.fair``). Each level has its queue policy
  (``LevelPolicy``): a bound, a queue timeout, then refused or delayed. Work of a lower level
  is refused (``Shed``, 429) before work of a higher one would be: it gives up its place.

Everything is asyncio and stdlib: no threads, no web framework, no torch.
"""

from __future__ import annotations

import asyncio
import contextlib
import itertools
import logging
import math
import time
from collections.abc import Callable, Hashable, Sequence
from dataclasses import dataclass
from typing import Generic, TypeVar

from app.background import Background
from app.batching.contract import answer, deliver, fail
from app.batching.fair import FairQueue, LevelPolicy, Ticket
from app.batching.observe import BatchObserver, Trace
from app.batching.transport import NO_TICKET, BatchFn, BatchItem
from app.errors import DeadlineExceeded, NotReady, QueueFull, Shed

log = logging.getLogger("app.batching.streamer")

T = TypeVar("T")
R = TypeVar("R")


@dataclass(eq=False, slots=True)
class _Pending(Generic[T, R]):
    id: int
    key: Hashable
    payload: T
    future: asyncio.Future[R]
    enqueued_at: float
    deadline: float | None
    trace: Trace | None = None
    level: int = 0  # its priority level (0: the highest); the delayed level once delayed
    tenant: Hashable = None
    weight: float = 1.0
    ticket: Ticket = NO_TICKET  # as submitted (its level before any delay), for the transport
    run: _Run | None = None  # once dispatched: its batch's run
    wait: list[int] | None = None  # traced: [enqueued, dispatched] in epoch ns


@dataclass(eq=False, slots=True)
class _Run:
    """A dispatched batch: the task running it, and how many of its callers still wait."""

    task: asyncio.Task[None]
    waiting: int


class Streamer(Generic[T, R]):
    """Micro-batcher in front of an async batch function.

    >>> async def double(key, items):
    ...     return {item.id: item.payload * 2 for item in items}
    >>> async def main():
    ...     async with Streamer(double, max_batch_size=8, max_latency_s=0.01) as streamer:
    ...         return await asyncio.gather(*(streamer.submit(i) for i in range(3)))
    >>> asyncio.run(main())
    [0, 2, 4]
    """

    def __init__(
        self,
        batch_fn: BatchFn[T],
        *,
        max_batch_size: int,
        max_latency_s: float,
        max_queue_size: int = 1024,
        max_concurrent_batches: int = 1,
        default_timeout_s: float | None = None,
        clock: Callable[[], float] = time.monotonic,
        on_batch: BatchObserver | None = None,
        batch_size_for: Callable[[Hashable], int] | None = None,
        levels: Sequence[LevelPolicy] = (LevelPolicy(),),
    ) -> None:
        if max_batch_size < 1:
            raise ValueError(f"max_batch_size must be >= 1, got {max_batch_size}")
        if max_latency_s < 0:
            raise ValueError(f"max_latency_s must be >= 0, got {max_latency_s}")
        if max_queue_size < 1:
            raise ValueError(f"max_queue_size must be >= 1, got {max_queue_size}")
        if max_concurrent_batches < 1:
            raise ValueError(f"max_concurrent_batches must be >= 1, got {max_concurrent_batches}")
        self._batch_fn = batch_fn
        self.max_batch_size = max_batch_size
        # A key's own largest batch (each model's), never above max_batch_size.
        self._batch_size_for = batch_size_for
        self.max_latency_s = max_latency_s
        self.max_queue_size = max_queue_size
        self.max_concurrent_batches = max_concurrent_batches
        self.default_timeout_s = default_timeout_s
        self._clock = clock
        self._on_batch = on_batch
        self.levels = tuple(levels)
        self._bounds = tuple(policy.max_queue for policy in self.levels)  # read per request
        self._waits = tuple(policy.timeout_s for policy in self.levels)
        self._batch_limits = tuple(policy.max_batch for policy in self.levels)
        self._queue: FairQueue[_Pending[T, R]] = FairQueue(len(self.levels))
        self._ids = itertools.count()
        self._wake = asyncio.Event()
        self._in_flight = 0
        self._tasks = Background()  # the batches running
        self._dispatcher: asyncio.Task[None] | None = None
        self._closing = False
        self._item_time_s: float | None = None  # EWMA of batch seconds per item, for Retry-After

    # -- lifecycle ---------------------------------------------------------------------------

    async def start(self) -> None:
        if self._dispatcher is None:
            self._dispatcher = asyncio.create_task(self._dispatch_loop(), name="streamer")

    async def aclose(self, drain_timeout_s: float = 0.0) -> None:
        """Stop accepting; let queued and running work finish for up to ``drain_timeout_s``;
        then answer whatever is left with ``NotReady``."""
        self._closing = True
        deadline = self._clock() + drain_timeout_s
        while (self._queue or self._in_flight) and self._clock() < deadline:
            self._wake.set()
            await asyncio.sleep(0.01)
        if self._dispatcher is not None:
            self._dispatcher.cancel()
            await asyncio.gather(self._dispatcher, return_exceptions=True)
            self._dispatcher = None
        for item in list(self._queue):
            self._queue.remove(item)
            fail(item, NotReady("server is shutting down"))
        await self._tasks.cancel()

    async def __aenter__(self) -> Streamer[T, R]:
        await self.start()
        return self

    async def __aexit__(self, *exc_info: object) -> None:
        await self.aclose()

    # -- public API --------------------------------------------------------------------------

    @property
    def queue_depth(self) -> int:
        return self._queue.size

    @property
    def in_flight(self) -> int:
        return self._in_flight

    def check_admission(self, ticket: Ticket | None = None) -> None:
        """Raise now if ``submit`` with ``ticket`` would refuse: lets callers skip costly
        preparation (decoding an upload) when the answer is already known. ``NotReady``
        while closing. At a bound, someone gives way: the newest work of a lower level, else
        of the tenant holding the most at this level for its weight (a full level is shared
        out, and a noisy tenant cannot keep a quiet one out). If none does: ``Shed`` (429)
        for a lower level or the tenant holding the most, else ``QueueFull`` (503)."""
        if self._closing or self._dispatcher is None:
            raise NotReady("server is not accepting work")
        ticket = ticket or NO_TICKET
        full = self._queue.room_for(ticket, self._bounds, self.max_queue_size)
        if full is not None and full[0] is None:
            if self._queue.holds_most(ticket.level, ticket.tenant, ticket.weight):
                why = f"{full[1]}; its tenant holds the most"
            elif ticket.level > 0:
                why = f"{full[1]}; higher priorities come first"
            else:  # the server is full, whoever asks
                raise QueueFull(full[1], retry_after_s=self.retry_after_s())
            raise Shed(why, retry_after_s=self.retry_after_s())

    async def submit(
        self,
        payload: T,
        *,
        key: Hashable = "default",
        timeout_s: float | None = None,
        trace: Trace | None = None,
        ticket: Ticket | None = None,
    ) -> R:
        """Queue ``payload`` and wait for its result.

        Raises ``QueueFull`` or ``Shed`` at once when its level cannot take it
        (``check_admission``), ``DeadlineExceeded`` when ``timeout_s`` (or the default)
        passes first, ``Shed`` when its level's queue timeout does, ``NotReady`` while
        closing, and whatever the batch produced for this item otherwise. ``ticket`` (who
        asks, at which priority) orders it in the queue. ``trace``, if given, is filled in
        with the size of the batch the item ran in and, when it has a ``link``, its time in
        the queue.
        """
        level = 0 if ticket is None else ticket.level
        if not 0 <= level < len(self._bounds):
            raise ValueError(f"priority level {level} is not one of {len(self._bounds)}")
        self.check_admission(ticket)
        timeout = self.default_timeout_s if timeout_s is None else timeout_s
        now = self._clock()
        loop = asyncio.get_running_loop()
        future: asyncio.Future[R] = loop.create_future()
        item = _Pending(
            next(self._ids),
            key,
            payload,
            future,
            now,
            None if timeout is None else now + timeout,
            trace,
            level,
            None if ticket is None else ticket.tenant,
            1.0 if ticket is None else ticket.weight,
            ticket or NO_TICKET,
        )
        if trace is not None:
            trace.images += 1
            if trace.link is not None:
                item.wait = [time.time_ns(), 0]
                trace.waits.append(item.wait)
        self._make_room(item, ticket or NO_TICKET)
        self._queue.append(item)
        self._wake.set()
        timer = waits_timer = None
        if timeout is not None:
            timer = loop.call_later(timeout, self._expire, item, timeout)
        waits = self._waits[level]
        if waits is not None and (timeout is None or waits < timeout):
            waits_timer = loop.call_later(waits, self._queue_timeout, item, waits)
        try:
            return await future
        finally:
            if timer is not None:
                timer.cancel()
            if waits_timer is not None:
                waits_timer.cancel()
            # A caller that gave up (deadline, disconnect, cancellation) leaves the queue now,
            # so its item is never computed. Once every caller of a dispatched batch has
            # gone, the batch is cancelled: a transport may still stop it (a broker drops
            # what no worker has read yet); the pool lets its worker finish.
            if not future.done():
                future.cancel()
            run = item.run
            if run is None:
                self._queue.remove(item)
            else:
                run.waiting -= 1
                if run.waiting == 0:
                    run.task.cancel()  # a no-op once it has finished

    def _expire(self, item: _Pending[T, R], timeout: float) -> None:
        if not item.future.done():
            item.future.set_exception(DeadlineExceeded(f"no result within {timeout:g} s"))

    def _queue_timeout(self, item: _Pending[T, R], waited: float) -> None:
        """Its level's queue timeout passed while it was still queued: refused, or moved
        behind everything else (``delay``)."""
        if item.run is not None or item.future.done():
            return
        policy = self.levels[item.level]
        if policy.on_timeout == "delay":
            self._queue.remove(item)
            item.level = self._queue.delayed_level
            self._queue.append(item)
            return
        why = f"priority {item.level + 1} waits at most {waited:g} s in the queue"
        fail(item, Shed(why, retry_after_s=self.retry_after_s()))

    def _make_room(self, item: _Pending[T, R], ticket: Ticket) -> None:
        """At a full level or a full queue, refuse the one that gives way
        (``check_admission`` made sure there is one)."""
        full = self._queue.room_for(ticket, self._bounds, self.max_queue_size)
        if full is None:
            return
        heavy, why = full
        assert heavy is not None, "admitted into a full queue with nothing to displace"
        self._queue.remove(heavy)
        lower = heavy.level > item.level
        own = "higher priorities come first" if lower else "its tenant holds the most"
        fail(heavy, Shed(f"{why}; {own}", retry_after_s=self.retry_after_s()))

    def queue_timeout_s(self, ticket: Ticket | None) -> float | None:
        """How long work of ``ticket`` may wait queued before its level delays or refuses
        it (its ``LevelPolicy.timeout_s``; None: its deadline only)."""
        return self._waits[0 if ticket is None else ticket.level]

    def retry_after_s(self) -> float:
        """Seconds until the current queue is likely drained (at least 1)."""
        per_item = self._item_time_s or 0.05
        return float(max(1, math.ceil(len(self._queue) * per_item / self.max_concurrent_batches)))

    # -- dispatching -------------------------------------------------------------------------

    async def _dispatch_loop(self) -> None:
        while True:
            timeout = self._dispatch_ready()
            self._wake.clear()
            if timeout == 0.0:
                continue
            # A timeout scope, not wait_for: no task per wait, so a submit wakes the
            # dispatcher in one event-loop turn.
            with contextlib.suppress(TimeoutError):
                async with asyncio.timeout(timeout):
                    await self._wake.wait()

    def _dispatch_ready(self) -> float | None:
        """Send every batch that may go now. Returns how long to sleep before looking again
        (``None``: until woken, ``0.0``: look again at once)."""
        head = self._queue.head()
        while head is not None and head.future.done():
            self._queue.remove(head)  # cancelled callers that were not removed yet
            head = self._queue.head()
        if head is None or self._in_flight >= self.max_concurrent_batches:
            return None
        now = self._clock()
        waited = now - head.enqueued_at
        if (
            self._in_flight == 0
            or waited >= self.max_latency_s
            or self._queue.count_key(head.key, self.batch_size(head.key))
            >= self.batch_size(head.key)
        ):
            self._launch(self._take_batch(head.key, now))
            return 0.0
        return self.max_latency_s - waited

    def batch_size(self, key: Hashable) -> int:
        """The largest batch of ``key``'s items."""
        if self._batch_size_for is None:
            return self.max_batch_size
        return max(1, min(self.max_batch_size, self._batch_size_for(key)))

    def _take_batch(self, key: Hashable, now: float) -> list[_Pending[T, R]]:
        def usable(item: _Pending[T, R]) -> bool:
            if item.future.done():
                return False
            if item.deadline is not None and item.deadline <= now:
                fail(item, DeadlineExceeded("deadline passed while queued"))
                return False
            return True

        return self._queue.take(key, self.batch_size(key), usable, self._batch_limits)

    def _launch(self, batch: list[_Pending[T, R]]) -> None:
        if not batch:
            return
        now = self._clock()
        waits = [now - item.enqueued_at for item in batch]
        for item in batch:
            if item.trace is not None:
                item.trace.batch_size = len(batch)
            if item.wait is not None:
                item.wait[1] = time.time_ns()
        if self._on_batch is not None:
            try:  # an observer (the metrics) never stops a batch, nor the dispatcher
                self._on_batch(batch[0].key, len(batch), waits, [item.tenant for item in batch])
            except Exception:
                log.exception("the batch observer failed; the batch runs")
        self._in_flight += 1
        run = _Run(self._tasks.start(self._execute(batch)), len(batch))
        for item in batch:
            item.run = run

    async def _execute(self, batch: list[_Pending[T, R]]) -> None:
        started = self._clock()
        try:
            await answer(batch[0].key, batch, self._run)
        finally:
            elapsed = self._clock() - started
            per_item = elapsed / len(batch)
            self._item_time_s = (
                per_item if self._item_time_s is None else 0.8 * self._item_time_s + 0.2 * per_item
            )
            self._in_flight -= 1
            self._wake.set()

    async def _run(self, key: Hashable, batch: Sequence[_Pending[T, R]]) -> None:
        items = [
            BatchItem(
                item.id, item.payload, item.deadline, item.trace and item.trace.link, item.ticket
            )
            for item in batch
        ]
        results = await self._batch_fn(key, items)
        deliver(batch, results)
