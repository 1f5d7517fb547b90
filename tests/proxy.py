"""A TCP proxy on loopback whose way back a test can stall: what the server sends is held,
not passed on, while it is ``frozen`` (a network path that stops delivering), and dropped
with the connection if the client gives up meanwhile."""

from __future__ import annotations

import contextlib
import socket
import threading
import time
from collections.abc import Iterator


class StallingProxy:
    """Listens on a port of its own and passes each connection on to ``127.0.0.1:port``."""

    def __init__(self, port: int) -> None:
        self.target = port
        self.listener = socket.create_server(("127.0.0.1", 0))
        self.port: int = self.listener.getsockname()[1]
        self.frozen = threading.Event()
        self._open: list[socket.socket] = []
        threading.Thread(target=self._accept, daemon=True).start()

    def _accept(self) -> None:
        while True:
            try:
                client, _ = self.listener.accept()
            except OSError:  # closed
                return
            server = socket.create_connection(("127.0.0.1", self.target))
            self._open += [client, server]
            threading.Thread(target=self._pump, args=(client, server, False), daemon=True).start()
            threading.Thread(target=self._pump, args=(server, client, True), daemon=True).start()

    def _pump(self, source: socket.socket, sink: socket.socket, back: bool) -> None:
        try:
            while data := source.recv(65536):
                while back and self.frozen.is_set():
                    time.sleep(0.01)
                sink.sendall(data)
        except OSError:
            pass
        finally:  # either end closed: so is the other, and whatever was held is lost
            for end in (source, sink):
                with contextlib.suppress(OSError):
                    end.shutdown(socket.SHUT_RDWR)
                end.close()

    @contextlib.contextmanager
    def stalled(self) -> Iterator[None]:
        self.frozen.set()
        try:
            yield
        finally:
            self.frozen.clear()

    def close(self) -> None:
        self.listener.close()
        for end in self._open:
            end.close()
