"""Traces of requests, with the OpenTelemetry SDK, across the HTTP (or gRPC) process, the
model workers and, in broker mode, Redis and other hosts.

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

from __future__ import annotations

import logging
import os
import time
from collections.abc import Callable, Iterator, Mapping, Sequence
from contextlib import AbstractContextManager, contextmanager, nullcontext
from typing import TYPE_CHECKING, Any

from app.errors import ServerError, SettingsError, http_status

if TYPE_CHECKING:
    from opentelemetry.sdk.trace import SpanProcessor
    from opentelemetry.sdk.trace.export import SpanExporter
    from opentelemetry.trace import Span, SpanContext, Tracer

log = logging.getLogger("app")

ENDPOINTS = ("OTEL_EXPORTER_OTLP_TRACES_ENDPOINT", "OTEL_EXPORTER_OTLP_ENDPOINT")
PROTOCOLS = ("OTEL_EXPORTER_OTLP_TRACES_PROTOCOL", "OTEL_EXPORTER_OTLP_PROTOCOL")
SERVICES = {"server": "microbatch", "worker": "microbatch-worker"}
TRACEPARENT = "traceparent"

_tracer: Tracer | None = None
_configured = False
_provider: Any = None
_dropped: dict[str, int] = {"queue_full": 0, "export_failed": 0}
OFF: AbstractContextManager[None] = nullcontext()  # what a span is when tracing is off


# -- set-up ------------------------------------------------------------------------------------


def wanted(environ: Mapping[str, str] = os.environ) -> str | None:
    """The exporter the environment asks for (``otlp`` or ``console``), or None: tracing off.
    Raises ``SettingsError`` for an exporter or OTLP protocol this server does not ship."""
    if environ.get("OTEL_SDK_DISABLED", "").strip().lower() == "true":
        return None
    exporter = environ.get("OTEL_TRACES_EXPORTER", "").strip().lower()
    if exporter == "none":
        return None
    if exporter and exporter not in ("otlp", "console"):
        raise SettingsError(f"OTEL_TRACES_EXPORTER={exporter!r}: this server ships otlp, console")
    if not exporter and not any(environ.get(name) for name in ENDPOINTS):
        return None
    for name in PROTOCOLS:
        protocol = environ.get(name, "").strip()
        if protocol and protocol != "http/protobuf":
            raise SettingsError(f"{name}={protocol!r}: this server exports OTLP over http/protobuf")
    return exporter or "otlp"


def configure(
    role: str,
    *,
    exporter: SpanExporter | None = None,
    environ: Mapping[str, str] = os.environ,
) -> bool:
    """Turn tracing on in this process if the environment asks (or an ``exporter`` is given:
    tests pass an in-memory one, exported synchronously), as ``role`` (``server`` or
    ``worker``: the service name unless ``OTEL_SERVICE_NAME`` gives one). Turns it off
    otherwise. Returns whether it is on."""
    global _tracer, _provider, _configured
    shutdown()
    _configured = True
    kind = "given" if exporter is not None else wanted(environ)
    if kind is None:
        return False
    from opentelemetry.sdk.resources import Resource
    from opentelemetry.sdk.trace import TracerProvider
    from opentelemetry.sdk.trace.export import SimpleSpanProcessor

    attributes: dict[str, Any] = {"microbatch.role": role}
    if not environ.get("OTEL_SERVICE_NAME"):
        attributes["service.name"] = SERVICES.get(role, "microbatch")
    # The sampler comes from OTEL_TRACES_SAMPLER (default: parent-based, always on).
    provider = TracerProvider(resource=Resource.create(attributes), shutdown_on_exit=False)
    processor: SpanProcessor
    if exporter is not None:
        processor = SimpleSpanProcessor(exporter)
    else:
        processor = _counted_batches(_exporter(kind))
    provider.add_span_processor(processor)
    _provider = provider
    _tracer = provider.get_tracer("app")
    log.info("tracing on (%s exporter, %s)", kind, role)
    return True


def configure_once(role: str) -> bool:
    """``configure(role)`` from the environment, unless this process was configured already
    (an app built twice, or a test that configured its own exporter)."""
    if _configured:
        return on()
    return configure(role)


def reset() -> None:
    """Tracing off, and unconfigured (tests)."""
    global _configured
    shutdown()
    _configured = False


def flush() -> None:
    """Export what is queued now (a few seconds at most)."""
    if _provider is not None:
        _provider.force_flush(5000)


def _exporter(kind: str) -> SpanExporter:
    if kind == "console":
        from opentelemetry.sdk.trace.export import ConsoleSpanExporter

        return ConsoleSpanExporter()
    from opentelemetry.exporter.otlp.proto.http.trace_exporter import OTLPSpanExporter

    return OTLPSpanExporter()


def _counted_batches(exporter: SpanExporter) -> SpanProcessor:
    """The SDK's background batch processor (bounded queue, never blocks), counting what it
    drops: spans that found its queue full, and spans the exporter failed to deliver."""
    from opentelemetry.sdk.trace.export import (
        BatchSpanProcessor,
        SpanExporter,
        SpanExportResult,
    )

    class Counted(SpanExporter):
        def export(self, spans: Sequence[Any]) -> SpanExportResult:
            result = exporter.export(spans)
            if result is not SpanExportResult.SUCCESS:
                _dropped["export_failed"] += len(spans)
            return result

        def shutdown(self) -> None:
            exporter.shutdown()

        def force_flush(self, timeout_millis: int = 30000) -> bool:
            return exporter.force_flush(timeout_millis)

    class Processor(BatchSpanProcessor):
        def on_end(self, span: Any) -> None:
            batches = self._batch_processor
            if len(batches._queue) >= batches._max_queue_size and span.context.trace_flags.sampled:
                _dropped["queue_full"] += 1
            super().on_end(span)

    return Processor(Counted())


def shutdown() -> None:
    """Export what is queued (a few seconds at most) and turn tracing off."""
    global _tracer, _provider
    provider, _provider, _tracer = _provider, None, None
    if provider is not None:
        provider.force_flush(5000)
        provider.shutdown()


def on() -> bool:
    return _tracer is not None


def spans_dropped() -> dict[str, int]:
    """Spans this process dropped since it started, by reason (``queue_full``,
    ``export_failed``)."""
    return dict(_dropped)


# -- spans -------------------------------------------------------------------------------------


def request(
    name: str, headers: Callable[[], Mapping[str, str]], attributes: Mapping[str, Any]
) -> AbstractContextManager[Span | None]:
    """The span of one request (kind SERVER), current inside the block: the child of the
    caller's ``traceparent`` header, if it sent a valid one (``headers()`` gives the
    request's headers; read only when tracing is on)."""
    if _tracer is None:
        return OFF
    from opentelemetry.propagate import extract
    from opentelemetry.trace import SpanKind

    return _span(name, attributes, kind=SpanKind.SERVER, context=extract(headers()))


