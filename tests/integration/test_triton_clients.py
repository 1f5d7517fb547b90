"""Triton's own clients (``tritonclient`` 2.73: HTTP and gRPC, sync and asyncio), unchanged,
against a real server (``python -m app`` with ``MB_GRPC_PORT``): health and metadata, infer
with raw image bytes, JSON, a preprocessed FP32 tensor and ``class_count``, configuration and
statistics, load and unload, a pinned version, and every error printed readably."""

from __future__ import annotations

import asyncio
import base64
import importlib
import inspect
import json
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import httpx
import numpy as np
import pytest
from tritonclient.utils import InferenceServerException

from tests.conftest import distinct_images, expected_for, normalised_pixels
from tests.models import TINY_DIM
from tests.server import ServerProcess, free_port

pytestmark = pytest.mark.slow

MODEL = "tiny-test"
API_KEY = "client-key"
ADMIN_KEY = "admin-key"
KINDS = ["http", "http.aio", "grpc", "grpc.aio"]


@pytest.fixture(scope="module")
def server(tiny_store: Path) -> Iterator[ServerProcess]:
    env = {
        "MODEL_STORE": str(tiny_store),
        "MB_WORKER_NUM": "1",
        "MB_GRPC_PORT": str(free_port()),
        "API_KEY": API_KEY,
        "ADMIN_API_KEY": ADMIN_KEY,
    }
    with ServerProcess(**env) as server:
        yield server


class Triton:
    """One of tritonclient's four clients, called the same way: the asyncio ones run on a
    loop of their own; ``key`` is the bearer token its calls carry."""

    def __init__(self, kind: str, server: ServerProcess, key: str = API_KEY) -> None:
        self.kind = kind
        self.grpc = kind.startswith("grpc")
        self.module = importlib.import_module(f"tritonclient.{kind}")
        self.types = importlib.import_module(f"tritonclient.{kind.split('.')[0]}")
        port = server.env["MB_GRPC_PORT"] if self.grpc else str(server.port)
        self.loop = asyncio.new_event_loop() if kind.endswith("aio") else None
        self.client = self._run(self._make(f"127.0.0.1:{port}"))
        self.key = key

    async def _build(self, url: str) -> Any:
        return self.module.InferenceServerClient(url)

    def _make(self, url: str) -> Any:
        return self._build(url) if self.loop else self.module.InferenceServerClient(url)

    def _run(self, value: Any) -> Any:
        if inspect.isawaitable(value):
            assert self.loop is not None
            return self.loop.run_until_complete(value)
        return value

    def headers(self, key: str | None = None) -> dict[str, str]:
        token = key if key is not None else self.key
        return {"authorization": f"Bearer {token}"} if token else {}

    def __call__(self, method: str, *args: Any, **kwargs: Any) -> Any:
        """``client.method(*args, **kwargs)``, JSON (a dict) where gRPC would answer a
        protobuf message."""
        if self.grpc and method.startswith("get_"):
            kwargs.setdefault("as_json", True)
        return self._run(getattr(self.client, method)(*args, **kwargs))

    def infer(self, inputs: list[Any], outputs: list[Any] | None = None, **kwargs: Any) -> Any:
        kwargs.setdefault("headers", self.headers())
        return self("infer", MODEL, inputs, outputs=outputs, **kwargs)

    def input(self, name: str, array: np.ndarray, datatype: str, **kwargs: Any) -> Any:
        given = self.types.InferInput(name, list(array.shape), datatype)
        given.set_data_from_numpy(array, **kwargs)
        return given

    def output(self, name: str, **kwargs: Any) -> Any:
        if self.grpc:
            kwargs.pop("binary_data", None)  # gRPC outputs are always raw
        return self.types.InferRequestedOutput(name, **kwargs)

    def close(self) -> None:
        self._run(self.client.close())
        if self.loop is not None:
            self.loop.close()


@pytest.fixture(params=KINDS)
def triton(request: pytest.FixtureRequest, server: ServerProcess) -> Iterator[Triton]:
    client = Triton(request.param, server)
    yield client
    client.close()


def _images(count: int) -> tuple[list[bytes], np.ndarray]:
    images = distinct_images(count)
    return images, np.array([[image] for image in images], dtype=np.object_)


def test_health_and_metadata(triton: Triton) -> None:
    assert triton("is_server_live") and triton("is_server_ready")
    assert triton("is_model_ready", MODEL)
    server = triton("get_server_metadata")
    assert server["name"] == "microbatch-server"
    assert {"binary_tensor_data", "classification", "statistics"} <= set(server["extensions"])
    model = triton("get_model_metadata", MODEL)
    assert [i["name"] for i in model["inputs"]] == ["image", "pixels"]
    assert {o["name"] for o in model["outputs"]} == {"embedding", "top_k_probs", "top_k_indices"}


