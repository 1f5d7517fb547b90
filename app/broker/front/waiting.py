"""The requests one broker front end has sent and waits the replies of: each by its id, with
the version it went to; the reply that comes is delivered to it, and none goes to another
caller (replies are matched by request id, and dropped when nobody waits)."""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Callable
from dataclasses import dataclass

from app.answers import SharedAnswer
from app.broker.wire.parsing import MalformedMessage
from app.broker.wire.reply import decode_reply
from app.errors import ServerError, WorkerDied

log = logging.getLogger("app.broker.transport")

ORPHANED_S = 2.0  # a waiting request whose version no live worker holds fails after this


@dataclass
class Entry:
    """Where a waiting request's entry is, and what it holds (to be sent again, should a
    failover lose it): the stream, the entry's id, its fields, the request's deadline, and
    for a lane, how a worker learns of it."""

    stream: str
    entry_id: bytes
    fields: dict[str, bytes]
    deadline: float | None  # time.monotonic(); None: none
    lane: LaneNote | None = None


@dataclass(frozen=True)
class LaneNote:
    """A lane's description in its version's lanes hash, and the stream (its task's) where a
    doorbell tells the workers to read a lane new to them (``app.broker.wire.lanes``)."""

    lanes: str
    doorbell: str
    description: bytes


class Waiting:
    """The requests waiting for replies (``add``/``discard``), delivered (``deliver``) or
    failed together (``fail``, ``fail_orphaned``).

    >>> # waiting = Waiting()
    >>> # future = waiting.add("fe-1", "tagger@1a2b3c4d5e6f")   # in the event loop
    >>> # waiting.deliver(raw_reply)      # or: waiting.fail(WorkerDied("gone"), served_id)
    """

    def __init__(self) -> None:
        self._futures: dict[str, asyncio.Future[object]] = {}
        self._models: dict[str, str] = {}  # request id -> the served id it went to
        self._entries: dict[str, Entry] = {}  # request id -> its entry, once added
        self._unheld_since: dict[str, float] = {}  # served id -> since no live worker holds it

    def __len__(self) -> int:
        return len(self._futures)

    def add(self, request_id: str, served_id: str) -> asyncio.Future[object]:
        future: asyncio.Future[object] = asyncio.get_running_loop().create_future()
        self._futures[request_id] = future
        self._models[request_id] = served_id
        return future

    def discard(self, request_id: str) -> None:
        self._futures.pop(request_id, None)
        self._models.pop(request_id, None)
        self._entries.pop(request_id, None)

    def __contains__(self, request_id: str) -> bool:
        """Whether ``request_id`` still waits for its reply (none delivered yet)."""
        future = self._futures.get(request_id)
        return future is not None and not future.done()

    def sent(self, request_id: str, entry: Entry) -> None:
        """The request's entry is in Redis (again, after a resend)."""
        if request_id in self._futures:
            self._entries[request_id] = entry

    def entry(self, request_id: str) -> Entry | None:
        return self._entries.get(request_id)

    def entries(self) -> list[tuple[str, Entry]]:
        """Every waiting request whose entry was added, with it."""
        return list(self._entries.items())

    def deliver(self, raw: object) -> None:
        """A reply from the list: to the request it names, if it still waits. Never raises:
        one bad reply must not stop the reader."""
        if not isinstance(raw, bytes):
            return
        try:
            reply = decode_reply(raw)
        except MalformedMessage as exc:
            log.error("broker: dropped a malformed reply (%s)", exc)
            return
        except Exception:
            log.exception("broker: decoding a reply failed")
            return
        future = self._futures.get(reply.id)
        if future is None or future.done():
            return  # its caller gave up, or a duplicate after a reclaim
        if isinstance(reply.result, ServerError):
            future.set_exception(reply.result)
        else:
            future.set_result(SharedAnswer(reply.result) if reply.shared else reply.result)

    def fail(self, error: ServerError, served_id: str | None = None) -> None:
        """Fail every waiting request (or those sent to ``served_id``) with ``error``."""
        failed = [
            request_id
            for request_id, model in self._models.items()
            if served_id is None or model == served_id
        ]
        for request_id in failed:
            self.fail_one(request_id, error)

    def fail_one(self, request_id: str, error: ServerError) -> None:
        """Fail ``request_id``'s caller with ``error``. Its records stay until that caller
        is done (``discard``): it deletes the entry nobody waits for, the one it was sent
        again as after a failover if it was."""
        future = self._futures.get(request_id)
        if future is not None and not future.done():
            future.set_exception(error)

    def fail_orphaned(self, held: Callable[[str], bool]) -> None:
        """Requests waiting on a version that has not been ``held`` (by a live worker, or
        waited for) for ``ORPHANED_S`` fail now (503 ``worker_died``): its workers died (a
        restart and a reload take longer than a caller should wait), or its name moved on
        and it is gone."""
        now = time.monotonic()
        waiting = set(self._models.values())
        for served_id in waiting:
            if held(served_id):
                self._unheld_since.pop(served_id, None)
                continue
            since = self._unheld_since.setdefault(served_id, now)
            if now - since >= ORPHANED_S:
                log.error("broker: no live worker holds %s; failing its requests", served_id)
                error = WorkerDied(f"no live worker holds {served_id} any more", retry_after_s=2)
                self.fail(error, served_id)
        for served_id in set(self._unheld_since) - waiting:
            del self._unheld_since[served_id]
