"""app.logs: every library's records in our format, at warnings and up, once, with repeats
held back and counted (tests/integration/test_observability.py checks a real server's output
with a collector that is down)."""

from __future__ import annotations

import io
import json
import logging
import re
from collections.abc import Iterator
from typing import Any

import pytest

from app.logs import REPEAT_INTERVAL_S, JsonFormatter, Repeats, TextFormatter, configure_logging

EXPORTER = "opentelemetry.exporter.otlp.proto.http.trace_exporter"
TRANSIENT = "Transient error %s encountered while exporting %s batch, retrying in %.2fs."


def ours(handler: logging.Handler) -> bool:
    return any(isinstance(f, Repeats) for f in handler.filters)


@pytest.fixture(autouse=True)
def restore_logging() -> Iterator[None]:
    """configure_logging changes this process's loggers: put them back as they were."""
    root = logging.getLogger()
    named = [logging.getLogger(n) for n in ("app", "uvicorn", "uvicorn.error", "uvicorn.access")]
    saved = [(x, x.handlers[:], x.level, x.propagate, x.disabled) for x in named]
    before, root_level = [h for h in root.handlers if ours(h)], root.level
    yield
    for logger, handlers, level, propagate, disabled in saved:
        logger.handlers[:], logger.propagate, logger.disabled = handlers, propagate, disabled
        logger.setLevel(level)
    # Only ours: pytest's own handlers on the root logger come and go with each phase.
    for handler in [h for h in root.handlers if ours(h)]:
        root.removeHandler(handler)
    for handler in before:
        root.addHandler(handler)
    root.setLevel(root_level)


def lines(capsys: pytest.CaptureFixture[str]) -> list[str]:
    return capsys.readouterr().err.splitlines()


def test_a_library_logs_json_lines(capsys: pytest.CaptureFixture[str]) -> None:
    configure_logging("info", "json")
    logging.getLogger("opentelemetry.sdk.trace.export").warning(
        "Exception while exporting %s.", "Span"
    )
    try:
        raise ConnectionRefusedError(111, "Connection refused")
    except OSError:
        logging.getLogger("redis.connection").exception("lost it")
    (warning, error) = [json.loads(line) for line in lines(capsys)]
    assert warning["message"] == "Exception while exporting Span."
    assert (warning["level"], warning["logger"]) == ("warning", "opentelemetry.sdk.trace.export")
    assert re.fullmatch(r"\d{4}-\d\d-\d\dT\d\d:\d\d:\d\d", warning["time"])
    assert error["level"] == "error" and "ConnectionRefusedError" in error["exception"]


def test_a_library_logs_our_text_lines(capsys: pytest.CaptureFixture[str]) -> None:
    configure_logging("info", "text")
    logging.getLogger("urllib3.connectionpool").warning("Retrying after %s", "a reset")
    (line,) = lines(capsys)
    assert re.fullmatch(
        r"\d{4}-\d\d-\d\d \d\d:\d\d:\d\d,\d{3} WARNING urllib3.connectionpool: Retrying after a reset",
        line,
    ), line


@pytest.mark.parametrize(
    ("level", "printed"),
    [
        ("debug", ["app debug", "app info", "library warning", "library error"]),
        ("info", ["app info", "library warning", "library error"]),
        ("warning", ["library warning", "library error"]),
        ("error", ["library error"]),
    ],
)
def test_libraries_log_warnings_and_up_unless_log_level_is_stricter(
    level: str, printed: list[str], capsys: pytest.CaptureFixture[str]
) -> None:
    configure_logging(level, "json")
    app, library = logging.getLogger("app.worker"), logging.getLogger("grpc._server")
    library.setLevel(logging.DEBUG)  # a library that asks for more does not get it
    try:
        app.debug("app debug")
        app.info("app info")
        library.info("library info")
        library.warning("library warning")
        library.error("library error")
    finally:
        library.setLevel(logging.NOTSET)
    assert [json.loads(line)["message"] for line in lines(capsys)] == printed


def test_configured_twice_each_record_is_printed_once(capsys: pytest.CaptureFixture[str]) -> None:
    configure_logging("info", "text")
    configure_logging("info", "json")
    assert len([h for h in logging.getLogger().handlers if ours(h)]) == 1
    logging.getLogger("app").info("ours")
    logging.getLogger("uvicorn.error").info("uvicorn's")
    logging.getLogger("asyncio").warning("a library's")
    assert [json.loads(line)["message"] for line in lines(capsys)] == [
        "ours",
        "uvicorn's",
        "a library's",
    ]


