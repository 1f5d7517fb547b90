"""The Open Inference Protocol (KServe v2) routes, against real worker processes."""

from __future__ import annotations

import base64
import json
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import pytest_asyncio

from app.v2.tensors import pack_bytes, unpack_bytes
from tests.conftest import distinct_images, expected_for, images_run, normalised_pixels, running_app
from tests.models import TINY_DIM

pytestmark = [pytest.mark.slow, pytest.mark.asyncio(loop_scope="module")]


@pytest_asyncio.fixture(loop_scope="module", scope="module")
async def served(tiny_store: Path) -> AsyncIterator[tuple[Any, Any]]:
    async with running_app(model_store=tiny_store, cuda_devices="cpu", mb_worker_num=1) as pair:
        yield pair


def _infer_body(images: list[bytes], **extra: Any) -> dict[str, Any]:
    data = [base64.b64encode(image).decode() for image in images]
    inputs = [{"name": "image", "datatype": "BYTES", "shape": [len(data)], "data": data}]
    return {"inputs": inputs, **extra}


async def test_health_and_readiness(served: tuple[Any, Any]) -> None:
    app, client = served
    assert (await client.get("/v2/health/live")).status_code == 200
    assert (await client.get("/v2/health/ready")).json() == {"ready": True}
    assert (await client.get("/v2/models/tiny-test/ready")).status_code == 200
    app.state.closing = True  # as after SIGTERM
    try:
        assert (await client.get("/v2/health/ready")).status_code == 503
        assert (await client.get("/v2/models/tiny-test/ready")).status_code == 503
    finally:
        app.state.closing = False
    assert (await client.get("/v2")).json()["name"] == "microbatch-server"


async def test_model_metadata_shows_shapes_and_datatypes(served: tuple[Any, Any]) -> None:
    _, client = served
    metadata = (await client.get("/v2/models/tiny-test")).json()
    assert metadata["name"] == "tiny-test"
    assert metadata["versions"] == ["1"]  # a lone store: version 1 of its model
    assert metadata["inputs"] == [
        {"name": "image", "datatype": "BYTES", "shape": [-1]},
        {"name": "pixels", "datatype": "FP32", "shape": [-1, 3, 32, 32]},
    ]
    outputs = {o["name"]: (o["datatype"], o["shape"]) for o in metadata["outputs"]}
    assert outputs == {
        "embedding": ("FP32", [-1, TINY_DIM]),
        "top_k_probs": ("FP32", [-1, -1]),
        "top_k_indices": ("INT64", [-1, -1]),
    }
    missing = await client.get("/v2/models/resnet50")
    # The protocol's error shape: a string its clients print, and this server's type beside.
    assert missing.status_code == 404 and missing.json() == {
        "error": "no model named 'resnet50' is served here (served: tiny-test)",
        "type": "model_not_found",
    }


async def test_infer_answers_what_the_rest_routes_answer(
    served: tuple[Any, Any], tiny_store: Path
) -> None:
    _, client = served
    images = distinct_images(2)
    body = _infer_body(
        images,
        id="req-1",
        outputs=[{"name": "embedding"}, {"name": "top_k_indices"}, {"name": "top_k_probs"}],
        parameters={"k": 3},
    )
    response = await client.post("/v2/models/tiny-test/infer", json=body)
    assert response.status_code == 200, response.text
    answer = response.json()
    assert answer["id"] == "req-1" and answer["model_name"] == "tiny-test"
    outputs = {o["name"]: o for o in answer["outputs"]}
    embedding = outputs["embedding"]
    assert embedding["datatype"] == "FP32" and embedding["shape"] == [2, TINY_DIM]
    rows = np.array(embedding["data"], dtype=np.float32).reshape(2, TINY_DIM)
    for row, image in zip(rows, images, strict=True):
        np.testing.assert_allclose(row, expected_for(image, tiny_store), atol=1e-5)
    files = [("image", ("a.png", images[0])), ("image", ("b.png", images[1]))]
    vectors = await client.post("/predict/embedding", files=files)
    np.testing.assert_allclose(rows, vectors.json(), rtol=1e-6, atol=1e-6)
    tags = await client.post("/predict/tag", files=files, data={"k": "3"})
    classes = (await client.get("/tags")).json()
    assert outputs["top_k_indices"]["datatype"] == "INT64"
    assert outputs["top_k_indices"]["shape"] == outputs["top_k_probs"]["shape"] == [2, 3]
    indices = np.array(outputs["top_k_indices"]["data"]).reshape(2, 3)
    assert [[classes[i] for i in row] for row in indices] == [
        [t["name"] for t in row] for row in tags.json()
    ]
    probs = np.array(outputs["top_k_probs"]["data"]).reshape(2, 3)
    np.testing.assert_allclose(probs, [[t["prob"] for t in row] for row in tags.json()], atol=1e-6)


