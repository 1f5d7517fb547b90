"""``app.http_protocol``: uvicorn's protocol sends each response in one write."""

from __future__ import annotations

import asyncio
import os
import re
import warnings
from pathlib import Path
from typing import Any

import pytest
import uvicorn
from uvicorn.config import Config
from uvicorn.server import ServerState

import app.http_protocol as protocol_module
from app.http_protocol import UVICORN_VERSION, CoalescingTransport, HttpProtocol, http_protocol

REQUEST = b"GET / HTTP/1.1\r\nhost: example.org\r\n\r\n"
BODY = b'{"ok":true}'


class RecordingTransport(asyncio.Transport):
    """Records each write, as the socket would see it."""

    def __init__(self) -> None:
        super().__init__()
        self.writes: list[bytes] = []
        self.closed = False
        self.aborted = False
        self.events: list[str] = []

    def write(self, data: Any) -> None:
        self.writes.append(bytes(data))
        self.events.append("write")

    def close(self) -> None:
        self.closed = True
        self.events.append("close")

    def abort(self) -> None:
        self.aborted = True

    def is_closing(self) -> bool:
        return self.closed or self.aborted

    def get_extra_info(self, name: str, default: Any = None) -> Any:
        return {"peername": ("127.0.0.1", 5000), "sockname": ("127.0.0.1", 8000)}.get(name, default)

    def get_write_buffer_size(self) -> int:
        return 0

    def pause_reading(self) -> None:
        pass

    def resume_reading(self) -> None:
        pass


async def _json_app(scope: Any, receive: Any, send: Any) -> None:
    await send(
        {
            "type": "http.response.start",
            "status": 200,
            "headers": [(b"content-type", b"application/json"), (b"content-length", b"11")],
        }
    )
    await send({"type": "http.response.body", "body": BODY})


async def _streaming_app(scope: Any, receive: Any, send: Any) -> None:
    await send({"type": "http.response.start", "status": 200, "headers": []})
    await asyncio.sleep(0.05)  # the first chunk comes a loop turn (or many) later
    await send({"type": "http.response.body", "body": b"chunk", "more_body": False})


async def _serve_one(app: Any) -> RecordingTransport:
    config = Config(app=app, lifespan="off", log_level="warning")
    protocol = HttpProtocol(config, ServerState(), {}, _loop=asyncio.get_running_loop())
    transport = RecordingTransport()
    protocol.connection_made(transport)
    protocol.data_received(REQUEST)
    for _ in range(100):
        if transport.writes and transport.writes[-1].endswith((BODY, b"0\r\n\r\n")):
            break
        await asyncio.sleep(0.01)
    return transport


async def test_a_response_goes_out_in_one_write() -> None:
    transport = await _serve_one(_json_app)
    assert len(transport.writes) == 1, transport.writes  # stock uvicorn: headers, then body
    assert transport.writes[0].startswith(b"HTTP/1.1 200 OK\r\n")
    assert transport.writes[0].endswith(b"\r\n\r\n" + BODY)


async def test_headers_that_no_body_follows_go_out_at_the_end_of_the_turn() -> None:
    transport = await _serve_one(_streaming_app)
    assert len(transport.writes) == 2  # headers did not wait for the late first chunk
    assert transport.writes[0].startswith(b"HTTP/1.1 200 OK\r\n")
    assert transport.writes[0].endswith(b"\r\n\r\n")
    assert b"chunk" in transport.writes[1]


async def test_held_headers_are_sent_before_a_close_and_dropped_on_abort() -> None:
    loop = asyncio.get_running_loop()
    inner = RecordingTransport()
    transport = CoalescingTransport(inner, loop)
    transport.write(b"HTTP/1.1 204 No Content\r\n\r\n")
    assert inner.writes == []
    assert transport.get_write_buffer_size() > 0
    transport.close()
    assert inner.events == ["write", "close"]

    inner = RecordingTransport()
    transport = CoalescingTransport(inner, loop)
    transport.write(b"HTTP/1.1 200 OK\r\n\r\n")
    transport.abort()
    await asyncio.sleep(0)  # the end-of-turn flush finds nothing to send
    assert inner.writes == [] and inner.aborted


