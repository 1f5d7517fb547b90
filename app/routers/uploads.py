"""Reading the image out of a prediction request, straight from the ASGI body stream.

Two shapes are accepted:

* ``multipart/form-data`` with the image in the field ``image`` (and small text fields such
  as ``k``), what browsers, ``curl -F`` and locust send; the field may repeat, up to
  ``max_images`` times (413 beyond), for several images in one request;
* the image itself as the whole body, with an ``image/*`` or ``application/octet-stream``
  Content-Type (``curl --data-binary @cat.jpg -H 'Content-Type: image/jpeg'``).

The multipart body goes through the ``multipart`` package's push parser as the chunks arrive
(python-multipart's byte-by-byte state machine cost each upload three times as much).
FastAPI's own form handling (spooled temporary files, a validation model per field) and its
dependency resolution cost the event loop more than everything else a request does, so the
prediction routes read the stream themselves: the upload limit still applies as the bytes
arrive, and every malformed body still gets its own 4xx.
"""

from __future__ import annotations

import re
from collections.abc import AsyncIterator
from dataclasses import dataclass, field

from fastapi import Request
from multipart import MultipartError, MultipartSegment, PushMultipartParser
from starlette.requests import ClientDisconnect

from app.errors import ClientDisconnected, ClientError, InvalidRequest, PayloadTooLarge

FILE_FIELD = "image"
MAX_TEXT_FIELDS = 8
MAX_TEXT_FIELD_BYTES = 1024
MAX_PART_HEADERS = 8  # a form part has two or three (RFC 7578)
MAX_BOUNDARY = 1024  # RFC 2046 allows 70; longer ones only cost each chunk's search more
_BOUNDARY = re.compile(r';\s*boundary\s*=\s*(?:"((?:[^"\\]|\\.)*)"|([^;\s]+))', re.IGNORECASE)
RAW_BODY_TYPES = ("image/", "application/octet-stream")
HOW_TO_SEND = (
    f"send the image as the multipart/form-data field '{FILE_FIELD}', or as the whole body "
    "with an image/* Content-Type"
)


@dataclass(frozen=True)
class Image:
    """One uploaded image: its bytes, and its file name (for error messages)."""

    data: bytes
    filename: str = ""


@dataclass
class Upload:
    """The images in form order (one for a raw body) and the form's text fields."""

    images: list[Image]
    fields: dict[str, str] = field(default_factory=dict)

    @property
    def several(self) -> bool:
        """The form repeated the image field: the answer is a list."""
        return len(self.images) > 1

    @property
    def data(self) -> list[bytes]:
        return [image.data for image in self.images]

    @property
    def names(self) -> list[str]:
        return [image.filename for image in self.images]


async def read_upload(
    request: Request,
    max_bytes: int,
    max_images: int = 1,
    *,
    image_fields: frozenset[str] = frozenset({FILE_FIELD}),
    any_body: bool = False,
) -> Upload:
    """The uploaded image(s) (413 as soon as the body passes ``max_bytes``, or the form holds
    more than ``max_images`` images, without reading on). ``image_fields``: the form fields
    that hold images; ``any_body``: a body that is not a form is the image, whatever its
    Content-Type (TorchServe's clients send none with ``curl -T``)."""
    content_type = request.headers.get("content-type") or ""
    media_type = content_type.partition(";")[0].strip().lower()
    if media_type == "multipart/form-data":
        return await _read_form(
            request, _boundary(content_type), max_bytes, max_images, image_fields
        )
    if any_body or media_type.startswith(RAW_BODY_TYPES):
        return Upload([Image(await _read_body(request, max_bytes))])
    raise InvalidRequest(HOW_TO_SEND)


async def _read_body(request: Request, max_bytes: int) -> bytes:
    length = request.headers.get("content-length", "")
    if length.isdigit() and int(length) > max_bytes:
        raise PayloadTooLarge(f"upload is {length} bytes; at most {max_bytes} allowed")
    body = bytearray()
    async for chunk in _chunks(request):
        body += chunk
        if len(body) > max_bytes:
            raise PayloadTooLarge(f"upload is over {max_bytes} bytes")
    return bytes(body)


async def _chunks(request: Request) -> AsyncIterator[bytes]:
    """The body as it arrives; a client that leaves mid-upload ends in ``ClientDisconnected``
    (499), like one that leaves while waiting for its answer."""
    try:
        async for chunk in request.stream():
            yield chunk
    except ClientDisconnect:
        raise ClientDisconnected("the client closed the connection during the upload") from None


