"""A front end's side of broker mode: a ``Transport`` that passes each request straight to a
Redis stream and waits for its reply. Batches form in the workers
(``app.broker.worker.consumer``), across every front end.

Per front-end process: one id (``frontend``), one reply list read by one asyncio task, and
a look at Redis every second (``app.broker.front.monitor``: readiness, ``/info``, metrics, which
version each model name serves, what the admin route chose). A request goes to the streams
of the version it was admitted for (``BatchKey.model``). No torch, no model weights.

Failure rules: a request is refused with 503 ``broker_unavailable`` while Redis cannot be
reached; what becomes of the requests waiting for a reply when the reply reader loses Redis
(they fail at once, or behind Sentinel are held through the failover and their entries
looked for) is ``app.broker.front.failover``'s. It is refused with 503
``worker_died`` while no live worker not told to stop holds its version (by a look at Redis
at most ``LOOK_AGAIN_S`` older than the request), and a request already waiting fails the same way
once no live worker has held its version for ``ORPHANED_S`` (its worker died: a restart
takes longer than a caller should wait; scaling from zero, it waits for its deadline). It is
refused with 503 ``queue_full`` (or, below the highest priority level, 429 ``shed``) when the
shared streams hold ``max_queue`` entries (checked and added in one script, so the bound
holds across front ends, and across every model served: ``app.broker.front.admission``).
"""

from __future__ import annotations

import asyncio
import contextlib
import itertools
import logging
import time
import uuid
from collections.abc import Callable, Hashable, Mapping, Sequence
from typing import Any

import redis.asyncio as aioredis
from redis.asyncio.retry import Retry
from redis.backoff import NoBackoff
from redis.exceptions import RedisError, ResponseError

from app import tracing
from app.background import Background
from app.batching import (
    BatchItem,
    LevelPolicy,
    QueueBacklog,
    WorkerStatus,
)
from app.broker.front.admission import ADMIT, Admission
from app.broker.front.backlog import count_backlog
from app.broker.front.deletes import Deletes
from app.broker.front.failover import Failover
from app.broker.front.monitor import Monitor, cannot_reach
from app.broker.front.status import worker_status
from app.broker.front.waiting import Entry, Waiting
from app.broker.wire.connect import BACKOFF, connect_async
from app.broker.wire.heartbeat import WorkerInfo
from app.broker.wire.keys import Keys
from app.broker.wire.lanes import Lane
from app.broker.wire.request import encode_request
from app.errors import (
    BrokerUnavailable,
    NotReady,
    ServerError,
    WorkerDied,
)
from app.jobs import BatchKey, ImageJob, Task
from app.lifecycle import Route
from app.settings_values import BrokerAddress

log = logging.getLogger("app.broker.transport")

REPLY_BLOCK_S = 1.0  # how long one read of the reply list blocks
# Every call's socket timeout: a primary that hangs is left after it (the reply reader's: its
# block, and as long again).
SOCKET_TIMEOUT_S = 2.0
NOTICE_S = 0.1  # how long before its deadline a request held through a failover hears so
NO_DEADLINE_MS = 3_600_000  # what a request without a deadline tells the workers


