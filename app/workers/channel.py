"""The socket between the pool and one worker: asyncio on the pool's end, a plain blocking
``multiprocessing.Connection`` on the worker's (which sends with ``post``).

Messages (``app.workers.messages``) are plain data, pickled by ``pickle`` itself both ways:
``multiprocessing``'s own pickler (for sockets and file descriptors, which no message holds)
copies its dispatch table for every message, which a worker fresh from a model call, its
caches cold, paid 30 us a reply for.
"""

from __future__ import annotations

import asyncio
import pickle
import socket
import struct
from multiprocessing.connection import Connection


def dumps(message: object) -> bytes:
    """A message's bytes on the socket (both ends)."""
    return pickle.dumps(message, protocol=pickle.HIGHEST_PROTOCOL)


def post(conn: Connection, message: object) -> None:
    """Send ``message`` from the worker's end (``Connection.send``, plainly pickled)."""
    conn.send_bytes(dumps(message))


class Channel:
    """The pool's end of a worker's socket pair, on asyncio streams.

    Reading a message never blocks the event loop, whatever the loop does to the socket's
    blocking mode (uvloop makes sockets it watches non-blocking, which breaks
    ``Connection.recv`` on large messages). The framing is ``multiprocessing.Connection``'s,
    so the worker keeps a plain blocking ``Connection`` on its end.
    """

    def __init__(self, sock: socket.socket) -> None:
        self._sock = sock
        self._reader: asyncio.StreamReader | None = None
        self._writer: asyncio.StreamWriter | None = None

    async def open(self) -> None:
        if self._reader is None:
            self._reader, self._writer = await asyncio.open_connection(sock=self._sock)

    async def recv(self) -> object:
        """The next message; ``asyncio.IncompleteReadError`` once the worker is gone."""
        assert self._reader is not None, "open() first"
        (size,) = struct.unpack("!i", await self._reader.readexactly(4))
        if size == -1:
            (size,) = struct.unpack("!Q", await self._reader.readexactly(8))
        return pickle.loads(await self._reader.readexactly(size))

    def send(self, message: object) -> None:
        """Queue ``message`` for the worker (buffered by the transport: never blocks)."""
        assert self._writer is not None, "open() first"
        payload = dumps(message)
        if len(payload) > 0x7FFFFFFF:
            header = struct.pack("!iQ", -1, len(payload))
        else:
            header = struct.pack("!i", len(payload))
        self._writer.write(header + payload)

    def close(self) -> None:
        if self._writer is not None:
            self._writer.close()
        else:
            self._sock.close()


def channel_pair() -> tuple[Channel, Connection]:
    """A connected (pool channel, worker connection) pair; the connection goes to the
    worker process (spawn passes its file descriptor along)."""
    parent, child = socket.socketpair()
    return Channel(parent), Connection(child.detach())
