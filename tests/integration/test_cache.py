"""The response cache (issue #51) on real processes and real clients: ``X-Cache`` and the
cache metrics of a real server, identical requests at once computed once, gRPC's trailing
``x-cache`` through Triton's client and a raw stub, one front end's answer handed to another
through the shared Redis in broker mode, and a server whose shared Redis is down serving on."""

from __future__ import annotations

import asyncio
import io
import time
from collections import Counter
from collections.abc import Iterator
from pathlib import Path

import grpc
import httpx
import numpy as np
import pytest
import tritonclient.grpc as triton_grpc
from PIL import Image

from app.cache import cache_key
from app.cache.shared import COOL_OFF_S
from app.jobs import Task
from app.v2.proto import inference_pb2 as pb
from app.v2.proto import inference_pb2_grpc as pb_grpc
from app.v2.tensors import pack_bytes
from tests.answers import metric
from tests.broker import PREFIX, RedisServer, Workers, broker_env
from tests.conftest import distinct_images, expected_for
from tests.models import TINY_DIM
from tests.server import ServerProcess, free_port

pytestmark = pytest.mark.slow

MODEL = "tiny-test"
BINARY = {"Accept": "application/octet-stream"}
# One image per test (a fresh one: the server of the first three tests is shared, and an
# image another test asked is already kept).
IMAGES = distinct_images(6, size=40)


def scrape(server: ServerProcess) -> str:
    response = httpx.get(f"{server.base_url}/metrics", timeout=10)
    assert response.status_code == 200, response.text
    return response.text


def outcomes(server: ServerProcess) -> Counter[str]:
    """Images the cache answered so far, by outcome (``microbatch_cache_images_total``)."""
    text = scrape(server)
    return Counter(
        {
            outcome: int(metric(text, "microbatch_cache_images_total", outcome=outcome))
            for outcome in ("hit", "shared_hit", "coalesced", "miss", "fresh")
        }
    )


def images_computed(server: ServerProcess, task: str = "embedding") -> float:
    """Images of ``task`` this server sent through the model so far (the batch sizes' sum)."""
    return metric(scrape(server), "microbatch_batch_size_sum", task=task)


def embed(
    server: ServerProcess, image: bytes, headers: dict[str, str] | None = None
) -> httpx.Response:
    """/predict/embedding of one image, as raw float32; the answer must be a 200."""
    response = httpx.post(
        f"{server.base_url}/predict/embedding",
        files={"image": ("x.png", image)},
        headers={**BINARY, **(headers or {})},
        timeout=30,
    )
    assert response.status_code == 200, response.text
    return response


def vector(response: httpx.Response) -> np.ndarray:
    return np.frombuffer(response.content, dtype="<f4")


def flat_png(side: int, rgb: tuple[int, int, int]) -> bytes:
    """A PNG of one colour: a few kilobytes to send, a megapixel or more to decode (the
    request that computes it takes a while, and the identical ones come meanwhile)."""
    buffer = io.BytesIO()
    Image.new("RGB", (side, side), rgb).save(buffer, format="PNG")
    return buffer.getvalue()


@pytest.fixture(scope="module")
def server(tiny_store: Path) -> Iterator[ServerProcess]:
    """A real server (its workers in-process) with a cache of its own and a gRPC port."""
    env = {
        "MODEL_STORE": str(tiny_store),
        "MB_WORKER_NUM": "1",
        "MB_CACHE_BYTES": "16MiB",
        "MB_GRPC_PORT": str(free_port()),
    }
    with ServerProcess(**env) as server:
        yield server


def test_a_repeat_is_a_hit_bit_for_bit_and_no_cache_computes_afresh(
    server: ServerProcess, tiny_store: Path
) -> None:
    image = IMAGES[0]
    before, computed_before = outcomes(server), images_computed(server)
    miss, hit = embed(server, image), embed(server, image)
    assert [miss.headers["X-Cache"], hit.headers["X-Cache"]] == ["miss", "hit"]
    assert hit.content == miss.content and len(miss.content) == 4 * TINY_DIM
    assert hit.headers["X-Model-Id"] == miss.headers["X-Model-Id"]
    assert hit.headers["X-Model-Id"].startswith(f"{MODEL}@")
    np.testing.assert_allclose(vector(hit), expected_for(image, tiny_store), atol=1e-5)
    fresh = embed(server, image, {"Cache-Control": "no-cache"})
    assert fresh.headers["X-Cache"] == "miss"  # computed again: equal within float rounding
    np.testing.assert_allclose(vector(fresh), vector(miss), atol=1e-5)
    assert images_computed(server) - computed_before == 2  # the miss and the fresh one
    counted = outcomes(server) - before
    assert counted == Counter({"miss": 1, "hit": 1, "fresh": 1}), counted
    text = scrape(server)
    assert metric(text, "microbatch_cache_bytes") > 0
    assert metric(text, "microbatch_cache_entries") >= 1
    assert metric(text, "microbatch_cache_in_flight") == 0


