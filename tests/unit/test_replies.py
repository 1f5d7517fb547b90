"""How a broker worker answers (``app.broker.worker.replies``), on a real Redis."""

from __future__ import annotations

import threading
from collections.abc import Iterator

import pytest
import redis

from app.broker.wire.keys import GROUP, Keys
from app.broker.wire.request import Request
from app.broker.worker.health import TroubleLog
from app.broker.worker.replies import Replier
from app.broker.worker.stats import ConsumerStats
from app.jobs import Task

KEYS = Keys("mb")
STREAM = "mb:{q}:89e9be0d4f64:tag"


@pytest.fixture
def client() -> Iterator[redis.Redis]:
    from tests.broker import RedisServer

    with RedisServer() as server:
        yield server.client()


def test_a_reply_list_that_is_not_a_list_fails_its_reply_alone_and_holds_nothing(
    client: redis.Redis,
) -> None:
    """A regression: a front end's reply key holding another type (WRONGTYPE) failed the
    whole answer, which the worker then tried again every 0.5 s for ever, pushing the
    other front ends' replies again each time, its batches stalled."""
    client.xgroup_create(STREAM, GROUP, id="0", mkstream=True)
    ids = [client.xadd(STREAM, {"n": str(n)}) for n in range(2)]
    client.xreadgroup(GROUP, "w1", {STREAM: ">"})
    client.set(KEYS.replies("forged"), "a string")
    stats, stop = ConsumerStats(), threading.Event()
    replier = Replier(client, KEYS, stop, TroubleLog("w1", stats))
    asked = [Request(str(n), fe, Task.TAG, 1, 1000, b"") for n, fe in enumerate(("fe", "forged"))]
    finished = threading.Event()

    def answer() -> None:
        replier.answer(STREAM, [(i, r, b"reply") for i, r in zip(ids, asked, strict=True)], [])
        finished.set()

    threading.Thread(target=answer, daemon=True).start()
    assert finished.wait(5), "the worker is held retrying"
    stop.set()
    assert client.lrange(KEYS.replies("fe"), 0, -1) == [b"reply"]  # once
    assert client.xlen(STREAM) == 0 and client.xpending(STREAM, GROUP)["pending"] == 0
