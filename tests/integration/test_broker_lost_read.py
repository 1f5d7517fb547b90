"""A broker worker whose read's answer never reached it: Redis made the entry its own (it sits
in the worker's pending list) while the worker saw nothing of it. The worker takes it back
once a read of its goes through again, not after the orphan claim's twice
``MB_BATCH_TIMEOUT`` (2 min by default), which its caller would not have waited out.

Real Redis, a real worker and front end; the worker reaches Redis through a proxy whose way
back the test stalls past the worker's socket timeout (a network path that stops delivering
for a few seconds), so the answer to its read is lost with its connection."""

from __future__ import annotations

import asyncio
import time
from collections.abc import Iterator
from pathlib import Path

import pytest

from app.broker.wire.keys import GROUP
from app.broker.worker.process import SOCKET_TIMEOUT_S
from tests.broker import RedisServer, Workers, stream_key, stream_state
from tests.conftest import distinct_images
from tests.integration.test_broker import front_end, post, total
from tests.proxy import StallingProxy
from tests.waiting import wait_for


@pytest.fixture
def redis_server() -> Iterator[RedisServer]:
    with RedisServer() as server:
        yield server


async def test_an_entry_whose_read_was_lost_is_run_once_the_worker_reads_again(
    redis_server: RedisServer, tiny_store: Path
) -> None:
    proxy = StallingProxy(redis_server.port)
    worker_url = f"redis://127.0.0.1:{proxy.port}/0"
    try:
        with Workers(redis_server, tiny_store, MB_BROKER=worker_url) as workers:
            with front_end(redis_server, tiny_store) as front:  # straight to Redis
                first, lost = distinct_images(2)
                answer = await post(front.base_url, "/predict/embedding", first)
                assert answer.status_code == 200
                (worker,) = workers.live().values()
                stream = stream_key(tiny_store, "embedding")
                client = redis_server.client()
                with workers.beating(worker), proxy.stalled():
                    asking = asyncio.create_task(
                        post(front.base_url, "/predict/embedding", lost,
                             headers={"X-Request-Timeout": "20"})
                    )  # fmt: skip
                    await wait_for(
                        lambda: stream_state(redis_server)["embedding"][0] == 1,
                        what="the request's entry in the stream",
                    )
                    # Handed to the worker's blocking read, whose answer the proxy holds;
                    # or, had that read just ended, read under its name here: either way
                    # the worker's in Redis, and never seen by it.
                    client.xreadgroup(GROUP, worker["name"], {stream: ">"}, count=10)
                    assert client.xpending(stream, GROUP)["consumers"] == [
                        {"name": worker["name"].encode(), "pending": 1}
                    ]
                    await asyncio.sleep(SOCKET_TIMEOUT_S + 0.5)  # its read has timed out
                resumed = time.monotonic()
                response = await asking
                waited = time.monotonic() - resumed
                assert response.status_code == 200, response.text
                assert waited < 10  # the orphan claim would come after 2 x MB_BATCH_TIMEOUT
                await wait_for(lambda: total(workers, "reclaimed") == 1, what="the heartbeat")
                assert stream_state(redis_server)["embedding"] == (0, 0)
    finally:
        proxy.close()
