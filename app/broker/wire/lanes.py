"""Priority levels and tenants in broker mode. Each (priority level, tenant) of a version's
task has a stream of its own, a *lane* (``Keys.lane``), so that the workers, whichever front
end a request came through, take a batch from the highest level first and the tenants of a
level in turn (``app.broker.worker.lanes``). The highest level without a tenant is the
task's own stream: without keys or levels nothing changes.

A front end describes each lane it adds to in the version's lanes hash (``Keys.lanes``):
the level, the tenant's weight and the level's policy, as its own settings say
(``MB_PRIORITY_LEVELS``, the keys file: give every front end the same); the workers read it
defensively, as they read requests.

>>> lane = Lane(Task.TAG, level=1, weight=3.0, timeout_ms=500)
>>> decode_lane(encode_lane(lane)) == lane
True
"""

from __future__ import annotations

import json
import math
from dataclasses import dataclass

from app.broker.wire.parsing import MalformedMessage, json_object
from app.jobs import Task

MAX_LEVELS = 100  # as many as MB_PRIORITY_LEVELS may name
MAX_WEIGHT = 1e6


@dataclass(frozen=True)
class Lane:
    """What a lane holds: requests of ``task`` at priority ``level`` (0: the highest), from a
    tenant of ``weight`` in fair batches; its level's policy: its work joins a batch only
    while the batch holds fewer than ``max_batch``; waiting over ``timeout_ms`` it is
    refused (429 ``shed``) when ``reject``, else it waits on in its level."""

    task: Task
    level: int = 0
    weight: float = 1.0
    max_batch: int | None = None
    timeout_ms: int | None = None
    reject: bool = True


def encode_lane(lane: Lane) -> bytes:
    """The lanes hash's value for ``lane``."""
    described = {
        "task": lane.task.value,
        "level": lane.level,
        "weight": lane.weight,
        "max_batch": lane.max_batch,
        "timeout_ms": lane.timeout_ms,
        "reject": lane.reject,
    }
    return json.dumps(described, separators=(",", ":")).encode()


def decode_lane(raw: bytes) -> Lane:
    """A lanes hash's value as a ``Lane``; ``MalformedMessage`` says what is wrong."""
    described = json_object(raw, "a lane")
    try:
        task = Task(str(described.get("task")))
    except ValueError:
        raise MalformedMessage(f"task {described.get('task')!r} is unknown") from None
    level = described.get("level")
    if not isinstance(level, int) or isinstance(level, bool) or not 0 <= level < MAX_LEVELS:
        raise MalformedMessage(f"level {level!r} is not one of {MAX_LEVELS}")
    weight = described.get("weight")
    if (
        not isinstance(weight, int | float)
        or isinstance(weight, bool)
        or not (0 < weight <= MAX_WEIGHT and math.isfinite(weight))
    ):
        raise MalformedMessage(f"weight {weight!r} is not a positive number")
    reject = described.get("reject")
    if not isinstance(reject, bool):
        raise MalformedMessage(f"reject {reject!r} is not true or false")
    return Lane(
        task,
        level,
        float(weight),
        _optional_count(described.get("max_batch"), "max_batch"),
        _optional_count(described.get("timeout_ms"), "timeout_ms"),
        reject,
    )


def _optional_count(value: object, name: str) -> int | None:
    if value is None:
        return None
    if not isinstance(value, int) or isinstance(value, bool) or not 0 < value < 1 << 40:
        raise MalformedMessage(f"{name} {value!r} is not a positive whole number")
    return value