def test_raw_image_bytes_in_a_batch_of_two(triton: Triton, tiny_store: Path) -> None:
    """Encoded images as BYTES [2, 1], sent binary (tritonclient's default): no base64."""
    images, batch = _images(2)
    result = triton.infer(
        [triton.input("image", batch, "BYTES")],
        [triton.output("embedding"), triton.output("top_k_indices", binary_data=False)],
    )
    rows = result.as_numpy("embedding")
    assert rows.shape == (2, TINY_DIM) and result.as_numpy("top_k_indices").shape == (2, 5)
    for row, image in zip(rows, images, strict=True):
        np.testing.assert_allclose(row, expected_for(image, tiny_store), atol=1e-5)


@pytest.mark.parametrize("algorithm", ["gzip", "deflate"])
def test_a_compressed_request_answers_as_a_plain_one(
    server: ServerProcess, tiny_store: Path, algorithm: str
) -> None:
    """tritonclient's ``request_compression_algorithm``, as Triton takes it (found by a
    review: the body was read as JSON, and refused 422 at its first byte)."""
    import tritonclient.http as http

    images, batch = _images(2)
    given = http.InferInput("image", [2, 1], "BYTES")
    given.set_data_from_numpy(batch)
    client = http.InferenceServerClient(server.base_url.removeprefix("http://"))
    try:
        result = client.infer(
            MODEL, [given], outputs=[http.InferRequestedOutput("embedding")],
            request_compression_algorithm=algorithm, response_compression_algorithm=algorithm,
            headers={"authorization": f"Bearer {API_KEY}"},
        )  # fmt: skip
    finally:
        client.close()
    for row, image in zip(result.as_numpy("embedding"), images, strict=True):
        np.testing.assert_allclose(row, expected_for(image, tiny_store), atol=1e-5)


def test_every_output_when_none_is_asked(triton: Triton) -> None:
    _, batch = _images(1)
    result = triton.infer([triton.input("image", batch, "BYTES")])
    assert result.as_numpy("embedding").shape == (1, TINY_DIM)
    assert result.as_numpy("top_k_probs").shape == result.as_numpy("top_k_indices").shape == (1, 5)


def test_json_with_base64_images(server: ServerProcess, tiny_store: Path) -> None:
    """binary_data=False: JSON both ways; JSON has no bytes, so each image is base64 text."""
    client = Triton("http", server)
    try:
        images = distinct_images(2)
        text = np.array([[base64.b64encode(i).decode()] for i in images], dtype=np.object_)
        result = client.infer(
            [client.input("image", text, "BYTES", binary_data=False)],
            [client.output("embedding", binary_data=False)],
        )
        assert result.get_output("embedding")["data"], "answered as JSON data"
        for row, image in zip(result.as_numpy("embedding"), images, strict=True):
            np.testing.assert_allclose(row, expected_for(image, tiny_store), atol=1e-5)
    finally:
        client.close()


def test_a_preprocessed_fp32_tensor_with_class_count(
    triton: Triton, server: ServerProcess, tiny_store: Path
) -> None:
    """As Triton's image client calls: NCHW FP32, normalised, the top classes as strings."""
    images = distinct_images(2)
    result = triton.infer(
        [triton.input("pixels", normalised_pixels(tiny_store, images), "FP32")],
        [triton.output("top_k_probs", class_count=3), triton.output("embedding")],
    )
    strings = result.as_numpy("top_k_probs")
    assert strings.shape == (2, 3)
    tags = httpx.post(
        f"{server.base_url}/predict/tag",
        files=[("image", ("a.png", images[0])), ("image", ("b.png", images[1]))],
        data={"k": "3"},
        headers={"Authorization": f"Bearer {API_KEY}"},
    ).json()
    for row, expected in zip(strings, tags, strict=True):
        cells = [cell.decode().split(":", 2) for cell in row]
        assert [label for *_, label in cells] == [tag["name"] for tag in expected]
        np.testing.assert_allclose(
            [float(score) for score, *_ in cells], [t["prob"] for t in expected], atol=2e-6
        )
    for row, image in zip(result.as_numpy("embedding"), images, strict=True):
        np.testing.assert_allclose(row, expected_for(image, tiny_store), atol=1e-5)


def test_config_and_statistics(triton: Triton) -> None:
    config = triton("get_model_config", MODEL, headers=triton.headers())
    config = config.get("config", config)  # gRPC wraps it
    assert config["name"] == MODEL and int(config["max_batch_size"]) >= 1
    assert [i["name"] for i in config["input"]] == ["image", "pixels"]
    assert "dynamic_batching" in config and config["instance_group"][0]["kind"] == "KIND_CPU"
    _, batch = _images(1)
    triton.infer([triton.input("image", batch, "BYTES")], [triton.output("embedding")])
    stats = triton("get_inference_statistics", MODEL)["model_stats"]
    assert [(s["name"], s["version"]) for s in stats] == [(MODEL, "1")]
    assert int(stats[0]["inference_count"]) >= 1 and int(stats[0]["execution_count"]) >= 1
    assert int(stats[0]["inference_stats"]["success"]["count"]) >= 1
    assert stats[0]["batch_stats"], "batch statistics by size"


