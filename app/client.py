"""A small Python client for this server: ``Client`` (blocking) and ``AsyncClient`` (asyncio).

It needs only httpx, numpy and the standard library, never the rest of ``app``, so it can be
copied into another project as a single file. Against ``make run``, from the repository root::

    from app.client import Client

    with Client("http://127.0.0.1:8000") as client:
        vector = client.embed("docs/cat.jpg")                   # float32 array, shape (1280,)
        rows = client.embed(["docs/cat.jpg", "docs/cat.jpg"])   # (2, 1280), one request
        print(client.tag("docs/cat.jpg", k=3)[0], client.model_id)

An image is ``bytes``, a path or a binary file object; a list or tuple of them is one request
(up to the server's ``MAX_IMAGES_PER_REQUEST``), answered as a list in order, even a list of
one. Every call sends ``X-Request-ID`` (kept across its retries) and ``X-Request-Timeout:
timeout_s``; ``model_id`` is the ``X-Model-Id`` of the last answer. ``model=`` chooses the
model of a server that serves several (``Client(url, model="tagger")`` for every call, or per
call: ``client.embed(image, model="embedder")``).

Errors: ``ServerReplyError`` for any non-2xx answer (``status``, ``type``, ``message`` from the
server's error body, ``retry_after_s``, ``request_id``), after retrying a 503 that carries
``Retry-After`` (at most ``retries`` times, and only if it asks for at most
``max_retry_wait_s``); ``ValueError`` for a 2xx answer it cannot read or a bad argument;
``TypeError`` for a file opened in text mode; httpx's errors for a connection that fails
(never retried: the request may or may not have run).
"""

from __future__ import annotations

import asyncio
import email.utils
import math
import os
import time
import uuid
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from datetime import UTC, datetime
from types import TracebackType
from typing import IO, Any, Generic, Self, TypeAlias, TypeVar, overload

import httpx
import numpy as np
import numpy.typing as npt

__all__ = ["AsyncClient", "Client", "Image", "ServerReplyError", "Tag"]

Image: TypeAlias = bytes | str | os.PathLike[str] | IO[bytes]
Images: TypeAlias = list[Image] | tuple[Image, ...]
Embedding: TypeAlias = npt.NDArray[np.float32]
T = TypeVar("T")

SHAPE_HEADER = "X-Embedding-Shape"
# Room for the upload and the server's own timeout answer (504) to arrive before ours fires.
HTTP_TIMEOUT_MARGIN_S = 5.0


@dataclass(frozen=True)
class Tag:
    """One class name and its probability."""

    name: str
    prob: float


class ServerReplyError(Exception):
    """The server answered with a non-2xx status (after any 503 retries).

    ``type`` is the server's stable error name (``invalid_image``, ``queue_full``, ...; see
    the README's error table), ``retry_after_s`` its ``Retry-After`` when it sent one."""

    def __init__(
        self,
        status: int,
        type: str,
        message: str,
        retry_after_s: float | None = None,
        *,
        request_id: str | None = None,
    ) -> None:
        super().__init__(f"{status} {type}: {message}")
        self.status = status
        self.type = type
        self.message = message
        self.retry_after_s = retry_after_s
        self.request_id = request_id


# -- the core: requests and answers, no I/O ----------------------------------------------------


@dataclass(frozen=True)
class _Call(Generic[T]):
    """One API call, ready to send as often as retries need (the images are bytes by now)."""

    method: str
    path: str
    headers: dict[str, str]
    parse: Callable[[httpx.Response], T]
    files: list[tuple[str, tuple[str, bytes]]] | None = None
    data: dict[str, str] | None = None
    answered: frozenset[int] = frozenset({200})  # the statuses `parse` reads
    params: dict[str, str] | None = None  # the query: the model chosen

    def request_args(self) -> dict[str, Any]:
        return {
            "headers": self.headers,
            "files": self.files,
            "data": self.data,
            "params": self.params,
        }


def _read_image(image: Image, index: int) -> tuple[str, bytes]:
    """(file name, bytes) of one image argument."""
    if isinstance(image, bytes | bytearray | memoryview):
        return f"image{index}", bytes(image)
    if isinstance(image, str | os.PathLike):
        with open(image, "rb") as file:
            return os.path.basename(os.fspath(image)), file.read()
    data = image.read()
    if not isinstance(data, bytes):
        raise TypeError("a file object passed as an image must be opened in binary mode ('rb')")
    name = getattr(image, "name", None)
    return (os.path.basename(name) if isinstance(name, str) else f"image{index}"), data