async def test_identical_requests_at_once_compute_the_image_once(server: ServerProcess) -> None:
    image = flat_png(1000, (10, 200, 30))
    before, computed_before = outcomes(server), images_computed(server)
    async with httpx.AsyncClient(base_url=server.base_url, timeout=30) as client:
        answers = await asyncio.gather(
            *[
                client.post("/predict/embedding", files={"image": ("x.png", image)}, headers=BINARY)
                for _ in range(32)
            ]
        )
    assert {a.status_code for a in answers} == {200}, [a.text for a in answers]
    assert len({a.content for a in answers}) == 1
    assert len({a.headers["X-Model-Id"] for a in answers}) == 1
    said = Counter(a.headers["X-Cache"] for a in answers)
    assert said["miss"] == 1 and set(said) <= {"miss", "coalesced", "hit"}, said
    # They came together: some waited on the one computing (a hit came after it ended).
    assert said["coalesced"] >= 1, said
    assert images_computed(server) - computed_before == 1
    counted = outcomes(server) - before
    assert counted == said, (counted, said)


def _raw_infer(
    channel: grpc.Channel, image: bytes, metadata: tuple[tuple[str, str], ...] = ()
) -> tuple[np.ndarray, dict[str, str]]:
    """One v2 ModelInfer of ``image`` (its embedding) through the generated stub: the
    embedding and the call's trailing metadata, which Triton's client does not show."""
    request = pb.ModelInferRequest(model_name=MODEL)
    request.inputs.add(name="image", datatype="BYTES", shape=[1])
    request.outputs.add(name="embedding")
    request.raw_input_contents.append(pack_bytes([image]))
    stub = pb_grpc.GRPCInferenceServiceStub(channel)
    response, call = stub.ModelInfer.with_call(request, metadata=metadata, timeout=30)
    embedding = np.frombuffer(response.raw_output_contents[0], dtype="<f4")
    return embedding, dict(call.trailing_metadata() or ())


def test_grpc_says_x_cache_in_its_trailing_metadata(
    server: ServerProcess, tiny_store: Path
) -> None:
    image = IMAGES[2]
    port = server.env["MB_GRPC_PORT"]
    triton = triton_grpc.InferenceServerClient(f"127.0.0.1:{port}")
    try:
        given = triton_grpc.InferInput("image", [1], "BYTES")
        given.set_data_from_numpy(np.array([image], dtype=np.object_))
        asked = [triton_grpc.InferRequestedOutput("embedding")]
        before = outcomes(server)
        first = triton.infer(MODEL, [given], outputs=asked).as_numpy("embedding")
        second = triton.infer(MODEL, [given], outputs=asked).as_numpy("embedding")
        assert outcomes(server) - before == Counter({"miss": 1, "hit": 1})
    finally:
        triton.close()
    assert first.shape == (1, TINY_DIM)
    np.testing.assert_array_equal(second, first)
    np.testing.assert_allclose(first[0], expected_for(image, tiny_store), atol=1e-5)
    with grpc.insecure_channel(f"127.0.0.1:{port}") as channel:
        kept, trailing = _raw_infer(channel, image)
        assert trailing.get("x-cache") == "hit", trailing
        np.testing.assert_array_equal(kept, first[0])
        fresh, trailing = _raw_infer(channel, image, (("cache-control", "no-cache"),))
        assert trailing.get("x-cache") == "miss", trailing
        np.testing.assert_allclose(fresh, first[0], atol=1e-5)  # computed again
        # An upload over HTTP is the same image of the same export: the same entry.
        over_http = embed(server, image)
    assert over_http.headers["X-Cache"] == "hit"
    np.testing.assert_array_equal(vector(over_http), first[0])


def test_one_front_end_s_answer_is_another_s_hit_through_the_shared_redis(
    tiny_store: Path,
) -> None:
    image, other = IMAGES[3], IMAGES[4]
    with RedisServer() as redis_server, Workers(redis_server, tiny_store):
        cache = {
            "MB_CACHE_BYTES": "16MiB",
            "MB_CACHE_REDIS": redis_server.url,
            "MB_CACHE_TTL_S": "60",
        }
        fronts = [ServerProcess(**broker_env(redis_server.url, tiny_store, **cache))]
        fronts.append(ServerProcess(**broker_env(redis_server.url, tiny_store, **cache)))
        with fronts[0] as a, fronts[1] as b:
            # B's first look at the shared cache (and its connection to it), on another image.
            assert embed(b, other).headers["X-Cache"] == "miss"
            miss = embed(a, image)
            assert miss.headers["X-Cache"] == "miss"
            served_id = miss.headers["X-Model-Id"]
            # A keeps its answer in the background: wait until Redis holds it.
            name = f"{PREFIX}:cache:{cache_key(served_id, Task.EMBEDDING, 0, image).hex()}"
            client = redis_server.client()
            deadline = time.monotonic() + 10
            while not client.exists(name):
                assert time.monotonic() < deadline, f"{name} never written"
                time.sleep(0.02)
            assert 0 < client.pttl(name) <= 60_000
            before = outcomes(b)
            hit = embed(b, image)
            errors = metric(scrape(b), "microbatch_cache_errors_total")
            assert hit.headers["X-Cache"] == "hit", (hit.headers, f"cache errors: {errors}")
            assert hit.content == miss.content
            assert hit.headers["X-Model-Id"] == served_id
            # Handed over, not computed (in broker mode the batch metrics are the workers',
            # from their heartbeats: they would not show it at once).
            assert outcomes(b) - before == Counter({"shared_hit": 1})
            # B keeps what it was handed: its next answer is its own process's.
            again = embed(b, image)
            assert again.headers["X-Cache"] == "hit" and again.content == miss.content
            assert outcomes(b) - before == Counter({"shared_hit": 1, "hit": 1})
            assert errors == 0