@pytest.mark.parametrize(
    "asked",
    [
        ["embedding"],
        ["top_k_indices"],
        ["top_k_probs", "top_k_indices"],
        ["embedding", "top_k_probs", "top_k_indices"],
    ],
)
async def test_infer_runs_each_image_through_the_model_once_whatever_outputs_are_asked(
    served: tuple[Any, Any], asked: list[str]
) -> None:
    _, client = served
    images = distinct_images(3)
    before = await images_run(client)
    body = _infer_body(images, outputs=[{"name": name} for name in asked])
    response = await client.post("/v2/models/tiny-test/infer", json=body)
    assert response.status_code == 200, response.text
    assert [output["name"] for output in response.json()["outputs"]] == [
        name for name in ("embedding", "top_k_probs", "top_k_indices") if name in asked
    ]
    ran = await images_run(client) - before
    assert ran == len(images), f"{ran:.0f} images went through the model for {len(images)}"


@pytest.mark.parametrize(
    ("body", "status", "kind"),
    [
        ({"inputs": []}, 422, "invalid_request"),
        (
            {"inputs": [{"name": "image", "datatype": "FP32", "shape": [1], "data": ["x"]}]},
            422,
            "invalid_request",
        ),
        (
            _infer_body([b"x"]) | {"parameters": {"k": 0}, "outputs": [{"name": "top_k_probs"}]},
            422,
            "invalid_request",
        ),
        (
            {
                "inputs": [
                    {"name": "image", "datatype": "BYTES", "shape": [1], "data": ["not base64!"]}
                ]
            },
            422,
            "invalid_request",
        ),
        (
            {"inputs": [{"name": "image", "datatype": "BYTES", "shape": [2], "data": ["eA=="]}]},
            422,
            "invalid_request",
        ),
        (
            {"inputs": [{"name": "pixels", "datatype": "FP32", "shape": [1, 3, 224, 224]}]},
            422,
            "invalid_request",
        ),
        (
            {
                "inputs": [
                    {
                        "name": "pixels",
                        "datatype": "FP32",
                        "shape": [1, 3, 224, 224],
                        "data": [0.0] * 150528,
                    }
                ]
            },
            422,
            "invalid_request",
        ),
        (
            {
                "inputs": [
                    {
                        "name": "pixels",
                        "datatype": "FP32",
                        "shape": [1, 3, 32, 32],
                        "data": ["x"] * 3072,
                    }
                ]
            },
            422,
            "invalid_request",
        ),
        (
            _infer_body([b"x"])
            | {"outputs": [{"name": "embedding", "parameters": {"classification": 2}}]},
            422,
            "invalid_request",
        ),
        (
            _infer_body([b"x"])
            | {
                "parameters": {"k": 2},
                "outputs": [{"name": "top_k_probs", "parameters": {"classification": 3}}],
            },
            422,
            "invalid_request",
        ),
        (
            {
                "inputs": [
                    {
                        "name": "image",
                        "datatype": "BYTES",
                        "shape": [1, 2],
                        "data": ["eA==", "eA=="],
                    }
                ]
            },
            422,
            "invalid_request",
        ),
        (_infer_body([b"not an image"]), 400, "invalid_image"),
        (_infer_body([b"x"] * 65), 413, "payload_too_large"),  # MAX_IMAGES_PER_REQUEST is 64
    ],
)
async def test_bad_infer_requests_get_the_usual_error_shape(
    served: tuple[Any, Any], body: dict[str, Any], status: int, kind: str
) -> None:
    _, client = served
    response = await client.post("/v2/models/tiny-test/infer", json=body)
    assert response.status_code == status
    error = response.json()
    assert isinstance(error["error"], str) and error["type"] == kind
    assert len(error["error"]) < 300, "one short message, never one per element"


def _tensor(datatype: str, shape: list[int], data: str) -> bytes:
    """An infer body with one input, its data as literal JSON text."""
    head = '{"inputs": [{"name": "pixels", "datatype": "%s", "shape": %s, "data": %s}]}'
    return (head % (datatype, json.dumps(shape), data)).encode()