def _image_files(images: Image | Images) -> tuple[list[tuple[str, tuple[str, bytes]]], bool]:
    """The multipart ``image`` fields, and whether the caller wants a list back (it gave one,
    even of one image, which the server answers as a single result)."""
    wants_list = isinstance(images, list | tuple)
    batch: Sequence[Image] = images if isinstance(images, list | tuple) else [images]
    if not batch:
        raise ValueError("no images given")
    return [("image", _read_image(image, i)) for i, image in enumerate(batch)], wants_list


def _retry_after_s(response: httpx.Response) -> float | None:
    """``Retry-After`` in seconds (delta-seconds or an HTTP date), None if absent or unreadable."""
    value = response.headers.get("Retry-After")
    if value is None:
        return None
    try:
        seconds = float(value)
    except ValueError:
        try:
            when = email.utils.parsedate_to_datetime(value)
        except (TypeError, ValueError):
            return None
        seconds = (when - datetime.now(UTC)).total_seconds()
    return max(0.0, seconds) if math.isfinite(seconds) else None


def _reply_error(response: httpx.Response) -> ServerReplyError:
    kind, message = "http_error", response.text[:500]
    try:
        error = response.json()["error"]
        kind, message = str(error["type"]), str(error["message"])
    except (ValueError, KeyError, TypeError):
        pass  # not this server's JSON error shape (a proxy's page, say): keep the raw text
    return ServerReplyError(
        response.status_code,
        kind,
        message,
        _retry_after_s(response),
        request_id=response.headers.get("X-Request-ID"),
    )


def _embeddings(listed: bool, wants_list: bool) -> Callable[[httpx.Response], Embedding]:
    """``listed``: the server answers several images (2-D); else one (1-D)."""

    def parse(response: httpx.Response) -> Embedding:
        header = response.headers.get(SHAPE_HEADER)
        if header is None:
            raise ValueError(f"the embedding answer has no {SHAPE_HEADER} header")
        try:
            shape = tuple(int(part) for part in header.split(","))
        except ValueError:
            raise ValueError(f"unreadable {SHAPE_HEADER}: {header!r}") from None
        if len(shape) != (2 if listed else 1) or math.prod(shape) * 4 != len(response.content):
            raise ValueError(
                f"{SHAPE_HEADER} {header!r} does not fit a {len(response.content)}-byte answer "
                f"to {'several images' if listed else 'one image'}"
            )
        # astype copies: frombuffer's array is a read-only view of the response body.
        vectors = np.frombuffer(response.content, dtype="<f4").reshape(shape).astype(np.float32)
        return vectors[None] if wants_list and not listed else vectors

    return parse


def _tags(
    listed: bool, wants_list: bool
) -> Callable[[httpx.Response], list[Tag] | list[list[Tag]]]:
    def one(tags: list[dict[str, Any]]) -> list[Tag]:
        return [Tag(str(t["name"]), float(t["prob"])) for t in tags]

    def parse(response: httpx.Response) -> list[Tag] | list[list[Tag]]:
        body = response.json()
        if listed:
            return [one(item) for item in body]
        return [one(body)] if wants_list else one(body)

    return parse


def _json(response: httpx.Response) -> Any:
    return response.json()


def _is_ready(response: httpx.Response) -> bool:
    return response.status_code == 200


_READYZ_ANSWERS = frozenset({200, 503})  # a 503 from /readyz is an answer: not ready


