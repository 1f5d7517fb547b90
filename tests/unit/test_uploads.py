"""``app.routers.uploads.read_upload``: the images and fields of a form or a raw body, read
from the ASGI stream in whatever chunks it arrives, and a typed 4xx for each bad body."""

from __future__ import annotations

import asyncio
from collections.abc import Sequence

import pytest
from starlette.requests import Request

from app.errors import ClientError, InvalidRequest, PayloadTooLarge
from app.routers.uploads import MAX_TEXT_FIELD_BYTES, Upload, read_upload
from tests.forms import multipart_form

BOUNDARY = "xYz-7d9f"
IMAGE = b"\xff\xd8\xff\xe0 not a real jpeg \r\n--xYz but close \r\n\xff\xd9"


def form(parts: Sequence[tuple[str, str | None, bytes]], boundary: str = BOUNDARY) -> bytes:
    return multipart_form(parts, boundary, file_type="image/jpeg")


def read(
    chunks: Sequence[bytes],
    content_type: str = f"multipart/form-data; boundary={BOUNDARY}",
    max_bytes: int = 10_000,
    max_images: int = 1,
) -> Upload:
    messages = [
        {"type": "http.request", "body": chunk, "more_body": i < len(chunks) - 1}
        for i, chunk in enumerate(chunks)
    ] or [{"type": "http.request", "body": b"", "more_body": False}]

    async def receive() -> dict[str, object]:
        return messages.pop(0)

    scope = {
        "type": "http",
        "method": "POST",
        "path": "/predict/tag",
        "headers": [(b"content-type", content_type.encode("latin-1"))],
    }
    return asyncio.run(read_upload(Request(scope, receive), max_bytes, max_images))


def test_a_form_reads_the_same_however_it_is_cut_into_chunks() -> None:
    body = form([("k", None, b"3"), ("image", "cat.jpg", IMAGE)])
    for cut in range(len(body) + 1):
        upload = read([body[:cut], body[cut:]])
        assert upload.data == [IMAGE], cut
        assert upload.names == ["cat.jpg"] and upload.fields == {"k": "3"}, cut
    upload = read([body[i : i + 1] for i in range(len(body))])  # a byte at a time
    assert upload.data == [IMAGE] and upload.fields == {"k": "3"}


def test_several_images_keep_their_order_and_names() -> None:
    body = form([("image", "a.jpg", b"first"), ("image", "b.jpg", b""), ("image", "", b"3rd")])
    upload = read([body], max_images=3)
    assert upload.data == [b"first", b"", b"3rd"] and upload.names == ["a.jpg", "b.jpg", ""]
    assert upload.several


def test_file_names_in_utf8_or_not() -> None:
    body = form([("image", "caf\u00e9 \u732b.jpg", IMAGE)])
    assert read([body]).names == ["caf\u00e9 \u732b.jpg"]
    latin1 = body.replace("caf\u00e9 \u732b".encode(), "caf\u00e9".encode("latin-1"))
    assert read([latin1]).names == ["caf\ufffd.jpg"]  # read, the odd byte replaced


def test_a_quoted_or_long_boundary_and_a_raw_body() -> None:
    assert read([form([("image", "a", IMAGE)], "q b")], 'multipart/form-data; boundary="q b"')
    # Unquoted with "=" and ".", after a tab (some mail and SOAP stacks send these).
    odd = "----=_Part_0_1.2"
    assert read([form([("image", "a", IMAGE)], odd)], f"multipart/form-data;\tboundary={odd}")
    long = "b" * 300
    assert read([form([("image", "a", IMAGE)], long)], f"multipart/form-data; boundary={long}")
    assert read([IMAGE[:5], IMAGE[5:]], "image/jpeg").data == [IMAGE]
    assert read([IMAGE], "Application/Octet-Stream; x=1").data == [IMAGE]


@pytest.mark.parametrize(
    ("chunks", "content_type", "error", "message"),
    [
        ([form([("image", "a", b"x"), ("image", "b", b"y")])], None, PayloadTooLarge, "at most 1"),
        ([form([("image", "a", b"x" * 10_001)])], None, PayloadTooLarge, "over 10000 bytes"),
        (
            [form([("k", None, b"9" * (MAX_TEXT_FIELD_BYTES + 1)), ("image", "a", b"x")])],
            None,
            InvalidRequest,
            "form field 'k' is over",
        ),
        ([form([("photo", "a.jpg", b"x")])], None, InvalidRequest, "unexpected file field"),
        ([form([("k", None, b"3")])], None, InvalidRequest, "'image' is missing"),
        ([form([(f"f{i}", None, b"1") for i in range(9)])], None, ClientError, "fields"),
        ([form([("image", "a", b"x")])[:-10]], None, ClientError, "ends before"),
        ([b"no boundary line at all"], None, ClientError, "malformed multipart body"),
        (
            [f"--{BOUNDARY}\r\nContent-Type: image/png\r\n\r\nxx\r\n--{BOUNDARY}--\r\n".encode()],
            None,
            ClientError,
            "malformed multipart body",
        ),
        ([b"--b--\r\n"], "multipart/form-data", ClientError, "no boundary"),
        ([b"--b--\r\n"], "multipart/form-data; boundary=" + "b" * 1025, ClientError, "over 1024"),
        (
            [form([("image", "a", b"x")] + [("k", None, b"3")] * 100)],
            None,
            ClientError,
            "malformed multipart body",
        ),
        ([b"{}"], "application/json", InvalidRequest, "send the image"),
    ],
    ids=[
        "images",
        "image-bytes",
        "text-field",
        "other-file",
        "no-image",
        "fields",
        "truncated",
        "garbage",
        "no-disposition",
        "no-boundary",
        "long-boundary",
        "repeated-field",
        "json",
    ],
)
def test_a_bad_body_is_a_typed_client_error(
    chunks: list[bytes], content_type: str | None, error: type[Exception], message: str
) -> None:
    with pytest.raises(error, match=message):
        if content_type is None:
            read(chunks)
        else:
            read(chunks, content_type)
