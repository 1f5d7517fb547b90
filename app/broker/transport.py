"""A front end's side of broker mode: a ``Transport`` that passes each request straight to a
Redis stream and waits for its reply. Batches form in the workers (``app.broker.consumer``),
across every front end.

Per front-end process: one id (``frontend``), one reply list read by one asyncio task, and
one monitor task that reads the workers' heartbeats and the shared queue's depth every
second (readiness, ``/info``, metrics), and from the heartbeats which version each model
name serves (``app.broker.routing``; ``on_routes`` hears it). A request goes to the streams of
the version it was admitted for (``BatchKey.model``). No torch, no model weights.

Failure rules: a request is refused with 503 ``broker_unavailable`` while Redis cannot be
reached, and every request waiting for a reply fails the same way the moment the reply
reader loses Redis (the entry or its reply may be gone). It is refused with 503
``worker_died`` while no worker has sent a heartbeat recently (by a look at Redis at most
``LOOK_AGAIN_S`` older than the request, not the monitor's last), and with 503 ``queue_full``
when the shared streams hold ``max_queue`` entries (checked and added in one script, so the
bound holds across front ends, and across every model served).
"""

from __future__ import annotations

import asyncio
import contextlib
import itertools
import logging
import math
import time
import uuid
from collections.abc import Callable, Hashable, Mapping, Sequence
from typing import Any

import redis.asyncio as aioredis
from redis.asyncio.retry import Retry
from redis.backoff import NoBackoff
from redis.exceptions import RedisError, ResponseError

from app.batching import BatchItem, HeldModel, QueueBacklog, WorkerStatus
from app.broker.backlog import count_backlog
from app.broker.keys import STALE_S, Keys
from app.broker.routing import routes
from app.broker.wire import (
    MalformedMessage,
    WorkerInfo,
    decode_reply,
    decode_routes,
    decode_worker_info,
    encode_request,
    encode_route,
    text,
)
from app.errors import (
    BrokerUnavailable,
    NotReady,
    QueueFull,
    ServerError,
    WorkerDied,
)
from app.jobs import BatchKey, ImageJob, Task
from app.repository import Route

log = logging.getLogger(__name__)

