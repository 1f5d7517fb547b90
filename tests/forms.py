"""Multipart forms built by hand, so field and file names go out as given, quotes and all."""

from __future__ import annotations

from collections.abc import Sequence


def multipart_form(
    parts: Sequence[tuple[str, str | None, bytes]], boundary: str, file_type: str | None = None
) -> bytes:
    """``parts``: (field name, file name or None for a text field, content); ``file_type``:
    the Content-Type header each file part carries (none by default)."""
    body = b""
    for name, filename, content in parts:
        disposition = f'form-data; name="{name}"'
        if filename is not None:
            disposition += f'; filename="{filename}"'
        body += f"--{boundary}\r\nContent-Disposition: {disposition}\r\n".encode()
        if filename is not None and file_type is not None:
            body += f"Content-Type: {file_type}\r\n".encode()
        body += b"\r\n" + content + b"\r\n"
    return body + f"--{boundary}--\r\n".encode()
