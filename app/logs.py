"""Logging set-up, text or JSON lines, for every process: the HTTP server, its model workers,
broker workers and the batch job. A leaf module (stdlib only)."""

from __future__ import annotations

import json
import logging
from typing import Any

_STANDARD_FIELDS = set(vars(logging.makeLogRecord({}))) | {"message", "asctime"}


class JsonFormatter(logging.Formatter):
    """One JSON object per line: time, level, logger, message, plus any ``extra`` fields."""

    def format(self, record: logging.LogRecord) -> str:
        entry: dict[str, Any] = {
            "time": self.formatTime(record, "%Y-%m-%dT%H:%M:%S"),
            "level": record.levelname.lower(),
            "logger": record.name,
            "message": record.getMessage(),
        }
        entry.update({k: v for k, v in vars(record).items() if k not in _STANDARD_FIELDS})
        if record.exc_info:
            entry["exception"] = self.formatException(record.exc_info)
        return json.dumps(entry, default=str)


def configure_logging(level: str, fmt: str) -> None:
    """Route our loggers (and uvicorn's) to stderr in ``text`` or ``json`` format."""
    handler = logging.StreamHandler()
    if fmt == "json":
        handler.setFormatter(JsonFormatter())
    else:
        handler.setFormatter(logging.Formatter("%(asctime)s %(levelname)s %(name)s: %(message)s"))
    for name in ("app", "uvicorn", "uvicorn.error"):
        logger = logging.getLogger(name)
        logger.handlers[:] = [handler]
        logger.setLevel(level.upper())
        logger.propagate = False
    # Our request log replaces uvicorn's access log (it has the request id and batch size).
    logging.getLogger("uvicorn.access").disabled = True
    # python-multipart warns about each malformed form it parses: the client already gets its
    # 400, so keep only its errors, in our format.
    multipart = logging.getLogger("python_multipart")
    multipart.handlers[:] = [handler]
    multipart.setLevel(max(logging.ERROR, logging.getLevelName(level.upper())))
    multipart.propagate = False