MONITOR_S = 1.0
LOOK_AGAIN_S = 0.2  # a request that finds no worker looks at Redis itself, at most this often
REPLY_BLOCK_S = 1.0  # how long one read of the reply list blocks
RECONNECT_S = 0.5
NO_DEADLINE_MS = 3_600_000  # what a request without a deadline tells the workers
# Add one request to KEYS[ARGV[1]] unless the streams in KEYS (every served version's) already
# hold ARGV[2] entries (those waiting and those being computed): one round trip, and the
# bound holds across every front end.
ADMIT = """
local held = 0
for i = 1, #KEYS do held = held + redis.call('XLEN', KEYS[i]) end
if held >= tonumber(ARGV[2]) then return held end
return redis.call('XADD', KEYS[tonumber(ARGV[1])], '*', 'h', ARGV[3], 'img', ARGV[4])
"""


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
        on_routes: Callable[[dict[str, Route]], None] | None = None,
        scale_from_zero: bool = False,
        own_routes: Mapping[str, Route] | None = None,
    ) -> None:
        self.keys = Keys(prefix)
        self.max_queue = max_queue
        self.switch_min_workers = switch_min_workers
        # Scaling from zero, what a name routes to while no worker serves it: the route it had
        # here, else the one front ends keep in Redis, else the version this front end's own
        # repository chooses (so a front end is ready, and queues, before any worker ran).
        self.scale_from_zero = scale_from_zero
        self._own_routes = dict(own_routes or {})
        self._last_routes: dict[str, Route] = {}  # the routes hash in Redis, at the last look
        self._derived: dict[str, Route] = {}  # the routes the live workers' heartbeats give
        self._on_routes = on_routes  # each monitor round: the version each name serves
        self.routes: dict[str, Route] = {}
        self._names: dict[str, str] = {}  # served id -> its model's name, as heartbeats say
        self.frontend = uuid.uuid4().hex[:16]
        self._url = url
        self._on_workers = on_workers  # each monitor round: the live workers' heartbeats
        self._redis: aioredis.Redis | None = None
        self._reader: aioredis.Redis | None = None
        self._admit: Any = None
        self._ids = itertools.count()
        self._pending: dict[str, asyncio.Future[object]] = {}
        self._pending_model: dict[str, str] = {}  # request id -> the served id it went to
        self._tasks: list[asyncio.Task[None]] = []
        self._background: set[asyncio.Task[None]] = set()
        self._connected = False
        self._closing = False  # aclose() began: the reader and the monitor end their loops
        self._run_id: str | None = None
        self._workers: list[WorkerInfo] = []
        self._queue_depth = 0
        self._rate = 0.0  # images/s the workers answered, lately (for Retry-After)
        self._last_items: tuple[float, int] | None = None
        self._looked_at = -math.inf  # monotonic time the last look ended
        self._looking: asyncio.Task[None] | None = None

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
    def ready(self) -> bool:
        """Connected, and a worker is live; or, scaling from zero, a route is known (the
        requests queue, and their lag starts workers)."""
        waits = self.scale_from_zero and bool(self.routes)
        return self._connected and (bool(self._workers) or waits)

    @property
    def shared_queue_depth(self) -> int:
        """Entries in the shared streams at the last look (waiting or being computed)."""
        return self._queue_depth

    def worker_status(self) -> list[WorkerStatus]:
        """The workers that sent a heartbeat lately, as they describe themselves."""
        return [
            WorkerStatus(
                index=w.index, device=w.device, threads=w.threads, pid=w.pid, ready=w.ready,
                alive=w.alive, batch_size=w.batch_size, batches=w.batches, items=w.items,
                rss_bytes=w.rss_bytes, restarts=w.restarts, name=w.name, host=w.host,
                runtime=w.runtime,
                models=tuple(
                    HeldModel(
                        m.served_id, m.state.value, m.runtime, m.batch_size, m.memory_bytes,
                        m.reason,
                    )
                    for m in w.models
                ),
            )
            for w in self._workers
        ]  # fmt: skip

    # -- lifecycle ---------------------------------------------------------------------------

    async def start(self) -> None:
        """Connect (or keep trying in the background: Redis may come up later)."""
        # No retries inside the client: a request fails fast while Redis is away (503), and
        # the reader and the monitor keep trying on their own.
        once = Retry(NoBackoff(), 0)
        self._redis = aioredis.Redis.from_url(
            self._url, socket_timeout=5, socket_connect_timeout=2, retry=once
        )
        self._reader = aioredis.Redis.from_url(
            self._url, socket_timeout=REPLY_BLOCK_S + 5, socket_connect_timeout=2, retry=once
        )
        self._admit = self._redis.register_script(ADMIT)
        await self._look()
        self._tasks = [
            asyncio.create_task(self._read_replies(), name="broker-replies"),
            asyncio.create_task(self._monitor(), name="broker-monitor"),
        ]
        if not self._connected:
            log.warning("broker: Redis is not reachable yet; requests get 503 until it is")

    async def aclose(self) -> None:
        """Stop the reader and the monitor, fail what waits, close the clients. The loops
        also end by themselves once ``_closing`` is set: a cancellation that the Redis client
        swallows (mid-command) must not leave one running, and this waiting forever."""
        self._closing = True
        tasks = [*self._tasks, *([self._looking] if self._looking else [])]
        for task in tasks:
            task.cancel()
        if tasks:
            _, running = await asyncio.wait(tasks, timeout=REPLY_BLOCK_S + 5)
            for task in running:
                log.error("broker: %s did not stop; leaving it", task.get_name())
        self._tasks = []
        self._fail_pending(NotReady("server is shutting down"))
        for client in (self._redis, self._reader):
            if client is not None:
                with contextlib.suppress(RedisError, OSError):
                    if self._connected and client is self._redis:
                        await client.delete(self.keys.replies(self.frontend))
                await client.aclose()
        self._redis = self._reader = None
        self._connected = False

    # -- running batches ---------------------------------------------------------------------

    async def run_batch(
        self, key: Hashable, items: Sequence[BatchItem[ImageJob]]
    ) -> Mapping[int, Any]:
        """Add each item to its task's stream and wait for its reply (or its deadline).
        The Streamer passes one item at a time: batches form in the workers."""
        assert isinstance(key, BatchKey) and key.encoded, "broker mode sends uploads encoded"
        if not self._connected or self._redis is None:
            raise BrokerUnavailable("the broker (Redis) cannot be reached", retry_after_s=1)
        if not self._served(key.model):
            await self._look_again()
            if not self._served(key.model) and not self._waits_for(key.model):
                raise WorkerDied(f"no live model worker holds {key.model}", retry_after_s=2)
        return {item.id: await self._one(key.model, key.task, item) for item in items}

    def _served(self, served_id: str) -> bool:
        return any(worker.holds(served_id) for worker in self._workers)

    def _waits_for(self, served_id: str) -> bool:
        """Scaling from zero, a request for a routed version no live worker holds yet
        queues for it (its deadline bounds the wait)."""
        return self.scale_from_zero and any(r.served_id == served_id for r in self.routes.values())

    async def backlog(self) -> QueueBacklog:
        """The work waiting for workers (``app.broker.backlog``), over the streams of every
        version a name routes to or a live worker holds: entries of any other version have
        nobody to compute them, and must not keep an autoscaler up. Raises
        ``BrokerUnavailable``."""
        if self._redis is None:
            raise BrokerUnavailable("the broker (Redis) cannot be reached", retry_after_s=1)
        held = {m.served_id for w in self._workers for m in w.models if w.holds(m.served_id)}
        served = held | {route.served_id for route in self.routes.values()}
        try:
            return await count_backlog(self._redis, self.keys, served)
        except (RedisError, OSError) as exc:
            raise BrokerUnavailable(
                f"the broker (Redis) cannot be reached: {exc}", retry_after_s=1
            ) from exc

    def _queue_streams(self, served_id: str) -> list[str]:
        """The streams the queue bound counts: every routed version's, and this one's."""
        ids = {route.served_id for route in self.routes.values()} | {served_id}
        return [stream for model in sorted(ids) for stream in self.keys.streams(model)]

    async def _one(self, served_id: str, task: Task, item: BatchItem[ImageJob]) -> object:
        """One request: admitted and added in one script call, then its reply."""
        assert self._redis is not None
        request_id = f"{self.frontend}-{next(self._ids)}"
        ttl_ms = NO_DEADLINE_MS
        if item.deadline is not None:
            ttl_ms = max(1, int(1000 * (item.deadline - time.monotonic())))
        image = item.payload.image
        assert isinstance(image, bytes)
        fields = encode_request(request_id, self.frontend, task, item.payload.top_k, ttl_ms, image)
        stream = self.keys.stream(served_id, task)
        counted = self._queue_streams(served_id)
        future: asyncio.Future[object] = asyncio.get_running_loop().create_future()
        self._pending[request_id] = future  # before the entry exists: a fast reply finds it
        self._pending_model[request_id] = served_id
        added: Any = None  # the entry id (bytes), or the queue depth (int) when full
        try:
            added = await self._admit(
                keys=counted,
                args=[counted.index(stream) + 1, self.max_queue, fields["h"], fields["img"]],
            )
        except ResponseError as exc:  # Redis answered, and refused (out of memory, say)
            log.error("broker: Redis refused a request: %s", exc)
            return BrokerUnavailable("the broker (Redis) refused the request")
        except (RedisError, OSError) as exc:  # only this request failed to go out
            self._unreachable(exc)
            return BrokerUnavailable("the broker (Redis) cannot be reached")
        finally:
            if not isinstance(added, bytes):  # not added (an entry id is bytes): no reply comes
                self._pending.pop(request_id, None)
                self._pending_model.pop(request_id, None)
        if isinstance(added, int):  # the streams held max_queue entries: not added
            return QueueFull(
                f"the shared queue is full ({added} waiting)",
                retry_after_s=self._retry_after(added),
            )
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
        timeout = None if item.deadline is None else max(0.0, item.deadline - time.monotonic())
        try:
            async with asyncio.timeout(None if timeout is None else timeout + 1.0):
                return await asyncio.shield(future)
        except TimeoutError:
            self._forget(stream, entry_id)  # stale: a worker that reads it drops it anyway
            return BrokerUnavailable("no reply came before the deadline")
        except ServerError as exc:
            # A worker's error (it has deleted the entry: this delete finds nothing), or this
            # front end's (the version moved, Redis lost): the entry must not wait on.
            self._forget(stream, entry_id)
            return exc
        except asyncio.CancelledError:
            self._forget(stream, entry_id)
            raise
        finally:
            self._pending.pop(request_id, None)
            self._pending_model.pop(request_id, None)

    def _forget(self, stream: str, entry_id: bytes) -> None:
        """Delete an entry nobody waits for (in the background: its caller has gone)."""
        if self._redis is None:
            return
        task = asyncio.get_running_loop().create_task(self._delete(stream, entry_id))
        self._background.add(task)
        task.add_done_callback(self._background.discard)

    async def _delete(self, stream: str, entry_id: bytes) -> None:
        assert self._redis is not None
        with contextlib.suppress(RedisError, OSError):
            await self._redis.xdel(stream, entry_id)

    def _retry_after(self, waiting: int) -> float:
        return float(max(1, math.ceil(waiting / self._rate))) if self._rate > 0 else 2.0

    # -- replies -----------------------------------------------------------------------------

    async def _read_replies(self) -> None:
        key = self.keys.replies(self.frontend)
        while not self._closing:
            assert self._reader is not None
            try:
                popped = await self._reader.blmpop(
                    REPLY_BLOCK_S, 1, key, direction="LEFT", count=512
                )
            except (RedisError, OSError) as exc:
                self._lost(exc)
                await asyncio.sleep(RECONNECT_S)
                continue
            if popped:
                for raw in popped[1]:
                    if isinstance(raw, bytes):
                        try:
                            self._deliver(raw)
                        except Exception:  # one bad reply must not stop the reader
                            log.exception("broker: delivering a reply failed")

    def _deliver(self, raw: bytes) -> None:
        try:
            reply = decode_reply(raw)
        except MalformedMessage as exc:
            log.error("broker: dropped a malformed reply (%s)", exc)
            return
        future = self._pending.get(reply.id)
        if future is None or future.done():
            return  # its caller gave up, or a duplicate after a reclaim
        if isinstance(reply.result, ServerError):
            future.set_exception(reply.result)
        else:
            future.set_result(reply.result)

    def _unreachable(self, exc: BaseException) -> None:
        """A command failed to reach Redis: new requests are refused at once until the
        monitor reaches it again; requests already waiting keep waiting for their replies."""
        if self._connected:
            log.error("broker: Redis unreachable (%s)", exc)
        self._connected = False

    def _lost(self, exc: BaseException) -> None:
        """The reply reader lost Redis: the replies of waiting requests may never come
        (Redis may be gone, or back empty), so every waiting request fails now."""
        if self._pending:
            waiting = len(self._pending)
            log.error("broker: lost Redis (%s); failing %d waiting request(s)", exc, waiting)
        self._unreachable(exc)
        self._fail_pending(BrokerUnavailable("lost the broker (Redis) while waiting"))

    def _fail_pending(self, error: ServerError, served_id: str | None = None) -> None:
        """Fail every waiting request (or those sent to ``served_id``) with ``error``."""
        failed = [
            request_id
            for request_id, model in self._pending_model.items()
            if served_id is None or model == served_id
        ]
        if served_id is None:
            failed = list(self._pending)
        for request_id in failed:
            future = self._pending.pop(request_id, None)
            self._pending_model.pop(request_id, None)
            if future is not None and not future.done():
                future.set_exception(error)

    # -- the workers and the queue, as Redis sees them ---------------------------------------

    async def _monitor(self) -> None:
        while not self._closing:
            await asyncio.sleep(MONITOR_S)
            if not self._closing:
                await self._look_safely()

    async def _look_safely(self) -> None:
        try:
            await self._look()
        except Exception:  # a bug must not freeze readiness: log it, look again
            log.exception("broker: looking at Redis failed")

    async def refresh(self) -> None:
        """Look at the workers (and so at which version each name serves) now, shared and
        throttled as ``_look_again`` is: for a request whose model no worker served at the
        last look."""
        await self._look_again()

    async def _look_again(self) -> None:
        """Look at Redis before refusing for want of a worker, rather than trust the monitor's
        last look (up to a second old: a front end that just started, or whose workers just
        came back, would refuse for that long). Looks are at least ``LOOK_AGAIN_S`` apart
        (a flood of refusals must not become a flood of looks), and concurrent callers share
        one."""
        if self._looking is None:
            delay = self._looked_at + LOOK_AGAIN_S - time.monotonic()
            self._looking = asyncio.create_task(self._look_after(delay), name="broker-look")
            self._looking.add_done_callback(lambda _: setattr(self, "_looking", None))
        await asyncio.shield(self._looking)

    async def _look_after(self, delay_s: float) -> None:
        if delay_s > 0:
            await asyncio.sleep(delay_s)
        await self._look_safely()

    async def _look(self) -> None:
        """One look at Redis: is it there (the same instance as before), which workers have
        sent a heartbeat lately, how full are the streams."""
        assert self._redis is not None
        self._looked_at = time.monotonic()
        counted = [
            stream
            for served_id in sorted({route.served_id for route in self.routes.values()})
            for stream in self.keys.streams(served_id)
        ]
        try:
            async with self._redis.pipeline(transaction=False) as pipe:
                pipe.time()
                pipe.info("server")
                for stream in counted:
                    pipe.xlen(stream)
                if self.scale_from_zero:
                    pipe.hgetall(self.keys.routes)
                answers = await pipe.execute()
            seconds, micros = answers[0]
            now_ms = seconds * 1000 + micros // 1000
            names = await self._redis.zrangebyscore(
                self.keys.heartbeats, now_ms - int(1000 * STALE_S), "+inf"
            )
            infos: list[Any] = []
            if names:
                infos = await self._redis.hmget(self.keys.worker_info, [text(n) for n in names])
        except (RedisError, OSError) as exc:
            self._unreachable(exc)
            return
        run_id = answers[1].get("run_id")
        if self._run_id is not None and run_id != self._run_id:
            # A different Redis (restarted): the entries of waiting requests are gone.
            self._fail_pending(BrokerUnavailable("the broker (Redis) restarted"))
        self._run_id = run_id
        if not self._connected:
            log.info("broker: connected to Redis (front end %s)", self.frontend)
        self._connected = True
        self._queue_depth = sum(answers[2 : 2 + len(counted)])
        if self.scale_from_zero:
            self._last_routes = decode_routes(answers[-1])
        workers = []
        for raw in infos:
            try:
                workers.append(decode_worker_info(raw))
            except MalformedMessage as exc:
                log.error("broker: ignored a worker's heartbeat: %s", str(exc)[:300])
        self._workers = sorted(workers, key=lambda w: w.name)
        self._update_rate(time.monotonic(), sum(w.items for w in workers))
        self._route()
        if self.scale_from_zero and any(
            self._last_routes.get(n) != r for n, r in self._derived.items()
        ):
            await self._remember_routes()
        if self._on_workers is not None:
            self._on_workers(self._workers)

    async def _remember_routes(self) -> None:
        """Scaling from zero: the routes the live workers give (only those: never one kept
        from before), for every front end to route by while no worker is live, one started
        since included. A name no worker serves any more keeps its field: a front end
        serves only the names in its own repository."""
        assert self._redis is not None
        fields: dict[Any, Any] = {  # (redis-py types the mapping invariantly)
            name: encode_route(r)
            for name, r in self._derived.items()
            if self._last_routes.get(name) != r
        }
        try:
            await self._redis.hset(self.keys.routes, mapping=fields)
        except (RedisError, OSError) as exc:  # written again at the next look
            log.warning("broker: could not record the routes: %s", exc)
            return
        self._last_routes.update(self._derived)

    def _route(self) -> None:
        """Which version each name serves now, by the heartbeats. Requests still waiting on
        a version whose name has moved to another, and that no live worker holds, fail now:
        nothing will compute them (after a proper drain there are none). While no worker
        serves a name at all (its only worker restarting), its requests wait for it."""
        before = self.routes
        self._derived = routes(self._workers, self.switch_min_workers, sticky=before)
        self.routes = dict(self._derived)
        if self.scale_from_zero:  # a name no worker serves yet keeps a route
            for name, kept in {**self._own_routes, **self._last_routes, **before}.items():
                self.routes.setdefault(name, kept)
        for model in (m for w in self._workers for m in w.models):
            self._names[model.served_id] = model.name
        moved = {
            served_id
            for served_id in set(self._pending_model.values())
            if (route := self.routes.get(self._names.get(served_id, ""))) is not None
            and route.served_id != served_id
            and not any(w.holds(served_id) for w in self._workers)
        }
        for served_id in moved:
            self._fail_pending(WorkerDied(f"no live worker holds {served_id} any more"), served_id)
        if self._on_routes is not None and self.routes:
            self._on_routes(dict(self.routes))

    def _update_rate(self, now: float, items: int) -> None:
        if self._last_items is not None:
            then, before = self._last_items
            if now > then and items >= before:
                rate = (items - before) / (now - then)
                self._rate = rate if self._rate == 0 else 0.7 * self._rate + 0.3 * rate
        self._last_items = (now, items)