@pytest.mark.parametrize(
    ("content", "headers"),
    [
        (b'{"inputs": [], "id": ' + b"9" * 4400 + b"}", {}),  # past Python's int digits
        (b"[" * 3000 + b"]" * 3000, {}),  # nested past the recursion limit
        (_tensor("FP32", [1], "[" + "9" * 401 + "]"), {}),  # no FP32 holds it
        (_tensor("INT64", [1], str([2**70])), {}),
        (_tensor("FP32", [0, 10**30], "[]"), {}),
        (_tensor("FP32", [0, 2**31, 2**31], "[]"), {}),  # numpy: "array is too big"
        (json.dumps(_infer_body([b"x"]) | {"parameters": {"priority": "\u00b2"}}).encode(), {}),
        (b"{}", {"Inference-Header-Content-Length": b"\xb2"}),  # latin-1: a superscript two
    ],
)
async def test_input_past_what_python_or_numpy_take_gets_a_422_not_a_500(
    served: tuple[Any, Any], content: bytes, headers: dict[str, bytes]
) -> None:
    """Found by a review: each of these was a 500 (a ValueError, OverflowError or
    RecursionError past the checks; ``str.isdigit`` is true of a superscript two)."""
    _, client = served
    response = await client.post("/v2/models/tiny-test/infer", content=content, headers=headers)
    assert response.status_code == 422, response.text
    assert isinstance(response.json()["error"], str) and len(response.json()["error"]) < 300


async def test_a_json_body_is_read_whatever_its_content_type(served: tuple[Any, Any]) -> None:
    """tritonclient's sync client sends no Content-Type, its aio client octet-stream."""
    _, client = served
    body = json.dumps(_infer_body(distinct_images(1), outputs=[{"name": "embedding"}]))
    for content_type in (None, "application/octet-stream", "text/plain", "application/json"):
        headers = {"Content-Type": content_type} if content_type else {}
        response = await client.post("/v2/models/tiny-test/infer", content=body, headers=headers)
        assert response.status_code == 200, (content_type, response.text)
        assert response.json()["outputs"][0]["shape"] == [1, TINY_DIM]


async def test_no_outputs_asked_answers_every_output(served: tuple[Any, Any]) -> None:
    _, client = served
    response = await client.post("/v2/models/tiny-test/infer", json=_infer_body(distinct_images(2)))
    assert response.status_code == 200, response.text
    shapes = {o["name"]: o["shape"] for o in response.json()["outputs"]}
    assert shapes == {"embedding": [2, TINY_DIM], "top_k_probs": [2, 5], "top_k_indices": [2, 5]}


def _binary_request(
    inputs: list[tuple[str, str, list[int], bytes]],
    outputs: list[dict[str, Any]] | None = None,
    parameters: dict[str, Any] | None = None,
) -> tuple[bytes, dict[str, str]]:
    """A request in the binary tensor extension's form, as tritonclient builds it."""
    listed = [
        {
            "name": name,
            "datatype": datatype,
            "shape": shape,
            "parameters": {"binary_data_size": len(raw)},
        }
        for name, datatype, shape, raw in inputs
    ]
    document: dict[str, Any] = {"inputs": listed}
    if outputs is not None:
        document["outputs"] = outputs
    if parameters is not None:
        document["parameters"] = parameters
    head = json.dumps(document).encode()
    body = head + b"".join(raw for *_, raw in inputs)
    return body, {"Inference-Header-Content-Length": str(len(head))}


def _binary_answer(response: Any) -> dict[str, np.ndarray | list[bytes]]:
    """The outputs of an answer in the binary tensor extension's form."""
    length = int(response.headers["Inference-Header-Content-Length"])
    document = json.loads(response.content[:length])
    rest = memoryview(response.content)[length:]
    outputs: dict[str, np.ndarray | list[bytes]] = {}
    for output in document["outputs"]:
        size = output["parameters"]["binary_data_size"]
        raw, rest = bytes(rest[:size]), rest[size:]
        if output["datatype"] == "BYTES":
            outputs[output["name"]] = unpack_bytes(raw, output["name"])
        else:
            dtype = {"FP32": np.float32, "INT64": np.int64}[output["datatype"]]
            outputs[output["name"]] = np.frombuffer(raw, dtype).reshape(output["shape"])
    assert not rest, "bytes left over after the outputs"
    return outputs


