"""Reading this server's answers in tests."""

from __future__ import annotations

from typing import Any


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
