"""How both sides of broker mode read what they take from Redis: defensively, since anyone
who can write to Redis can write anything. What does not check raises ``MalformedMessage``
and is dropped, never used."""

from __future__ import annotations

import json
import re
from typing import Any

MAX_HEADER_BYTES = 4096  # a request's or reply's JSON header; ours are under 200 bytes
TOKEN = re.compile(r"^[A-Za-z0-9:._-]{1,128}$")  # an id or a name


class MalformedMessage(ValueError):
    """A stream entry or a reply that does not follow this format: dropped, never used."""


def token(value: object, what: str) -> str:
    """``value``, if it is a short token (an id or a name)."""
    if not isinstance(value, str) or not TOKEN.match(value):
        raise MalformedMessage(f"{what} is not a short token")
    return value


def integer(value: object, what: str, low: int, high: int) -> int:
    """``value``, if it is an integer (not a bool) in ``low..high``."""
    if not isinstance(value, int) or isinstance(value, bool) or not low <= value <= high:
        raise MalformedMessage(f"{what} is not an integer in {low}..{high}")
    return value


def json_object(raw: object, what: str) -> dict[str, Any]:
    """``raw``, bytes of at most ``MAX_HEADER_BYTES``, as the JSON object they hold."""
    if not isinstance(raw, bytes) or len(raw) > MAX_HEADER_BYTES:
        raise MalformedMessage(f"{what} is missing or over {MAX_HEADER_BYTES} bytes")
    try:
        header = json.loads(raw)
    except (UnicodeDecodeError, ValueError, RecursionError):  # nesting past the stack
        raise MalformedMessage(f"{what} is not JSON") from None
    if not isinstance(header, dict):
        raise MalformedMessage(f"{what} is not a JSON object")
    return header


def text(value: object) -> str:
    """Redis's replies come as bytes (or str, or loosely typed): text, for names and ids."""
    return value.decode() if isinstance(value, bytes) else str(value)
