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
server's error body, ``retry_after_s``, ``request_id``), after retrying a 503 (the server is
full) or a 429 (this key's tenant is over its quota) that carries ``Retry-After`` (at most
``retries`` times, and only if it asks for at most ``max_retry_wait_s``); ``ValueError``
for a 2xx answer it cannot read or a bad argument; ``TypeError`` for a file opened in text
mode; httpx's errors for a connection that fails (never retried: the request may or may not
have run).
"""

from __future__ import annotations

import asyncio
import email.utils
import functools
import math
import os
import time
import uuid
from collections.abc import Callable, Coroutine, Sequence
from dataclasses import KW_ONLY, dataclass
from datetime import UTC, datetime
from types import TracebackType
from typing import IO, Any, Concatenate, Generic, ParamSpec, Self, TypeAlias, TypeVar, overload

import httpx
import numpy as np
import numpy.typing as npt

__all__ = ["AsyncClient", "Client", "Image", "ServerReplyError", "Tag"]

Image: TypeAlias = bytes | str | os.PathLike[str] | IO[bytes]
Images: TypeAlias = list[Image] | tuple[Image, ...]
Embedding: TypeAlias = npt.NDArray[np.float32]
# Multipart fields: ("image", (file name, bytes)) each.
_Files: TypeAlias = list[tuple[str, tuple[str, bytes]]]
T = TypeVar("T")
_Reader: TypeAlias = Callable[[httpx.Response], T]  # reads an answer
P = ParamSpec("P")
_Transport = TypeVar("_Transport", httpx.BaseTransport, httpx.AsyncBaseTransport)
_Http = TypeVar("_Http", httpx.Client, httpx.AsyncClient)

SHAPE_HEADER = "X-Embedding-Shape"
# Room for the upload and the server's own timeout answer (504) to arrive before ours fires.
HTTP_TIMEOUT_MARGIN_S = 5.0


@dataclass(frozen=True)
class Tag:
    """One class name and its probability."""

    name: str
    prob: float


@dataclass(eq=False, repr=False)  # an exception's identity and repr
class ServerReplyError(Exception):
    """The server answered with a non-2xx status (after any 503 or 429 retries).

    ``type`` is the server's stable error name (``invalid_image``, ``queue_full``, ...; see
    the README's error table), ``retry_after_s`` its ``Retry-After`` when it sent one."""

    status: int
    type: str
    message: str
    retry_after_s: float | None = None
    _: KW_ONLY
    request_id: str | None = None

    def __post_init__(self) -> None:
        super().__init__(f"{self.status} {self.type}: {self.message}")


# -- the core: requests and answers, no I/O ----------------------------------------------------


@dataclass(frozen=True)
class _Call(Generic[T]):
    """One API call, ready to send as often as retries need (the images are bytes by now)."""

    method: str
    path: str
    parse: _Reader[T]
    request: dict[str, Any]  # httpx's arguments: headers, and params, files, data if any
    answered: frozenset[int] = frozenset({200})  # the statuses `parse` reads


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


def _image_files(images: Image | Images) -> tuple[_Files, bool]:
    """The multipart ``image`` fields, and whether the caller wants a list back (it gave one,
    even of one image, which the server answers as a single result)."""
    wants_list = isinstance(images, list | tuple)
    batch: Sequence[Image] = images if isinstance(images, list | tuple) else [images]
    if not batch:
        raise ValueError("no images given")
    return [("image", _read_image(image, i)) for i, image in enumerate(batch)], wants_list


RETRIED = frozenset({429, 503})  # the statuses worth another try after their Retry-After


def _retry_after_s(response: httpx.Response) -> float | None:
    """``Retry-After`` in seconds (delta-seconds or an HTTP date), None if absent or unreadable."""
    value = response.headers.get("Retry-After", "")
    try:
        seconds = float(value)
    except ValueError:
        try:  # a date without a zone (naive) is unreadable too: TypeError
            seconds = (email.utils.parsedate_to_datetime(value) - datetime.now(UTC)).total_seconds()
        except (TypeError, ValueError):
            return None
    return max(0.0, seconds) if math.isfinite(seconds) else None


