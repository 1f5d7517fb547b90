"""Request and response models (they also document the API in OpenAPI)."""

from __future__ import annotations

from pydantic import BaseModel, Field


class TagOut(BaseModel):
    name: str = Field(description="class name")
    prob: float = Field(ge=0, le=1, description="softmax probability")


class ErrorBody(BaseModel):
    type: str = Field(description="stable machine-readable error name, e.g. 'queue_full'")
    message: str = Field(description="what went wrong, for humans")


class ErrorResponse(BaseModel):
    error: ErrorBody


class ProtocolErrorResponse(BaseModel):
    """An error on the Open Inference Protocol's routes (``/v2``), in the protocol's shape."""

    error: str = Field(description="what went wrong, for humans (what v2 clients print)")
    type: str = Field(description="stable machine-readable error name, e.g. 'queue_full'")


class Health(BaseModel):
    status: str


class TrialState(BaseModel):
    label: str = Field(description="a runtime, and its precision below fp32: 'openvino+bf16'")
    passed: bool = Field(description="whether it passed its gate against fp32 TorchScript")
    cosine_min: float | None = Field(
        None, description="least embedding cosine with fp32 TorchScript on the self-test images"
    )
    top1: float | None = Field(None, description="share of those images given the same class")
    images_per_s: float | None = Field(None, description="where timed: images/s at batch 8")


class HeldModelState(BaseModel):
    served_id: str = Field(description="the model version's id (X-Model-Id)")
    state: str = Field(description="loading, ready, draining, or (broker mode) failed")
    name: str = Field("", description="the model's name")
    version: int = Field(0, description="the version's number")
    runtime: str | None = None
    batch_size: int | None = Field(None, description="the largest batch it takes of this model")
    memory_bytes: int | None = Field(None, description="what this model costs this worker")
    reason: str = ""
    skipped: list[tuple[str, str]] = Field(
        default_factory=list, description="runtimes that failed their self-test here, and why"
    )
    slowdown: float | None = Field(
        None, description="times slower than the fastest of those, as the export measured"
    )
    dtype: str | None = Field(None, description="the precision that computes it: 'bfloat16'")
    trials: list[TrialState] = Field(
        default_factory=list,
        description="the runtimes and precisions tried here, with their gate figures",
    )


class WorkerState(BaseModel):
    name: str | None = Field(None, description="broker mode: '<host>:<index>'")
    host: str | None = Field(None, description="broker mode: the worker's host")
    index: int
    device: str
    threads: int
    pid: int | None
    ready: bool
    alive: bool
    batch_size: int = Field(description="largest batch this worker takes (auto: its choice)")
    batches: int = Field(description="model calls this worker has run")
    items: int = Field(description="images this worker has been given")
    rss_bytes: int | None = Field(None, description="its resident memory")
    restarts: int = Field(0, description="times its slot was restarted after dying or hanging")
    runtime: str | None = Field(
        None, description="what runs its (first) model: torchscript, openvino, aoti"
    )
    models: list[HeldModelState] = Field(
        default_factory=list, description="the model versions it holds or is loading"
    )


class StreamBacklog(BaseModel):
    stream: str = Field(description="a model version's stream for one task")
    group: str | None = Field(description="the workers' consumer group; null until one reads")
    lag: int = Field(ge=0, description="entries no worker has read yet")
    pending: int = Field(ge=0, description="entries read and not yet answered")


class Backlog(BaseModel):
    """The work waiting for model workers, for an autoscaler (KEDA's metrics-api trigger):
    the same figure from every front end, summed over every version's streams."""

    backlog: int = Field(ge=0, description="lag + pending")
    lag: int = Field(ge=0, description="requests no worker has read yet")
    pending: int = Field(
        ge=0,
        description="requests read by a worker, not answered yet (in-process: batches running)",
    )
    streams: list[StreamBacklog] = Field(description="broker mode: each stream counted")


class Readiness(BaseModel):
    status: str = Field(description="'ready' or 'not_ready'")
    queue_depth: int = Field(description="requests waiting for a batch")
    in_flight: int = Field(description="batches running now")
    workers: list[WorkerState]
