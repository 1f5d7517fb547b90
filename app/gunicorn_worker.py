"""A gunicorn worker class: uvicorn, as ``python -m app`` runs it (one write per response).

    gunicorn -k app.gunicorn_worker.Worker -w 2 -b 127.0.0.1:8000 'app.main:create_app()'

Each gunicorn worker process is a whole server of its own: it calls the factory, starts its
own model workers and batches only its own requests. ``kill -HUP`` of the master reloads
each of them in place (``Worker.check_config``).
"""

from __future__ import annotations

import contextlib
import os
import signal
from functools import partial
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

    @classmethod
    def check_config(cls, cfg: Any, log: Any) -> None:
        """In gunicorn's master, as it starts: ``kill -HUP`` of the master has each
        front-end process reload in place, as ``kill -HUP`` of ``python -m app`` does (the
        keys file, a file with an error keeping the keys in force; the model repository).
        gunicorn's own HUP starts new processes and stops the old ones: new processes refuse
        a keys file with an error, and the front end then served nothing."""
        ready = cfg.when_ready

        def when_ready(server: Any) -> None:
            ready(server)
            server.handle_hup = partial(_hang_up, server)

        cfg.set("when_ready", when_ready)

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


def _hang_up(server: Any) -> None:
    """The master's SIGHUP, handed to each of its front-end processes."""
    server.log.info("Hang up: each front-end process reloads in place")
    for pid in list(server.WORKERS):
        with contextlib.suppress(ProcessLookupError):
            os.kill(pid, signal.SIGHUP)