def served(
    span: Span,
    *,
    model: str | None = None,
    version: int | None = None,
    served_id: str | None = None,
    images: int | None = None,
    batch_size: int | None = None,
) -> None:
    """A request span's attributes for what served it (those known), the same for every
    protocol."""
    for attribute, value in (
        ("microbatch.model", model),
        ("microbatch.model.version", version),
        ("microbatch.served_id", served_id),
        ("microbatch.images", images),
        ("microbatch.batch.size", batch_size),
    ):
        if value not in (None, ""):
            span.set_attribute(attribute, value)


def span(name: str, attributes: Mapping[str, Any] | None = None) -> AbstractContextManager[Any]:
    """A child of the current span, current inside the block; nothing when tracing is off
    or the current span is not recorded (an unsampled request's steps cost no spans)."""
    if _tracer is None or current() is None:
        return OFF
    return _span(name, attributes or {})


def child_of(
    parent: Any, name: str, attributes: Mapping[str, Any]
) -> AbstractContextManager[Span | None]:
    """A span (kind PRODUCER: it hands work on) that is the child of ``parent`` (a ``link()``
    taken in its request), current inside the block; nothing when ``parent`` is None."""
    if _tracer is None or parent is None:
        return OFF
    from opentelemetry.trace import SpanKind, set_span_in_context

    context = set_span_in_context(_remote(parent))
    return _span(name, attributes, kind=SpanKind.PRODUCER, context=context)


@contextmanager
def _span(name: str, attributes: Mapping[str, Any], **options: Any) -> Iterator[Span]:
    assert _tracer is not None
    with _tracer.start_as_current_span(
        name,
        attributes=attributes,
        record_exception=False,
        set_status_on_exception=False,
        **options,
    ) as current:
        try:
            yield current
        except BaseException as exc:
            if "error.type" not in (getattr(current, "attributes", None) or {}):
                failed(current, exc)  # unless what raised it said why first
            raise


def failed(span: Span | None, error: BaseException) -> None:
    """Mark ``span`` as ended by ``error``: its type (``error.type``: this server's refusal
    type, or the exception's class), and status ERROR unless the caller was at fault (a
    4xx refusal, as OpenTelemetry's HTTP conventions have it). Never image bytes or paths:
    a refusal's message is written for its caller."""
    if span is None or not span.is_recording():
        return
    from opentelemetry.trace import StatusCode

    if isinstance(error, ServerError):
        span.set_attribute("error.type", error.code)
        if http_status(error) >= 500:
            span.set_status(StatusCode.ERROR, error.code)
    else:
        span.set_attribute("error.type", type(error).__name__)
        span.set_status(StatusCode.ERROR, type(error).__name__)


