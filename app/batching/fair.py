"""The Streamer's queue: priority levels, and within a level the tenants in turn.

* **Priorities**: a batch is filled from the highest level first (level 0 is priority 1);
  slots left over go to the levels below, so a batch is never smaller for them.
* **Fair within a level**: deficit round-robin over the tenants with work queued. Each visit
  credits a tenant its ``weight`` (in images) and it gives as many images as its credit
  holds; credit left when a batch fills keeps its turn for the next batch; a tenant with
  nothing more of the batch's kind waiting loses its credit (as a DRR queue that empties).
  A tenant with 1,000 queued images gives its share of a batch, not the whole batch.
* **Delayed**: the extra last level holds items whose level's queue timeout passed under
  the ``delay`` policy: they run only when nothing else of their kind waits.

With one level and one tenant it is the plain FIFO it replaces, at the same cost.

>>> from types import SimpleNamespace as Item
>>> queue = FairQueue(levels=1)
>>> for tenant, n in (("bulk", 4), ("shop", 2)):
...     for i in range(n):
...         queue.append(Item(key="k", level=0, tenant=tenant, weight=1.0, name=f"{tenant}{i}"))
>>> [item.name for item in queue.take("k", 4, usable=lambda item: True)]
['bulk0', 'shop0', 'bulk1', 'shop1']
"""

from __future__ import annotations

from collections import deque
from collections.abc import Callable, Hashable, Iterator, Sequence
from dataclasses import dataclass
from typing import Generic, Literal, Protocol, TypeVar


@dataclass(frozen=True, slots=True)
class Ticket:
    """Who asks and how urgently: the queue orders an item by its ``level`` (0 is the
    highest priority), then its ``tenant``'s turn, weighted by ``weight``."""

    tenant: Hashable = None
    level: int = 0
    weight: float = 1.0


@dataclass(frozen=True, slots=True)
class LevelPolicy:
    """A priority level's queue, in Triton's terms: at most ``max_queue`` items (None: the
    Streamer's whole bound), each waiting at most ``timeout_s`` (None: its request's own
    deadline), then refused (``reject``) or run after everything else (``delay``). Its work
    joins a batch only while the batch holds fewer than ``max_batch`` (None: any size): a
    lower level's short batches keep the wait of higher work short, at some throughput."""

    max_queue: int | None = None
    timeout_s: float | None = None
    on_timeout: Literal["reject", "delay"] = "reject"
    max_batch: int | None = None


class Queued(Protocol):
    """What the queue reads of an item."""

    @property
    def key(self) -> Hashable: ...
    @property
    def level(self) -> int: ...
    @property
    def tenant(self) -> Hashable: ...
    @property
    def weight(self) -> float: ...


Q = TypeVar("Q", bound=Queued)


class _Level(Generic[Q]):
    __slots__ = ("deficit", "mid", "queues", "size")

    def __init__(self) -> None:
        self.queues: dict[Hashable, deque[Q]] = {}  # in turn order: the first goes next
        self.deficit: dict[Hashable, float] = {}
        self.mid: Hashable | None = None  # a tenant whose turn a full batch interrupted
        self.size = 0

    def rotate(self, tenant: Hashable) -> None:
        self.queues[tenant] = self.queues.pop(tenant)

    def drop(self, tenant: Hashable) -> None:
        del self.queues[tenant]
        self.deficit.pop(tenant, None)
        if self.mid == tenant:
            self.mid = None


