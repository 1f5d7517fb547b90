"""What crosses the broker: requests and replies survive the trip exactly, and anything that
is not our format (forged, truncated, pickled, oversized) is refused, never used."""

from __future__ import annotations

import json
import pickle
import struct

import numpy as np
import pytest

from app.broker.wire.parsing import MalformedMessage
from app.broker.wire.reply import decode_reply, encode_error, encode_result
from app.broker.wire.request import decode_request, encode_request, entry_time_ms
from app.errors import DeadlineExceeded, InferenceError, InvalidImage, PayloadTooLarge
from app.jobs import EmbeddingAndTopK, Task, TopK


def _fields(**header: object) -> dict[bytes, bytes]:
    fields = encode_request("fe1-7", "fe1", Task.TAG, 5, 3000, b"jpeg bytes")
    decoded = json.loads(fields["h"])
    decoded.update(header)
    return {b"h": json.dumps(decoded).encode(), b"img": fields["img"]}


def test_a_request_comes_back_as_it_was_sent() -> None:
    fields = encode_request("fe1-7", "fe1", Task.TAG, 5, 3000, b"jpeg bytes")
    request = decode_request({k.encode(): v for k, v in fields.items()}, max_image_bytes=100)
    assert (request.id, request.frontend, request.task, request.top_k, request.ttl_ms) == (
        "fe1-7",
        "fe1",
        Task.TAG,
        5,
        3000,
    )
    assert request.image == b"jpeg bytes"
    assert len(fields["h"]) < 100  # the header stays small


def test_preprocessed_pixels_come_back_as_they_were_sent() -> None:
    pixels = np.arange(2 * 3 * 3, dtype=np.uint8).reshape(2, 3, 3)
    fields = encode_request("fe1-8", "fe1", Task.EMBEDDING, 0, 3000, pixels)
    request = decode_request({k.encode(): v for k, v in fields.items()}, max_image_bytes=100)
    assert request.pixels == (2, 3)
    np.testing.assert_array_equal(request.as_input(), pixels)
    with pytest.raises(ValueError, match="uint8"):
        encode_request("fe1-9", "fe1", Task.EMBEDDING, 0, 3000, pixels.astype(np.float32))


@pytest.mark.parametrize(
    ("fields", "reason"),
    [
        ({b"h": pickle.dumps({"v": 1}), b"img": b"x"}, "not JSON"),
        ({b"img": b"x"}, "exactly h and img"),
        ({**_fields(), b"extra": b"1"}, "exactly h and img"),
        (_fields(v=2), "wire version"),
        (_fields(task="segment"), "task"),
        (_fields(k="5"), "k is not an integer"),
        (_fields(k=True), "k is not an integer"),
        (_fields(k=0), "k is not an integer"),
        (_fields(ttl_ms=-1), "ttl_ms"),
        (_fields(id="../../etc/passwd"), "the id"),
        (_fields(fe=""), "the front end"),
        ({b"h": b"[1, 2]", b"img": b"x"}, "not a JSON object"),
        ({b"h": b"{" * 5000, b"img": b"x"}, "over 4096 bytes"),
        ({**_fields(), b"img": b"x" * 101}, "over 100 bytes"),
        (_fields(px=[2, 2]), "are not \\(2, 2\\) RGB pixels"),
        (_fields(px=[0, 2]), "the height"),
        (_fields(px="2x2"), "px is not"),
    ],
)
def test_a_malformed_request_is_refused_with_its_reason(
    fields: dict[bytes, bytes], reason: str
) -> None:
    with pytest.raises(MalformedMessage, match=reason):
        decode_request(fields, max_image_bytes=100)


def test_an_embedding_request_may_have_k_zero() -> None:
    request = decode_request(_fields(task="embedding", k=0), max_image_bytes=100)
    assert request.task is Task.EMBEDDING and request.top_k == 0


def test_a_request_for_both_needs_k() -> None:
    request = decode_request(_fields(task="embedding_and_tag", k=3), max_image_bytes=100)
    assert request.task is Task.EMBEDDING_AND_TAG and request.top_k == 3
    with pytest.raises(MalformedMessage, match="k is not an integer"):
        decode_request(_fields(task="embedding_and_tag", k=0), max_image_bytes=100)


def test_the_entry_id_carries_redis_time() -> None:
    assert entry_time_ms(b"1795557463117-3") == 1795557463117
    assert entry_time_ms("17-0") == 17


