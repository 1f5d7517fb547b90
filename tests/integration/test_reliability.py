"""Every request gets exactly one answer: its own result or a typed error, under load, worker
deaths, hangs, overload, disconnects and shutdown. Real worker processes throughout."""

from __future__ import annotations

import asyncio
import contextlib
import io
import json
import os
import shutil
import signal
import time
from collections import Counter
from pathlib import Path
from typing import Any

import httpx
import numpy as np
import pytest
from PIL import Image

from bench.loadgen import Response, closed_loop, multipart_request
from tests.answers import error_of
from tests.checks import Expectation, httpx_closed_loop, mixed_jobs
from tests.conftest import distinct_images, running_app
from tests.models import POISON_RGB
from tests.server import ServerProcess, alive, shm_files
from tests.transports import Watched, wait_queued

pytestmark = pytest.mark.slow


# One worker on one thread, as slow_store's model is sized (SLOW_STORE_S a batch, 0.25 s).
SLOW_ONE_WORKER = {"MB_WORKER_NUM": "1", "MB_WORKER_THREADS": "1"}


async def test_thousands_of_concurrent_requests_each_get_their_own_answer(tiny_store: Path) -> None:
    expect = Expectation(tiny_store)
    images = distinct_images(4000, size=40)
    jobs = mixed_jobs(images)
    answers: dict[int, list[Any]] = {}
    with ServerProcess(MODEL_STORE=str(tiny_store), MB_BATCH_SIZE="32") as server:
        requests = [
            multipart_request(
                "127.0.0.1", server.port, f"/predict/{task}", data, fields=[("k", "3")]
            )
            for task, data in jobs
        ]

        def record(index: int, response: Response) -> None:
            answers.setdefault(index, []).append((response.status, json.loads(response.body)))

        result = await closed_loop(
            "127.0.0.1", server.port, requests, clients=64, total=len(jobs), check=record
        )
        workers = server.readiness()[1]["workers"]
    statuses = Counter(status for replies in answers.values() for status, _ in replies)
    mismatches = [
        i for i, [(_, body)] in answers.items() if not expect.check(jobs[i][0], jobs[i][1], body)
    ]
    embeddings = {
        tuple(np.round(replies[0][1], 5))
        for i, replies in answers.items()
        if jobs[i][0] == "embedding"
    }
    batches = sum(w["batches"] for w in workers)
    print(
        f"\nmix-up: {len(jobs)} requests from 64 clients in {result.seconds:.1f} s "
        f"({result.rate:.0f}/s), statuses {dict(statuses)}, mismatches {len(mismatches)}, "
        f"mean batch {len(jobs) / batches:.2f}"
    )
    assert result.errors == 0
    assert sorted(answers) == list(range(len(jobs)))  # none missing
    assert all(len(replies) == 1 for replies in answers.values())  # none twice
    assert statuses == {200: len(jobs)}
    assert mismatches == []
    assert len(embeddings) == len(jobs) // 2  # distinct inputs, distinct answers
    assert batches < len(jobs), "some batch held more than one image"


async def test_real_model_under_concurrency_answers_as_when_alone(
    default_store: Path, cat_jpeg: bytes, coffee_jpeg: bytes
) -> None:
    from skimage import data

    from tests.conftest import jpeg

    photos = [cat_jpeg, coffee_jpeg, jpeg(data.astronaut()), jpeg(data.rocket())]  # type: ignore[no-untyped-call]  # skimage.data is unannotated
    watched = Watched()
    async with running_app(
        watched.wrap,
        model_store=default_store,
        cuda_devices="cpu",
        mb_worker_num=1,
        mb_batch_size=16,
    ) as (app, client):
        alone = {}
        for index, photo in enumerate(photos):
            for task in ("embedding", "tag"):
                response = await client.post(
                    f"/predict/{task}", files={"image": ("p.jpg", photo)}, data={"k": "3"}
                )
                alone[task, index] = response.json()
        jobs = [("embedding" if i % 3 else "tag", photos[i % 4]) for i in range(120)]
        transport = httpx.ASGITransport(app=app)
        ran = len(watched.batches)
        watched.hold()  # until the 16 clients' first requests wait: they must share batches
        load = asyncio.create_task(
            httpx_closed_loop("http://test", jobs, clients=16, transport=transport)
        )
        await watched.wait_entered()
        await wait_queued(app, 16 - watched.held)  # every client's first request
        watched.release()
        results = await load
        sizes = [size for _, size in watched.batches[ran:]]
    assert Counter(status for _, status, _ in results) == {200: 120}
    for index, _, body in results:
        task, expected = jobs[index][0], alone[jobs[index][0], index % 4]
        if task == "embedding":
            np.testing.assert_allclose(body, expected, atol=1e-4)
        else:
            assert [t["name"] for t in body] == [t["name"] for t in expected]
            np.testing.assert_allclose(
                [t["prob"] for t in body], [t["prob"] for t in expected], atol=1e-4
            )
    assert max(sizes) > 1 and sum(sizes) == len(jobs)


