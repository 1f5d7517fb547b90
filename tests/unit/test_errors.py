from __future__ import annotations

import pytest

from app import errors


@pytest.mark.parametrize(
    ("error", "status"),
    [
        (errors.InvalidImage("x"), 400),
        (errors.PayloadTooLarge("x"), 413),
        (errors.UnsupportedImageFormat("x"), 415),
        (errors.InvalidParameter("x"), 422),
        (errors.QueueFull("x"), 503),
        (errors.NotReady("x"), 503),
        (errors.WorkerDied("x"), 503),
        (errors.DeadlineExceeded("x"), 504),
        (errors.InferenceError("x"), 500),
        (errors.BatchContractError("x"), 500),
    ],
)
def test_status_table(error: errors.ServerError, status: int) -> None:
    assert errors.http_status(error) == status


def test_codes_are_unique() -> None:
    """Each type has its own code, but for a kind the server tells apart and its callers
    need not (``DiedRunning`` is a ``worker_died``, retried alone before it reaches them)."""
    classes = [
        c
        for c in vars(errors).values()
        if isinstance(c, type) and issubclass(c, errors.ServerError)
    ]
    codes = [c.code for c in classes if c is not errors.DiedRunning]
    assert len(codes) == len(set(codes))
    assert errors.DiedRunning.code == errors.WorkerDied.code


@pytest.mark.parametrize(
    ("error", "reason"),
    [
        (errors.QueueFull("x"), "queue_full"),
        (errors.DeadlineExceeded("x"), "timeout"),
        (errors.WorkerDied("x"), "worker_died"),
        (errors.ClientDisconnected("x"), "client_disconnected"),
        (errors.InvalidImage("x"), "bad_input"),
        (errors.InvalidRequest("x"), "bad_input"),
        (errors.InvalidParameter("x"), "bad_input"),
        (errors.Unauthorized("x"), "bad_input"),
        (errors.NotReady("x"), "not_ready"),
        (errors.InferenceError("x"), None),
        (errors.BatchContractError("x"), None),
    ],
)
def test_rejection_reasons(error: errors.ServerError, reason: str | None) -> None:
    assert error.reject_reason == reason


def test_the_grpc_codes_docs_api_gives_are_the_codes_the_table_gives() -> None:
    """docs/api.md says which gRPC status each refusal ends a call with; every pair it
    names is the table's (a failed load is FAILED_PRECONDITION, not INVALID_ARGUMENT)."""
    from pathlib import Path

    docs = " ".join((Path(__file__).parents[2] / "docs" / "api.md").read_text().split())
    pairs = {
        errors.ModelLoadFailed("x", "verify"): "422 `model_load_failed`, `FAILED_PRECONDITION`",
        errors.ModelMemoryBudget("x"): "507 `model_memory_budget` `RESOURCE_EXHAUSTED`",
        errors.ModelVersionUnavailable("x"): "409 `FAILED_PRECONDITION`",
        errors.ModelNotFound("x"): "404s `NOT_FOUND`",
        errors.InvalidRequest("x"): "other 4xx `INVALID_ARGUMENT`",
        errors.Unauthorized("x"): "401 `UNAUTHENTICATED`",
        errors.Forbidden("x"): "403 `PERMISSION_DENIED`",
        errors.QuotaExceeded("x"): "429 `RESOURCE_EXHAUSTED`",
        errors.PayloadTooLarge("x"): "413 `RESOURCE_EXHAUSTED`",
        errors.NotReady("x"): "503s `UNAVAILABLE`",
        errors.DeadlineExceeded("x"): "504 `DEADLINE_EXCEEDED`",
    }
    for error, said in pairs.items():
        assert said in docs, said
        assert said.split("`")[-2] == errors.grpc_status(error), said


@pytest.mark.parametrize(
    ("error", "after"),
    [
        (errors.QueueFull("x", retry_after_s=2.5), "3"),
        (errors.DeadlineExceeded("x"), "1"),  # busy: as a 503 (it said nothing)
        (errors.QuotaExceeded("x", retry_after_s=4.0), "4"),
        (errors.InvalidImage("x"), None),
        (errors.InferenceError("x"), None),
    ],
)
def test_the_busy_and_over_quota_refusals_say_when_to_try_again(
    error: errors.ServerError, after: str | None
) -> None:
    from app.metrics import Metrics
    from app.routers.errors import refusal
    from app.v2.grpc_calls import trailing_of

    assert refusal(error, Metrics()).headers.get("retry-after") == after
    assert dict(trailing_of(error)).get("retry-after") == after
