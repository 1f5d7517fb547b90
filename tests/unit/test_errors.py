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
    classes = [
        c
        for c in vars(errors).values()
        if isinstance(c, type) and issubclass(c, errors.ServerError)
    ]
    codes = [c.code for c in classes]
    assert len(codes) == len(set(codes))


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