async def test_raw_image_bytes_in_and_binary_tensors_out(
    served: tuple[Any, Any], tiny_store: Path
) -> None:
    """The binary tensor extension: encoded images as length-prefixed BYTES elements, no
    base64, shaped [N, 1] as tritonclient's batches are; outputs back as binary."""
    _, client = served
    images = distinct_images(2)
    body, headers = _binary_request(
        [("image", "BYTES", [2, 1], pack_bytes(images))],
        [{"name": "embedding", "parameters": {"binary_data": True}}, {"name": "top_k_indices"}],
    )
    response = await client.post("/v2/models/tiny-test/infer", content=body, headers=headers)
    assert response.status_code == 200, response.text
    assert response.headers["content-type"] == "application/octet-stream"
    length = int(response.headers["Inference-Header-Content-Length"])
    document = json.loads(response.content[:length])
    indices = next(o for o in document["outputs"] if o["name"] == "top_k_indices")
    assert "data" in indices and "parameters" not in indices  # not asked binary: JSON
    embedding = next(o for o in document["outputs"] if o["name"] == "embedding")
    assert embedding["parameters"] == {"binary_data_size": 2 * TINY_DIM * 4}
    rows = np.frombuffer(response.content[length:], np.float32).reshape(2, TINY_DIM)
    for row, image in zip(rows, images, strict=True):
        np.testing.assert_allclose(row, expected_for(image, tiny_store), atol=1e-5)
    # binary_data_output asks every output binary
    body, headers = _binary_request(
        [("image", "BYTES", [2], pack_bytes(images))], parameters={"binary_data_output": True}
    )
    every = await client.post("/v2/models/tiny-test/infer", content=body, headers=headers)
    assert every.status_code == 200, every.text
    outputs = _binary_answer(every)
    assert set(outputs) == {"embedding", "top_k_probs", "top_k_indices"}
    np.testing.assert_allclose(np.asarray(outputs["embedding"], np.float32), rows, atol=1e-6)


@pytest.mark.parametrize(
    ("header", "extra", "message"),
    [
        ("12345678", b"", "Inference-Header-Content-Length must be"),
        (None, b"", "binary tensors need the Inference-Header-Content-Length header"),
        ("", b"-10", "runs past the body's binary part"),  # the last 10 bytes cut
        ("", b"xx", "belong to no input"),
    ],
)
async def test_a_malformed_binary_body_gets_one_clear_message(
    served: tuple[Any, Any], header: str | None, extra: bytes, message: str
) -> None:
    _, client = served
    body, headers = _binary_request([("image", "BYTES", [1], pack_bytes(distinct_images(1)))])
    if header is None:
        headers = {}
    elif header:
        headers["Inference-Header-Content-Length"] = header
    if extra == b"-10":
        body, extra = body[:-10], b""
    response = await client.post(
        "/v2/models/tiny-test/infer", content=body + extra, headers=headers
    )
    assert response.status_code == 422, response.text
    assert message in response.json()["error"]


async def test_a_preprocessed_fp32_tensor_answers_as_its_image(
    served: tuple[Any, Any], tiny_store: Path
) -> None:
    _, client = served
    images = distinct_images(2)
    tensor = normalised_pixels(tiny_store, images)
    body, headers = _binary_request(
        [("pixels", "FP32", list(tensor.shape), tensor.tobytes())],
        [{"name": "embedding", "parameters": {"binary_data": False}}],
    )
    response = await client.post("/v2/models/tiny-test/infer", content=body, headers=headers)
    assert response.status_code == 200, response.text
    rows = np.array(response.json()["outputs"][0]["data"], np.float32).reshape(2, TINY_DIM)
    for row, image in zip(rows, images, strict=True):
        np.testing.assert_allclose(row, expected_for(image, tiny_store), atol=1e-5)
    as_json = {
        "inputs": [
            {
                "name": "pixels",
                "datatype": "FP32",
                "shape": list(tensor.shape),
                "data": tensor.tolist(),
            }
        ],
        "outputs": [{"name": "embedding"}],
    }
    nested = await client.post("/v2/models/tiny-test/infer", json=as_json)
    assert nested.status_code == 200, nested.text
    np.testing.assert_allclose(
        np.array(nested.json()["outputs"][0]["data"]).reshape(2, TINY_DIM), rows, atol=1e-6
    )
    other = tensor * 4  # normalised another way: values no 8-bit level maps to
    body, headers = _binary_request([("pixels", "FP32", list(other.shape), other.tobytes())])
    refused = await client.post("/v2/models/tiny-test/infer", content=body, headers=headers)
    assert refused.status_code == 422 and "outside 0-255" in refused.json()["error"]


