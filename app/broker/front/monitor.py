"""A broker front end's look at Redis, every second (and sooner when a request or an admin
call asks): is Redis there (the same instance as before), which workers live
(``app.broker.wire.live``), how full the shared streams are, what the admin route chose
(``app.broker.wire.control``), and so which version each model name serves
(``app.lifecycle.routes``). Its ``view`` is what the front end's models follow, its
readiness and ``/info`` read, and what the admin routes wait on; ``pin`` is how they ask.

Scaling from zero (``MB_SCALE_FROM_ZERO``), a name no live worker serves keeps a route: the
one it had here, else the one front ends keep in Redis (``Keys.routes``, written from what
live workers gave), else the version this front end's own repository chooses; requests for
it queue, and their lag starts workers.
"""

from __future__ import annotations

import asyncio
import logging
import math
import time
from collections.abc import Callable, Mapping, Sequence
from typing import TYPE_CHECKING, Any

import redis.asyncio as aioredis
from redis.exceptions import RedisError, ResponseError

from app.background import Background
from app.batching import ClusterView
from app.broker.front.pins import KnownPins
from app.broker.front.routes import decode_routes, encode_route
from app.broker.wire.connect import drop_idle_async, follow_primary_async
from app.broker.wire.control import SEQ, bump, decode_pins, later, restore_pins, set_pin
from app.broker.wire.heartbeat import WorkerInfo
from app.broker.wire.keys import Keys
from app.broker.wire.live import LiveWorkers
from app.broker.wire.parsing import text
from app.errors import BrokerUnavailable
from app.lifecycle import UNLOADED, AdminPin, Route, VersionState, routes
from app.lifecycle.keeper import export_of

if TYPE_CHECKING:
    from app.repository import Repository

log = logging.getLogger("app.broker.transport")

MONITOR_S = 1.0
LOOK_AGAIN_S = 0.2  # a caller that needs a fresh look gets one at most this often


def cannot_reach(cause: BaseException | None = None) -> BrokerUnavailable:
    """503 ``broker_unavailable``, Retry-After 1 s: Redis cannot be reached (``cause``, when
    known, says why)."""
    detail = f": {cause}" if cause is not None else ""
    return BrokerUnavailable(f"the broker (Redis) cannot be reached{detail}", retry_after_s=1)