def test_an_exporter_retrying_prints_once_per_interval(capsys: pytest.CaptureFixture[str]) -> None:
    configure_logging("info", "json")
    exporter = logging.getLogger(EXPORTER)
    for delay in (1.17, 2.38, 3.25, 0.89, 1.83):  # each retry's delay differs
        exporter.warning(TRANSIENT, "Connection refused at 0x7f3a2c1d0e50", "spans", delay)
    (line,) = lines(capsys)
    assert json.loads(line)["message"].endswith("retrying in 1.17s.")


class Clock:
    def __init__(self) -> None:
        self.now = 1000.0

    def __call__(self) -> float:
        return self.now


def handled(formatter: logging.Formatter) -> tuple[logging.Logger, io.StringIO, Clock]:
    """A logger of its own (outside the logging tree) with our filter, on a clock we turn."""
    clock, out = Clock(), io.StringIO()
    handler = logging.StreamHandler(out)
    handler.setFormatter(formatter)
    handler.addFilter(Repeats(logging.WARNING, clock=clock))
    logger = logging.Logger(EXPORTER)
    logger.addHandler(handler)
    return logger, out, clock


def test_repeats_are_counted_and_the_next_one_printed_says_how_many() -> None:
    logger, out, clock = handled(JsonFormatter())
    for delay in (1.0, 2.0, 4.0):
        logger.warning(TRANSIENT, "refused", "spans", delay)
        clock.now += 1
    clock.now += REPEAT_INTERVAL_S
    logger.warning(TRANSIENT, "refused", "spans", 1.0)
    logger.warning(TRANSIENT, "refused", "spans", 2.0)  # a new interval from the last printed
    first, second = [json.loads(line) for line in out.getvalue().splitlines()]
    assert "repeated" not in first and second["repeated"] == 2


def test_the_text_line_says_how_many_were_held_back() -> None:
    logger, out, clock = handled(TextFormatter())
    logger.error("Failed to export %s batch due to timeout, max retries or shutdown.", "spans")
    logger.error("Failed to export %s batch due to timeout, max retries or shutdown.", "spans")
    clock.now += REPEAT_INTERVAL_S
    logger.error("Failed to export %s batch due to timeout, max retries or shutdown.", "spans")
    first, second = out.getvalue().splitlines()
    assert not first.endswith("times)")
    assert second.endswith("shutdown. (repeated 1 times)")


def test_different_messages_and_request_lines_are_never_held_back() -> None:
    clock, out = Clock(), io.StringIO()
    handler = logging.StreamHandler(out)
    handler.setFormatter(JsonFormatter())
    handler.addFilter(Repeats(logging.WARNING, clock=clock))
    printed: list[tuple[str, str]] = []

    def log(name: str, level: int, msg: str, *args: Any) -> None:
        logger = logging.Logger(name)
        logger.addHandler(handler)
        logger.log(level, msg, *args)

    for _ in range(3):
        log("app.request", logging.INFO, "POST /predict/tag 200")  # the same line, each its own
    for _ in range(2):
        log("app.signals", logging.INFO, "SIGHUP: loading what is new")  # each one heard
    log(EXPORTER, logging.ERROR, "Failed to export: %s", "connection refused")
    log(EXPORTER, logging.ERROR, "Failed to export: %s", "name not known")
    log(EXPORTER, logging.WARNING, "Failed to export: %s", "name not known")  # another level
    log("redis.connection", logging.ERROR, "Failed to export: %s", "name not known")
    log("app.worker", logging.ERROR, "worker %d died", 0)  # ours: numbers are not masked
    log("app.worker", logging.ERROR, "worker %d died", 1)
    log("app.worker", logging.ERROR, "worker %d died", 1)  # the one repeat
    for line in out.getvalue().splitlines():
        entry = json.loads(line)
        printed.append((entry["logger"], entry["message"]))
    assert printed == [
        ("app.request", "POST /predict/tag 200"),
        ("app.request", "POST /predict/tag 200"),
        ("app.request", "POST /predict/tag 200"),
        ("app.signals", "SIGHUP: loading what is new"),
        ("app.signals", "SIGHUP: loading what is new"),
        (EXPORTER, "Failed to export: connection refused"),
        (EXPORTER, "Failed to export: name not known"),
        (EXPORTER, "Failed to export: name not known"),
        ("redis.connection", "Failed to export: name not known"),
        ("app.worker", "worker 0 died"),
        ("app.worker", "worker 1 died"),
    ]


def test_a_bad_format_does_not_raise_from_the_filter() -> None:
    record = logging.makeLogRecord(
        {"name": "lib", "levelno": logging.ERROR, "msg": "%d", "args": ("x",)}
    )
    assert Repeats(logging.WARNING).filter(record)
