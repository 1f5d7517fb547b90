"""A pool's host (``app.workers.hosting.PoolHost``) against fake worker handles (no
processes): a worker that dies in the middle of a load or an unload comes back holding
exactly what it should, loaded as any worker that starts."""

from __future__ import annotations

import asyncio
import types
from pathlib import Path
from typing import Any

import pytest

from app.errors import WorkerDied
from app.lifecycle import UNLOADED, AdminPin, ModelSpec
from app.workers.messages import LoadDone, LoadModel, ModelLoaded, ModelUnloaded
from app.workers.pool import WorkerPool

V1 = ModelSpec("t", 1, "/x", "t@v1", (8, 8, 3))
V2 = ModelSpec("t", 2, "/y", "t@v2", (8, 8, 3))


class FakeProcess:
    pid = 1
    exitcode = -9

    def join(self, timeout: float | None = None) -> None:
        return None


class FakeHandle:
    """A worker that loads and unloads in ``step_s``, and can be made to die."""

    def __init__(self, index: int, models: tuple[ModelSpec, ...], step_s: float = 0.2) -> None:
        self.index, self.device, self.threads = index, "cpu", 1
        self.models = {m.served_id: ModelLoaded(m.served_id, 8, "torchscript", 0) for m in models}
        self.ready, self.alive, self.batches, self.process = False, True, 0, FakeProcess()
        self.step_s = step_s
        self.killed_for: str | None = None
        self.running_batch = self.died_running = False  # a batch beside its load, when it died
        self._pending: asyncio.Future[Any] | None = None
        self._on_idle: Any = None
        self._on_exit: Any = None

    def holds(self, served_id: str) -> bool:
        return self.alive and self.ready and served_id in self.models

    async def wait_ready(self) -> None:
        await asyncio.sleep(0.01)
        self.ready = True

    def start_reading(self, on_idle: Any, on_exit: Any) -> None:
        self._on_idle, self._on_exit = on_idle, on_exit
        on_idle(self)

    def send(self, message: Any) -> asyncio.Future[Any]:
        future: asyncio.Future[Any] = asyncio.get_running_loop().create_future()
        self._pending = future

        async def reply() -> None:
            await asyncio.sleep(self.step_s)
            if not self.alive:
                return
            self._pending = None
            if isinstance(message, LoadModel):
                report = ModelLoaded(message.spec.served_id, 8, "torchscript", 0)
                self.models[report.served_id] = report
                answer: Any = LoadDone(message.batch_id, report)
            else:
                self.models.pop(message.served_id, None)
                answer = ModelUnloaded(message.batch_id, message.served_id, 0)
            if not future.done():
                future.set_result(answer)

        asyncio.get_running_loop().create_task(reply())
        return future

    def die(self) -> None:
        self._on_exit(self)

    def mark_dead(self, reason: str, *, crashed: bool = False) -> None:
        self.died_running = self.died_running or (crashed and self.running_batch)
        self.alive = False
        future, self._pending = self._pending, None
        if future is not None and not future.done():
            future.set_exception(WorkerDied(reason))

    def kill(self) -> None:
        self.die()

    def ask_to_stop(self) -> None:
        return None

    async def stop(self, timeout_s: float, reason: str) -> None:
        self.mark_dead(reason)


class Disk:
    """A repository of one model, ``t``, with versions 1 and 2 (``ModelSpec``s above)."""

    root = Path("/nowhere")

    def names(self) -> list[str]:
        return ["t"]

    def chosen(self, name: str, admin: AdminPin | None = None) -> int | None:
        return None if admin == UNLOADED else (admin if isinstance(admin, int) else 1)

    def targets(self, pins: dict[str, AdminPin], on_error: Any) -> dict[str, int | None]:
        return {name: self.chosen(name, pins.get(name)) for name in self.names()}

    def spec(self, name: str, version: int, dtype: str, *, verify: bool) -> ModelSpec:
        return {1: V1, 2: V2}[version]


def fake_pool() -> WorkerPool:
    plan: Any = types.SimpleNamespace(
        placement=types.SimpleNamespace(devices=("cpu", "cpu"), threads=1, decode=None),
        worker=types.SimpleNamespace(
            max_batch_size=8, decode_threads=0, runtime="torchscript", auto_batch=False,
            state_dir=None, load_delay_for=lambda index: 0.0,
        ),
        limits=types.SimpleNamespace(start_timeout_s=5, batch_timeout_s=5),
    )  # fmt: skip
    pool = WorkerPool([V1], plan)
    pool.supervision.backoff.next_delay = lambda index: 0.05  # type: ignore[method-assign]
    pool._spawn = lambda index: FakeHandle(index, ())  # type: ignore[assignment, method-assign, return-value]
    repository: Any = Disk()
    pool.models.attach(repository, "float32", on_view=lambda view: None, in_use=lambda sid: False)
    return pool