def test_statistics_in_broker_mode_count_what_the_workers_ran(tiny_store: Path) -> None:
    """In broker mode the batches run in the workers: a front end's statistics add what their
    heartbeats say they ran (images, model calls, queue waits, worker time by batch size) to
    the requests it answered itself; the workers' part is the same from either front end."""
    from tritonclient.http import InferenceServerClient

    from tests.broker import RedisServer, Workers, broker_env

    def stats(front: ServerProcess) -> dict[str, Any]:
        client = InferenceServerClient(f"127.0.0.1:{front.port}")
        try:
            (entry,) = client.get_inference_statistics(MODEL)["model_stats"]
            return dict(entry)
        finally:
            client.close()

    images = distinct_images(4)
    sent = len(images)
    with RedisServer() as redis_server, Workers(redis_server, tiny_store, count=1):
        env = broker_env(redis_server.url, tiny_store)
        with ServerProcess(**env) as one, ServerProcess(**env) as two:
            for data in images:
                answer = httpx.post(
                    f"{one.base_url}/predict/embedding", files={"image": ("x.png", data)}
                )
                assert answer.status_code == 200, answer.text
            deadline = time.monotonic() + 20  # the heartbeat after the last batch, and a look
            while time.monotonic() < deadline:
                if all(int(stats(f)["inference_count"]) >= sent for f in (one, two)):
                    break
                time.sleep(0.2)
            seen = {name: stats(front) for name, front in (("one", one), ("two", two))}
    for name, entry in seen.items():
        inference, batches = entry["inference_stats"], entry["batch_stats"]
        assert int(entry["inference_count"]) == sent, (name, entry)
        assert 1 <= int(entry["execution_count"]) <= sent, (name, entry)
        assert int(inference["queue"]["count"]) == sent, (name, entry)
        assert int(inference["compute_infer"]["count"]) == sent, (name, entry)
        assert int(inference["compute_infer"]["ns"]) > 0, (name, entry)
        counted = sum(int(b["compute_infer"]["count"]) for b in batches)
        assert counted == int(entry["execution_count"]), (name, entry)
        assert all(int(b["compute_infer"]["ns"]) > 0 for b in batches), (name, entry)
    assert int(seen["one"]["inference_stats"]["success"]["count"]) == sent
    assert int(seen["two"]["inference_stats"]["success"]["count"]) == 0


def test_a_pinned_version(triton: Triton) -> None:
    _, batch = _images(1)
    image = triton.input("image", batch, "BYTES")
    result = triton.infer([image], [triton.output("embedding")], model_version="1")
    assert result.get_response(as_json=True)["model_version"] == "1" if triton.grpc else True
    with pytest.raises(InferenceServerException) as refused:
        triton.infer([image], [triton.output("embedding")], model_version="7")
    assert "not served" in str(refused.value) or "serving" in str(refused.value)
    assert refused.value.status() in ("409", "StatusCode.FAILED_PRECONDITION")


@pytest.mark.parametrize(
    ("call", "words", "statuses"),
    [
        ("unknown_model", "no model named 'resnet50'", ("404", "StatusCode.NOT_FOUND")),
        ("not_an_image", "not an image", ("400", "StatusCode.INVALID_ARGUMENT")),
        ("no_key", "Bearer", ("401", "StatusCode.UNAUTHENTICATED")),
        ("wrong_shape", "is FP32 shaped [N, 3, 32, 32]", ("422", "StatusCode.INVALID_ARGUMENT")),
    ],
)
def test_errors_print_readably(
    triton: Triton, call: str, words: str, statuses: tuple[str, str]
) -> None:
    _, batch = _images(1)
    image = triton.input("image", batch, "BYTES")
    attempts: dict[str, Callable[[], Any]] = {
        "unknown_model": lambda: triton("infer", "resnet50", [image], headers=triton.headers()),
        "not_an_image": lambda: triton.infer(
            [triton.input("image", np.array([[b"junk"]], dtype=np.object_), "BYTES")]
        ),
        "no_key": lambda: triton.infer([image], headers={}),
        "wrong_shape": lambda: triton.infer(
            [triton.input("pixels", np.zeros((1, 3, 8, 8), np.float32), "FP32")]
        ),
    }
    with pytest.raises(InferenceServerException) as raised:
        attempts[call]()
    shown = str(raised.value)  # what print(e) shows: this failed before (a dict, not a str)
    assert words in shown and words in raised.value.message()
    assert raised.value.status() in statuses


def test_load_and_unload(triton: Triton) -> None:
    admin = triton.headers(ADMIN_KEY)
    triton("unload_model", MODEL, headers=admin)
    assert not triton("is_model_ready", MODEL)
    triton("load_model", MODEL, headers=admin)
    assert triton("is_model_ready", MODEL)
    with pytest.raises(InferenceServerException) as refused:
        triton("load_model", MODEL, headers=admin, config=json.dumps({"max_batch_size": 8}))
    assert "takes no model configuration" in str(refused.value)
    with pytest.raises(InferenceServerException) as unauthorized:
        triton("load_model", MODEL, headers=triton.headers())
    assert "ADMIN_API_KEY" in str(unauthorized.value)
    index = triton("get_model_repository_index", headers=admin)
    models = index if isinstance(index, list) else index.get("models", [])
    assert any(m["name"] == MODEL and str(m.get("state", "")).lower() == "ready" for m in models)
