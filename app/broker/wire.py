"""What crosses the broker, both ways, and how it is checked. No pickle anywhere.

A request is a stream entry with two fields: ``h``, a small JSON header (the request's id,
its front end, the task, ``k`` and the milliseconds left before its deadline), and ``img``,
the upload's bytes as they came. A reply is one list element: a 2-byte magic, the length of a
JSON header (4 bytes, big-endian), the header (the request's id, the size of the batch it ran
in, and either its arrays' names, dtypes and shapes, or an error's class name and message),
then the arrays' raw little-endian bytes, end to end.

Both sides parse what they read defensively: anyone who can write to Redis can write
anything. A malformed request is never run; a malformed reply is never delivered; dtypes and
error names come from allowlists.
"""

from __future__ import annotations

import json
import re
import struct
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np
import numpy.typing as npt
from pydantic import BaseModel, ConfigDict, Field, ValidationError

from app.errors import IMAGE_ERRORS, DeadlineExceeded, InferenceError, ServerError
from app.jobs import EmbeddingAndTopK, Task, TopK
from app.lifecycle import VersionState
from app.settings_values import MODEL_NAME_PATTERN

WIRE_VERSION = 1
REPLY_MAGIC = b"R1"
MAX_HEADER_BYTES = 4096  # a request's or reply's JSON header; ours are under 200 bytes
MAX_K = 100_000
MAX_SIDE = 8192  # the largest preprocessed image (pixels) an entry may carry, per side
MAX_TTL_MS = 2 * 3600 * 1000  # entries older than this are trimmed unread
_TOKEN = re.compile(r"^[A-Za-z0-9:._-]{1,128}$")
# The only arrays a reply may carry, and their only dtypes (little-endian on the wire).
REPLY_ARRAYS: dict[str, str] = {"embedding": "<f4", "indices": "<i8", "probs": "<f4"}
# The only errors a reply may name: rebuilt as these classes, anything else is refused.
REPLY_ERRORS: dict[str, type[ServerError]] = {
    **IMAGE_ERRORS,
    **{cls.__name__: cls for cls in (InferenceError, DeadlineExceeded)},
}


TRACEPARENT_LENGTH = 55  # "00-<32 hex>-<16 hex>-<2 hex>"


class MalformedMessage(ValueError):
    """A stream entry or a reply that does not follow this format: dropped, never used."""


@dataclass(frozen=True)
class Request:
    """One request as a worker reads it from the stream."""

    id: str
    frontend: str
    task: Task
    top_k: int
    ttl_ms: int  # deadline: the entry's id time (Redis's clock) plus this
    image: bytes
    # (height, width): ``image`` holds that many uint8 RGB pixels, preprocessed (a v2
    # client's FP32 input), rather than an encoded upload.
    pixels: tuple[int, int] | None = None
    traceparent: str | None = None  # the sender's trace context, when the request is traced

    def as_input(self) -> bytes | npt.NDArray[np.uint8]:
        """What a worker runs: the encoded upload, or the pixels as ``[H, W, 3]``."""
        if self.pixels is None:
            return self.image
        return np.frombuffer(self.image, dtype=np.uint8).reshape(*self.pixels, 3)


def encode_request(
    request_id: str,
    frontend: str,
    task: Task,
    top_k: int,
    ttl_ms: int,
    image: bytes | npt.NDArray[np.uint8],
    traceparent: str | None = None,
) -> dict[str, bytes]:
    """The stream entry's fields for one request: an encoded upload, or ``[H, W, 3]`` uint8
    pixels (their size in the header's ``px``); a traced request's W3C ``traceparent`` in
    the header's ``tp``."""
    header: dict[str, Any] = {
        "v": WIRE_VERSION,
        "id": request_id,
        "fe": frontend,
        "task": task.value,
        "k": top_k,
        "ttl_ms": ttl_ms,
    }
    if isinstance(image, np.ndarray):
        if image.dtype != np.uint8 or image.ndim != 3 or image.shape[2] != 3:
            raise ValueError(f"pixels are uint8 [H, W, 3], not {image.dtype} {image.shape}")
        header["px"] = list(image.shape[:2])
        image = np.ascontiguousarray(image).tobytes()
    if traceparent is not None:
        header["tp"] = traceparent
    return {"h": json.dumps(header, separators=(",", ":")).encode(), "img": image}