async def test_queue_bound_plus_k_gives_exactly_k_fast_503s(tiny_store: Path) -> None:
    bound, extra = 16, 5
    expect = Expectation(tiny_store)
    watched = Watched()
    async with running_app(
        watched.wrap, model_store=tiny_store, cuda_devices="cpu", mb_worker_num=1,
        mb_max_queue=bound,
    ) as (app, client):  # fmt: skip
        watched.hold()
        images = distinct_images(1 + bound + extra)

        async def post(data: bytes) -> tuple[httpx.Response, float]:
            started = time.monotonic()
            response = await client.post("/predict/embedding", files={"image": ("x.png", data)})
            return response, time.monotonic() - started

        first = asyncio.create_task(post(images[0]))
        await watched.wait_entered()  # the only worker is now blocked
        queued = [asyncio.create_task(post(d)) for d in images[1 : 1 + bound]]
        await wait_queued(app, bound)
        rejected = await asyncio.gather(*(post(d) for d in images[1 + bound :]))
        unread = await unread_upload_refused(client)
        unread_v2 = await unread_upload_refused(client, "/v2/models/tiny-test/infer")
        watched.release()
        admitted = await asyncio.gather(first, *queued)
    assert [r.status_code for r, _ in rejected] == [503] * extra
    assert all(error_of(r)["type"] == "queue_full" for r, _ in rejected)
    assert all(int(r.headers["Retry-After"]) >= 1 for r, _ in rejected)
    assert max(seconds for _, seconds in rejected) < 2.0  # at once: waiting for room hangs
    assert [r.status_code for r, _ in admitted] == [200] * (1 + bound)
    for (response, _), data in zip(admitted, images, strict=False):
        assert expect.check("embedding", data, response.json())
    assert unread.status_code == 503 and error_of(unread)["type"] == "queue_full"
    assert unread_v2.status_code == 503 and "Retry-After" in unread_v2.headers


async def unread_upload_refused(
    client: httpx.AsyncClient, path: str = "/predict/embedding"
) -> httpx.Response:
    """An upload to a full queue whose body never ends: refused before it is read (it was
    read whole, and held in memory, to be refused: under overload a stream of 10 MB
    uploads filled the memory; here it waits for ever). ``path``: /predict's multipart
    form, or (a ``/v2`` path) an Open Inference Protocol JSON body."""
    never = asyncio.Event()
    v2 = path.startswith("/v2/")
    start = (
        b'{"inputs": [{"name": "image", "datatype": "BYTES", "shape": [1], "data": ["'
        if v2
        else b'--b\r\nContent-Disposition: form-data; name="image"; filename="x"\r\n\r\n'
    )

    async def body() -> Any:
        yield start
        await never.wait()

    kind = "application/json" if v2 else "multipart/form-data; boundary=b"
    async with asyncio.timeout(5):
        return await client.post(path, content=body(), headers={"Content-Type": kind})


async def test_killed_workers_under_load_give_only_200_or_503_and_come_back(
    tiny_store: Path,
) -> None:
    images = distinct_images(400, size=40)
    jobs = mixed_jobs(images) * 10
    recoveries = []
    with ServerProcess(
        MODEL_STORE=str(tiny_store), MB_WORKER_NUM="2", MB_BATCH_SIZE="16"
    ) as server:
        load = asyncio.create_task(
            httpx_closed_loop(server.base_url, jobs, clients=32, timeout_s=15)
        )
        for round_ in range(3):
            await asyncio.sleep(1.0)
            victim = server.worker_pids()[round_ % 2]
            os.kill(victim, signal.SIGKILL)
            killed = time.monotonic()
            async with asyncio.timeout(30):
                while True:
                    _, body = await asyncio.to_thread(server.readiness)
                    workers = body["workers"]
                    if victim not in [w["pid"] for w in workers] and all(
                        w["ready"] and w["alive"] for w in workers
                    ):
                        break
                    await asyncio.sleep(0.05)
            recoveries.append(time.monotonic() - killed)
        results = await load
        final_status, final = server.readiness()
        after = await httpx_closed_loop(server.base_url, mixed_jobs(images[:40]), clients=8)
    statuses = Counter(status for _, status, _ in results)
    print(
        f"\nworker kills: statuses {dict(statuses)}, recovery s {[round(r, 2) for r in recoveries]}"
    )
    assert set(statuses) <= {200, 503}, statuses  # no 500, no client timeout (0)
    assert statuses[200] > len(jobs) * 0.5
    assert len(results) == len(jobs)
    assert final_status == 200 and all(w["alive"] and w["ready"] for w in final["workers"])
    assert Counter(status for _, status, _ in after) == {200: 40}


