"""The spans this server makes, while tracing is on (``app.tracing.configuration``): a
request's (``request``) and its steps' (``span``, ``record``, ``queued``), the hand-off to
the workers (``child_of``), a batch's in the worker that ran it (``batch``), and the W3C
``traceparent`` that carries a request's context to another process (``link``,
``traceparent``, ``carried``). Off, each returns at its first line (``OFF`` for a span)."""

from __future__ import annotations

import time
from collections.abc import Callable, Iterator, Mapping, Sequence
from contextlib import AbstractContextManager, contextmanager, nullcontext
from typing import TYPE_CHECKING, Any

from app.errors import ServerError, http_status
from app.tracing import configuration

if TYPE_CHECKING:
    from opentelemetry.trace import Span, SpanContext

TRACEPARENT = "traceparent"
OFF: AbstractContextManager[None] = nullcontext()  # what a span is when tracing is off


def request(
    name: str, headers: Callable[[], Mapping[str, str]], attributes: Mapping[str, Any]
) -> AbstractContextManager[Span | None]:
    """The span of one request (kind SERVER), current inside the block: the child of the
    caller's ``traceparent`` header, if it sent a valid one (``headers()`` gives the
    request's headers; read only when tracing is on)."""
    if configuration.tracer is None:
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
    tenant: str | None = None,
) -> None:
    """A request span's attributes for what served it and whom (those known), the same for
    every protocol."""
    for attribute, value in (
        ("microbatch.tenant", tenant),
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
    if configuration.tracer is None or current() is None:
        return OFF
    return _span(name, attributes or {})


def child_of(
    parent: Any, name: str, attributes: Mapping[str, Any]
) -> AbstractContextManager[Span | None]:
    """A span (kind PRODUCER: it hands work on) that is the child of ``parent`` (a ``link()``
    taken in its request), current inside the block; nothing when ``parent`` is None."""
    if configuration.tracer is None or parent is None:
        return OFF
    from opentelemetry.trace import SpanKind, set_span_in_context

    context = set_span_in_context(_remote(parent))
    return _span(name, attributes, kind=SpanKind.PRODUCER, context=context)


@contextmanager
def _span(name: str, attributes: Mapping[str, Any], **options: Any) -> Iterator[Span]:
    tracer = configuration.tracer
    assert tracer is not None
    with tracer.start_as_current_span(
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
    if configuration.tracer is None:
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
    if configuration.tracer is None or all(item.link is None for item in items):
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
    tracer = configuration.tracer
    if tracer is None:
        return
    from opentelemetry.trace import set_span_in_context

    context = None
    if parent is not None:
        parent_context = _parsed(parent)
        if parent_context is None:
            return
        context = set_span_in_context(_remote(parent_context))
    recorded = tracer.start_span(name, context, attributes=attributes, start_time=start_ns)
    recorded.end(end_time=max(start_ns, end_ns))


def queued(waits: Sequence[Sequence[int]]) -> None:
    """A ``queue`` span, a child of the current span, for each ``[enqueued, dispatched]``
    wait (``app.batching.Trace.waits``; one never dispatched ends now, marked so)."""
    if configuration.tracer is None:
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
    if configuration.tracer is None or not any(carriers):
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