class BrokerTransport:
    """``app.batching.Transport`` over Redis Streams, for one front-end process.

    >>> # transport = BrokerTransport("redis://127.0.0.1:6379/0", "mb", max_queue=1024)
    >>> # await transport.start()    # never fails for Redis being down: it reconnects
    >>> # await transport.run_batch(BatchKey(Task.TAG, True, "tagger@1a2b3c4d5e6f"), items)
    """

    def __init__(
        self,
        url: str,
        prefix: str,
        *,
        max_queue: int,
        switch_min_workers: int | None = None,
        on_workers: Callable[[Sequence[WorkerInfo]], None] | None = None,
        scale_from_zero: bool = False,
        own_routes: Mapping[str, Route] | None = None,
        admin_url: str | None = None,
        on_event: Callable[[str], None] | None = None,
        levels: Sequence[LevelPolicy] = (LevelPolicy(),),
        tenant_lanes: bool = False,
    ) -> None:
        self.keys = Keys(prefix)
        self.max_queue = max_queue
        self.scale_from_zero = scale_from_zero
        self.monitor = Monitor(
            self.keys,
            switch_min_workers=switch_min_workers,
            scale_from_zero=scale_from_zero,
            own_routes=own_routes,
            on_workers=on_workers,
            on_restart=lambda: self._failover.restarted(),
            after_look=lambda: self._waiting.fail_orphaned(self._held),
        )
        self.admission = Admission(
            self.keys, self.monitor, max_queue=max_queue, levels=levels, tenant_lanes=tenant_lanes
        )
        self.frontend = uuid.uuid4().hex[:16]
        self._url = url
        self._admin_url = admin_url  # the admin routes' pins go through it (MB_BROKER_ADMIN)
        self._redis: aioredis.Redis | None = None
        self._reader: aioredis.Redis | None = None
        self._admit: Any = None
        self._ids = itertools.count()
        self._waiting = Waiting()
        sentinel = BrokerAddress.parse(url).sentinel
        self._failover = Failover(self._waiting, hold=sentinel, on_event=on_event)
        self._tasks: list[asyncio.Task[None]] = []
        self._background = Background()
        self._deletes = Deletes(lambda: self._redis)

    # -- the Transport's state ---------------------------------------------------------------

    @property
    def capacity(self) -> int:
        """Requests this front end may have in Redis at once (its local bound)."""
        return self.max_queue

    @property
    def batch_size(self) -> int:
        """1: the front end passes each request on at once; the workers batch."""
        return 1

    def batch_size_for(self, key: Hashable) -> int:
        return 1

    @property
    def routes(self) -> dict[str, Route]:
        return self.monitor.routes

    @property
    def ready(self) -> bool:
        """Connected, and a worker is live; or, scaling from zero, a route is known (the
        requests queue, and their lag starts workers)."""
        waits = self.scale_from_zero and bool(self.monitor.routes)
        return self.monitor.connected and (bool(self.monitor.workers) or waits)

    @property
    def shared_queue_depth(self) -> int:
        """Entries in the shared streams at the last look (waiting or being computed)."""
        return self.monitor.queue_depth

    @property
    def models(self) -> Monitor:
        """The workers' versions, as Redis says them, and the admin route's way to ask."""
        return self.monitor

    def worker_status(self) -> list[WorkerStatus]:
        """The workers that sent a heartbeat lately, as they describe themselves."""
        return [worker_status(w) for w in self.monitor.workers]

    # -- lifecycle ---------------------------------------------------------------------------

    async def start(self) -> None:
        """Connect (or keep trying in the background: Redis may come up later)."""
        # No retries inside the client: a request fails fast while Redis is away (503), and
        # the reader and the monitor keep trying on their own.
        once = Retry(NoBackoff(), 0)
        self._redis = connect_async(
            self._url, socket_timeout=SOCKET_TIMEOUT_S, socket_connect_timeout=2, retry=once
        )
        self._reader = connect_async(
            self._url, socket_timeout=2 * REPLY_BLOCK_S, socket_connect_timeout=2, retry=once
        )
        self.monitor.client = self._redis
        if self._admin_url is not None:
            self.monitor.admin = connect_async(
                self._admin_url,
                socket_timeout=SOCKET_TIMEOUT_S,
                socket_connect_timeout=2,
                retry=once,
            )
        self.monitor.clients = [c for c in (self._redis, self._reader, self.monitor.admin) if c]
        self._admit = self._redis.register_script(ADMIT)
        await self.monitor.look_safely()
        self._tasks = [
            asyncio.create_task(self._read_replies(), name="broker-replies"),
            asyncio.create_task(self.monitor.run(), name="broker-monitor"),
        ]
        if not self.monitor.connected:
            log.warning("broker: Redis is not reachable yet; requests get 503 until it is")
        else:
            log.info("broker: front end %s connected", self.frontend)

    async def aclose(self) -> None:
        """Stop the reader and the monitor, fail what waits, close the clients. The loops
        also end by themselves once closing: a cancellation that the Redis client swallows
        (mid-command) must not leave one running, and this waiting forever."""
        self.monitor.closing = True
        for task in self._tasks:
            task.cancel()
        if self._tasks:
            _, running = await asyncio.wait(self._tasks, timeout=REPLY_BLOCK_S + 5)
            for task in running:
                log.error("broker: %s did not stop; leaving it", task.get_name())
        await self.monitor.aclose()
        self._tasks = []
        left = [entry for _, entry in self._waiting.entries()]
        self._waiting.fail(NotReady("server is shutting down"))
        if self.monitor.connected:  # their entries out first: no worker computes them
            await self._deletes.now(left, SOCKET_TIMEOUT_S)
            await self._deletes.settle(SOCKET_TIMEOUT_S)  # and those their callers began
        if self.monitor.admin is not None:
            with contextlib.suppress(RedisError, OSError):
                await self.monitor.admin.aclose()
            self.monitor.admin = None
        for client in (self._redis, self._reader):
            if client is not None:
                with contextlib.suppress(RedisError, OSError):
                    if self.monitor.connected and client is self._redis:
                        await client.delete(self.keys.replies(self.frontend))
                await client.aclose()
        self._redis = self._reader = self.monitor.client = None
        self.monitor.connected = False

    async def refresh(self) -> None:
        """Look at the workers (and so at which version each name serves) now, shared and
        throttled: for a request whose model no worker served at the last look. Raises
        ``BrokerUnavailable`` where Redis cannot be reached: that, not a model with no
        version ready, is what its caller should hear (a front end that never reached
        Redis, a TLS client certificate refused, knows no version at all)."""
        await self.monitor.look_again()
        if not self.monitor.connected:
            raise cannot_reach()

    # -- running batches ---------------------------------------------------------------------

    async def run_batch(
        self, key: Hashable, items: Sequence[BatchItem[ImageJob]]
    ) -> Mapping[int, Any]:
        """Add each item to its task's stream and wait for its reply (or its deadline).
        The Streamer passes one item at a time: batches form in the workers."""
        assert isinstance(key, BatchKey)
        if not self.monitor.connected or self._redis is None:
            raise cannot_reach()
        if not self._held(key.model, new=True):
            await self.monitor.look_again()
            if not self._held(key.model, new=True):
                raise WorkerDied(f"no live model worker holds {key.model}", retry_after_s=2)
        return {item.id: await self._one(key.model, key.task, item) for item in items}

    def _held(self, served_id: str, *, new: bool = False) -> bool:
        """Whether a live worker holds ``served_id`` (one not told to stop, for a ``new``
        request), or its requests wait for one."""
        return self.monitor.served(served_id, new=new) or served_id in self.monitor.queued

    async def backlog(self) -> QueueBacklog:
        """The work waiting for workers (``app.broker.front.backlog``), over the streams of every
        version a name routes to or a live worker holds: entries of any other version have
        nobody to compute them, and must not keep an autoscaler up. Raises
        ``BrokerUnavailable``."""
        if self._redis is None:
            raise cannot_reach()
        workers = self.monitor.workers
        held = {m.served_id for w in workers for m in w.models if w.holds(m.served_id)}
        served = held | {route.served_id for route in self.monitor.routes.values()}
        try:
            return await count_backlog(self._redis, self.keys, served)
        except (RedisError, OSError) as exc:
            raise cannot_reach(exc) from exc

    async def _one(self, served_id: str, task: Task, item: BatchItem[ImageJob]) -> object:
        """One request, in a ``broker`` span of its trace when traced: ``_sent``."""
        stream, lane = self.admission.lane(served_id, task, item.ticket)
        attributes = {"messaging.system": "redis", "messaging.destination.name": stream}
        with tracing.child_of(item.link, "broker", attributes) as span:
            answer = await self._sent(served_id, task, item, stream, lane)
            if isinstance(answer, ServerError):
                tracing.failed(span, answer)
            return answer

    async def _sent(
        self,
        served_id: str,
        task: Task,
        item: BatchItem[ImageJob],
        stream: str,
        lane: Lane | None,
    ) -> object:
        """One request: admitted and added to ``stream`` (its lane) in one script call, then
        its reply."""
        assert self._redis is not None
        request_id = f"{self.frontend}-{next(self._ids)}"
        ttl_ms = NO_DEADLINE_MS
        if item.deadline is not None:
            ttl_ms = max(1, int(1000 * (item.deadline - time.monotonic())))
        image = item.payload.image  # encoded, or pixels (a v2 client's preprocessed input)
        top_k, traced = item.payload.top_k, tracing.traceparent()
        fields = encode_request(
            request_id, self.frontend, task, top_k, ttl_ms, image, traced, item.payload.shared
        )
        keys, args = self.admission.request(served_id, task, stream, lane, fields)
        future = self._waiting.add(request_id, served_id)  # before the entry: a fast reply finds it
        added: Any = None  # the entry id (bytes), or why not and the depth ([b"full", n])
        admitting = asyncio.ensure_future(self._admit(keys=keys, args=args))
        try:
            added = await asyncio.shield(admitting)
        except asyncio.CancelledError:  # its caller left while Redis ran the script
            self._deletes.once_added(stream, admitting)
            raise
        except ResponseError as exc:  # Redis answered, and refused (out of memory, say)
            log.error("broker: Redis refused a request: %s", exc)
            return BrokerUnavailable("the broker (Redis) refused the request")
        except (RedisError, OSError) as exc:  # only this request failed to go out
            self._unreachable(exc)
            return cannot_reach()
        finally:
            if not isinstance(added, bytes):  # not added (an entry id is bytes): no reply comes
                self._waiting.discard(request_id)
        if isinstance(added, bytes):
            note = self.admission.note(served_id, task, lane)
            self._waiting.sent(request_id, Entry(stream, added, fields, item.deadline, note))
        if not isinstance(added, bytes):  # not added: refused
            return self.admission.refusal(added, lane)
        return await self._reply(item, request_id, future, stream, added)

    async def _reply(
        self,
        item: BatchItem[ImageJob],
        request_id: str,
        future: asyncio.Future[object],
        stream: str,
        entry_id: bytes,
    ) -> object:
        """The item's result or error; after its deadline (the caller has had its 504),
        forget it: a reply that still comes is dropped. If its caller goes away first (the
        Streamer cancels this), the entry leaves the stream: unread, it is never computed."""
        sent = time.monotonic()
        timeout = None if item.deadline is None else max(0.0, item.deadline - sent)
        try:
            if timeout is not None and timeout > NOTICE_S:
                # One held through a failover is told so just before its deadline (503), not
                # with the Streamer's plain 504 at it.
                with contextlib.suppress(TimeoutError):
                    async with asyncio.timeout(timeout - NOTICE_S):
                        return await asyncio.shield(future)
                if self._failover.disturbed_since(sent):
                    raise self._failover.too_late()
            # Up to its deadline and a second more, from when it was sent.
            left = None if timeout is None else max(0.0, sent + timeout + 1.0 - time.monotonic())
            async with asyncio.timeout(left):
                return await asyncio.shield(future)
        except TimeoutError:
            self._forget(request_id, stream, entry_id)  # stale: a worker that reads it drops it
            return BrokerUnavailable("no reply came before the deadline")
        except ServerError as exc:
            # A worker's error (it has deleted the entry: this delete finds nothing), or this
            # front end's (the version moved, Redis lost): the entry must not wait on.
            self._forget(request_id, stream, entry_id)
            return exc
        except asyncio.CancelledError:
            self._forget(request_id, stream, entry_id)
            raise
        finally:
            self._waiting.discard(request_id)

    def _forget(self, request_id: str, stream: str, entry_id: bytes) -> None:
        """Delete an entry nobody waits for (in the background: its caller has gone): the
        one it was sent again as after a failover, if it was."""
        if self._redis is None:
            return
        entry = self._waiting.entry(request_id)
        if entry is not None:
            stream, entry_id = entry.stream, entry.entry_id
        self._deletes.later(stream, entry_id)

    # -- replies -----------------------------------------------------------------------------

    async def _read_replies(self) -> None:
        """The reply reader: its failures back off (``BACKOFF``), and what waits meanwhile
        is the failover policy's (``app.broker.front.failover``)."""
        key = self.keys.replies(self.frontend)
        failures = 0
        while not self.monitor.closing:
            assert self._reader is not None
            try:
                if self._failover.due():
                    await self._failover.recheck(self._reader, key, self._waiting.deliver)
                popped = await self._reader.blmpop(
                    REPLY_BLOCK_S, 1, key, direction="LEFT", count=512
                )
            except (RedisError, OSError) as exc:
                self._unreachable(exc)
                self._failover.lost(exc)
                failures += 1
                await asyncio.sleep(BACKOFF.compute(failures))
                continue
            if failures:  # Redis is back: a look now, not at the next second's
                self._background.start(self.monitor.look_again())
            failures = 0
            self._failover.reached()
            if popped:
                for raw in popped[1]:
                    self._waiting.deliver(raw)

    def _unreachable(self, exc: BaseException) -> None:
        self.monitor.unreachable(exc)
