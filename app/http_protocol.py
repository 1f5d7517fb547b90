"""uvicorn's HTTP protocol (httptools), with each response sent in one write.

uvicorn writes a response's status line and headers the moment the app starts the response,
and the body in a second write: two ``send()`` calls, two TCP segments and two wake-ups of
the client for every answer. Our answers are small JSON bodies sent right after their
headers, so ``HttpProtocol`` holds the header block back and sends it together with the first
body bytes. A header block that no body follows within the same event-loop turn (a streamed
response, ``100 Continue``) goes out on its own at the end of that turn.

Measured with the do-nothing model at 64 clients (``MB_DECODE=worker``, nine alternated
pairs of runs): requests/s rose in every pair (median about 5%), and the load generator's CPU
per request fell (0.15-0.21 to 0.13-0.19 ms): it is woken once per answer instead of twice.
"""

from __future__ import annotations

import asyncio
from typing import Any

from uvicorn.protocols.http.httptools_impl import HttpToolsProtocol


def _is_header_block(data: bytes | bytearray | memoryview) -> bool:
    head = bytes(data[:5])
    return head == b"HTTP/" and bytes(data[-4:]) == b"\r\n\r\n"


class CoalescingTransport(asyncio.Transport):
    """A connection's transport that holds a response's header block until the next write
    (or the end of the event-loop turn) and sends both in one call. Everything else passes
    straight through, in order."""

    def __init__(self, transport: asyncio.Transport, loop: asyncio.AbstractEventLoop) -> None:
        super().__init__()
        self._transport = transport
        self._loop = loop
        self._held: bytes | None = None

    def write(self, data: bytes | bytearray | memoryview) -> None:
        if self._held is not None:
            data, self._held = self._held + data, None
        elif _is_header_block(data):
            self._held = bytes(data)
            self._loop.call_soon(self.flush)
            return
        self._transport.write(data)

    def flush(self) -> None:
        """Send a held header block now (no-op if none is held or the connection closed)."""
        held, self._held = self._held, None
        if held is not None and not self._transport.is_closing():
            self._transport.write(held)

    def writelines(self, list_of_data: Any) -> None:
        self.write(b"".join(list_of_data))

    def write_eof(self) -> None:
        self.flush()
        self._transport.write_eof()

    def can_write_eof(self) -> bool:
        return self._transport.can_write_eof()

    def close(self) -> None:
        self.flush()
        self._transport.close()

    def abort(self) -> None:
        self._held = None
        self._transport.abort()

    def is_closing(self) -> bool:
        return self._transport.is_closing()

    def get_extra_info(self, name: str, default: Any = None) -> Any:
        return self._transport.get_extra_info(name, default)

    def set_protocol(self, protocol: asyncio.BaseProtocol) -> None:
        self._transport.set_protocol(protocol)

    def get_protocol(self) -> asyncio.BaseProtocol:
        return self._transport.get_protocol()

    def is_reading(self) -> bool:
        return self._transport.is_reading()

    def pause_reading(self) -> None:
        self._transport.pause_reading()

    def resume_reading(self) -> None:
        self._transport.resume_reading()

    def get_write_buffer_size(self) -> int:
        return self._transport.get_write_buffer_size() + len(self._held or b"")

    def get_write_buffer_limits(self) -> tuple[int, int]:
        return self._transport.get_write_buffer_limits()

    def set_write_buffer_limits(self, high: int | None = None, low: int | None = None) -> None:
        self._transport.set_write_buffer_limits(high, low)


class HttpProtocol(HttpToolsProtocol):
    """uvicorn's httptools protocol on a ``CoalescingTransport``: pass it as
    ``uvicorn.Config(http=HttpProtocol)``."""

    def connection_made(self, transport: asyncio.Transport) -> None:  # type: ignore[override]
        super().connection_made(CoalescingTransport(transport, self.loop))
