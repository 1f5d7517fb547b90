"""The response cache as the services use it: an answer kept in this process, then in the
shared Redis, else computed once however many identical requests are in flight."""

from __future__ import annotations

import asyncio
import time
from collections.abc import Awaitable, Callable, Hashable
from dataclasses import dataclass, field
from enum import StrEnum
from typing import TYPE_CHECKING

from app.answers import BytesLRU, SharedAnswer, frozen
from app.errors import IMAGE_ERROR_TYPES, DeadlineExceeded, ServerError

if TYPE_CHECKING:  # redis is imported only where a shared cache is asked for
    from app.cache.shared import SharedCache


class Outcome(StrEnum):
    """How the cache answered one image (``microbatch_cache_images_total``'s label)."""

    HIT = "hit"  # kept in this process
    SHARED_HIT = "shared_hit"  # kept in the shared Redis
    COALESCED = "coalesced"  # an identical request in flight computed it
    MISS = "miss"  # computed for this request
    FRESH = "fresh"  # computed, as ``Cache-Control: no-cache`` asked


# What X-Cache says of a request, from its images' outcomes: a miss if any image was
# computed for it, else coalesced if any waited on another's computation, else a hit.
_HEADER = {
    Outcome.HIT: "hit",
    Outcome.SHARED_HIT: "hit",
    Outcome.COALESCED: "coalesced",
    Outcome.MISS: "miss",
    Outcome.FRESH: "miss",
}


@dataclass
class CacheUse:
    """One request's use of the cache: whether it asked for a fresh answer
    (``Cache-Control: no-cache``), and how each of its images was answered."""

    fresh: bool = False
    outcomes: list[Outcome] = field(default_factory=list)

    @classmethod
    def asked(cls, cache_control: str | None) -> CacheUse:
        """The use a ``Cache-Control`` request header (or gRPC metadata) asks: afresh for
        ``no-cache`` or ``max-age=0``.

        >>> CacheUse.asked("no-cache").fresh, CacheUse.asked("Max-Age=0, x").fresh
        (True, True)
        >>> CacheUse.asked("max-age=60").fresh, CacheUse.asked(None).fresh
        (False, False)
        """
        if not cache_control:
            return cls()
        said = {part.strip().lower().replace(" ", "") for part in cache_control.split(",")}
        return cls(fresh=bool(said & {"no-cache", "max-age=0"}))

    @property
    def header(self) -> str | None:
        """``X-Cache``: ``hit``, ``coalesced`` or ``miss`` (None before any image).

        >>> CacheUse(outcomes=[Outcome.HIT, Outcome.COALESCED]).header
        'coalesced'
        """
        said = {_HEADER[outcome] for outcome in self.outcomes}
        for answer in ("miss", "coalesced", "hit"):
            if answer in said:
                return answer
        return None


@dataclass(frozen=True)
class _Flight:
    """A computation in flight for a key: what it leaves its followers, where it queues
    (its priority ``level``, 0 the most urgent, and its ``tenant``'s turn), and until when
    it may wait there before its level delays or refuses it (``until``: monotonic; None:
    no bound but its deadline)."""

    landed: asyncio.Future[_Landed]
    level: int
    until: float | None

    @property
    def waited_out(self) -> bool:
        """Whether it has waited its level's time: delayed behind everything, or refused."""
        return self.until is not None and time.monotonic() >= self.until

    def takes(self, level: int) -> bool:
        """Whether a request of its tenant at ``level`` may wait on it: it queues no worse
        than that request would (as urgent or more) and has not outwaited its level."""
        return level >= self.level and not self.waited_out


@dataclass(frozen=True)
class _Landed:
    """What a computation left its followers: its answer, or the error to share (the
    image's own: the same bytes fail the same way), or neither (it timed out, was refused
    or cancelled: each follower then computes for itself, within its own deadline)."""

    answer: object = None
    error: ServerError | None = None