class _Form:
    """The parser's events (``multipart.PushMultipartParser``): keeps the image parts and
    the small text fields."""

    def __init__(
        self,
        max_bytes: int,
        max_images: int,
        image_fields: frozenset[str] = frozenset({FILE_FIELD}),
    ) -> None:
        self.max_bytes = max_bytes
        self.max_images = max_images
        self.image_fields = image_fields
        self.images: list[Image] = []
        self.fields: dict[str, str] = {}
        self.other_files: list[str] = []  # file parts not named image: refused
        self._name = ""
        self._filename = ""
        self._is_image = False
        self._skip = False  # this part is a file not named image: refused at the end
        self._limit = 0
        self._size = 0  # the bytes of every image so far: together within max_bytes
        self._data: list[bytes] = []  # this part's, as the parser gave them (no copy)
        self._length = 0

    def take(self, event: MultipartSegment | bytes | None) -> None:
        if event is None:
            self._part_end()
        elif isinstance(event, MultipartSegment):
            self._part_begin(event)
        else:
            self._part_data(event)

    def _part_begin(self, part: MultipartSegment) -> None:
        self._data, self._length = [], 0
        self._name = _utf8(part.name or "")
        self._filename = _utf8(part.filename or "")[:200]
        self._is_image = self._name in self.image_fields
        self._skip = not self._is_image and part.filename is not None
        if self._is_image:
            if len(self.images) >= self.max_images:
                raise PayloadTooLarge(f"at most {self.max_images} images per request")
        elif self._skip:
            self.other_files.append(self._name)
            if len(self.other_files) > MAX_TEXT_FIELDS:
                raise ClientError(f"the form has more than {MAX_TEXT_FIELDS} other files")
        else:
            if len(self.fields) >= MAX_TEXT_FIELDS:
                raise ClientError(f"the form has more than {MAX_TEXT_FIELDS} fields")
            self._limit = MAX_TEXT_FIELD_BYTES

    def _part_data(self, data: bytes) -> None:
        if self._skip:
            return  # refused at the end; the body's own limit bounds it meanwhile
        self._data.append(data)
        self._length += len(data)
        if self._is_image and self._size + self._length > self.max_bytes:
            raise PayloadTooLarge(f"upload is over {self.max_bytes} bytes")
        if not self._is_image and self._length > self._limit:
            raise InvalidRequest(f"form field '{self._name}' is over {self._limit} bytes")

    def _part_end(self) -> None:
        data = b"".join(self._data)  # one chunk (the usual): that very object
        if self._is_image:
            self.images.append(Image(data, self._filename))
            self._size += len(data)
        elif not self._skip:
            self.fields[self._name] = data.decode("utf-8", "replace")


def _boundary(content_type: str) -> bytes:
    """The form's boundary, as sent (header values are Latin-1 in ASGI, as are the body's
    bytes): quoted, or up to the next ``;`` or space, so ``=``, ``/`` or ``:`` unquoted (against
    RFC 2045, but some clients send them) still find the parts."""
    found = _BOUNDARY.search(content_type)
    if found is None:
        raise ClientError("the multipart Content-Type has no boundary")
    quoted, bare = found.groups()
    boundary = bare if quoted is None else re.sub(r"\\(.)", r"\1", quoted)
    if not boundary:
        raise ClientError("the multipart Content-Type has an empty boundary")
    if len(boundary) > MAX_BOUNDARY:
        raise ClientError(f"the multipart boundary is over {MAX_BOUNDARY} characters")
    return boundary.encode("latin-1", "replace")


def _utf8(latin1: str) -> str:
    """A header value the parser read as Latin-1, as the UTF-8 forms send (RFC 7578): a
    file name in another charset keeps its request going, its odd bytes replaced."""
    return latin1.encode("latin-1").decode("utf-8", "replace")


async def _read_form(
    request: Request,
    boundary: bytes,
    max_bytes: int,
    max_images: int,
    image_fields: frozenset[str] = frozenset({FILE_FIELD}),
) -> Upload:
    form = _Form(max_bytes, max_images, image_fields)
    try:
        # Latin-1 decodes any header bytes; names are then read as UTF-8, mistakes replaced.
        parser = PushMultipartParser(
            boundary,
            max_header_count=MAX_PART_HEADERS,
            max_segment_count=max_images + 2 * MAX_TEXT_FIELDS + 1,  # then 400, read no more
            header_charset="latin-1",
        )
        async for chunk in _chunks(request):
            for event in parser.parse(chunk) if chunk else ():  # b"": the end, checked below
                form.take(event)
    except MultipartError as exc:
        raise ClientError(f"malformed multipart body: {exc}") from None
    try:
        parser.close()  # refuses a body that ended before its closing boundary
    except MultipartError:
        raise ClientError("malformed multipart body: it ends before its closing boundary") from None
    if form.other_files:
        names = ", ".join(repr(name) for name in form.other_files)
        wanted = " or ".join(f"'{name}'" for name in sorted(image_fields))
        missing = "" if form.images else f"the form field {wanted} is missing; "
        raise InvalidRequest(f"{missing}unexpected file field(s) {names}; {HOW_TO_SEND}")
    if not form.images:
        wanted = " or ".join(f"'{name}'" for name in sorted(image_fields))
        raise InvalidRequest(f"the form field {wanted} is missing; {HOW_TO_SEND}")
    return Upload(form.images, form.fields)
