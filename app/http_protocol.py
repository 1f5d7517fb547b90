"""uvicorn's HTTP protocol (httptools), with each response sent in one write.

uvicorn writes a response's status line and headers as soon as the app starts the response,
and the body in a second write. Our answers are small JSON bodies sent right after their
headers, so ``HttpProtocol`` holds the header block back and sends it with the first body
bytes: one ``send()`` and one wake-up of the client per answer instead of two. A header block
that no body follows within the same event-loop turn (a streamed response, ``100 Continue``)
goes out on its own at the end of that turn.

Serve with ``uvicorn.Config(http=http_protocol())``: that is ``HttpProtocol`` on the uvicorn
this was written and tested for (``UVICORN_VERSION``), and uvicorn's stock ``"auto"`` (two
writes per response) with a ``RuntimeWarning`` on any other, or without httptools.

What this relies on in uvicorn's internals (``uvicorn/protocols/http/httptools_impl.py``),
none of it documented; re-check each line before moving ``UVICORN_VERSION``:

- ``HttpToolsProtocol`` lives in ``uvicorn.protocols.http.httptools_impl`` and sets
  ``self.loop`` in ``__init__``, before ``connection_made`` is called.
- ``HttpToolsProtocol.connection_made(transport)`` is where the protocol takes its
  transport, and every later use goes through that object (``self.transport``): the
  ``RequestResponseCycle`` writes and closes through it, ``FlowControl`` pauses and resumes
  reading on it, addresses and TLS come from its ``get_extra_info``, a WebSocket upgrade
  hands it on with ``set_protocol``.
- ``RequestResponseCycle.send`` writes a response's status line and headers with one
  ``transport.write`` that starts with ``HTTP/`` and ends with ``\\r\\n\\r\\n`` (the blank
  line), and its body with later, separate writes. Responses uvicorn writes whole by itself
  (``send_400_response``) end with their body, so they pass straight through.
- Between those two writes ``send`` yields to the event loop only when writing is paused
  (``flow.drain()``); otherwise the body arrives in the same turn and the two are coalesced.
  When it does not, the headers go out at the end of the turn: slower, never wrong.
"""

from __future__ import annotations

import asyncio
import warnings
from typing import TYPE_CHECKING, Any

import uvicorn

# The uvicorn release the internals listed above were checked against (requirements.txt).
UVICORN_VERSION = "0.54.0"

_import_error: ImportError | None = None
if TYPE_CHECKING:
    from uvicorn.protocols.http.httptools_impl import HttpToolsProtocol
else:
    try:
        from uvicorn.protocols.http.httptools_impl import HttpToolsProtocol
    except ImportError as exc:  # no httptools, or uvicorn moved its internals
        _import_error = exc
        # Keeps this module importable so that http_protocol() can fall back; HttpProtocol
        # is never handed out on this base.
        HttpToolsProtocol = asyncio.Protocol


def http_protocol() -> type[asyncio.Protocol] | str:
    """What to pass as ``uvicorn.Config(http=...)``: ``HttpProtocol`` on uvicorn
    ``UVICORN_VERSION`` with httptools installed; otherwise uvicorn's stock ``"auto"``, with
    a ``RuntimeWarning`` that says why."""
    if _import_error is not None:
        problem = f"uvicorn's httptools protocol did not import ({_import_error})"
    elif uvicorn.__version__ != UVICORN_VERSION:
        problem = f"uvicorn is {uvicorn.__version__}, not the {UVICORN_VERSION} it was checked on"
    else:
        return HttpProtocol
    warnings.warn(
        f"app.http_protocol: {problem}; serving with uvicorn's stock HTTP protocol (headers "
        "and body in two writes). Re-check the internals listed in app/http_protocol.py, "
        "then update UVICORN_VERSION.",
        RuntimeWarning,
        stacklevel=2,
    )
    return "auto"


def server_options(keep_alive_s: int | None) -> dict[str, Any]:
    """The ``uvicorn.Config`` options ``python -m app`` and the gunicorn worker class share:
    this protocol, no access log (the app logs each request itself, with its request id), and
    idle connections kept ``keep_alive_s`` (``MB_KEEP_ALIVE``; uvicorn's own 5 s and
    gunicorn's 2 s are shorter than any load balancer's idle timeout; ``None``: set later)."""
    options: dict[str, Any] = {"http": http_protocol(), "access_log": False}
    if keep_alive_s is not None:
        options["timeout_keep_alive"] = keep_alive_s
    return options


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
    """uvicorn's httptools protocol on a ``CoalescingTransport``. Get it through
    ``http_protocol()``, which checks that the uvicorn installed is the one it fits."""

    def connection_made(self, transport: asyncio.Transport) -> None:  # type: ignore[override]
        super().connection_made(CoalescingTransport(transport, self.loop))