def holdings(pool: WorkerPool) -> list[set[str]]:
    return [set(worker.models) for worker in pool.workers if worker.alive]


async def until_held(pool: WorkerPool, wanted: list[set[str]]) -> None:
    async with asyncio.timeout(10):
        while holdings(pool) != wanted:
            await asyncio.sleep(0.02)


async def test_a_worker_that_restarts_during_a_load_loads_what_it_should_hold() -> None:
    pool = fake_pool()
    await pool.start()  # start-up is a load: each worker loads version 1
    assert holdings(pool) == [{"t@v1"}, {"t@v1"}]
    await pool.models.pin("t", 2)
    await asyncio.sleep(0.05)
    pool.workers[1].die()  # type: ignore[attr-defined]  # while worker 0 loads version 2
    # Restarted, it loads what the others serve, then the target; once version 2 is ready
    # on both, version 1 drains and is unloaded (no request here uses it).
    await until_held(pool, [{"t@v2"}, {"t@v2"}])
    assert pool.models.view.routes["t"].version == 2
    await pool.aclose()


async def test_a_worker_dying_as_it_runs_a_batch_beside_a_load_does_not_give_the_load_up() -> None:
    """A batch beside the load may have crashed it (a poison upload): the version was given
    up on every worker for good, and the rollout stopped until a SIGHUP. Now its restart
    loads it again, once: a second death while loading it gives it up, as a crash."""
    pool = fake_pool()
    await pool.start()
    await pool.models.pin("t", 2)
    await asyncio.sleep(0.05)  # worker 0 loads version 2, and runs a batch meanwhile
    worker = pool.workers[0]
    worker.running_batch = True  # type: ignore[attr-defined]
    worker.die()  # type: ignore[attr-defined]
    await until_held(pool, [{"t@v2"}, {"t@v2"}])
    assert pool.models.view.routes["t"].version == 2
    await pool.aclose()


async def test_an_unload_goes_on_past_a_worker_that_dies_during_it() -> None:
    pool = fake_pool()
    await pool.start()
    await pool.models.pin("t", UNLOADED)
    await asyncio.sleep(0.05)
    pool.workers[0].die()  # type: ignore[attr-defined]  # while it unloads
    await until_held(pool, [set(), set()])  # the dead one restarted without it
    assert "t" not in pool.models.view.routes
    await pool.aclose()


async def test_a_load_that_freezes_its_worker_is_not_tried_again_by_its_restart(
    monkeypatch: Any,
) -> None:
    """A regression: a load that froze its worker (no answer past the load deadline and
    ``STUCK_S``: the pool kills it) was not kept as a load that killed its worker, so the
    restarted worker loaded it again, froze, and was killed again, each time taking the
    version it served down with it."""
    import app.workers.pool as pool_module

    monkeypatch.setattr(pool_module, "STUCK_S", 0.1)
    sent: list[str] = []

    class Freezing(FakeHandle):
        def send(self, message: Any) -> asyncio.Future[Any]:
            if isinstance(message, LoadModel):
                sent.append(message.spec.served_id)
                if message.spec.served_id == "t@v2":
                    self._pending = asyncio.get_running_loop().create_future()
                    return self._pending  # never answered: frozen
            return super().send(message)

    pool = fake_pool()
    pool._spawn = lambda index: Freezing(index, ())  # type: ignore[assignment, method-assign, return-value]
    await pool.start()
    pool.start_timeout_s = 0.3
    await pool.models.pin("t", 2)
    async with asyncio.timeout(10):  # killed, restarted, holding version 1 again
        while sent.count("t@v1") < 3 or len(holdings(pool)) < 2:
            await asyncio.sleep(0.02)
    tried = sent.count("t@v2")  # once on each worker at most: they load side by side
    await asyncio.sleep(1.5)  # another frozen load would have begun by now
    assert sent.count("t@v2") == tried <= 2, sent
    assert holdings(pool) == [{"t@v1"}, {"t@v1"}]
    failed = [m for w in pool.models.view.workers for m in w.models if m.version == 2]
    assert failed and all(m.step == "worker crash" for m in failed), failed
    await pool.aclose()


async def test_a_start_that_fails_to_spawn_a_worker_stops_those_spawned_before() -> None:
    """The second spawn failing (out of memory, of file descriptors) left the first worker
    running and its buffer in /dev/shm: the pool had not kept it yet."""
    pool = fake_pool()
    spawned: list[FakeHandle] = []

    def spawn(index: int) -> FakeHandle:
        if index == 1:
            raise OSError(24, "Too many open files")
        spawned.append(FakeHandle(index, ()))
        return spawned[-1]

    pool._spawn = spawn  # type: ignore[assignment, method-assign]
    with pytest.raises(OSError):
        await pool.start()
    assert [worker.alive for worker in spawned] == [False]
