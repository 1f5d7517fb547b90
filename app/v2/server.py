"""What the server says of itself and of its models over v2, whichever protocol asks: its
metadata and extensions, a version's configuration, the statistics."""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from app.errors import ModelNotFound
from app.services.registry import ModelVersion
from app.v2.config import model_config

if TYPE_CHECKING:  # the engine is wired by app.main, which hands it over
    from app.engine import Engine

SERVER = {"name": "microbatch-server", "version": "0.1.0"}
# The protocol extensions this server implements (the server metadata lists them).
EXTENSIONS = [
    "binary_tensor_data",
    "classification",
    "model_configuration",
    "model_repository",
    "statistics",
]


def config_of(engine: Engine, version: ModelVersion) -> dict[str, Any]:
    """The configuration of a serving ``version`` (``app.v2.config``)."""
    limits = engine.plan.limits
    workers = engine.transport.worker_status()
    return model_config(version, workers, limits.max_batch_size, limits.max_latency_s)


def statistics_of(engine: Engine, name: str | None, number: str | None) -> list[dict[str, Any]]:
    """The statistics of every version known, of ``name``'s, or of one (``number``);
    ``ModelNotFound`` for a name or version this server has never known."""
    known = [
        (version.name, str(version.version))
        for version in engine.registry.versions()
        if (name is None or version.name == name)
        and (number is None or number in (str(version.version), version.served_id))
    ]
    if name is not None and not known:
        which = f"{name!r} version {number}" if number is not None else repr(name)
        raise ModelNotFound(f"no model {which} here")
    return engine.metrics.statistics.report(known) if engine.metrics is not None else []
