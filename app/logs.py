"""Logging set-up, text or JSON lines, for every process: the HTTP server, its model workers,
broker workers and the batch job. Every library's records go through the same handler as
ours, and one logger's message is printed at most once every ``REPEAT_INTERVAL_S``
(``Repeats``). A leaf module (stdlib only)."""

from __future__ import annotations

import json
import logging
import re
import threading
import time
from collections.abc import Callable
from typing import Any

REPEAT_INTERVAL_S = 60.0
"""A message is printed at most once this often from one logger: long enough that an exporter
retrying a collector that is down (a line every few seconds) says so once a minute, short
enough that the log still shows, minute by minute, that it goes on."""

_STANDARD_FIELDS = set(vars(logging.makeLogRecord({}))) | {"message", "asctime"}
_OURS = ("app", "uvicorn")  # at LOG_LEVEL; every other library at warnings and up
# One line per request, and per operator's signal (a second SIGHUP within the interval was
# held back: no line said it had been heard), each its own.
_NEVER_LIMITED = frozenset({"app.request", "app.signals"})
# A library's repeat differs in its numbers: the OTLP exporter's "retrying in 1.17s", an
# object's address in urllib3's errors.
_NUMBERS = re.compile(r"0x[0-9a-fA-F]+|\d+")
_MAX_KEYS = 1000  # past this, messages last printed an interval ago are forgotten


class JsonFormatter(logging.Formatter):
    """One JSON object per line: time, level, logger, message, plus any ``extra`` fields
    (``repeated``, from ``Repeats``, among them)."""

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


class TextFormatter(logging.Formatter):
    """``time LEVEL logger: message``, with `` (repeated N times)`` when ``Repeats`` held
    back N like it since the last one printed."""

    def __init__(self) -> None:
        super().__init__("%(asctime)s %(levelname)s %(name)s: %(message)s")

    def formatMessage(self, record: logging.LogRecord) -> str:
        line = super().formatMessage(record)
        repeated = getattr(record, "repeated", 0)
        return f"{line} (repeated {repeated} times)" if repeated else line


class Repeats(logging.Filter):
    """The filter on our handler: drops a library's records below ``library_level``, and
    repeats. A record whose logger, level and message match one printed less than
    ``interval_s`` ago is counted instead of printed; the next one printed carries the count
    as ``record.repeated``. A library's messages are compared with their numbers masked, ours
    as they are (``worker 0 died`` and ``worker 1 died`` are two messages); ``app.request``
    lines are never held back.

    >>> repeats = Repeats(logging.WARNING, interval_s=60, clock=lambda: 0.0)
    >>> record = lambda: logging.makeLogRecord({"name": "urllib3", "levelno": logging.WARNING,
    ...                                         "msg": "retry in %.2fs", "args": (1.5,)})
    >>> [bool(repeats.filter(record())) for _ in range(3)]
    [True, False, False]
    """

    def __init__(
        self,
        library_level: int,
        interval_s: float = REPEAT_INTERVAL_S,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        super().__init__()
        self.library_level = library_level
        self.interval_s = interval_s
        self._clock = clock
        self._printed: dict[tuple[str, int, str], tuple[float, int]] = {}  # when, held back
        self._lock = threading.Lock()  # a handler's filters run outside its lock

    def filter(self, record: logging.LogRecord) -> bool:
        ours = record.name.partition(".")[0] in _OURS
        if not ours and record.levelno < self.library_level:
            return False
        if record.name in _NEVER_LIMITED:
            return True
        try:
            message = record.getMessage()
        except Exception:  # a bad format: the formatter reports it, the caller must not see it
            message = str(record.msg)
        key = (record.name, record.levelno, message if ours else _NUMBERS.sub("#", message))
        now = self._clock()
        with self._lock:
            printed_at, held = self._printed.get(key, (None, 0))
            if printed_at is not None and now - printed_at < self.interval_s:
                self._printed[key] = (printed_at, held + 1)
                return False
            if len(self._printed) >= _MAX_KEYS:  # their counts go with them
                self._printed = {
                    k: v for k, v in self._printed.items() if now - v[0] < self.interval_s
                }
            self._printed[key] = (now, 0)
        if held:
            record.__dict__["repeated"] = held
        return True


def configure_logging(level: str, fmt: str) -> None:
    """Send every log record of this process to one stderr handler, in ``text`` or ``json``
    format: ours (and uvicorn's) from ``level`` up, every other library's from warnings up
    (or ``level``, if stricter), repeats held back (``Repeats``). Calling it again replaces
    the handler."""
    ours = logging.getLevelNamesMapping()[level.upper()]
    library = max(logging.WARNING, ours)
    handler = logging.StreamHandler()
    handler.setFormatter(JsonFormatter() if fmt == "json" else TextFormatter())
    handler.addFilter(Repeats(library))
    # Libraries log through the root logger: without a handler there, Python's last resort
    # printed their records bare, with no time or level, and never as JSON.
    root = logging.getLogger()
    for old in [h for h in root.handlers if any(isinstance(f, Repeats) for f in h.filters)]:
        root.removeHandler(old)
    root.addHandler(handler)
    root.setLevel(library)
    for name in ("app", "uvicorn", "uvicorn.error"):
        logger = logging.getLogger(name)
        logger.handlers[:] = [handler]
        logger.setLevel(ours)
        logger.propagate = False
    # Our request log replaces uvicorn's access log (it has the request id and batch size).
    logging.getLogger("uvicorn.access").disabled = True
