"""The one owner of a model version's lifecycle: its vocabulary (``VersionState``,
``VersionLife``, ``ModelSpec``, ``Route``; ``app.lifecycle.states``) and its rules (which
version a name should serve, which it serves now, when a rollout is given up, what a worker
does with each version it holds; ``app.lifecycle.rules``). In-process serving, broker front
ends and broker workers all ask it. No I/O, no asyncio: a leaf any layer may import."""

from app.lifecycle.rules import (
    LOADERS_PER_HOST,
    RETIRE_S,
    SWITCH_GRACE_S,
    UNKNOWN,
    UNLOADED,
    AdminPin,
    Fate,
    HeldView,
    WorkerView,
    chosen_version,
    fate,
    followed,
    given_up,
    routes,
)
from app.lifecycle.states import IllegalMove, ModelSpec, Route, VersionLife, VersionState

__all__ = [
    "LOADERS_PER_HOST",
    "RETIRE_S",
    "SWITCH_GRACE_S",
    "UNKNOWN",
    "UNLOADED",
    "AdminPin",
    "Fate",
    "HeldView",
    "IllegalMove",
    "ModelSpec",
    "Route",
    "VersionLife",
    "VersionState",
    "WorkerView",
    "chosen_version",
    "fate",
    "followed",
    "given_up",
    "routes",
]