class ResponseCache:
    """``answer(key, compute, use)``: the answer kept under ``key``, in this process
    (``max_bytes``, 0 for none) or ``shared``; else the answer of the computation already in
    flight for ``key`` (single-flight: it shares that request's batch slot); else
    ``compute()``'s, kept in both. Errors are never kept. ``on_outcome`` hears each image's
    ``Outcome``, ``on_evict`` each answer this process's share let go.

    A request waits on an identical one in flight until its own ``deadline`` at most (then
    ``DeadlineExceeded``, as it would queued), and only on one that queues no worse than it
    would: as urgent or more (a lower priority ``level`` may wait long in the queue), in
    its own ``tenant``'s turn (another's backlog would make it wait for that tenant's
    share), and within the level's ``patience_s`` (its queue timeout, past which the first
    is delayed behind everything or refused); else it computes alone.

    >>> # cache = ResponseCache(64 << 20, shared=None)
    >>> # vector = await cache.answer(cache_key(...), lambda: streamer.submit(...), CacheUse())
    """

    def __init__(
        self,
        max_bytes: int,
        shared: SharedCache | None = None,
        on_outcome: Callable[[Outcome], None] = lambda outcome: None,
        on_evict: Callable[[], None] = lambda: None,
    ) -> None:
        self.memory = BytesLRU(max_bytes, on_evict) if max_bytes > 0 else None
        self.shared = shared
        self._on_outcome = on_outcome
        # (key, tenant) -> its computation in flight: a tenant waits in its own turn only.
        self._flights: dict[tuple[bytes, Hashable], _Flight] = {}

    async def answer(
        self,
        key: bytes,
        compute: Callable[[], Awaitable[object]],
        use: CacheUse | None,
        *,
        deadline: float | None = None,
        level: int = 0,
        tenant: Hashable = None,
        patience_s: float | None = None,
    ) -> object:
        """``key``'s answer (see the class); ``deadline``: ``time.monotonic()``'s, if any;
        ``level`` and ``tenant``: where ``compute`` queues; ``patience_s``: its level's
        queue timeout, if any."""
        fresh = use is not None and use.fresh
        while not fresh:
            kept = self.memory.get(key) if self.memory is not None else None
            if kept is not None:
                return self._told(use, Outcome.HIT, kept)
            flight = self._flights.get((key, tenant))
            if flight is None or not flight.takes(level):  # none, or worse: alone
                break
            landed = await _waited(flight, deadline)
            if landed.error is not None:
                raise type(landed.error)(landed.error.message)  # each caller its own
            if landed.answer is not None:
                return self._told(use, Outcome.COALESCED, landed.answer)
            # It came to nothing (a timeout, a cancel, its level's wait): look again.
        until = None if patience_s is None else time.monotonic() + patience_s
        lead = _Flight(asyncio.get_running_loop().create_future(), level, until)
        return await self._lead((key, tenant), compute, use, fresh, lead)

    async def _lead(
        self,
        place: tuple[bytes, Hashable],
        compute: Callable[[], Awaitable[object]],
        use: CacheUse | None,
        fresh: bool,
        lead: _Flight,
    ) -> object:
        """Compute the answer of ``place``'s key (first asking the shared tier, unless
        ``fresh``), with every identical request of its tenant that comes meanwhile waiting
        on it (``lead``: where it queues)."""
        key = place[0]
        flight: _Flight | None = None
        there = self._flights.get(place)
        if there is None or there.waited_out:  # else a fresh or more urgent one: alone
            flight = self._flights[place] = lead
        landed = _Landed()
        try:
            if not fresh and self.shared is not None:
                kept = await self.shared.get(key)
                if kept is not None:
                    kept = frozen(kept)
                    landed = _Landed(kept)
                    if self.memory is not None:
                        self.memory.put(key, kept)
                    return self._told(use, Outcome.SHARED_HIT, kept)
            try:
                got = await compute()
            except IMAGE_ERROR_TYPES as exc:  # the bytes' own, the same for all: shared
                landed = _Landed(error=exc)  # (a timeout, a refusal, a cancel: its own)
                raise
            outcome = Outcome.FRESH if fresh else Outcome.MISS
            if isinstance(got, SharedAnswer):  # a worker computed it for an identical one
                got, outcome = got.answer, Outcome.COALESCED
            computed = frozen(got)
            landed = _Landed(computed)
            if self.memory is not None:
                self.memory.put(key, computed)
            if self.shared is not None:
                self.shared.put(key, computed)
            return self._told(use, outcome, computed)
        finally:
            if flight is not None:
                if self._flights.get(place) is flight:
                    del self._flights[place]
                flight.landed.set_result(landed)

    def _told(self, use: CacheUse | None, outcome: Outcome, answer: object) -> object:
        if use is not None:
            use.outcomes.append(outcome)
        self._on_outcome(outcome)
        return answer

    @property
    def in_flight(self) -> int:
        """Answers being computed now, each for one request or more of one tenant."""
        return len(self._flights)

    async def aclose(self) -> None:
        if self.shared is not None:
            await self.shared.aclose()


async def _waited(flight: _Flight, deadline: float | None) -> _Landed:
    """What ``flight`` leaves, waited for until ``deadline`` at most (the computation goes
    on for the others: shielded), or until it has waited its level's time (nothing: the
    follower then queues for itself, no longer behind it)."""
    ends = [t for t in (deadline, flight.until) if t is not None]
    if not ends:
        return await asyncio.shield(flight.landed)
    try:
        return await asyncio.wait_for(
            asyncio.shield(flight.landed), max(0.0, min(ends) - time.monotonic())
        )
    except TimeoutError:
        if deadline is None or time.monotonic() < deadline:
            return _Landed()
        raise DeadlineExceeded(
            "no result by the request's deadline: an identical request was still computing it"
        ) from None
