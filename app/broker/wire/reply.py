"""A reply as it crosses the broker: one list element: a 2-byte magic, the length of a JSON
header (4 bytes, big-endian), the header (the request's id, the size of the batch it ran in,
and either its arrays' names, dtypes and shapes, or an error's class name and message), then
the arrays' raw little-endian bytes, end to end. A front end parses it defensively
(``app.broker.wire.parsing``): a malformed reply is never delivered; dtypes and error names
come from allowlists."""

from __future__ import annotations

import json
import struct
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np
import numpy.typing as npt

from app.broker.wire.parsing import MalformedMessage, integer, json_object, token
from app.errors import IMAGE_ERRORS, DeadlineExceeded, InferenceError, ServerError, Shed
from app.jobs import EmbeddingAndTopK, TopK

REPLY_MAGIC = b"R1"
# The only arrays a reply may carry, and their only dtypes (little-endian on the wire).
REPLY_ARRAYS: dict[str, str] = {"embedding": "<f4", "indices": "<i8", "probs": "<f4"}
# The only errors a reply may name: rebuilt as these classes, anything else is refused.
REPLY_ERRORS: dict[str, type[ServerError]] = {
    **IMAGE_ERRORS,
    **{cls.__name__: cls for cls in (InferenceError, DeadlineExceeded, Shed)},
}


def _frame(header: dict[str, Any], payload: Sequence[bytes] = ()) -> bytes:
    raw = json.dumps(header, separators=(",", ":")).encode()
    return b"".join((REPLY_MAGIC, struct.pack(">I", len(raw)), raw, *payload))


def encode_result(
    request_id: str,
    batch_size: int,
    outputs: Mapping[str, npt.NDArray[Any]],
    shared: bool = False,
) -> bytes:
    """A reply carrying one item's arrays: its embedding, its top-k indices and probs, or
    all three (``EMBEDDING_AND_TAG``); ``shared`` (``sh``): computed for an identical
    request."""
    arrays, payload = [], []
    for name, array in outputs.items():
        dtype = REPLY_ARRAYS[name]
        data = np.ascontiguousarray(array, dtype=dtype)
        arrays.append([name, dtype, list(data.shape)])
        payload.append(data.tobytes())
    header: dict[str, Any] = {"id": request_id, "batch": batch_size, "arrays": arrays}
    if shared:
        header["sh"] = 1
    return _frame(header, payload)


def encode_error(request_id: str, batch_size: int, error: ServerError) -> bytes:
    """A reply carrying one item's error (its class must be in ``REPLY_ERRORS``)."""
    name = type(error).__name__
    if name not in REPLY_ERRORS:
        error, name = InferenceError("model call failed"), "InferenceError"
    return _frame({"id": request_id, "batch": batch_size, "error": [name, error.message]})


def encode_answer(request_id: str, batch_size: int, answer: object, shared: bool = False) -> bytes:
    """A reply carrying one item's answer as a worker computed it: an embedding array,
    ``TopK``, ``EmbeddingAndTopK`` or a ``ServerError``; ``shared``: computed for an
    identical request (an error says nothing of it)."""
    if isinstance(answer, ServerError):
        return encode_error(request_id, batch_size, answer)
    outputs: dict[str, Any]
    if isinstance(answer, TopK):
        outputs = {"indices": answer.indices, "probs": answer.probs}
    elif isinstance(answer, EmbeddingAndTopK):
        top = answer.top_k
        outputs = {"embedding": answer.embedding, "indices": top.indices, "probs": top.probs}
    else:
        outputs = {"embedding": answer}
    return encode_result(request_id, batch_size, outputs, shared)


@dataclass(frozen=True)
class Reply:
    """One reply as a front end reads it: the result for ``id`` (or its error)."""

    id: str
    batch_size: int  # the size of the batch the worker ran it in
    # np.ndarray (embedding), TopK (tag), EmbeddingAndTopK (both) or a ServerError
    result: object
    shared: bool = False  # computed for an identical request (app.broker.worker.sharing)


def decode_reply(raw: bytes, max_bytes: int = 64 << 20) -> Reply:
    """A reply list element as a ``Reply``; ``MalformedMessage`` says what is wrong."""
    if len(raw) < 6 or raw[:2] != REPLY_MAGIC or len(raw) > max_bytes:
        raise MalformedMessage("not a reply of this format")
    (length,) = struct.unpack(">I", raw[2:6])
    header = json_object(raw[6 : 6 + length], "the reply header")
    body = memoryview(raw)[6 + length :]
    request_id = token(header.get("id"), "the id")
    batch_size = integer(header.get("batch"), "batch", 1, 1 << 20)
    if "error" in header:
        error = header["error"]
        if not (isinstance(error, list) and len(error) == 2 and isinstance(error[1], str)):
            raise MalformedMessage("the error is not [name, message]")
        kind = REPLY_ERRORS.get(error[0])
        if kind is None:
            raise MalformedMessage(f"error {error[0]!r} is not one a worker may send")
        return Reply(request_id, batch_size, kind(error[1][:1000]))
    arrays = _arrays(header.get("arrays"), body)
    shared = header.get("sh") == 1
    if set(arrays) == {"embedding"}:
        return Reply(request_id, batch_size, arrays["embedding"], shared)
    if set(arrays) == {"indices", "probs"}:
        return Reply(request_id, batch_size, TopK(arrays["indices"], arrays["probs"]), shared)
    if set(arrays) == {"embedding", "indices", "probs"}:
        top = TopK(arrays["indices"], arrays["probs"])
        return Reply(request_id, batch_size, EmbeddingAndTopK(arrays["embedding"], top), shared)
    raise MalformedMessage(f"arrays {sorted(arrays)} are neither an embedding, top-k nor both")


def _arrays(described: object, body: memoryview) -> dict[str, npt.NDArray[Any]]:
    if not isinstance(described, list) or len(described) > len(REPLY_ARRAYS):
        raise MalformedMessage("the arrays are not a short list")
    arrays: dict[str, npt.NDArray[Any]] = {}
    offset = 0
    for entry in described:
        if not (isinstance(entry, list) and len(entry) == 3):
            raise MalformedMessage("an array is not [name, dtype, shape]")
        name, dtype, shape = entry
        if REPLY_ARRAYS.get(name) != dtype:
            raise MalformedMessage(f"array {name!r} of dtype {dtype!r} is not allowed")
        if not (isinstance(shape, list) and len(shape) == 1):
            raise MalformedMessage(f"array {name!r} is not one-dimensional")
        count = integer(shape[0], "an array's length", 0, 1 << 24)
        size = count * np.dtype(dtype).itemsize
        if offset + size > len(body):
            raise MalformedMessage("the arrays run past the reply")
        arrays[name] = np.frombuffer(body[offset : offset + size], dtype=dtype).astype(
            dtype[1:], copy=False
        )
        offset += size
    if offset != len(body):
        raise MalformedMessage("bytes are left over after the arrays")
    return arrays
