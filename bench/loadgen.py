"""A lean closed-loop HTTP/1.1 load generator (asyncio streams, keep-alive, no dependencies).

Generic clients cost more CPU per request than this server spends answering one (httpx's
AsyncClient tops out at a few hundred requests/s on two cores), which would measure the
client instead of the server. This one sends prebuilt requests and parses only the status
line, the headers it needs and a Content-Length body. Another protocol plugs in as a
:class:`Sender` (``closed_loop(..., connect=...)``): ``bench.protocols`` sends gRPC that way.
"""

from __future__ import annotations

import asyncio
import contextlib
import resource
import time
from collections import Counter
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Protocol


def multipart_request(
    host: str,
    port: int,
    path: str,
    file_bytes: bytes,
    *,
    fields: Sequence[tuple[str, str]] = (),
    headers: Sequence[tuple[str, str]] = (),
    file_field: str = "image",
) -> bytes:
    """A complete ``POST`` with a multipart body holding one file (and optional fields)."""
    boundary = "mbBoundary7d9f1c"
    parts = [
        f'--{boundary}\r\nContent-Disposition: form-data; name="{name}"\r\n\r\n{value}\r\n'.encode()
        for name, value in fields
    ]
    parts.append(
        (
            f'--{boundary}\r\nContent-Disposition: form-data; name="{file_field}"; '
            'filename="upload"\r\nContent-Type: application/octet-stream\r\n\r\n'
        ).encode()
        + file_bytes
        + b"\r\n"
    )
    body = b"".join(parts) + f"--{boundary}--\r\n".encode()
    extra = "".join(f"{name}: {value}\r\n" for name, value in headers)
    head = (
        f"POST {path} HTTP/1.1\r\nHost: {host}:{port}\r\n"
        f"Content-Type: multipart/form-data; boundary={boundary}\r\n"
        f"Content-Length: {len(body)}\r\n{extra}\r\n"
    )
    return head.encode() + body


def get_request(host: str, port: int, path: str) -> bytes:
    return f"GET {path} HTTP/1.1\r\nHost: {host}:{port}\r\n\r\n".encode()


@dataclass
class Response:
    status: int
    headers: dict[str, str]
    body: bytes


class Sender(Protocol):
    """What one closed-loop client sends through: :class:`Connection` for HTTP/1.1. ``send``
    raises ``OSError`` (or ``TimeoutError``) where no answer came; ``close`` drops the
    connection, and the next ``send`` opens a new one."""

    async def send(self, request: bytes) -> Response: ...

    async def close(self) -> None: ...


class Connection:
    """One keep-alive connection; reconnects when the server closes it."""

    def __init__(self, host: str, port: int) -> None:
        self.host, self.port = host, port
        self._reader: asyncio.StreamReader | None = None
        self._writer: asyncio.StreamWriter | None = None

    async def send(self, request: bytes) -> Response:
        if self._writer is None:
            self._reader, self._writer = await asyncio.open_connection(self.host, self.port)
        assert self._reader is not None
        self._writer.write(request)
        status_line = await self._reader.readline()
        if not status_line:
            await self.close()
            raise ConnectionError("server closed the connection")
        headers: dict[str, str] = {}
        while True:
            line = await self._reader.readline()
            if line in (b"\r\n", b""):
                break
            name, _, value = line.decode("latin-1").partition(":")
            headers[name.strip().lower()] = value.strip()
        body = await self._reader.readexactly(int(headers.get("content-length", "0")))
        if headers.get("connection", "").lower() == "close":
            await self.close()
        return Response(int(status_line.split()[1]), headers, body)

    async def close(self) -> None:
        if self._writer is not None:
            self._writer.close()
            with contextlib.suppress(ConnectionError, OSError):
                await self._writer.wait_closed()
        self._reader = self._writer = None


@dataclass
class LoadResult:
    """What one closed-loop run measured."""

    requests: int
    seconds: float
    statuses: Counter[int]
    latencies_s: list[float] = field(repr=False)
    client_cpu_s: float
    errors: int = 0

    @property
    def rate(self) -> float:
        return self.requests / self.seconds if self.seconds else 0.0

    def percentile_ms(self, q: float) -> float:
        if not self.latencies_s:
            return float("nan")
        ordered = sorted(self.latencies_s)
        return 1000 * ordered[min(len(ordered) - 1, int(q / 100 * len(ordered)))]


def _cpu_seconds() -> float:
    usage = resource.getrusage(resource.RUSAGE_SELF)
    return usage.ru_utime + usage.ru_stime


async def closed_loop(
    host: str,
    port: int,
    requests: Sequence[bytes],
    *,
    clients: int,
    duration_s: float | None = None,
    total: int | None = None,
    check: Callable[[int, Response], None] | None = None,
    timeout_s: float = 60.0,
    connect: Callable[[], Sender] | None = None,
) -> LoadResult:
    """``clients`` connections each send the next request as soon as the last one answered,
    for ``duration_s`` seconds or until ``total`` requests were sent (request i is
    ``requests[i % len(requests)]``). ``check(i, response)`` sees every answer. ``connect``
    makes each client's :class:`Sender` (default: an HTTP/1.1 ``Connection`` to
    ``host:port``)."""
    if (duration_s is None) == (total is None):
        raise ValueError("give exactly one of duration_s and total")
    counter = iter(range(total if total is not None else 1 << 62))
    latencies: list[float] = []
    statuses: Counter[int] = Counter()
    errors = 0
    stop_at = time.monotonic() + duration_s if duration_s is not None else float("inf")

    async def client() -> None:
        nonlocal errors
        connection: Sender = connect() if connect is not None else Connection(host, port)
        try:
            for index in counter:
                if time.monotonic() >= stop_at:
                    break
                started = time.perf_counter()
                try:
                    # A timeout scope, not wait_for: no task per request, so no event-loop
                    # turns of the load generator's own in the latencies it measures.
                    async with asyncio.timeout(timeout_s):
                        response = await connection.send(requests[index % len(requests)])
                except (OSError, TimeoutError, asyncio.IncompleteReadError):
                    errors += 1
                    statuses[0] += 1
                    await connection.close()
                    continue
                latencies.append(time.perf_counter() - started)
                statuses[response.status] += 1
                if check is not None:
                    check(index, response)
        finally:
            await connection.close()

    cpu, started = _cpu_seconds(), time.perf_counter()
    await asyncio.gather(*(client() for _ in range(clients)))
    return LoadResult(
        requests=len(latencies),
        seconds=time.perf_counter() - started,
        statuses=statuses,
        latencies_s=latencies,
        client_cpu_s=_cpu_seconds() - cpu,
        errors=errors,
    )
