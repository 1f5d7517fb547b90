"""Reading this server's answers in tests."""

from __future__ import annotations

from typing import Any

from prometheus_client.parser import text_string_to_metric_families


def error_of(response: Any) -> dict[str, str]:
    """An error answer's ``type`` and ``message``, in either of the server's shapes: ``{"error":
    {"type", "message"}}`` (its own routes) or the v2 protocol's ``{"error": "<message>",
    "type": ...}`` (``/v2``)."""
    body = response.json()
    error = body["error"]
    if isinstance(error, str):
        return {"type": body["type"], "message": error}
    assert isinstance(error, dict), body
    return error


def metric(scrape: str, name: str, **labels: str) -> float:
    """The sum of ``name``'s samples on a /metrics scrape whose labels include ``labels``
    (0 when there is none)."""
    return sum(
        sample.value
        for family in text_string_to_metric_families(scrape)
        for sample in family.samples
        if sample.name == name and labels.items() <= sample.labels.items()
    )
