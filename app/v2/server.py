"""What the server says of itself and of its models over v2, whichever protocol asks: its
metadata and extensions, a version's configuration, the statistics, and what a repository
load asks."""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from pydantic import BaseModel, ConfigDict, Field

from app.errors import InvalidRequest, ModelNotFound
from app.services.registry import ModelVersion, numbered
from app.settings_values import VERSION_PATTERN
from app.v2.config import model_config
from app.v2.http_body import validated

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


class LoadParameters(BaseModel):
    model_config = ConfigDict(extra="forbid")

    version: str | None = Field(
        None, pattern=VERSION_PATTERN, description="the version to load (default: the newest)"
    )
    replace: bool = Field(
        False,
        description="unload the serving version first (less memory; the name answers 503 "
        "until the new one serves)",
    )


class LoadRequest(BaseModel):
    model_config = ConfigDict(extra="forbid")

    parameters: LoadParameters = Field(default_factory=LoadParameters)


class UnloadParameters(BaseModel):
    model_config = ConfigDict(extra="forbid")

    version: str | None = Field(
        None,
        pattern=VERSION_PATTERN,
        description="the version serving (optional: an unload stops serving the name, whose "
        "one version serves at a time; another version is refused with 422)",
    )
    unload_dependents: bool = Field(
        False,
        description="Triton's: also unload the ensembles that use the model (tritonclient "
        "sends it with every unload); no model here depends on another, so there are none",
    )


class UnloadRequest(BaseModel):
    model_config = ConfigDict(extra="forbid")

    parameters: UnloadParameters = Field(default_factory=UnloadParameters)


def unload_asked(document: object) -> int | None:
    """The version a repository unload names, if any (``{"parameters": {"version": "N"}}``,
    as either protocol carries it)."""
    request: UnloadRequest = validated(UnloadRequest, document)
    version = request.parameters.version
    return int(version) if version is not None else None


def load_asked(document: object) -> LoadParameters:
    """What a repository load asks (``{"parameters": {"version": "N", "replace": bool}}``,
    as either protocol carries it). Triton's load may also carry a model configuration
    (``config``) or model files (``file:...``): refused, as this server serves each version
    as exported, from its repository."""
    parameters = document.get("parameters") if isinstance(document, dict) else None
    named = parameters if isinstance(parameters, dict) else {}  # else: 422 from the model
    given = [k for k in named if k == "config" or str(k).startswith("file:")]
    if given:
        raise InvalidRequest(
            f"parameters {', '.join(given)}: this server takes no model configuration or files "
            "at load; it serves each version as exported (python -m app.export) into its "
            "repository, with the MB_* settings. Load a version: parameters.version"
        )
    request: LoadRequest = validated(LoadRequest, document)
    return request.parameters


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
        and (number is None or number == version.served_id or numbered(version, number))
    ]
    if name is not None and not known:
        which = f"{name!r} version {number}" if number is not None else repr(name)
        raise ModelNotFound(f"no model {which} here")
    return engine.metrics.statistics.report(known) if engine.metrics is not None else []