class Monitor:
    """The front end's look at Redis (see the module's docstring), and its
    ``VersionControl`` for the admin routes.

    >>> # monitor = Monitor(keys, switch_min_workers=None, on_view=models.follow)
    >>> # await monitor.look(client); monitor.view.routes; await monitor.pin("tagger", 3)
    """

    def __init__(
        self,
        keys: Keys,
        *,
        switch_min_workers: int | None = None,
        scale_from_zero: bool = False,
        own_routes: Mapping[str, Route] | None = None,
        on_workers: Callable[[Sequence[WorkerInfo]], None] | None = None,
        on_restart: Callable[[], None] | None = None,
        after_look: Callable[[], None] | None = None,
    ) -> None:
        self.keys = keys
        self.switch_min_workers = switch_min_workers
        self.scale_from_zero = scale_from_zero
        self._own_routes = dict(own_routes or {})
        self._on_workers = on_workers  # each look: the live workers' heartbeats
        self._on_view: Callable[[ClusterView], None] | None = None  # each look (attach)
        self._on_restart = on_restart  # Redis came back empty: waiting requests are lost
        self._after_look = after_look  # each look that reached Redis
        self._live = LiveWorkers(keys)
        self.client: aioredis.Redis | None = None
        # The admin routes' writes (the pins) go through this one where it is set
        # (MB_BROKER_ADMIN: a Redis user allowed to), else through ``client``.
        self.admin: aioredis.Redis | None = None
        self.clients: list[aioredis.Redis] = []  # every client of the front end's
        self._dropping = Background()
        self.connected = False
        self.workers: list[WorkerInfo] = []
        self.routes: dict[str, Route] = {}
        self.pins: dict[str, AdminPin] = {}
        # The pins as last seen and written: written again where a failover (or a restart)
        # lost them.
        self._known = KnownPins()
        self.queue_depth = 0  # entries in the routed versions' streams at the last look
        # The lanes (``app.broker.wire.lanes``) of each routed version at the last look.
        self.lanes: dict[str, tuple[str, ...]] = {}
        self.rate = 0.0  # images/s the workers answered, lately (for Retry-After)
        self._derived: dict[str, Route] = {}  # the routes the live workers' heartbeats give
        self._last_routes: dict[str, Route] = {}  # the routes hash in Redis, at the last look
        self._run_id: str | None = None
        self._last_items: tuple[float, int] | None = None
        self._looked_at = -math.inf  # monotonic time the last look ended
        self._looking: asyncio.Task[None] | None = None
        self.closing = False

    # -- what it saw -------------------------------------------------------------------------

    @property
    def view(self) -> ClusterView:
        return ClusterView(tuple(self.workers), dict(self.routes), dict(self.pins), self.queued)

    @property
    def queued(self) -> frozenset[str]:
        """Scaling from zero, the served ids the names route to: their requests queue for
        workers to come, held or not (their deadline bounds the wait)."""
        return frozenset(r.served_id for r in self.routes.values() if self.scale_from_zero)

    def counted(self, served_id: str) -> tuple[str, ...]:
        """A version's streams, one per task, and its lanes known at the last look."""
        return self.keys.streams(served_id) + self.lanes.get(served_id, ())

    def served(self, served_id: str, *, new: bool = False) -> bool:
        """Whether a live worker reads ``served_id``'s streams, or is loading its export (a
        worker restarted after dying starts holding nothing: it reads them once loaded, and
        takes back what its last life left pending). For a ``new`` request, a worker told to
        stop (draining) does not count: it finishes what it holds and takes nothing new, and
        front ends stop routing to it at once (readiness says the same)."""
        export = export_of(served_id)
        return any(
            worker.holds(served_id)
            or any(
                m.state is VersionState.LOADING and export_of(m.served_id) == export
                for m in worker.models
            )
            for worker in self.workers
            if not (new and worker.draining)
        )

    def retry_after(self, waiting: int) -> float:
        return float(max(1, math.ceil(waiting / self.rate))) if self.rate > 0 else 2.0

    def unreachable(self, exc: BaseException) -> None:
        """A command failed to reach Redis: new requests are refused at once until the
        next look reaches it again; at the first failure, the idle connections of every
        client of this front end are closed (``drop_idle``)."""
        if self.connected:
            log.error("broker: Redis unreachable (%s)", exc)
            for client in self.clients:
                self._dropping.start(drop_idle_async(client))
        self.connected = False

    # -- the admin routes' control -----------------------------------------------------------

    def attach(
        self,
        repository: Repository,
        dtype: str,
        on_view: Callable[[ClusterView], None],
        in_use: Callable[[str], bool],
    ) -> None:
        """Who hears each look's view (the workers read the repository themselves, and
        drain a version by its streams)."""
        self._on_view = on_view

    async def pin(self, name: str, pin: AdminPin | None) -> int:
        """Set what the admin route chose for ``name`` (None: clear it), and have every
        worker act on it (``app.broker.wire.control``); the request's number, which each
        worker's heartbeat says it acted on (``aimed``)."""
        if self.client is None:
            raise cannot_reach()
        try:
            asked, raw = await set_pin(self.admin or self.client, self.keys, name, pin)
        except (RedisError, OSError) as exc:
            raise self._admin_failed(exc) from exc
        self._known.wrote(name, raw, asked)
        self.pins = (
            {**self.pins, name: pin}
            if pin is not None
            else {n: p for n, p in self.pins.items() if n != name}
        )
        return asked

    async def reload(self, *, explicit: bool) -> int:
        """``explicit`` (SIGHUP on a front end): every worker of the fleet reads the
        repository again and retries what failed. A poll is the workers' own
        (``MB_REPOSITORY_POLL_S`` where they run): nothing to ask."""
        if not explicit or self.client is None:
            return 0
        try:
            asked = await bump(self.admin or self.client, self.keys)
        except (RedisError, OSError) as exc:
            raise self._admin_failed(exc) from exc
        self._known.asked(asked)
        return asked

    def _admin_failed(self, exc: BaseException) -> BrokerUnavailable:
        """What an admin write that failed says: Redis refused it (its user may not write
        the pins: a configuration to fix, and the broker still serves), or cannot be
        reached (refused at once until the next look reaches it)."""
        if isinstance(exc, ResponseError):
            return BrokerUnavailable(
                f"the broker (Redis) refused to write the pins ({str(exc)[:200]}): give the "
                "admin routes a Redis user allowed to, with MB_BROKER_ADMIN",
                retry_after_s=60,
            )
        self.unreachable(exc)
        return cannot_reach(exc)

    async def refresh(self) -> None:
        await self.look_again()

    # -- looking -----------------------------------------------------------------------------

    async def run(self) -> None:
        """Look every ``MONITOR_S`` until closing."""
        while not self.closing:
            await asyncio.sleep(MONITOR_S)
            if not self.closing:
                await self.look_safely()

    async def look_safely(self) -> None:
        try:
            await self.look()
        except Exception:  # a bug must not freeze readiness: log it, look again
            log.exception("broker: looking at Redis failed")

    async def look_again(self) -> None:
        """Look at Redis now rather than trust the last look (up to a second old: a front
        end that just started, or whose workers just came back, would refuse for that
        long). Looks are at least ``LOOK_AGAIN_S`` apart (a flood of callers must not become
        a flood of looks), and concurrent callers share one."""
        if self._looking is None:
            delay = self._looked_at + LOOK_AGAIN_S - time.monotonic()
            self._looking = asyncio.create_task(self._look_after(delay), name="broker-look")
            self._looking.add_done_callback(lambda _: setattr(self, "_looking", None))
        await asyncio.shield(self._looking)

    async def _look_after(self, delay_s: float) -> None:
        if delay_s > 0:
            await asyncio.sleep(delay_s)
        await self.look_safely()

    async def aclose(self) -> None:
        self.closing = True
        if self._looking is not None:
            self._looking.cancel()
            await asyncio.gather(self._looking, return_exceptions=True)

    async def look(self) -> None:
        """One look at Redis, in one round trip."""
        assert self.client is not None
        self._looked_at = time.monotonic()
        routed = sorted({route.served_id for route in self.routes.values()})
        counted = [stream for served_id in routed for stream in self.counted(served_id)]
        try:
            for client in self.clients:  # behind Sentinel: the primary it names now
                await follow_primary_async(client)
            async with self.client.pipeline(transaction=False) as pipe:
                pipe.info("server")
                pipe.hgetall(self.keys.pins)
                pipe.hget(self.keys.pins_seq, SEQ)
                for stream in counted:
                    pipe.xlen(stream)
                for served_id in routed:
                    pipe.hkeys(self.keys.lanes(served_id))
                if self.scale_from_zero:
                    pipe.hgetall(self.keys.routes)
                self._live.queue(pipe)
                answers = await pipe.execute()
        except (RedisError, OSError) as exc:
            self.unreachable(exc)
            return
        run_id = answers[0].get("run_id")
        other = self._run_id is not None and run_id != self._run_id
        if other and self._on_restart:
            self._on_restart()  # another Redis (failed over, restarted): entries may be lost
        self._run_id = run_id
        if not self.connected:
            log.info("broker: connected to Redis")
        self.connected = True
        if other:
            self._known.lost()
        self._known.seen(answers[1], int(answers[2] or 0))
        self.pins = decode_pins(answers[1])
        if self._known.restoring:
            await self._restore_pins(answers[1])
        self.queue_depth = sum(answers[3 : 3 + len(counted)])
        lanes = answers[3 + len(counted) : 3 + len(counted) + len(routed)]
        self.lanes = {
            served_id: self.keys.lanes_of(served_id, (text(name) for name in names))
            for served_id, names in zip(routed, lanes, strict=True)
        }
        if self.scale_from_zero:
            self._last_routes = decode_routes(answers[-2])
        live = self._live.parse(answers[-1])
        for problem in live.malformed:
            log.error("broker: ignored a worker's heartbeat: %s", problem)
        self.workers = list(live.workers)
        self._update_rate(time.monotonic(), sum(w.items for w in self.workers))
        self._route()
        if self.scale_from_zero and any(
            self._last_routes.get(n) != r for n, r in self._derived.items()
        ):
            await self._remember_routes()
        if self._on_workers is not None:
            self._on_workers(self.workers)
        if self._after_look is not None:
            self._after_look()
        if self._on_view is not None:
            self._on_view(self.view)

    async def _restore_pins(self, there: Mapping[Any, Any]) -> None:
        """Another Redis answers, whose pins are ``there``: those it lacks, or has older
        than this front end knew them, are written again (``KnownPins``), so a rollout asked
        before it completes after it."""
        assert self.client is not None
        fields = self._known.fields()
        try:
            seq, wrote = await restore_pins(
                self.admin or self.client, self.keys, fields, self._known.seq
            )
        except (RedisError, OSError) as exc:  # tried again at the next look
            log.error("broker: could not write the lost pins again: %s", exc)
            return
        if wrote:
            log.warning("broker: Redis lost pins the fleet had; written again (%d of %s)",
                        wrote, ", ".join(fields) or "none")  # fmt: skip
        self._known.restored(seq)
        self.pins = decode_pins(later({text(n): text(raw) for n, raw in there.items()}, fields))

    def _route(self) -> None:
        """Which version each name serves now, by the heartbeats; a name the admin route
        unloaded serves none."""
        before = self.routes
        self._derived = routes(self.workers, self.switch_min_workers, sticky=before)
        chosen = dict(self._derived)
        if self.scale_from_zero:  # a name no worker serves yet keeps a route
            for name, kept in {**self._own_routes, **self._last_routes, **before}.items():
                chosen.setdefault(name, kept)
        self.routes = {n: r for n, r in chosen.items() if self.pins.get(n) != UNLOADED}

    async def _remember_routes(self) -> None:
        """Scaling from zero: the routes the live workers give (only those: never one kept
        from before), for every front end to route by while no worker is live, one started
        since included. A name no worker serves any more keeps its field: a front end
        serves only the names in its own repository."""
        assert self.client is not None
        fields: dict[Any, Any] = {  # (redis-py types the mapping invariantly)
            name: encode_route(r)
            for name, r in self._derived.items()
            if self._last_routes.get(name) != r
        }
        try:
            await self.client.hset(self.keys.routes, mapping=fields)
        except (RedisError, OSError) as exc:  # written again at the next look
            log.warning("broker: could not record the routes: %s", exc)
            return
        self._last_routes.update(self._derived)

    def _update_rate(self, now: float, items: int) -> None:
        if self._last_items is not None:
            then, before = self._last_items
            if now > then and items >= before:
                rate = (items - before) / (now - then)
                self.rate = rate if self.rate == 0 else 0.7 * self.rate + 0.3 * rate
        self._last_items = (now, items)