def set_error(span: Span, status: int) -> None:
    """Status ERROR on ``span`` for an HTTP answer of ``status`` (5xx), if nothing set it."""
    from opentelemetry.trace import StatusCode

    status_now = getattr(span, "status", None)  # the SDK's span has it, the API's not
    unset = status_now is None or status_now.status_code is StatusCode.UNSET
    if span.is_recording() and unset:
        span.set_status(StatusCode.ERROR, f"HTTP {status}")


def current() -> Span | None:
    """The current span, where tracing is on and it records."""
    if _tracer is None:
        return None
    from opentelemetry.trace import get_current_span

    found = get_current_span()
    return found if found.is_recording() else None


def link() -> SpanContext | None:
    """The current span's context, for a batch to link to; None when off or not sampled."""
    found = current()
    return found.get_span_context() if found is not None else None


def traceparent(context: Any = None) -> str | None:
    """``context`` (a ``link()``; default: the current span's) as a W3C ``traceparent``, for
    a batch's carrier; None when there is none."""
    if context is None:
        context = link()
        if context is None:
            return None
    return f"00-{context.trace_id:032x}-{context.span_id:016x}-{int(context.trace_flags):02x}"


def carried(items: Sequence[Any]) -> tuple[str | None, ...]:
    """Each item's ``link`` as a ``traceparent`` (None for an untraced one), or () when no
    item is traced: what a transport sends its worker with a batch."""
    if _tracer is None or all(item.link is None for item in items):
        return ()
    return tuple(traceparent(item.link) if item.link is not None else None for item in items)


def log_fields() -> dict[str, str]:
    """``trace_id`` and ``span_id`` of the current span, for a log line (empty when off)."""
    found = current()
    if found is None:
        return {}
    context = found.get_span_context()
    return {"trace_id": f"{context.trace_id:032x}", "span_id": f"{context.span_id:016x}"}


def record(
    name: str,
    start_ns: int,
    end_ns: int,
    *,
    parent: str | None = None,
    attributes: Mapping[str, Any] | None = None,
) -> None:
    """A span that has already happened (a wait measured elsewhere): a child of the current
    span, or of the ``parent`` traceparent."""
    if _tracer is None:
        return
    from opentelemetry.trace import set_span_in_context

    context = None
    if parent is not None:
        parent_context = _parsed(parent)
        if parent_context is None:
            return
        context = set_span_in_context(_remote(parent_context))
    recorded = _tracer.start_span(name, context, attributes=attributes, start_time=start_ns)
    recorded.end(end_time=max(start_ns, end_ns))


def queued(waits: Sequence[Sequence[int]]) -> None:
    """A ``queue`` span, a child of the current span, for each ``[enqueued, dispatched]``
    wait (``app.batching.Trace.waits``; one never dispatched ends now, marked so)."""
    if _tracer is None:
        return
    for start, end in waits:
        attributes = {"microbatch.dispatched": bool(end)}
        record("queue", start, end or now_ns(), attributes=attributes)


def batch(
    carriers: Sequence[str | None], attributes: Mapping[str, Any]
) -> AbstractContextManager[Any]:
    """A worker's span for one batch: the child of its first traced request, linked to each
    traced request (``carriers``: a ``traceparent`` per item, None where untraced). Nothing
    when no item is traced."""
    if _tracer is None or not any(carriers):
        return OFF
    from opentelemetry.trace import Link, SpanKind, set_span_in_context

    contexts = [found for found in map(_parsed, filter(None, carriers)) if found is not None]
    if not contexts:
        return OFF
    links, seen = [], set()
    for context in contexts:
        if (context.trace_id, context.span_id) not in seen:
            seen.add((context.trace_id, context.span_id))
            links.append(Link(context))
    attributes = {**attributes, "microbatch.batch.size": len(carriers)}
    parent = set_span_in_context(_remote(contexts[0]))
    return _span("batch", attributes, kind=SpanKind.CONSUMER, context=parent, links=links)


def _parsed(carrier: str) -> SpanContext | None:
    from opentelemetry.trace import NonRecordingSpan, get_current_span
    from opentelemetry.trace.propagation.tracecontext import TraceContextTextMapPropagator

    context = TraceContextTextMapPropagator().extract({TRACEPARENT: carrier})
    found = get_current_span(context)
    if isinstance(found, NonRecordingSpan) and found.get_span_context().is_valid:
        return found.get_span_context()
    return None


def _remote(context: SpanContext) -> Span:
    from opentelemetry.trace import NonRecordingSpan

    return NonRecordingSpan(context)


def now_ns() -> int:
    """Wall-clock time for a span's bounds (spans are in epoch nanoseconds)."""
    return time.time_ns()
