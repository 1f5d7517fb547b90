"""``python -m app``: serve ``app.main:app`` with uvicorn on ``HOST``:``PORT``.

The same as ``uvicorn app.main:app --host $HOST --port $PORT``, except that each response
goes out in one write (``app.http_protocol``), and that a SIGTERM or SIGINT that ends in a
clean, graceful shutdown exits with status 0 (plain uvicorn re-raises the signal after
shutting down, so its exit status reads "killed by SIGTERM").
"""

from __future__ import annotations

import signal
import sys

import uvicorn

from app.errors import SettingsError
from app.http_protocol import HttpProtocol
from app.settings import get_settings


def main() -> int:
    try:
        settings = get_settings()
    except SettingsError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    # uvicorn restores and re-raises the handlers it found: make those a no-op so a graceful
    # shutdown is an ordinary exit.
    for sig in (signal.SIGTERM, signal.SIGINT):
        signal.signal(sig, lambda *_: None)
    server = uvicorn.Server(
        uvicorn.Config(
            "app.main:app",
            host=settings.host,
            port=settings.port,
            http=HttpProtocol,  # each response in one write
            log_level=settings.log_level,
            access_log=False,  # the app logs each request itself, with its request id
        )
    )
    server.run()
    return 0 if server.started else 1


if __name__ == "__main__":
    sys.exit(main())