def _reply_error(response: httpx.Response) -> ServerReplyError:
    kind, message = "http_error", response.text[:500]
    try:
        error = response.json()["error"]
        kind, message = str(error["type"]), str(error["message"])
    except (ValueError, KeyError, TypeError):
        pass  # not this server's JSON error shape (a proxy's page, say): keep the raw text
    request_id = response.headers.get("X-Request-ID")
    status = response.status_code
    return ServerReplyError(status, kind, message, _retry_after_s(response), request_id=request_id)


def _embeddings(images: Image | Images) -> tuple[_Files, _Reader[Embedding]]:
    """The images' fields, and how to read the answer: 1-D for one image, else 2-D."""
    files, wants_list = _image_files(images)
    listed = len(files) > 1  # the server answers several images (2-D); else one (1-D)

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

    return files, parse


def _tags(images: Image | Images) -> tuple[_Files, _Reader[list[Tag] | list[list[Tag]]]]:
    """The images' fields, and how to read the answer: tags, or a list of them for a list."""
    files, wants_list = _image_files(images)
    listed = len(files) > 1  # the server answers several images with a list of lists

    def parse(response: httpx.Response) -> list[Tag] | list[list[Tag]]:
        body = response.json() if listed else [response.json()]
        tags = [[Tag(str(t["name"]), float(t["prob"])) for t in item] for item in body]
        return tags if listed or wants_list else tags[0]

    return files, parse


class _ClientBase(Generic[_Transport, _Http]):
    """What both clients share: settings, the connection, building calls, reading answers."""

    _connect: Callable[..., _Http]  # httpx.Client or httpx.AsyncClient

    def __init__(
        self,
        base_url: str,
        *,
        api_key: str | None = None,
        timeout_s: float = 30.0,
        retries: int = 3,
        max_retry_wait_s: float = 10.0,
        transport: _Transport | None = None,
        model: str | None = None,
    ) -> None:
        if not timeout_s > 0:
            raise ValueError(f"timeout_s must be positive, got {timeout_s}")
        if retries < 0:
            raise ValueError(f"retries must be 0 or more, got {retries}")
        if not max_retry_wait_s >= 0:
            raise ValueError(f"max_retry_wait_s must be 0 or more, got {max_retry_wait_s}")
        self._api_key = api_key
        self._timeout_s = timeout_s
        self._retries = retries
        self._max_retry_wait_s = max_retry_wait_s
        self._model = model  # every call's model unless it names one
        self._model_id: str | None = None
        timeout = httpx.Timeout(timeout_s + HTTP_TIMEOUT_MARGIN_S)
        self._http: _Http = self._connect(base_url=base_url, timeout=timeout, transport=transport)

    @property
    def model_id(self) -> str | None:
        """``X-Model-Id`` of the last answer (``<arch>@<12 hex>``): which export answered."""
        return self._model_id

    def _params(self, model: str | None) -> dict[str, str] | None:
        chosen = model if model is not None else self._model
        return None if chosen is None else {"model": chosen}

    def _call(
        self,
        path: str,
        parse: _Reader[T],
        request_id: str | None,
        accept: str = "application/json",
        answered: frozenset[int] = frozenset({200}),
        **request: Any,
    ) -> _Call[T]:
        """A call to ``path``, POST if it has a body, with the headers every call sends."""
        headers = {
            "Accept": accept,
            "X-Request-ID": request_id or uuid.uuid4().hex,
            "X-Request-Timeout": f"{self._timeout_s:g}",
        }
        if self._api_key is not None:
            headers["Authorization"] = f"Bearer {self._api_key}"
        method = "POST" if "files" in request else "GET"
        return _Call(method, path, parse, {"headers": headers, **request}, answered)

    def _retry_in(self, call: _Call[Any], response: httpx.Response, attempt: int) -> float | None:
        """None when ``response`` is the call's answer; else the seconds to wait before the
        next attempt. Raises ``ServerReplyError`` when the answer is an error to give up on."""
        self._model_id = response.headers.get("X-Model-Id", self._model_id)
        if response.status_code in call.answered:
            return None
        error = _reply_error(response)
        wait = error.retry_after_s
        retry = wait is not None and wait <= self._max_retry_wait_s and attempt < self._retries
        if response.status_code in RETRIED and retry:
            return wait
        raise error


# -- the two clients: Client's methods are AsyncClient's too, sent by its own _send ------------