def test_a_shared_cache_that_is_down_costs_requests_nothing_but_is_counted(
    tiny_store: Path,
) -> None:
    nobody = free_port()  # nothing listens there
    env = {
        "MODEL_STORE": str(tiny_store),
        "MB_WORKER_NUM": "1",
        "MB_CACHE_BYTES": "16MiB",
        "MB_CACHE_REDIS": f"redis://127.0.0.1:{nobody}/0",
    }
    with ServerProcess(**env) as server:
        took: list[float] = []
        said: list[str] = []

        def timed(image: bytes) -> httpx.Response:
            started = time.monotonic()
            response = embed(server, image)
            took.append(time.monotonic() - started)
            said.append(response.headers["X-Cache"])
            return response

        first = timed(IMAGES[5])
        assert timed(IMAGES[5]).content == first.content  # this process's share serves on
        errors = metric(scrape(server), "microbatch_cache_errors_total")
        assert errors >= 1
        time.sleep(COOL_OFF_S + 0.1)  # then the shared cache is asked again, and fails again
        timed(IMAGES[0])
        assert metric(scrape(server), "microbatch_cache_errors_total") > errors
    assert said == ["miss", "hit", "miss"]
    assert max(took) < 1.0, took


def test_identical_requests_through_two_front_ends_are_computed_once_by_the_worker(
    tiny_store: Path,
) -> None:
    """Each front end computes an image once however many ask it at once; the worker then
    computes it once for both front ends (broker mode has no shared Redis here: the worker
    is where their requests meet), unless a caller asks afresh."""
    image, fresh_image = IMAGES[1], IMAGES[2]
    with RedisServer() as redis_server, Workers(redis_server, tiny_store) as workers:
        cache = {"MB_CACHE_BYTES": "16MiB"}
        fronts = [ServerProcess(**broker_env(redis_server.url, tiny_store, **cache))]
        fronts.append(ServerProcess(**broker_env(redis_server.url, tiny_store, **cache)))
        with fronts[0] as a, fronts[1] as b:

            def ran() -> tuple[int, int]:
                beats = workers.live().values()
                return sum(int(w["items"]) for w in beats), sum(int(w["shared"]) for w in beats)

            def both(picture: bytes, headers: dict[str, str]) -> list[httpx.Response]:
                async def send() -> list[httpx.Response]:
                    async with httpx.AsyncClient(timeout=30) as client:
                        return await asyncio.gather(*(
                            client.post(f"{front.base_url}/predict/embedding",
                                        files={"image": ("x.png", picture)},
                                        headers={**BINARY, **headers})
                            for front in (a, b, a, b)
                        ))  # fmt: skip

                return asyncio.run(send())

            def settled(before: tuple[int, int], answered: int) -> tuple[int, int]:
                deadline = time.monotonic() + 20  # the heartbeats tell it within seconds
                while sum(ran()) - sum(before) < answered:
                    assert time.monotonic() < deadline, (before, ran())
                    time.sleep(0.1)
                time.sleep(1.5)  # and nothing more comes
                now = ran()
                return now[0] - before[0], now[1] - before[1]

            before = ran()
            embed(a, IMAGES[0])  # each front end's first request (its workers' view) is done
            embed(b, IMAGES[0])
            assert settled(before, 2) == (1, 1)  # one after the other: the worker kept it
            before = ran()
            responses = both(image, {})
            assert all(r.status_code == 200 for r in responses), [r.text for r in responses]
            assert len({r.content for r in responses}) == 1  # one answer, bit for bit
            assert len({r.headers["X-Model-Id"] for r in responses}) == 1
            # Only the request whose entry ran says miss; the other front end's says
            # coalesced (and each front end's second request coalesced, or a hit).
            said = sorted(r.headers["X-Cache"] for r in responses)
            assert said.count("miss") == 1 and "coalesced" in said, said
            assert settled(before, 2) == (1, 1)  # an entry from each: one computed, one shared
            assert metric(scrape(a), "microbatch_worker_shared_images_total") >= 1

            before = ran()
            responses = both(fresh_image, {"Cache-Control": "no-cache"})
            assert all(r.status_code == 200 for r in responses)
            assert settled(before, 4) == (4, 0)  # asked afresh: each computed for itself