def _token(value: object, what: str) -> str:
    if not isinstance(value, str) or not _TOKEN.match(value):
        raise MalformedMessage(f"{what} is not a short token")
    return value


def _int(value: object, what: str, low: int, high: int) -> int:
    if not isinstance(value, int) or isinstance(value, bool) or not low <= value <= high:
        raise MalformedMessage(f"{what} is not an integer in {low}..{high}")
    return value


def _json_object(raw: object, what: str) -> dict[str, Any]:
    if not isinstance(raw, bytes) or len(raw) > MAX_HEADER_BYTES:
        raise MalformedMessage(f"{what} is missing or over {MAX_HEADER_BYTES} bytes")
    try:
        header = json.loads(raw)
    except (UnicodeDecodeError, ValueError, RecursionError):  # nesting past the stack
        raise MalformedMessage(f"{what} is not JSON") from None
    if not isinstance(header, dict):
        raise MalformedMessage(f"{what} is not a JSON object")
    return header


def decode_request(fields: Mapping[bytes, bytes], max_image_bytes: int) -> Request:
    """A stream entry's fields as a ``Request``; ``MalformedMessage`` says what is wrong."""
    if set(fields) != {b"h", b"img"}:
        raise MalformedMessage(f"fields {sorted(fields)!r} are not exactly h and img")
    header = _json_object(fields[b"h"], "the header")
    if header.get("v") != WIRE_VERSION:
        raise MalformedMessage(f"wire version {header.get('v')!r} is not {WIRE_VERSION}")
    try:
        task = Task(str(header.get("task")))
    except ValueError:
        raise MalformedMessage(f"task {header.get('task')!r} is unknown") from None
    image = fields[b"img"]
    if not isinstance(image, bytes) or len(image) > max_image_bytes:
        raise MalformedMessage(f"the image is missing or over {max_image_bytes} bytes")
    low_k = 0 if task is Task.EMBEDDING else 1  # a task with top-k needs k
    pixels = None
    if "px" in header:
        size = header["px"]
        if not isinstance(size, list) or len(size) != 2:
            raise MalformedMessage("px is not [height, width]")
        pixels = (_int(size[0], "the height", 1, MAX_SIDE), _int(size[1], "the width", 1, MAX_SIDE))
        if len(image) != pixels[0] * pixels[1] * 3:
            raise MalformedMessage(f"{len(image)} bytes are not {pixels} RGB pixels")
    return Request(
        id=_token(header.get("id"), "the id"),
        frontend=_token(header.get("fe"), "the front end"),
        task=task,
        top_k=_int(header.get("k"), "k", low_k, MAX_K),
        ttl_ms=_int(header.get("ttl_ms"), "ttl_ms", 1, MAX_TTL_MS),
        image=image,
        pixels=pixels,
        traceparent=_traceparent(header.get("tp")),
    )


def _traceparent(value: object) -> str | None:
    """A header's trace context: kept when it has a traceparent's shape, else ignored (a
    trace is never worth a request)."""
    if isinstance(value, str) and len(value) == TRACEPARENT_LENGTH:
        return value
    return None


def text(value: object) -> str:
    """Redis's replies come as bytes (or str, or loosely typed): text, for names and ids."""
    return value.decode() if isinstance(value, bytes) else str(value)


def entry_time_ms(entry_id: bytes | str) -> int:
    """The Redis time (ms) at which a stream entry was added: its id's first part."""
    return int(text(entry_id).split("-", 1)[0])


