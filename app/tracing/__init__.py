"""Traces of requests, with the OpenTelemetry SDK, across the HTTP (or gRPC) process, the
model workers and, in broker mode, Redis and other hosts: ``configuration`` turns it on or
off in a process, ``spans`` makes the spans; both are used through this package
(``from app import tracing``; ``tracing.span(...)``).

Off unless the environment asks (``OTEL_EXPORTER_OTLP_ENDPOINT``,
``OTEL_EXPORTER_OTLP_TRACES_ENDPOINT`` or ``OTEL_TRACES_EXPORTER=otlp|console``; never with
``OTEL_SDK_DISABLED=true``); the SDK reads its other standard variables itself
(``OTEL_SERVICE_NAME``, ``OTEL_RESOURCE_ATTRIBUTES``, ``OTEL_TRACES_SAMPLER`` and ``_ARG``,
``OTEL_BSP_*``, ``OTEL_EXPORTER_OTLP_HEADERS``...). Off, every function here returns at its
first line and nothing of OpenTelemetry is imported.

What a request's trace holds (docs/operations.md, "Traces"):

- the request span (``POST /predict/tag``, ``inference.GRPCInferenceService/ModelInfer``), a
  child of the caller's ``traceparent`` when it sent one, with its children ``admission``,
  ``read upload``, ``queue`` (each image's wait for its batch here), ``broker`` (broker mode:
  from the stream entry to its reply) and ``reply``;
- ``batch``, in the model worker that ran it: one span per batch, the child of its first
  traced request and linked to each of them, with its size; in broker mode a
  ``broker queue`` span per entry (its wait in Redis) and, after a reclaim,
  ``microbatch.retry`` on the batch; its children ``decode`` and ``model``.

Workers learn their requests' context from what carries the batch to them: a W3C
``traceparent`` per item, sent only for sampled requests, so an unsampled batch costs its
worker nothing either. Spans are exported in the background (a bounded queue,
``OTEL_BSP_MAX_QUEUE_SIZE``): a collector that is slow or down costs dropped spans, counted
(``spans_dropped``), never a request's time."""

from app.tracing.configuration import (
    configure,
    configure_once,
    flush,
    on,
    reset,
    shutdown,
    spans_dropped,
    wanted,
)
from app.tracing.spans import (
    OFF,
    batch,
    carried,
    child_of,
    current,
    failed,
    link,
    log_fields,
    now_ns,
    queued,
    record,
    request,
    served,
    set_error,
    span,
    traceparent,
)

__all__ = [
    "OFF",
    "batch",
    "carried",
    "child_of",
    "configure",
    "configure_once",
    "current",
    "failed",
    "flush",
    "link",
    "log_fields",
    "now_ns",
    "on",
    "queued",
    "record",
    "request",
    "reset",
    "served",
    "set_error",
    "shutdown",
    "span",
    "spans_dropped",
    "traceparent",
    "wanted",
]