class _Core:
    """Everything both clients share: settings, building calls, reading answers, retries."""

    def __init__(
        self,
        api_key: str | None,
        timeout_s: float,
        retries: int,
        max_retry_wait_s: float,
        model: str | None = None,
    ) -> None:
        if not timeout_s > 0:
            raise ValueError(f"timeout_s must be positive, got {timeout_s}")
        if retries < 0:
            raise ValueError(f"retries must be 0 or more, got {retries}")
        if not max_retry_wait_s >= 0:
            raise ValueError(f"max_retry_wait_s must be 0 or more, got {max_retry_wait_s}")
        self.api_key = api_key
        self.timeout_s = timeout_s
        self.retries = retries
        self.max_retry_wait_s = max_retry_wait_s
        self.http_timeout = httpx.Timeout(timeout_s + HTTP_TIMEOUT_MARGIN_S)
        self.model = model  # every call's model unless it names one
        self.model_id: str | None = None

    def _params(self, model: str | None) -> dict[str, str] | None:
        chosen = model if model is not None else self.model
        return None if chosen is None else {"model": chosen}

    def _headers(self, request_id: str | None, accept: str = "application/json") -> dict[str, str]:
        headers = {
            "Accept": accept,
            "X-Request-ID": request_id or uuid.uuid4().hex,
            "X-Request-Timeout": f"{self.timeout_s:g}",
        }
        if self.api_key is not None:
            headers["Authorization"] = f"Bearer {self.api_key}"
        return headers

    def embed(
        self, images: Image | Images, request_id: str | None, model: str | None
    ) -> _Call[Embedding]:
        files, wants_list = _image_files(images)
        headers = self._headers(request_id, accept="application/octet-stream")
        parse = _embeddings(len(files) > 1, wants_list)
        params = self._params(model)
        return _Call("POST", "/predict/embedding", headers, parse, files, params=params)

    def tag(
        self, images: Image | Images, k: int, request_id: str | None, model: str | None
    ) -> _Call[list[Tag] | list[list[Tag]]]:
        files, wants_list = _image_files(images)
        parse = _tags(len(files) > 1, wants_list)
        headers, params = self._headers(request_id), self._params(model)
        return _Call("POST", "/predict/tag", headers, parse, files, {"k": str(k)}, params=params)

    def info(self, request_id: str | None) -> _Call[dict[str, Any]]:
        return _Call("GET", "/info", self._headers(request_id), _json)

    def ready(self, request_id: str | None) -> _Call[bool]:
        headers = self._headers(request_id)
        return _Call("GET", "/readyz", headers, _is_ready, answered=_READYZ_ANSWERS)

    def tags(self, request_id: str | None, model: str | None) -> _Call[list[str]]:
        return _Call("GET", "/tags", self._headers(request_id), _json, params=self._params(model))

    def retry_delay(self, call: _Call[Any], response: httpx.Response, attempt: int) -> float | None:
        """None when ``response`` is the call's answer; else the seconds to wait before the
        next attempt. Raises ``ServerReplyError`` when the answer is an error to give up on."""
        self.model_id = response.headers.get("X-Model-Id", self.model_id)
        if response.status_code in call.answered:
            return None
        error = _reply_error(response)
        wait = error.retry_after_s
        if (
            response.status_code == 503
            and wait is not None
            and wait <= self.max_retry_wait_s
            and attempt < self.retries
        ):
            return wait
        raise error


# -- the two transports -----------------------------------------------------------------------


class _ClientBase:
    """What both clients share beyond ``_Core``: which export answered last."""

    _core: _Core

    @property
    def model_id(self) -> str | None:
        """``X-Model-Id`` of the last answer (``<arch>@<12 hex>``): which export answered."""
        return self._core.model_id


class Client(_ClientBase):
    """Blocking client. ``with Client("http://127.0.0.1:8000") as c: c.embed("cat.jpg")``.

    ``transport`` (an ``httpx.BaseTransport``) replaces the network, e.g. for tests."""

    def __init__(
        self,
        base_url: str,
        *,
        api_key: str | None = None,
        timeout_s: float = 30.0,
        retries: int = 3,
        max_retry_wait_s: float = 10.0,
        transport: httpx.BaseTransport | None = None,
        model: str | None = None,
    ) -> None:
        self._core = _Core(api_key, timeout_s, retries, max_retry_wait_s, model)
        self._http = httpx.Client(
            base_url=base_url, timeout=self._core.http_timeout, transport=transport
        )

    def _send(self, call: _Call[T]) -> T:
        attempt = 0
        while True:
            response = self._http.request(call.method, call.path, **call.request_args())
            wait = self._core.retry_delay(call, response, attempt)
            if wait is None:
                return call.parse(response)
            time.sleep(wait)
            attempt += 1

    def embed(
        self, images: Image | Images, *, request_id: str | None = None, model: str | None = None
    ) -> Embedding:
        """Embedding of one image (1-D float32), or of a list of images (2-D, in order)."""
        return self._send(self._core.embed(images, request_id, model))

    @overload
    def tag(
        self,
        images: Images,
        k: int = 5,
        *,
        request_id: str | None = None,
        model: str | None = None,
    ) -> list[list[Tag]]: ...

    @overload
    def tag(
        self, images: Image, k: int = 5, *, request_id: str | None = None, model: str | None = None
    ) -> list[Tag]: ...

    def tag(
        self,
        images: Image | Images,
        k: int = 5,
        *,
        request_id: str | None = None,
        model: str | None = None,
    ) -> list[Tag] | list[list[Tag]]:
        """Top-``k`` tags of one image, most probable first (a list of such lists for a list)."""
        return self._send(self._core.tag(images, k, request_id, model))

    def info(self, *, request_id: str | None = None) -> dict[str, Any]:
        """``GET /info``: the model manifest, ``model_id``, batching settings, workers."""
        return self._send(self._core.info(request_id))

    def ready(self, *, request_id: str | None = None) -> bool:
        """Whether ``GET /readyz`` answers 200 (a model worker is ready)."""
        return self._send(self._core.ready(request_id))

    def tags(self, *, request_id: str | None = None, model: str | None = None) -> list[str]:
        """The class names, in the model's order (404 ``no_classifier`` for embedding-only)."""
        return self._send(self._core.tags(request_id, model))

    def close(self) -> None:
        self._http.close()

    def __enter__(self) -> Self:
        return self

    def __exit__(
        self, kind: type[BaseException] | None, exc: BaseException | None, tb: TracebackType | None
    ) -> None:
        self.close()