def _frame(header: dict[str, Any], payload: Sequence[bytes] = ()) -> bytes:
    raw = json.dumps(header, separators=(",", ":")).encode()
    return b"".join((REPLY_MAGIC, struct.pack(">I", len(raw)), raw, *payload))


def encode_result(
    request_id: str, batch_size: int, outputs: Mapping[str, npt.NDArray[Any]]
) -> bytes:
    """A reply carrying one item's arrays: its embedding, its top-k indices and probs, or
    all three (``EMBEDDING_AND_TAG``)."""
    arrays, payload = [], []
    for name, array in outputs.items():
        dtype = REPLY_ARRAYS[name]
        data = np.ascontiguousarray(array, dtype=dtype)
        arrays.append([name, dtype, list(data.shape)])
        payload.append(data.tobytes())
    return _frame({"id": request_id, "batch": batch_size, "arrays": arrays}, payload)


def encode_error(request_id: str, batch_size: int, error: ServerError) -> bytes:
    """A reply carrying one item's error (its class must be in ``REPLY_ERRORS``)."""
    name = type(error).__name__
    if name not in REPLY_ERRORS:
        error, name = InferenceError("model call failed"), "InferenceError"
    return _frame({"id": request_id, "batch": batch_size, "error": [name, error.message]})


def encode_answer(request_id: str, batch_size: int, answer: object) -> bytes:
    """A reply carrying one item's answer as a worker computed it: an embedding array,
    ``TopK``, ``EmbeddingAndTopK`` or a ``ServerError``."""
    if isinstance(answer, ServerError):
        return encode_error(request_id, batch_size, answer)
    if isinstance(answer, TopK):
        return encode_result(
            request_id, batch_size, {"indices": answer.indices, "probs": answer.probs}
        )
    if isinstance(answer, EmbeddingAndTopK):
        top = answer.top_k
        return encode_result(
            request_id,
            batch_size,
            {"embedding": answer.embedding, "indices": top.indices, "probs": top.probs},
        )
    return encode_result(request_id, batch_size, {"embedding": answer})  # type: ignore[dict-item]


@dataclass(frozen=True)
class Reply:
    """One reply as a front end reads it: the result for ``id`` (or its error)."""

    id: str
    batch_size: int  # the size of the batch the worker ran it in
    # np.ndarray (embedding), TopK (tag), EmbeddingAndTopK (both) or a ServerError
    result: object


def decode_reply(raw: bytes, max_bytes: int = 64 << 20) -> Reply:
    """A reply list element as a ``Reply``; ``MalformedMessage`` says what is wrong."""
    if len(raw) < 6 or raw[:2] != REPLY_MAGIC or len(raw) > max_bytes:
        raise MalformedMessage("not a reply of this format")
    (length,) = struct.unpack(">I", raw[2:6])
    header = _json_object(raw[6 : 6 + length], "the reply header")
    body = memoryview(raw)[6 + length :]
    request_id = _token(header.get("id"), "the id")
    batch_size = _int(header.get("batch"), "batch", 1, 1 << 20)
    if "error" in header:
        error = header["error"]
        if not (isinstance(error, list) and len(error) == 2 and isinstance(error[1], str)):
            raise MalformedMessage("the error is not [name, message]")
        kind = REPLY_ERRORS.get(error[0])
        if kind is None:
            raise MalformedMessage(f"error {error[0]!r} is not one a worker may send")
        return Reply(request_id, batch_size, kind(error[1][:1000]))
    arrays = _arrays(header.get("arrays"), body)
    if set(arrays) == {"embedding"}:
        return Reply(request_id, batch_size, arrays["embedding"])
    if set(arrays) == {"indices", "probs"}:
        return Reply(request_id, batch_size, TopK(arrays["indices"], arrays["probs"]))
    if set(arrays) == {"embedding", "indices", "probs"}:
        top = TopK(arrays["indices"], arrays["probs"])
        return Reply(request_id, batch_size, EmbeddingAndTopK(arrays["embedding"], top))
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
        count = _int(shape[0], "an array's length", 0, 1 << 24)
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


