"""The app's lifecycle without workers: nothing happens at import, and what the lifespan
does around the engine (start-up objects frozen out of the collector's sight while serving,
readiness flipped at shutdown)."""

from __future__ import annotations

import asyncio
import gc
import subprocess
import sys
from pathlib import Path
from types import SimpleNamespace, TracebackType
from typing import Any, ClassVar

import pytest
from fastapi import FastAPI

import app.main
from app.main import create_app
from app.plan import ServingPlan
from app.settings import Settings

REPO = Path(__file__).resolve().parents[2]


def test_importing_the_app_builds_nothing_and_configures_no_logging() -> None:
    code = (
        "import logging, app.main;"
        "print(hasattr(app.main, 'app'), logging.getLogger('app').handlers,"
        " logging.getLogger('uvicorn').handlers)"
    )
    out = subprocess.run(
        [sys.executable, "-c", code], cwd=REPO, capture_output=True, text=True, check=True
    )
    assert out.stdout.split() == ["False", "[]", "[]"]


def test_python_m_app_help_lists_every_setting_and_starts_nothing() -> None:
    out = subprocess.run(
        [sys.executable, "-m", "app", "--help"],
        cwd=REPO,
        capture_output=True,
        text=True,
        timeout=60,
        check=True,
    )
    assert out.stdout.startswith("usage: python -m app")
    for name in Settings.model_fields:
        assert f"  {name.upper()} (default" in out.stdout


class FakeEngine:
    """Stands in for the engine: no workers, just the attributes the lifespan reads."""

    instances: ClassVar[list[FakeEngine]] = []

    def __init__(
        self,
        plan: ServingPlan,
        metrics: Any,
        *,
        transport: Any,
        drain_timeout_s: float,
        charge: Any = None,
    ) -> None:
        self.drain_timeout_s = drain_timeout_s
        self.plan = plan
        self.transport = SimpleNamespace(worker_status=list, ready=True)
        self.streamer = SimpleNamespace(queue_depth=0, in_flight=0)
        self.queue_depth = 0
        self.registry = SimpleNamespace(default=None, versions=list)
        self.models = SimpleNamespace()  # neither reloads nor polls
        self.labels = lambda served_id: ("", "")
        self.closed_while_serving: bool | None = None
        FakeEngine.instances.append(self)

    async def __aenter__(self) -> FakeEngine:
        return self

    async def __aexit__(
        self, kind: type[BaseException] | None, exc: BaseException | None, tb: TracebackType | None
    ) -> None:
        self.frozen_at_exit = gc.get_freeze_count()


def test_start_up_objects_are_frozen_while_serving_and_released_at_shutdown(
    monkeypatch: pytest.MonkeyPatch, tiny_store: Path
) -> None:
    monkeypatch.setattr(app.main, "Engine", FakeEngine)
    served = create_app(Settings(mb_request_timeout=7, model_store=tiny_store))

    async def lifespan() -> None:
        async with served.router.lifespan_context(served):
            # The app and the engine, alive at start-up, are out of the collector's sight.
            frozen = {id(o) for o in gc.get_objects()}
            assert id(served) not in frozen and id(served.state.engine) not in frozen
            assert gc.get_freeze_count() > 1000
            assert not served.state.closing
        assert served.state.closing  # readiness turned 503 before the engine drained

    asyncio.run(lifespan())
    (engine,) = FakeEngine.instances
    assert engine.drain_timeout_s == 7  # admitted requests may finish at shutdown
    assert engine.frozen_at_exit == 0  # unfrozen before the engine stopped
    assert gc.get_freeze_count() == 0


def test_the_api_docs_show_the_bearer_scheme_when_an_api_key_is_set(tiny_store: Path) -> None:
    with_key = create_app(Settings(api_key="s3cret", model_store=tiny_store)).openapi()
    assert with_key["components"]["securitySchemes"]["bearer"]["scheme"] == "bearer"
    assert with_key["paths"]["/predict/tag"]["post"]["security"] == [{"bearer": []}]
    assert with_key["paths"]["/v2/models/{name}/infer"]["post"]["security"] == [{"bearer": []}]
    assert "security" not in with_key["paths"]["/readyz"]["get"]
    without = create_app(Settings(model_store=tiny_store)).openapi()
    assert "securitySchemes" not in without.get("components", {})


@pytest.mark.parametrize("setting", ["MODEL_STORE", "MODEL_REPOSITORY"])
def test_no_model_to_serve_is_one_line_not_a_traceback(setting: str, tmp_path: Path) -> None:
    out = subprocess.run(
        [sys.executable, "-m", "app"],
        cwd=REPO,
        env={"PATH": "/usr/bin:/bin", setting: str(tmp_path / "nothing"), "PORT": "0"},
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert out.returncode == 2
    assert out.stderr.startswith(f"error: no model in {tmp_path / 'nothing'}")
    assert "Traceback" not in out.stderr and len(out.stderr.splitlines()) == 1


def test_the_old_batch_job_name_still_runs_and_says_the_new_one() -> None:
    out = subprocess.run(
        [sys.executable, "-m", "app.batch", "--help"],
        cwd=REPO,
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert out.returncode == 0, out.stderr
    assert "python -m app.bulk" in out.stderr
    assert "usage:" in out.stdout


def _without_batches(settings: Settings) -> FastAPI:
    """The app on a transport that runs no batch (a test that reaches one fails)."""
    from app.testing import FakeTransport

    async def unused(*_: Any) -> list[object]:
        raise AssertionError("no batch is run")

    return create_app(settings, transport=FakeTransport(unused))


async def test_an_unexpected_error_on_any_route_answers_with_the_request_id(
    tiny_store: Path,
) -> None:
    """A route FastAPI resolves (not a direct one) that raises: a JSON 500 that echoes the
    request id, as every answer does (Starlette answered it outside the middleware, with no
    X-Request-ID: the client could not find the log line of its own failure)."""
    import httpx

    served = _without_batches(Settings(model_store=tiny_store))

    @served.get("/boom")
    async def boom() -> None:
        raise RuntimeError("a bug")

    transport = httpx.ASGITransport(app=served, raise_app_exceptions=False)
    async with served.router.lifespan_context(served):
        async with httpx.AsyncClient(transport=transport, base_url="http://t") as client:
            answer = await client.get("/boom", headers={"X-Request-ID": "order-7"})
    assert answer.status_code == 500
    assert answer.headers["x-request-id"] == "order-7"
    assert answer.json()["error"]["type"] == "internal_error"


async def test_a_body_refused_by_its_length_is_counted_under_its_route(tiny_store: Path) -> None:
    """A 413 from the Content-Length alone (before any route ran) is counted under its route,
    as one refused while its body streams; it was counted under ``unmatched``, with the 404s
    of unknown paths."""
    import httpx

    served = _without_batches(Settings(model_store=tiny_store, max_upload_bytes=1000))
    transport = httpx.ASGITransport(app=served)
    async with served.router.lifespan_context(served):
        async with httpx.AsyncClient(transport=transport, base_url="http://t") as client:
            answer = await client.post("/predict/tag", content=b"x" * 200_000)
    assert answer.status_code == 413
    counted = [
        line
        for line in served.state.metrics.render().decode().splitlines()
        if line.startswith("microbatch_http_requests_total{") and 'status="413"' in line
    ]
    assert len(counted) == 1 and 'route="/predict/tag"' in counted[0], counted