def test_results_come_back_exactly() -> None:
    embedding = np.random.default_rng(0).standard_normal(1280).astype(np.float32)
    reply = decode_reply(encode_result("fe1-1", 7, {"embedding": embedding}))
    assert (reply.id, reply.batch_size) == ("fe1-1", 7)
    assert isinstance(reply.result, np.ndarray) and reply.result.dtype == np.float32
    np.testing.assert_array_equal(reply.result, embedding)
    tags = decode_reply(
        encode_result(
            "fe1-2",
            1,
            {"indices": np.array([3, 1, 2]), "probs": np.array([0.5, 0.3, 0.2], np.float32)},
        )
    )
    assert isinstance(tags.result, TopK)
    assert tags.result.indices.tolist() == [3, 1, 2]
    np.testing.assert_allclose(tags.result.probs, [0.5, 0.3, 0.2])


def test_an_embedding_and_its_top_k_come_back_together_exactly() -> None:
    embedding = np.random.default_rng(1).standard_normal(1280).astype(np.float32)
    indices, probs = np.array([4, 0]), np.array([0.7, 0.2], np.float32)
    arrays = {"embedding": embedding, "indices": indices, "probs": probs}
    reply = decode_reply(encode_result("fe1-4", 3, arrays))
    assert (reply.id, reply.batch_size) == ("fe1-4", 3)
    assert isinstance(reply.result, EmbeddingAndTopK)
    assert reply.result.embedding.dtype == np.float32
    np.testing.assert_array_equal(reply.result.embedding, embedding)
    assert reply.result.top_k.indices.tolist() == [4, 0]
    np.testing.assert_array_equal(reply.result.top_k.probs, probs)


@pytest.mark.parametrize(
    ("error", "kind"),
    [
        (InvalidImage("cannot decode"), InvalidImage),
        (PayloadTooLarge("too many pixels"), PayloadTooLarge),
        (DeadlineExceeded("late"), DeadlineExceeded),
        (InferenceError("model call failed"), InferenceError),
    ],
)
def test_errors_come_back_typed(error: Exception, kind: type) -> None:
    reply = decode_reply(encode_error("fe1-3", 4, error))  # type: ignore[arg-type]
    assert type(reply.result) is kind and str(reply.result) == str(error)


def _reply(header: object, body: bytes = b"") -> bytes:
    raw = json.dumps(header).encode()
    return b"R1" + struct.pack(">I", len(raw)) + raw + body


@pytest.mark.parametrize(
    ("raw", "reason"),
    [
        (pickle.dumps({"id": "x"}), "not a reply"),
        (b"R1" + struct.pack(">I", 5) + b"nope!", "not JSON"),
        (_reply({"id": "x", "batch": 1, "error": ["SystemExit", "bye"]}), "not one a worker"),
        (_reply({"id": "x", "batch": 1, "error": "oops"}), "not \\[name, message\\]"),
        (
            _reply({"id": "x", "batch": 1, "arrays": [["embedding", "|O", [1]]]}, b"12345678"),
            "dtype",
        ),
        (
            _reply({"id": "x", "batch": 1, "arrays": [["weights", "<f4", [1]]]}, b"1234"),
            "not allowed",
        ),
        (
            _reply({"id": "x", "batch": 1, "arrays": [["embedding", "<f4", [4]]]}, b"1234"),
            "run past",
        ),
        (
            _reply({"id": "x", "batch": 1, "arrays": [["embedding", "<f4", [1]]]}, b"12345"),
            "left over",
        ),
        (
            _reply({"id": "x", "batch": 1, "arrays": [["embedding", "<f4", [2, 2]]]}, b"0" * 16),
            "one-dimensional",
        ),
        (_reply({"id": "x", "batch": 1, "arrays": [["probs", "<f4", [1]]]}, b"1234"), "neither"),
        (
            _reply(
                {
                    "id": "x",
                    "batch": 1,
                    "arrays": [["embedding", "<f4", [1]], ["probs", "<f4", [1]]],
                },
                b"12345678",
            ),
            "neither",
        ),
        (_reply({"id": "x", "batch": 0, "arrays": []}), "batch"),
        (_reply({"batch": 1, "arrays": []}), "the id"),
    ],
)
def test_a_malformed_reply_is_refused_with_its_reason(raw: bytes, reason: str) -> None:
    with pytest.raises(MalformedMessage, match=reason):
        decode_reply(raw)


def test_a_header_nested_past_the_stack_is_malformed_not_a_crash() -> None:
    deep = b"[" * 2000 + b"]" * 2000
    with pytest.raises(MalformedMessage, match="not JSON"):
        decode_request({b"h": deep, b"img": b"x"}, max_image_bytes=100)
    with pytest.raises(MalformedMessage, match="not JSON"):
        decode_reply(b"R1" + struct.pack(">I", len(deep)) + deep)
