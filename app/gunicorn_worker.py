"""A gunicorn worker class: uvicorn, as ``python -m app`` runs it (one write per response).

    gunicorn -k app.gunicorn_worker.Worker -w 2 -b 127.0.0.1:8000 'app.main:create_app()'

Each gunicorn worker process is a whole server of its own: it calls the factory, starts its
own model workers and batches only its own requests.
"""

from __future__ import annotations

from typing import Any

from uvicorn_worker import UvicornWorker

from app.http_protocol import http_protocol


class Worker(UvicornWorker):  # type: ignore[misc]
    """``uvicorn_worker.UvicornWorker`` with our HTTP protocol and no access log (the app
    logs each request itself, with its request id)."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        self.CONFIG_KWARGS = {"loop": "auto", "http": http_protocol(), "access_log": False}
        super().__init__(*args, **kwargs)
