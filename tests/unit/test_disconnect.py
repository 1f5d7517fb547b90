"""``unless_disconnected``: the work runs in the request's own task, and a client that leaves
cancels it; a cancellation from anyone else (a shutdown) is never taken for a disconnect."""

from __future__ import annotations

import asyncio
from collections.abc import MutableMapping
from typing import Any

import pytest

from app.errors import ClientDisconnected
from app.routers import common
from app.routers.common import unless_disconnected


class FakeRequest:
    """Stands in for a Starlette request whose body has been read: ``receive`` waits for
    what the test puts in ``messages``."""

    def __init__(self) -> None:
        self.messages: asyncio.Queue[dict[str, Any]] = asyncio.Queue()

    async def receive(self) -> dict[str, Any]:
        return await self.messages.get()

    def leave(self) -> None:
        self.messages.put_nowait({"type": "http.disconnect"})


class Work:
    """Waits until released; records whether it was cancelled."""

    def __init__(self) -> None:
        self.release = asyncio.Event()
        self.started = asyncio.Event()
        self.cancelled = False

    async def __call__(self) -> str:
        self.started.set()
        try:
            await self.release.wait()
        except asyncio.CancelledError:
            self.cancelled = True
            raise
        return "result"


async def handling(request: FakeRequest, work: Work) -> asyncio.Task[None]:
    """A request's task awaiting ``work`` under ``unless_disconnected``, once the work runs."""

    async def handler() -> None:
        await unless_disconnected(request, work())  # type: ignore[arg-type]

    task = asyncio.create_task(handler())
    await work.started.wait()
    return task


def watchers() -> list[asyncio.Task[Any]]:
    return [t for t in asyncio.all_tasks() if "_disconnected" in repr(t.get_coro())]


async def test_the_result_comes_back_and_the_watcher_stops() -> None:
    request, work = FakeRequest(), Work()
    task = await handling(request, work)
    await asyncio.sleep(0)  # the watcher starts at the loop's next turn
    started = watchers()
    assert len(started) == 1 and not started[0].done()
    work.release.set()
    await task
    async with asyncio.timeout(5):  # the watcher ends: nothing is left to hear a disconnect
        await asyncio.gather(*started, return_exceptions=True)
    assert started[0].cancelled()
    request.leave()  # a disconnect after the answer cancels nothing
    assert asyncio.current_task().cancelling() == 0  # type: ignore[union-attr]


async def test_work_done_without_waiting_starts_no_watcher(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """An answer the response cache kept: no watcher is made for it."""
    made: list[object] = []
    real = common._disconnected

    def counted(request: Any) -> Any:
        made.append(request)
        return real(request)

    monkeypatch.setattr(common, "_disconnected", counted)
    request, work = FakeRequest(), Work()
    work.release.set()
    assert await unless_disconnected(request, work()) == "result"  # type: ignore[arg-type]
    await asyncio.sleep(0)
    assert made == [] and watchers() == []
    waiting = await handling(request, Work())  # work that waits gets one
    await asyncio.sleep(0)
    assert made == [request]
    waiting.cancel()
    await asyncio.gather(waiting, return_exceptions=True)


async def test_a_client_that_leaves_cancels_the_work() -> None:
    request, work = FakeRequest(), Work()

    task = await handling(request, work)
    request.leave()
    with pytest.raises(ClientDisconnected):
        await task
    assert work.cancelled
    assert task.cancelling() == 0  # no cancellation left pending on the request's task


async def test_a_shutdown_stays_a_cancellation() -> None:
    request, work = FakeRequest(), Work()

    task = await handling(request, work)
    task.cancel()
    with pytest.raises(asyncio.CancelledError):
        await task
    assert work.cancelled


async def test_a_shutdown_while_the_client_leaves_stays_a_cancellation() -> None:
    request, work = FakeRequest(), Work()

    task = await handling(request, work)
    (watcher,) = watchers()
    # The shutdown's cancel lands in the same loop turn as the disconnect's.
    watcher.add_done_callback(lambda _: task.cancel())
    request.leave()
    with pytest.raises(asyncio.CancelledError):
        await task
    assert work.cancelled


async def test_a_disconnect_heard_as_the_work_ends_cancels_nothing_after() -> None:
    """The client leaves in the very loop turn the answer comes: the request's task goes on
    to send it, uncancelled (the watcher's callback runs after the work has returned)."""
    request, work = FakeRequest(), Work()

    async def handler() -> str:
        result = await unless_disconnected(request, work())  # type: ignore[arg-type]
        await asyncio.sleep(0.01)  # sending the answer
        return result

    task = asyncio.create_task(handler())
    await work.started.wait()
    await asyncio.sleep(0)  # the watcher is waiting for the disconnect
    request.leave()
    work.release.set()
    assert await task == "result"
    assert task.cancelling() == 0


async def test_a_client_that_leaves_mid_body_gets_499_not_500(tmp_path: Any) -> None:
    """Found by a review: a /v2 infer (as any route reading its body whole: the repository's
    load and unload) whose client left mid-upload was answered 500 with a traceback, and
    counted as a server error; /predict's uploads answered 499."""
    import numpy as np

    from app.main import create_app
    from app.settings import Settings
    from app.testing import FakeTransport
    from tests.models import export_tiny

    store = export_tiny(tmp_path / "store")
    fake = FakeTransport(lambda task, jobs: [np.zeros(4, np.float32) for _ in jobs])
    app = create_app(Settings(model_store=store), transport=fake)
    path = "/v2/models/tiny-test/infer"
    incoming: list[MutableMapping[str, Any]] = [
        {"type": "http.request", "body": b'{"inputs": [', "more_body": True},
        {"type": "http.disconnect"},
    ]
    sent: list[MutableMapping[str, Any]] = []

    async def receive() -> MutableMapping[str, Any]:
        if not incoming:
            await asyncio.Event().wait()
        return incoming.pop(0)

    async def send(message: MutableMapping[str, Any]) -> None:
        sent.append(message)

    scope = {"type": "http", "asgi": {"version": "3.0"}, "http_version": "1.1", "method": "POST",
             "scheme": "http", "path": path, "raw_path": path.encode(), "query_string": b"",
             "root_path": "", "headers": [(b"content-type", b"application/json")],
             "client": ("127.0.0.1", 1), "server": ("t", 80)}  # fmt: skip
    async with app.router.lifespan_context(app):
        await asyncio.wait_for(app(scope, receive, send), 10)
    (start,) = [m for m in sent if m["type"] == "http.response.start"]
    assert start["status"] == 499
