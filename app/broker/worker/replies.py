"""How a broker worker answers what it read: the replies pushed to each front end's list, and
the entries acknowledged and deleted, in one transaction, so an entry leaves its stream
exactly when its reply exists. Used for batches, for claimed orphans and for entries dropped
unrun (malformed, or past their deadline)."""

from __future__ import annotations

import threading
import time
from collections import defaultdict
from collections.abc import Mapping, Sequence

import redis
from redis.exceptions import RedisError, ResponseError

from app.broker.wire.keys import GROUP, REPLY_TTL_S, Keys
from app.broker.wire.request import Request
from app.broker.worker.health import TroubleLog

RETRY_S = 0.5  # after Redis failed us
EntryId = bytes | str  # as Redis returns it, or as we pass it back
Entry = tuple[EntryId, dict[bytes, bytes]]
# One answered entry: its id, the request it held, and the reply's bytes.
Answered = tuple[EntryId, Request, bytes]


class Replier:
    """Answers entries of one worker (``answer``), retrying while Redis is away unless the
    worker is stopping (then they stay pending: its next life, or another worker, redoes
    them)."""

    def __init__(
        self, client: redis.Redis, keys: Keys, stop: threading.Event, trouble: TroubleLog
    ) -> None:
        self.client = client
        self.keys = keys
        self.stop = stop
        self.trouble = trouble

    def answer(self, stream: str, replies: Sequence[Answered], dropped: Sequence[EntryId]) -> None:
        """Push the replies, acknowledge and delete their entries (and the dropped ones),
        in one transaction."""
        self.answer_all({stream: (replies, dropped)})

    def answer_all(
        self, streams: Mapping[str, tuple[Sequence[Answered], Sequence[EntryId]]]
    ) -> None:
        """``answer`` for the entries of several streams (a batch taken from lanes), in one
        transaction."""
        by_frontend: dict[str, list[bytes]] = defaultdict(list)
        done: dict[str, list[EntryId]] = {}
        for stream, (replies, dropped) in streams.items():
            for _, request, reply in replies:
                by_frontend[request.frontend].append(reply)
            ids = [entry_id for entry_id, _, _ in replies] + list(dropped)
            if ids:
                done[stream] = ids
        if not done:
            return
        while True:
            try:
                with self.client.pipeline(transaction=True) as pipe:
                    for frontend, items in by_frontend.items():
                        pipe.rpush(self.keys.replies(frontend), *items)
                        pipe.expire(self.keys.replies(frontend), REPLY_TTL_S)
                    for stream, ids in done.items():
                        pipe.xack(stream, GROUP, *ids)
                        pipe.xdel(stream, *ids)
                    ran = pipe.execute(raise_on_error=False)
                # The transaction ran: a command of it that failed (a stream or group gone as
                # Redis came back empty, a front end's reply list that is not a list) is not
                # tried again, which would push the other replies twice and hold the worker.
                failed = {str(r)[:200] for r in ran if isinstance(r, ResponseError)}
                for why in failed:
                    if "NOGROUP" not in why and "no such key" not in why:
                        self.trouble.error(f"part of an answer failed: {why}")
                return
            except ResponseError as exc:  # refused whole (out of memory): nothing ran
                self.trouble.error(
                    f"could not answer {sum(map(len, done.values()))} entries: {exc}"
                )
            except (RedisError, OSError) as exc:
                self.trouble.unreachable(exc)
                if self.stop.is_set():
                    return
                self.trouble.pause()
                continue
            if self.stop.is_set():
                return
            time.sleep(RETRY_S)
