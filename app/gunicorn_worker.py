"""A gunicorn worker class: uvicorn, as ``python -m app`` runs it (one write per response).

    gunicorn -k app.gunicorn_worker.Worker -w 2 -b 127.0.0.1:8000 'app.main:create_app()'

Each gunicorn worker process is a whole server of its own: it calls the factory, starts its
own model workers and batches only its own requests.
"""

from __future__ import annotations

import signal
from typing import Any

from uvicorn_worker import UvicornWorker

from app.http_protocol import server_options
from app.settings import get_settings
from app.workers.lineage import die_with_parent


class Worker(UvicornWorker):  # type: ignore[misc]
    """``uvicorn_worker.UvicornWorker`` with the options ``python -m app`` serves with
    (``app.http_protocol.server_options``: one write per response, no access log, idle
    connections kept ``MB_KEEP_ALIVE``); it stops (SIGTERM: admitted requests
    finish) the moment its gunicorn master dies, even by ``kill -9`` (gunicorn itself would
    notice only at its next timeout check)."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        self.CONFIG_KWARGS = {"loop": "auto", **server_options(get_settings().mb_keep_alive)}
        super().__init__(*args, **kwargs)

    def init_process(self) -> None:
        die_with_parent(self.ppid, signal.SIGTERM)
        super().init_process()