async def test_only_worker_dying_gives_fast_503s_and_readiness_503_until_restarted(
    slow_store: Path,
) -> None:
    # SLOW_STORE_S (0.25 s) a batch: the test sees the request in flight (it looks every
    # 5 ms) and kills its worker long before the batch could end.
    with ServerProcess(MODEL_STORE=str(slow_store), **SLOW_ONE_WORKER) as server:
        async with httpx.AsyncClient(base_url=server.base_url, timeout=30) as client:
            in_flight = asyncio.create_task(
                client.post("/predict/embedding", files={"image": ("x.png", distinct_images(1)[0])})
            )
            async with asyncio.timeout(10):  # wait until it is inside the slow model
                while (await client.get("/readyz")).json()["in_flight"] == 0:
                    await asyncio.sleep(0.005)
            os.kill(server.worker_pids()[0], signal.SIGKILL)
            died = await in_flight
            status_after_kill = (await client.get("/readyz")).status_code
            fresh = await client.post(
                "/predict/embedding", files={"image": ("x.png", distinct_images(2)[1])}
            )
            started = time.monotonic()
            async with asyncio.timeout(30):
                while (await client.get("/readyz")).status_code != 200:
                    await asyncio.sleep(0.05)
            recovery = time.monotonic() - started
            again = await client.post(
                "/predict/embedding", files={"image": ("x.png", distinct_images(1)[0])}
            )
    assert died.status_code == 503 and error_of(died)["type"] == "worker_died"
    assert status_after_kill == 503
    assert fresh.status_code == 503 and "Retry-After" in fresh.headers
    assert again.status_code == 200
    print(f"\nsingle worker recovered in {recovery:.2f} s")