@pytest.mark.parametrize(
    "data",
    [b"partial body", b"HTTP/1.1 400 Bad Request\r\ncontent-length: 3\r\n\r\nbad", b""],
)
async def test_anything_but_a_header_block_passes_straight_through(data: bytes) -> None:
    inner = RecordingTransport()
    CoalescingTransport(inner, asyncio.get_running_loop()).write(data)
    assert inner.writes == [data]


def test_the_command_line_serves_with_this_protocol_and_mb_keep_alive(
    monkeypatch: pytest.MonkeyPatch, tiny_store: Path
) -> None:
    import app.__main__ as cli
    from app.settings import load_settings

    # The tiny model, not the checkout's model_store (empty on a fresh clone), read afresh.
    monkeypatch.setenv("MODEL_STORE", str(tiny_store))
    monkeypatch.setenv("MB_KEEP_ALIVE", "42")
    monkeypatch.setattr("app.__main__.get_settings", load_settings)

    configs: list[Config] = []

    class FakeServer:
        started = True

        def __init__(self, config: Config) -> None:
            configs.append(config)

        def run(self) -> None:
            pass

    # By dotted name: app.__main__ does not re-export the modules it imports.
    monkeypatch.setattr("app.__main__.uvicorn.Server", FakeServer)
    monkeypatch.setattr("app.__main__.signal.signal", lambda *_: None)
    assert cli.main([]) == 0
    assert configs[0].http is HttpProtocol
    assert configs[0].timeout_keep_alive == 42 and configs[0].access_log is False


def test_the_gunicorn_worker_class_serves_as_the_command_line_does(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    from gunicorn.config import Config as GunicornConfig
    from gunicorn.glogging import Logger

    from app.gunicorn_worker import Worker
    from app.settings import load_settings

    monkeypatch.setenv("MB_KEEP_ALIVE", "42")
    monkeypatch.setattr("app.gunicorn_worker.get_settings", load_settings)
    cfg = GunicornConfig()  # --keep-alive 2, gunicorn's default, which MB_KEEP_ALIVE replaces
    worker = Worker(0, os.getpid(), [], None, 30, cfg, Logger(cfg))  # in gunicorn's master
    worker.tmp.close()  # the heartbeat file gunicorn's worker opens
    assert worker.config.http is HttpProtocol and worker.config.access_log is False
    worker.apply_settings()  # in the worker process, before it serves (init_process)
    assert worker.config.timeout_keep_alive == 42
    monkeypatch.setenv("MB_KEEP_ALIVE", "0")  # a bad setting: left for the app's start
    worker.apply_settings()
    assert worker.config.timeout_keep_alive == 42


def test_the_pinned_uvicorn_gets_this_protocol_without_a_warning() -> None:
    assert uvicorn.__version__ == UVICORN_VERSION  # the tests above ran on the real one
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        assert http_protocol() is HttpProtocol


def test_the_pin_matches_requirements() -> None:
    requirements = (Path(__file__).parents[2] / "requirements.txt").read_text()
    pinned = re.search(r"^uvicorn==(\S+)", requirements, re.MULTILINE)
    assert pinned is not None and pinned.group(1) == UVICORN_VERSION


def test_another_uvicorn_gets_the_stock_protocol_with_a_warning(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.setattr(uvicorn, "__version__", "0.99.0")
    expected = rf"uvicorn is 0\.99\.0, not the {re.escape(UVICORN_VERSION)}"
    with pytest.warns(RuntimeWarning, match=expected):
        assert http_protocol() == "auto"


def test_without_httptools_it_falls_back_with_a_warning(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(
        protocol_module, "_import_error", ImportError("No module named 'httptools'")
    )
    with pytest.warns(RuntimeWarning, match="did not import .*httptools"):
        assert http_protocol() == "auto"
