"""``app.metrics``: refusals are counted under the ``reject_reason`` of their error class."""

from __future__ import annotations

import httpx
import pytest
from fastapi import FastAPI
from starlette.exceptions import HTTPException as StarletteHTTPException

from app import errors
from app.metrics import Metrics
from app.routers.errors import install_error_handlers

REFUSALS = [
    (errors.QueueFull, "queue_full"),
    (errors.DeadlineExceeded, "timeout"),
    (errors.WorkerDied, "worker_died"),
    (errors.ClientDisconnected, "client_disconnected"),
    (errors.ClientError, "bad_input"),
    (errors.InvalidImage, "bad_input"),
    (errors.UnsupportedImageFormat, "bad_input"),
    (errors.PayloadTooLarge, "bad_input"),
    (errors.InvalidRequest, "bad_input"),
    (errors.InvalidParameter, "bad_input"),
    (errors.Unauthorized, "bad_input"),
]


def _rejected_lines(metrics: Metrics) -> list[str]:
    text = metrics.render().decode()
    return [line for line in text.splitlines() if line.startswith("microbatch_rejected_total")]


@pytest.mark.parametrize(("kind", "reason"), REFUSALS)
def test_a_refusal_is_counted_under_its_reason(kind: type[errors.ServerError], reason: str) -> None:
    metrics = Metrics()
    metrics.on_error(kind("x"))
    metrics.on_error(kind)  # a refusal Starlette or FastAPI made, named by its class
    assert _rejected_lines(metrics) == [f'microbatch_rejected_total{{reason="{reason}"}} 2.0']


@pytest.mark.parametrize(
    "kind", [errors.InferenceError, errors.BatchContractError, errors.NotReady, errors.Unavailable]
)
def test_a_failure_that_is_no_refusal_counts_nothing(kind: type[errors.ServerError]) -> None:
    metrics = Metrics()
    metrics.on_error(kind("x"))
    assert _rejected_lines(metrics) == []


def test_the_table_above_lists_every_counted_class() -> None:
    classes = [c for c in vars(errors).values() if isinstance(c, type)]
    counted = {c for c in classes if issubclass(c, errors.ServerError) and c.reject_reason}
    assert counted == {kind for kind, _ in REFUSALS}


async def test_refusals_starlette_and_fastapi_make_count_as_bad_input() -> None:
    app = FastAPI()
    metrics = Metrics()
    install_error_handlers(app, metrics)

    @app.get("/too-large")
    async def too_large() -> None:
        raise StarletteHTTPException(413, "too large")

    @app.get("/typed")
    async def typed(k: int) -> int:
        return k

    transport = httpx.ASGITransport(app=app)
    async with httpx.AsyncClient(transport=transport, base_url="http://test") as client:
        assert (await client.get("/too-large")).json()["error"]["type"] == "payload_too_large"
        assert (await client.get("/typed?k=abc")).json()["error"]["type"] == "invalid_request"
        assert (await client.get("/nowhere")).status_code == 404  # not a refusal
    assert _rejected_lines(metrics) == ['microbatch_rejected_total{reason="bad_input"} 2.0']