async def test_class_count_answers_score_index_label(served: tuple[Any, Any]) -> None:
    """The classification extension, as Triton answers it."""
    _, client = served
    images = distinct_images(2)
    body = _infer_body(
        images,
        outputs=[
            {"name": "top_k_probs", "parameters": {"classification": 3, "binary_data": False}},
            {"name": "top_k_indices"},
        ],
    )
    response = await client.post("/v2/models/tiny-test/infer", json=body)
    assert response.status_code == 200, response.text
    outputs = {o["name"]: o for o in response.json()["outputs"]}
    strings = outputs["top_k_probs"]
    assert strings["datatype"] == "BYTES" and strings["shape"] == [2, 3]
    classes = (await client.get("/tags")).json()
    indices = np.array(outputs["top_k_indices"]["data"]).reshape(2, 3)
    cells = np.array(strings["data"]).reshape(2, 3)
    for row, expected in zip(cells, indices, strict=True):
        parsed = [cell.split(":", 2) for cell in row]
        assert [int(index) for _, index, _ in parsed] == list(expected)
        assert [label for *_, label in parsed] == [classes[i] for i in expected]
        scores = [float(score) for score, *_ in parsed]
        assert scores == sorted(scores, reverse=True) and 0 < sum(scores) <= 1.0001


async def test_config_and_statistics_in_tritons_form(served: tuple[Any, Any]) -> None:
    _, client = served
    config = (await client.get("/v2/models/tiny-test/config")).json()
    assert config["name"] == "tiny-test" and config["max_batch_size"] >= 1
    inputs = {i["name"]: i for i in config["input"]}
    assert inputs["image"]["data_type"] == "TYPE_STRING"
    assert inputs["pixels"] == {
        "name": "pixels",
        "data_type": "TYPE_FP32",
        "dims": [3, 32, 32],
        "format": "FORMAT_NCHW",
    }
    assert {o["name"] for o in config["output"]} == {"embedding", "top_k_probs", "top_k_indices"}
    assert config["dynamic_batching"]["max_queue_delay_microseconds"] >= 0
    assert config["instance_group"] == [{"name": "cpu", "kind": "KIND_CPU", "count": 1, "gpus": []}]
    assert (await client.get("/v2/models/tiny-test/versions/1/config")).json() == config
    before = (await client.get("/v2/models/tiny-test/stats")).json()["model_stats"][0]
    response = await client.post("/v2/models/tiny-test/infer", json=_infer_body(distinct_images(3)))
    assert response.status_code == 200
    bad = await client.post("/v2/models/tiny-test/infer", json=_infer_body([b"not an image"]))
    assert bad.status_code == 400
    after = (await client.get("/v2/models/tiny-test/versions/1/stats")).json()["model_stats"][0]
    assert (after["name"], after["version"]) == ("tiny-test", "1")
    # The bad one is refused before the queue (its header is no image's): never batched.
    assert after["inference_count"] - before["inference_count"] == 3
    stats, was = after["inference_stats"], before["inference_stats"]
    assert stats["success"]["count"] - was["success"]["count"] == 1
    assert stats["fail"]["count"] - was["fail"]["count"] == 1
    assert stats["queue"]["count"] - was["queue"]["count"] == 3
    assert stats["compute_infer"]["ns"] > was["compute_infer"]["ns"]
    assert after["execution_count"] > before["execution_count"] and after["batch_stats"]
    assert (
        sum(b["compute_infer"]["count"] for b in after["batch_stats"]) == after["execution_count"]
    )
    # A version by its served id's part after "@", as infer takes it (it was a 404).
    served_as = response.headers["X-Model-Id"].rsplit("@", 1)[-1]
    by_id = await client.get(f"/v2/models/tiny-test/versions/{served_as}/stats")
    assert by_id.status_code == 200 and by_id.json()["model_stats"][0]["version"] == "1"
    every = (await client.get("/v2/models/stats")).json()["model_stats"]
    assert [entry["name"] for entry in every] == ["tiny-test"]
    missing = await client.get("/v2/models/resnet50/stats")
    assert missing.status_code == 404 and missing.json()["type"] == "model_not_found"


async def test_server_metadata_lists_the_extensions(served: tuple[Any, Any]) -> None:
    _, client = served
    extensions = (await client.get("/v2")).json()["extensions"]
    assert set(extensions) == {
        "binary_tensor_data",
        "classification",
        "model_configuration",
        "model_repository",
        "statistics",
    }