class AsyncClient(_ClientBase):
    """Asyncio client, the same methods as ``Client``, awaited.
    ``async with AsyncClient(url) as c: await c.embed(["a.jpg", "b.jpg"])``.

    ``transport`` (an ``httpx.AsyncBaseTransport``) replaces the network, e.g. for tests."""

    def __init__(
        self,
        base_url: str,
        *,
        api_key: str | None = None,
        timeout_s: float = 30.0,
        retries: int = 3,
        max_retry_wait_s: float = 10.0,
        transport: httpx.AsyncBaseTransport | None = None,
        model: str | None = None,
    ) -> None:
        self._core = _Core(api_key, timeout_s, retries, max_retry_wait_s, model)
        self._http = httpx.AsyncClient(
            base_url=base_url, timeout=self._core.http_timeout, transport=transport
        )

    async def _send(self, call: _Call[T]) -> T:
        attempt = 0
        while True:
            response = await self._http.request(call.method, call.path, **call.request_args())
            wait = self._core.retry_delay(call, response, attempt)
            if wait is None:
                return call.parse(response)
            await asyncio.sleep(wait)
            attempt += 1

    async def embed(
        self, images: Image | Images, *, request_id: str | None = None, model: str | None = None
    ) -> Embedding:
        """Embedding of one image (1-D float32), or of a list of images (2-D, in order)."""
        return await self._send(self._core.embed(images, request_id, model))

    @overload
    async def tag(
        self,
        images: Images,
        k: int = 5,
        *,
        request_id: str | None = None,
        model: str | None = None,
    ) -> list[list[Tag]]: ...

    @overload
    async def tag(
        self, images: Image, k: int = 5, *, request_id: str | None = None, model: str | None = None
    ) -> list[Tag]: ...

    async def tag(
        self,
        images: Image | Images,
        k: int = 5,
        *,
        request_id: str | None = None,
        model: str | None = None,
    ) -> list[Tag] | list[list[Tag]]:
        """Top-``k`` tags of one image, most probable first (a list of such lists for a list)."""
        return await self._send(self._core.tag(images, k, request_id, model))

    async def info(self, *, request_id: str | None = None) -> dict[str, Any]:
        """``GET /info``: the model manifest, ``model_id``, batching settings, workers."""
        return await self._send(self._core.info(request_id))

    async def ready(self, *, request_id: str | None = None) -> bool:
        """Whether ``GET /readyz`` answers 200 (a model worker is ready)."""
        return await self._send(self._core.ready(request_id))

    async def tags(self, *, request_id: str | None = None, model: str | None = None) -> list[str]:
        """The class names, in the model's order (404 ``no_classifier`` for embedding-only)."""
        return await self._send(self._core.tags(request_id, model))

    async def aclose(self) -> None:
        await self._http.aclose()

    async def __aenter__(self) -> Self:
        return self

    async def __aexit__(
        self, kind: type[BaseException] | None, exc: BaseException | None, tb: TracebackType | None
    ) -> None:
        await self.aclose()
