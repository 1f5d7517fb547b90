"""A gunicorn worker class: uvicorn, as ``python -m app`` runs it (one write per response).

    gunicorn -k app.gunicorn_worker.Worker -w 2 -b 127.0.0.1:8000 'app.main:create_app()'

Each gunicorn worker process is a whole server of its own: it calls the factory, starts its
own model workers and batches only its own requests.
"""

from __future__ import annotations

import signal
from typing import Any

from uvicorn_worker import UvicornWorker

from app.errors import SettingsError
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
        self.CONFIG_KWARGS = {"loop": "auto", **server_options(None)}
        super().__init__(*args, **kwargs)

    def init_process(self) -> None:
        die_with_parent(self.ppid, signal.SIGTERM)
        self.apply_settings()
        super().init_process()

    def apply_settings(self) -> None:
        """``MB_KEEP_ALIVE``, read in this worker process: gunicorn builds this object in its
        master, where settings read would outlive a HUP that brings a new ``.env``. A bad
        setting is left for the app's start to report, as it always has."""
        try:
            keep_alive_s = get_settings().mb_keep_alive
        except SettingsError:
            return
        self.config.timeout_keep_alive = keep_alive_s
