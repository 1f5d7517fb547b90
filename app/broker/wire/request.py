"""A request as it crosses the broker: a stream entry with two fields: ``h``, a small JSON
header (the request's id, its front end, the task, ``k`` and the milliseconds left before
its deadline), and ``img``, the upload's bytes as they came (or a v2 client's preprocessed
pixels, their size in the header). A worker parses it defensively
(``app.broker.wire.parsing``): a malformed request is never run."""

from __future__ import annotations

import json
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

import numpy as np
import numpy.typing as npt

from app.broker.wire.parsing import MalformedMessage, integer, json_object, text, token
from app.jobs import Task

WIRE_VERSION = 1
MAX_K = 100_000
MAX_SIDE = 8192  # the largest preprocessed image (pixels) an entry may carry, per side
MAX_TTL_MS = 2 * 3600 * 1000  # entries older than this are trimmed unread
TRACEPARENT_LENGTH = 55  # "00-<32 hex>-<16 hex>-<2 hex>"


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
    # Its front end keeps answers (its response cache is on, not asked afresh): an identical
    # request's answer is its answer (app.broker.worker.sharing).
    shared: bool = False

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
    shared: bool = False,
) -> dict[str, bytes]:
    """The stream entry's fields for one request: an encoded upload, or ``[H, W, 3]`` uint8
    pixels (their size in the header's ``px``); a traced request's W3C ``traceparent`` in
    the header's ``tp``; ``sh``: 1 when an identical request's answer may answer it."""
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
    if shared:
        header["sh"] = 1
    return {"h": json.dumps(header, separators=(",", ":")).encode(), "img": image}


def with_ttl(fields: Mapping[str, bytes], ttl_ms: int) -> dict[str, bytes]:
    """The fields of a request sent again, with ``ttl_ms`` left before its deadline (a
    worker counts it from the new entry's time).

    >>> with_ttl({"h": b'{"v":1,"id":"fe-1","ttl_ms":9000}', "img": b"x"}, 250)["h"]
    b'{"v":1,"id":"fe-1","ttl_ms":250}'
    """
    header = json.loads(fields["h"])
    if not isinstance(header, dict) or "ttl_ms" not in header:
        return dict(fields)
    header["ttl_ms"] = max(1, ttl_ms)
    return {**fields, "h": json.dumps(header, separators=(",", ":")).encode()}


def decode_request(fields: Mapping[bytes, bytes], max_image_bytes: int) -> Request:
    """A stream entry's fields as a ``Request``; ``MalformedMessage`` says what is wrong."""
    if set(fields) != {b"h", b"img"}:
        raise MalformedMessage(f"fields {sorted(fields)!r} are not exactly h and img")
    header = json_object(fields[b"h"], "the header")
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
        pixels = (
            integer(size[0], "the height", 1, MAX_SIDE),
            integer(size[1], "the width", 1, MAX_SIDE),
        )
        if len(image) != pixels[0] * pixels[1] * 3:
            raise MalformedMessage(f"{len(image)} bytes are not {pixels} RGB pixels")
    return Request(
        id=token(header.get("id"), "the id"),
        frontend=token(header.get("fe"), "the front end"),
        task=task,
        top_k=integer(header.get("k"), "k", low_k, MAX_K),
        ttl_ms=integer(header.get("ttl_ms"), "ttl_ms", 1, MAX_TTL_MS),
        image=image,
        pixels=pixels,
        traceparent=_traceparent(header.get("tp")),
        shared=header.get("sh") == 1,
    )


def _traceparent(value: object) -> str | None:
    """A header's trace context: kept when it has a traceparent's shape, else ignored (a
    trace is never worth a request)."""
    if isinstance(value, str) and len(value) == TRACEPARENT_LENGTH:
        return value
    return None


def entry_time_ms(entry_id: bytes | str) -> int:
    """The Redis time (ms) at which a stream entry was added: its id's first part."""
    return int(text(entry_id).split("-", 1)[0])