class AdvertisedTrial(BaseModel):
    """A runtime and precision a worker tried for a model (``app.batching.Trial``)."""

    model_config = ConfigDict(extra="ignore")

    label: str = Field(max_length=64)
    passed: bool
    cosine_min: float | None = None
    top1: float | None = Field(None, ge=0, le=1)
    images_per_s: float | None = Field(None, ge=0)


class AdvertisedModel(BaseModel):
    """One model version a worker holds, is loading, draining or failed to load, as its
    heartbeat says (front ends route by it: ``app.lifecycle.routes``): what runs it, the
    runtimes that failed their self-test there (and why), how many times slower than the
    fastest of those it runs, and why it failed (``step``, ``reason``) or drains."""

    model_config = ConfigDict(extra="ignore")

    name: str = Field(pattern=MODEL_NAME_PATTERN)
    version: int = Field(ge=1)
    served_id: str = Field(max_length=300)
    state: VersionState
    runtime: str | None = Field(None, max_length=32)
    batch_size: int | None = Field(None, ge=1)
    memory_bytes: int | None = Field(None, ge=0)
    step: str = Field("", max_length=32)
    reason: str = Field("", max_length=1000)
    skipped: dict[str, str] = Field(default_factory=dict, max_length=8)
    slowdown: float | None = Field(None, gt=0)
    dtype: str | None = Field(None, max_length=16)
    trials: list[AdvertisedTrial] = Field(default_factory=list, max_length=16)


class WorkerInfo(BaseModel):
    """What a worker says of itself in its heartbeat (``app.broker.consumer``); a front end
    validates it before it believes any of it (``/info``, readiness, routing, metrics)."""

    model_config = ConfigDict(extra="ignore")

    name: str = Field(pattern=_TOKEN.pattern)
    models: list[AdvertisedModel] = Field(default_factory=list, max_length=256)
    draining: bool = False  # told to stop: it finishes what it holds and takes nothing new
    host: str = Field(max_length=128)
    index: int = Field(ge=0)
    pid: int = Field(ge=0)
    device: str = Field(max_length=32)
    threads: int = Field(ge=0)
    batch_size: int = Field(ge=1)
    ready: bool
    alive: bool
    running: int = Field(ge=0)
    rss_bytes: int | None = Field(None, ge=0)
    cpu_seconds: float | None = Field(None, ge=0)  # absent from workers before it
    restarts: int = Field(ge=0)
    runtime: str | None = Field(None, max_length=32)  # absent from workers before runtimes
    batches: int = Field(ge=0)
    items: int = Field(ge=0)
    mixed_batches: int = Field(ge=0)
    expired: int = Field(ge=0)
    malformed: int = Field(ge=0)
    reclaimed: int = Field(ge=0)
    given_up: int = Field(ge=0)
    # served id -> task -> batch size -> batches; -> task -> histogram (see ConsumerStats)
    sizes: dict[str, dict[Task, dict[int, int]]] = Field(default_factory=dict)
    model_s: dict[str, dict[Task, list[float]]] = Field(default_factory=dict)
    wait_s: dict[str, dict[Task, list[float]]] = Field(default_factory=dict)

    def holds(self, served_id: str) -> bool:
        """Whether it reads ``served_id``'s streams: ready, or draining (it no longer takes
        the name's new requests, and finishes those sent to it)."""
        reading = (VersionState.READY, VersionState.DRAINING)
        return any(m.served_id == served_id and m.state in reading for m in self.models)


def decode_worker_info(raw: bytes | str | None) -> WorkerInfo:
    """A heartbeat's description, or ``MalformedMessage``."""
    if raw is None or len(raw) > 64 * 1024:
        raise MalformedMessage("the worker's description is missing or too large")
    try:
        return WorkerInfo.model_validate_json(raw)
    except (ValidationError, RecursionError) as exc:
        raise MalformedMessage(f"the worker's description does not check: {exc}") from None
