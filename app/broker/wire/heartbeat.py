"""What a worker says of itself in its heartbeat, as JSON (``WorkerInfo``): what it is and
runs on, each model version it holds and where that is in its life, and what it has run.
Everyone who reads it validates it first (``decode_worker_info``) and believes none of what
does not check."""

from __future__ import annotations

from typing import Annotated

from pydantic import BaseModel, ConfigDict, Field, ValidationError

from app.broker.wire.parsing import TOKEN, MalformedMessage
from app.jobs import Task
from app.lifecycle import VersionState
from app.settings_values import MODEL_NAME_PATTERN

ModelName = Annotated[str, Field(pattern=MODEL_NAME_PATTERN)]
Step = Annotated[str, Field(max_length=32)]
Count = Annotated[int, Field(ge=0)]


class AdvertisedTrial(BaseModel):
    """A runtime and precision a worker tried for a model (``app.batching.Trial``)."""

    model_config = ConfigDict(extra="ignore")

    label: str = Field(max_length=64)
    passed: bool
    cosine_min: float | None = None
    top1: float | None = Field(None, ge=0, le=1)
    images_per_s: float | None = Field(None, ge=0)


class AdvertisedModel(BaseModel):
    """One model version a worker holds, is loading, draining or failed to load, as its
    heartbeat says (front ends route by it: ``app.lifecycle.routes``): what runs it, the
    runtimes that failed their self-test there (and why), how many times slower than the
    fastest of those it runs, and why it failed (``step``, ``reason``) or drains."""

    model_config = ConfigDict(extra="ignore")

    name: str = Field(pattern=MODEL_NAME_PATTERN)
    version: int = Field(ge=1)
    served_id: str = Field(max_length=300)
    state: VersionState
    runtime: str | None = Field(None, max_length=32)
    batch_size: int | None = Field(None, ge=1)
    memory_bytes: int | None = Field(None, ge=0)
    step: str = Field("", max_length=32)
    reason: str = Field("", max_length=1000)
    skipped: dict[str, str] = Field(default_factory=dict, max_length=8)
    slowdown: float | None = Field(None, gt=0)
    dtype: str | None = Field(None, max_length=16)
    trials: list[AdvertisedTrial] = Field(default_factory=list, max_length=16)


class WorkerInfo(BaseModel):
    """What a worker says of itself in its heartbeat (``app.broker.worker.consumer``); a
    front end validates it before it believes any of it (``/info``, readiness, routing,
    metrics)."""

    model_config = ConfigDict(extra="ignore")

    name: str = Field(pattern=TOKEN.pattern)
    models: list[AdvertisedModel] = Field(default_factory=list, max_length=256)
    draining: bool = False  # told to stop: it finishes what it holds and takes nothing new
    aimed: int = Field(0, ge=0)  # the admin route's last request it acted on (pins' seq)
    # name -> the version it was last aimed at (absent from workers before it)
    targets: dict[str, Annotated[int, Field(ge=1)]] = Field(default_factory=dict, max_length=256)
    host: str = Field(max_length=128)
    index: int = Field(ge=0)
    pid: int = Field(ge=0)
    # One process's life, drawn at its start: a container restarted under the same name
    # often has the same pid (absent from workers before it)
    life: str = Field("", max_length=32, pattern=r"^[0-9a-f]*$")
    device: str = Field(max_length=32)
    threads: int = Field(ge=0)
    batch_size: int = Field(ge=1)
    ready: bool
    alive: bool
    running: int = Field(ge=0)
    rss_bytes: int | None = Field(None, ge=0)
    cpu_seconds: float | None = Field(None, ge=0)  # absent from workers before it
    restarts: int = Field(ge=0)
    runtime: str | None = Field(None, max_length=32)  # absent from workers before runtimes
    batches: int = Field(ge=0)
    items: int = Field(ge=0)
    mixed_batches: int = Field(ge=0)
    expired: int = Field(ge=0)
    malformed: int = Field(ge=0)
    reclaimed: int = Field(ge=0)
    given_up: int = Field(ge=0)
    shed: int = Field(0, ge=0)  # absent from workers before priorities in broker mode
    shared: int = Field(0, ge=0)  # absent from workers before they shared answers
    reconnects: int = Field(0, ge=0)  # absent from workers before it
    # served id -> task -> batch size -> batches; -> task -> histogram (see ConsumerStats)
    sizes: dict[str, dict[Task, dict[int, int]]] = Field(default_factory=dict)
    model_s: dict[str, dict[Task, list[float]]] = Field(default_factory=dict)
    wait_s: dict[str, dict[Task, list[float]]] = Field(default_factory=dict)
    size_s: dict[str, dict[Task, dict[int, float]]] = Field(default_factory=dict)  # by size
    tenant_wait_s: dict[str, list[float]] = Field(default_factory=dict)  # by tenant (lanes)
    # model name -> its loads' histogram; -> step -> loads failed (absent from workers before)
    load_s: dict[ModelName, list[float]] = Field(default_factory=dict, max_length=256)
    load_failures: dict[ModelName, dict[Step, Count]] = Field(default_factory=dict, max_length=256)

    def holds(self, served_id: str) -> bool:
        """Whether it reads ``served_id``'s streams: ready, or draining (it no longer takes
        the name's new requests, and finishes those sent to it)."""
        reading = (VersionState.READY, VersionState.DRAINING)
        return any(m.served_id == served_id and m.state in reading for m in self.models)

    @property
    def loading(self) -> bool:
        """Whether it is loading a version (it holds its host's load slot meanwhile)."""
        return any(m.state is VersionState.LOADING for m in self.models)


def decode_worker_info(raw: bytes | str | None) -> WorkerInfo:
    """A heartbeat's description, or ``MalformedMessage``."""
    if raw is None or len(raw) > 64 * 1024:
        raise MalformedMessage("the worker's description is missing or too large")
    try:
        return WorkerInfo.model_validate_json(raw)
    except (ValidationError, RecursionError) as exc:
        raise MalformedMessage(f"the worker's description does not check: {exc}") from None