async def test_a_worker_whose_restart_the_os_refuses_once_is_restarted_later(
    tiny_store: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The OS refuses the new process once (EAGAIN at fork, as when memory or process slots
    run short: often why the worker died). The restart tries again after its backoff, as
    after a failed start; before, the restart's task died with the error and the slot
    stayed dead: every request 503 until the server was restarted."""
    from app.workers.handle import WorkerHandle

    async with running_app(
        model_store=tiny_store, cuda_devices="cpu", mb_worker_num=1, mb_worker_threads=1
    ) as (app, client):
        pool = app.state.engine.transport
        spawn = WorkerHandle.spawn.__func__  # type: ignore[attr-defined]
        refused: list[int] = []

        def refuse_once(cls: type[WorkerHandle], *args: Any, **kwargs: Any) -> WorkerHandle:
            if not refused:
                refused.append(1)
                raise OSError(11, "Resource temporarily unavailable")
            return spawn(cls, *args, **kwargs)  # type: ignore[no-any-return]

        monkeypatch.setattr(WorkerHandle, "spawn", classmethod(refuse_once))
        dead = pool.workers[0].process.pid
        os.kill(dead, signal.SIGKILL)
        async with asyncio.timeout(30):  # back, and holding its model again
            while pool.workers[0].process.pid == dead or (
                (await client.get("/readyz")).status_code != 200
            ):
                await asyncio.sleep(0.05)
        assert refused == [1]
        response = await client.post(
            "/predict/embedding", files={"image": ("x.png", distinct_images(1)[0])}
        )
        assert response.status_code == 200


async def test_a_worker_killed_for_a_hung_batch_while_loading_loads_that_version_back(
    slow_store: Path, tiny_store: Path, tmp_path: Path
) -> None:
    """A reload loads version 2 on the only worker while a batch of version 1 runs past
    MB_BATCH_TIMEOUT: the pool kills the worker for the batch. The load is not to blame:
    the restarted worker loads version 2 (before, it was marked a load that crashed its
    worker and given up until an explicit retry: the rollout silently never happened)."""
    root = tmp_path / "models"
    shutil.copytree(slow_store, root / "tiny" / "1")  # SLOW_STORE_S (0.25 s) a batch
    async with running_app(
        model_repository=root, cuda_devices="cpu", mb_worker_num=1, mb_worker_threads=1,
        mb_batch_timeout=0.1, mb_test_load_delay_s="2",
    ) as (app, client):  # fmt: skip
        pool = app.state.engine.transport
        shutil.copytree(tiny_store, root / "tiny" / "2")
        await app.state.engine.models.reload(automatic=True)  # as the repository poll does
        async with asyncio.timeout(10):
            while pool.workers[0].loading is None:
                await asyncio.sleep(0.02)
        dead = pool.workers[0].process.pid
        during = await client.post(
            "/predict/embedding", files={"image": ("x.png", distinct_images(1)[0])}
        )
        assert during.status_code == 503 and error_of(during)["type"] == "worker_died"
        async with asyncio.timeout(60):  # restarted, then version 2 loaded (2 s a load)
            while pool.workers[0].process.pid == dead or not any(
                life.version == 2
                for keeper in pool.host.keepers.values()  # a new one for the new worker
                for life in keeper.lives.values()
            ):
                await asyncio.sleep(0.1)
        assert not pool.host._crashed


async def test_hung_worker_is_killed_after_the_batch_timeout(slow_store: Path) -> None:
    # SLOW_STORE_S (0.25 s) a batch, five times the batch timeout of 0.05 s: every batch
    # "hangs".
    with ServerProcess(
        MODEL_STORE=str(slow_store), MB_BATCH_TIMEOUT="0.05", **SLOW_ONE_WORKER
    ) as server:
        pid = server.worker_pids()[0]
        started = time.monotonic()
        response = httpx.post(
            f"{server.base_url}/predict/embedding",
            files={"image": ("x.png", distinct_images(1)[0])},
            timeout=30,
        )
        elapsed = time.monotonic() - started
        deadline = time.monotonic() + 5
        while alive(pid) and time.monotonic() < deadline:
            time.sleep(0.02)
        assert server.stop() == 0
    assert response.status_code == 503 and error_of(response)["type"] == "worker_died"
    assert elapsed < 5.0
    assert not alive(pid)


async def test_a_hung_worker_whose_callers_left_is_killed_and_serves_again(
    tiny_store: Path,
) -> None:
    """The batch timeout (3 s) outlasts the request's (1 s): the caller has its 504 and
    leaves, and the worker, hung (stopped), is still killed at the batch timeout and
    restarted; the requests after it are served."""
    with ServerProcess(
        MODEL_STORE=str(tiny_store), MB_BATCH_TIMEOUT="3", MB_REQUEST_TIMEOUT="1",
        **SLOW_ONE_WORKER,
    ) as server:  # fmt: skip
        (pid,) = server.worker_pids()
        image = {"image": ("x.png", distinct_images(1)[0])}
        os.kill(pid, signal.SIGSTOP)
        try:
            left = httpx.post(f"{server.base_url}/predict/embedding", files=image, timeout=30)
            assert left.status_code == 504, left.text
            assert left.headers["Retry-After"] == "1"  # the server is busy: 503 and 504 say when
            deadline = time.monotonic() + 10
            while alive(pid) and time.monotonic() < deadline:
                time.sleep(0.05)
            assert not alive(pid), "the hung worker was not killed"
        finally:
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, signal.SIGCONT)
        deadline = time.monotonic() + 60
        while time.monotonic() < deadline:
            status, body = server.readiness()
            if status == 200 and any(w["ready"] and w["pid"] != pid for w in body["workers"]):
                break
            time.sleep(0.1)
        served = httpx.post(f"{server.base_url}/predict/embedding", files=image, timeout=30)
        assert served.status_code == 200, served.text


async def test_sigterm_finishes_admitted_requests_and_exits_cleanly(slow_store: Path) -> None:
    # SLOW_STORE_S (0.25 s) a batch of 4: the first batch still runs when the next 4
    # requests are queued (the test looks every 10 ms), and SIGTERM comes then.
    images = distinct_images(12)
    server = ServerProcess(MODEL_STORE=str(slow_store), MB_BATCH_SIZE="4", **SLOW_ONE_WORKER)
    server.start()
    pool = server.pid  # whose input buffers go to /dev/shm
    workers = server.worker_pids()
    try:
        async with httpx.AsyncClient(base_url=server.base_url, timeout=60) as client:
            requests = [
                asyncio.create_task(
                    client.post("/predict/embedding", files={"image": ("x.png", data)})
                )
                for data in images
            ]
            async with asyncio.timeout(10):
                while (await client.get("/readyz")).json()["queue_depth"] < 4:
                    await asyncio.sleep(0.01)
            os.kill(server.pid, signal.SIGTERM)
            responses = await asyncio.gather(*requests)
        code = await asyncio.to_thread(server.stop)
    finally:
        if server.process and server.process.poll() is None:
            server.process.kill()
    assert [r.status_code for r in responses] == [200] * len(images)
    assert code == 0, server.output
    deadline = time.monotonic() + 5
    while any(alive(pid) for pid in workers) and time.monotonic() < deadline:
        time.sleep(0.05)
    assert not [pid for pid in workers if alive(pid)]
    assert not shm_files(pool)


def _multipart_request(port: int, data: bytes) -> bytes:
    boundary = "testboundary42"
    body = (
        (
            f'--{boundary}\r\nContent-Disposition: form-data; name="image"; filename="x.png"\r\n'
            f"Content-Type: image/png\r\n\r\n"
        ).encode()
        + data
        + f"\r\n--{boundary}--\r\n".encode()
    )
    head = (
        f"POST /predict/embedding HTTP/1.1\r\nHost: 127.0.0.1:{port}\r\n"
        f"Content-Type: multipart/form-data; boundary={boundary}\r\n"
        f"Content-Length: {len(body)}\r\n\r\n"
    ).encode()
    return head + body


async def test_a_thousand_disconnects_leave_nothing_queued_or_computed(slow_store: Path) -> None:
    # SLOW_STORE_S (0.25 s) a batch of 8: while the waves of 200 queue and hang up (a second
    # or so each), the worker can compute a few dozen batches at most, far from 1000 images.
    image = distinct_images(1)[0]
    with ServerProcess(
        MODEL_STORE=str(slow_store), MB_BATCH_SIZE="8", MB_MAX_QUEUE="2000", **SLOW_ONE_WORKER
    ) as server:
        request = _multipart_request(server.port, image)
        for _ in range(5):  # five waves of 200 clients that send a request and hang up
            writers = []
            for _ in range(200):
                _, writer = await asyncio.open_connection("127.0.0.1", server.port)
                writer.write(request)
                writers.append(writer)
            await asyncio.gather(*(w.drain() for w in writers))
            async with asyncio.timeout(30):  # hang up once the wave is queued, not at a guess
                while (await asyncio.to_thread(server.readiness))[1]["queue_depth"] < 100:
                    await asyncio.sleep(0.01)
            for writer in writers:
                writer.close()
            await asyncio.gather(*(w.wait_closed() for w in writers), return_exceptions=True)
        async with asyncio.timeout(30):
            while True:
                _, state = await asyncio.to_thread(server.readiness)
                if state["queue_depth"] == 0 and state["in_flight"] == 0:
                    break
                await asyncio.sleep(0.05)
        computed = state["workers"][0]["items"]
        after = await httpx_closed_loop(server.base_url, mixed_jobs(distinct_images(16)), clients=8)
    print(f"\n1000 disconnects: {computed} images computed, queue back to 0")
    assert computed < 300, f"{computed} of 1000 abandoned requests were computed"
    assert Counter(status for _, status, _ in after) == {200: 16}


async def test_a_failing_batch_is_retried_so_only_the_poison_image_fails(
    poison_store: Path,
) -> None:
    expect = Expectation(poison_store)
    buffer = io.BytesIO()
    Image.new("RGB", (40, 40), POISON_RGB).save(buffer, format="PNG")
    poison = buffer.getvalue()
    good = distinct_images(6)
    watched = Watched()
    async with running_app(
        watched.wrap, model_store=poison_store, cuda_devices="cpu", mb_worker_num=1,
        mb_max_latency=0.5,
    ) as (app, client):  # fmt: skip
        watched.hold()
        uploads = [good[0], *good[1:3], poison, *good[3:]]
        first = asyncio.create_task(
            client.post("/predict/embedding", files={"image": ("x.png", uploads[0])})
        )
        await watched.wait_entered()
        rest = [
            asyncio.create_task(client.post("/predict/embedding", files={"image": ("x.png", d)}))
            for d in uploads[1:]
        ]
        await wait_queued(app, len(rest))
        watched.release()
        responses = await asyncio.gather(first, *rest)
        sizes = [size for _, size in watched.batches]
        pool_ready = app.state.engine.transport.ready
    statuses = [r.status_code for r in responses]
    assert statuses == [200, 200, 200, 500, 200, 200, 200]
    assert error_of(responses[3]) == {
        "type": "inference_error",
        "message": "model call failed",
    }
    for response, data in zip(responses, uploads, strict=True):
        if response.status_code == 200:
            assert expect.check("embedding", data, response.json())
    # The first image alone, the six together, then those six again one by one: one retry.
    assert sizes == [1, 6, 1, 1, 1, 1, 1, 1] and pool_ready


class CrashingServer(ServerProcess):
    """``python -m app`` whose workers die (``os._exit``, as a native crash) on a batch that
    holds a pure magenta image (``tests/poison_worker.py``)."""

    argv = (str(Path(__file__).parents[1] / "poison_worker.py"), "--server")


async def test_an_input_that_crashes_its_worker_fails_alone_and_its_batch_is_answered(
    tiny_store: Path,
) -> None:
    """One worker; a batch of five good images and one that kills the worker's process.
    Each was 503 worker_died, and the retries of the poison's client killed the worker
    again and again: now its batch-mates are run again alone, once a worker is back, and
    only the image that crashes a worker alone too fails (500)."""
    poison = io.BytesIO()
    Image.new("RGB", (40, 40), POISON_RGB).save(poison, format="PNG")
    uploads = [*distinct_images(3, size=40), poison.getvalue(), *distinct_images(5, size=40)[3:]]
    with CrashingServer(
        MODEL_STORE=str(tiny_store), MB_WORKER_NUM="1", MB_MAX_LATENCY="0.5",
        MB_REQUEST_TIMEOUT="90",
    ) as server:  # fmt: skip
        async with httpx.AsyncClient(base_url=server.base_url, timeout=120) as client:
            answers = await asyncio.gather(
                *(client.post("/predict/embedding", files={"image": ("x.png", u)}) for u in uploads)
            )
            after = await client.post(
                "/predict/embedding", files={"image": ("x.png", distinct_images(1)[0])}
            )
    statuses = [answer.status_code for answer in answers]
    assert statuses == [200, 200, 200, 500, 200, 200], [a.text for a in answers]
    assert error_of(answers[3])["type"] == "inference_error"
    assert after.status_code == 200


async def test_stop_signal_turns_readiness_and_new_requests_to_503(tiny_store: Path) -> None:
    import signal as signals

    # Whatever handled SIGINT before (asyncio's runner, when this test runs first, cancels
    # the test's own task): Python's default here, so the hand-over below is deterministic.
    outer = signals.signal(signals.SIGINT, signals.default_int_handler)
    try:
        async with running_app(model_store=tiny_store, cuda_devices="cpu", mb_worker_num=1) as (
            _,
            client,
        ):
            assert (await client.get("/readyz")).status_code == 200
            handler = signals.getsignal(signals.SIGINT)
            assert callable(handler)
            # Our handler flips readiness, then hands over to the previous one (here Python's
            # default, which raises KeyboardInterrupt; under uvicorn, its graceful shutdown).
            with pytest.raises(KeyboardInterrupt):
                handler(signals.SIGINT, None)
            ready = await client.get("/readyz")
            refused = await client.post(
                "/predict/tag", files={"image": ("x.png", distinct_images(1)[0])}
            )
    finally:
        signals.signal(signals.SIGINT, outer)
    assert ready.status_code == 503 and ready.json()["status"] == "not_ready"
    assert refused.status_code == 503 and error_of(refused)["type"] == "not_ready"
    assert "Retry-After" in refused.headers


async def test_large_replies_under_concurrency_on_the_real_server(
    default_store: Path, cat_jpeg: bytes, coffee_jpeg: bytes
) -> None:
    """Batches of 1280-d embeddings are replies far larger than a socket buffer; under
    uvloop (which `python -m app` uses) they must arrive whole, with no worker 'dying'."""
    with ServerProcess(MODEL_STORE=str(default_store), MB_BATCH_SIZE="32") as server:
        requests = [
            multipart_request("127.0.0.1", server.port, "/predict/embedding", data)
            for data in (cat_jpeg, coffee_jpeg)
        ]
        result = await closed_loop("127.0.0.1", server.port, requests, clients=32, total=96)
        _, state = server.readiness()
    assert result.statuses == {200: 96}
    assert all(w["alive"] and w["ready"] for w in state["workers"])
    assert sum(w["items"] for w in state["workers"]) == 96
    assert sum(w["batches"] for w in state["workers"]) < 96  # they were batched