class FairQueue(Generic[Q]):
    """Items by level, then by tenant; ``levels`` levels plus the delayed one."""

    def __init__(self, levels: int) -> None:
        if levels < 1:
            raise ValueError(f"levels must be >= 1, got {levels}")
        self._levels: list[_Level[Q]] = [_Level() for _ in range(levels + 1)]
        self.size = 0  # items queued (an attribute: read on every request)

    @property
    def delayed_level(self) -> int:
        return len(self._levels) - 1

    def __len__(self) -> int:
        return self.size

    def __iter__(self) -> Iterator[Q]:
        for level in self._levels:
            for queue in level.queues.values():
                yield from queue

    def count(self, level: int) -> int:
        return self._levels[level].size

    def append(self, item: Q) -> None:
        level = self._levels[item.level]
        queue = level.queues.get(item.tenant)
        if queue is None:
            queue = level.queues[item.tenant] = deque()
        queue.append(item)
        level.size += 1
        self.size += 1

    def remove(self, item: Q) -> bool:
        """Take ``item`` out (a caller that left); False if it is not queued."""
        level = self._levels[item.level]
        queue = level.queues.get(item.tenant)
        if queue is None:
            return False
        try:
            queue.remove(item)
        except ValueError:
            return False
        level.size -= 1
        self.size -= 1
        if not queue:
            level.drop(item.tenant)
        return True

    def head(self) -> Q | None:
        """The item that goes next: the highest level's next tenant's oldest."""
        for level in self._levels:
            if level.size:
                return next(iter(level.queues.values()))[0]
        return None

    def count_key(self, key: Hashable, limit: int) -> int:
        """Items of ``key`` queued, counted up to ``limit``."""
        count = 0
        for level in self._levels:
            if not level.size:
                continue
            for queue in level.queues.values():
                for item in queue:
                    if item.key == key:
                        count += 1
                        if count >= limit:
                            return count
        return count

    def newest_below(self, level: int) -> Q | None:
        """The newest item of the lowest level below ``level`` (delayed ones first): the one
        to refuse so that work of ``level`` can be queued."""
        for index in range(len(self._levels) - 1, level, -1):
            lower = self._levels[index]
            if lower.size:
                return max((queue[-1] for queue in lower.queues.values()), key=_newest)
        return None

    def heaviest(self, level: int, tenant: Hashable, weight: float = 1.0) -> Q | None:
        """The newest item of the tenant holding the most at ``level`` for its weight, if
        that is more than ``tenant`` would hold with one more: the one to refuse so that
        ``tenant``'s is queued (a full level is shared out, not first come first served)."""
        queues = self._levels[level].queues
        if not queues:
            return None
        name, queue = max(queues.items(), key=lambda pair: len(pair[1]) / pair[1][0].weight)
        own = len(queues.get(tenant, ()))
        if name != tenant and len(queue) / queue[0].weight > (own + 1) / weight:
            return queue[-1]
        return None

    def holds_most(self, level: int, tenant: Hashable, weight: float = 1.0) -> bool:
        """Whether ``tenant`` holds more at ``level``, for its weight, than any other tenant
        there (a full level is then its excess, not the server's limit; with none holding
        more than another, the server is full, whoever asks)."""
        queues = self._levels[level].queues
        own = len(queues.get(tenant, ())) / weight
        others = [len(queue) / queue[0].weight for name, queue in queues.items() if name != tenant]
        return bool(others) and own > max(others)

    def room_for(
        self, ticket: Ticket, bounds: Sequence[int | None], max_size: int
    ) -> tuple[Q | None, str] | None:
        """Whether work of ``ticket`` fits: None when there is room; else why not, with the
        item that gives way for it (None: none does, it is refused). At its level's bound
        (``bounds``), the newest of the tenant holding the most at that level for its weight;
        at the whole queue's (``max_size``), the newest of a lower level, else that one."""
        level, tenant, weight = ticket.level, ticket.tenant, ticket.weight
        bound = bounds[level]
        if bound is not None and self.count(level) >= bound:
            why = f"priority {level + 1}'s queue is full ({bound} waiting)"
            return self.heaviest(level, tenant, weight), why
        if self.size >= max_size:
            why = f"queue is full ({max_size} waiting)"
            return self.newest_below(level) or self.heaviest(level, tenant, weight), why
        return None

    def take(
        self,
        key: Hashable,
        limit: int,
        usable: Callable[[Q], bool],
        level_limits: Sequence[int | None] = (),
    ) -> list[Q]:
        """Up to ``limit`` items of ``key``, highest level first, tenants in turn; a level
        adds items only while the batch holds fewer than its own ``level_limits`` (its
        ``max_batch``: a batch with its work in it stays short, so the next higher work
        waits less for it). Each is taken out; ``usable`` says whether it still goes in the
        batch (False: dropped, for a caller gone or a deadline passed, which ``usable``
        answers itself)."""
        batch: list[Q] = []
        for index, level in enumerate(self._levels):
            # The delayed level (past the last) has no bound of its own: its work runs after
            # everything else waiting, in whole batches.
            own = level_limits[index] if index < len(level_limits) else None
            bound = limit if own is None else min(limit, own)
            if level.size and len(batch) < bound:
                self._fill(level, key, bound, usable, batch)
        return batch

    def _fill(
        self,
        level: _Level[Q],
        key: Hashable,
        limit: int,
        usable: Callable[[Q], bool],
        batch: list[Q],
    ) -> None:
        if len(level.queues) == 1:
            self._fill_alone(level, key, limit, usable, batch)
            return
        left = sum(1 for queue in level.queues.values() for item in queue if item.key == key)
        while left and len(batch) < limit:
            if len(level.queues) == 1:  # the others emptied: alone now, no turn to share
                self._fill_alone(level, key, limit, usable, batch)
                return
            tenant, queue = next(iter(level.queues.items()))
            if level.mid == tenant:
                credit = level.deficit.get(tenant, 0.0)
            else:
                credit = level.deficit.get(tenant, 0.0) + queue[0].weight
            level.mid = None
            kept: deque[Q] = deque()
            while queue:
                item = queue.popleft()
                if item.key != key or credit < 1 or len(batch) >= limit:
                    kept.append(item)
                    continue
                left -= 1
                level.size -= 1
                self.size -= 1
                if usable(item):
                    batch.append(item)
                    credit -= 1
            level.queues[tenant] = kept
            more = any(item.key == key for item in kept)
            if not kept:
                level.drop(tenant)
            elif len(batch) >= limit and more and credit >= 1:
                level.deficit[tenant] = credit  # its turn goes on in the next batch
                level.mid = tenant
            else:
                level.deficit[tenant] = credit if more else 0.0
                level.rotate(tenant)

    def _fill_alone(
        self,
        level: _Level[Q],
        key: Hashable,
        limit: int,
        usable: Callable[[Q], bool],
        batch: list[Q],
    ) -> None:
        """One tenant at this level: its items in order, no turns (the common case, kept as
        cheap as the plain FIFO this queue replaced), and no credit carried into a batch
        where another tenant is back."""
        tenant, queue = next(iter(level.queues.items()))
        level.deficit.pop(tenant, None)
        level.mid = None
        kept: deque[Q] | None = None
        while queue and len(batch) < limit:
            item = queue.popleft()
            if item.key != key:
                if kept is None:
                    kept = deque()
                kept.append(item)
                continue
            level.size -= 1
            self.size -= 1
            if usable(item):
                batch.append(item)
        if kept:
            kept.extend(queue)
            level.queues[tenant] = queue = kept
        if not queue:
            level.drop(tenant)


def _newest(item: Queued) -> float:
    return float(getattr(item, "enqueued_at", 0.0))