class Client(_ClientBase[httpx.BaseTransport, httpx.Client]):
    """Blocking client. ``with Client("http://127.0.0.1:8000") as c: c.embed("cat.jpg")``.

    ``transport`` (an ``httpx.BaseTransport``) replaces the network, e.g. for tests."""

    _connect = httpx.Client

    def _send(self, call: _Call[T]) -> T:
        attempt = 0
        while True:
            response = self._http.request(call.method, call.path, **call.request)
            wait = self._retry_in(call, response, attempt)
            if wait is None:
                return call.parse(response)
            time.sleep(wait)
            attempt += 1

    def embed(
        self, images: Image | Images, *, request_id: str | None = None, model: str | None = None
    ) -> Embedding:
        """Embedding of one image (1-D float32), or of a list of images (2-D, in order)."""
        files, parse = _embeddings(images)
        params, accept = self._params(model), "application/octet-stream"
        return self._send(
            self._call("/predict/embedding", parse, request_id, accept, files=files, params=params)
        )

    @overload
    def tag(
        self, images: Images, k: int = 5, *, request_id: str | None = None, model: str | None = None
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
        files, parse = _tags(images)
        form, params = {"k": str(k)}, self._params(model)
        call = self._call("/predict/tag", parse, request_id, files=files, data=form, params=params)
        return self._send(call)

    def info(self, *, request_id: str | None = None) -> dict[str, Any]:
        """``GET /info``: the model manifest, ``model_id``, batching settings, workers."""
        return self._send(self._call("/info", httpx.Response.json, request_id))

    def ready(self, *, request_id: str | None = None) -> bool:
        """Whether ``GET /readyz`` answers 200 (a model worker is ready)."""
        answered = frozenset({200, 503})  # a 503 from /readyz is an answer too: not ready
        call = self._call("/readyz", lambda r: r.status_code == 200, request_id, answered=answered)
        return self._send(call)

    def tags(self, *, request_id: str | None = None, model: str | None = None) -> list[str]:
        """The class names, in the model's order (404 ``no_classifier`` for embedding-only)."""
        params = self._params(model)
        return self._send(self._call("/tags", httpx.Response.json, request_id, params=params))

    def close(self) -> None:
        self._http.close()

    def __enter__(self) -> Self:
        return self

    def __exit__(
        self, kind: type[BaseException] | None, exc: BaseException | None, tb: TracebackType | None
    ) -> None:
        self.close()


def _awaited(
    method: Callable[Concatenate[Client, P], T],
) -> Callable[Concatenate[AsyncClient, P], Coroutine[Any, Any, T]]:
    """A ``Client`` method as an ``AsyncClient`` one: the same signature and docstring. It
    only builds its call and returns ``self._send(call)``: run on an ``AsyncClient``, that is
    a coroutine, which this awaits."""

    async def awaited(self: AsyncClient, /, *args: P.args, **kwargs: P.kwargs) -> T:
        run: Any = method  # on an AsyncClient, it returns the coroutine of its _send
        answer: T = await run(self, *args, **kwargs)
        return answer

    functools.update_wrapper(awaited, method)
    awaited.__qualname__ = f"AsyncClient.{method.__name__}"
    return awaited


class AsyncClient(_ClientBase[httpx.AsyncBaseTransport, httpx.AsyncClient]):
    """Asyncio client, the same methods as ``Client``, awaited.
    ``async with AsyncClient(url) as c: await c.embed(["a.jpg", "b.jpg"])``.

    ``transport`` (an ``httpx.AsyncBaseTransport``) replaces the network, e.g. for tests."""

    _connect = httpx.AsyncClient

    async def _send(self, call: _Call[T]) -> T:
        attempt = 0
        while True:
            response = await self._http.request(call.method, call.path, **call.request)
            wait = self._retry_in(call, response, attempt)
            if wait is None:
                return call.parse(response)
            await asyncio.sleep(wait)
            attempt += 1

    embed = _awaited(Client.embed)
    tag = _awaited(Client.tag)
    info = _awaited(Client.info)
    ready = _awaited(Client.ready)
    tags = _awaited(Client.tags)

    async def aclose(self) -> None:
        await self._http.aclose()

    async def __aenter__(self) -> Self:
        return self

    async def __aexit__(
        self, kind: type[BaseException] | None, exc: BaseException | None, tb: TracebackType | None
    ) -> None:
        await self.aclose()
