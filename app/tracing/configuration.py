"""Tracing on or off in this process: what the environment asks for (``wanted``), the SDK's
tracer provider and its exporter (``configure``, ``shutdown``), and the spans dropped rather
than slow a request (``spans_dropped``). Off, nothing of OpenTelemetry is imported."""

from __future__ import annotations

import logging
import os
from collections.abc import Mapping, Sequence
from typing import TYPE_CHECKING, Any

from app.errors import SettingsError

if TYPE_CHECKING:
    from opentelemetry.sdk.trace import SpanProcessor
    from opentelemetry.sdk.trace.export import SpanExporter
    from opentelemetry.trace import Tracer

log = logging.getLogger("app")

ENDPOINTS = ("OTEL_EXPORTER_OTLP_TRACES_ENDPOINT", "OTEL_EXPORTER_OTLP_ENDPOINT")
PROTOCOLS = ("OTEL_EXPORTER_OTLP_TRACES_PROTOCOL", "OTEL_EXPORTER_OTLP_PROTOCOL")
SERVICES = {"server": "microbatch", "worker": "microbatch-worker"}

tracer: Tracer | None = None  # while tracing is on (``app.tracing.spans`` makes spans with it)
_configured = False
_provider: Any = None
_dropped: dict[str, int] = {"queue_full": 0, "export_failed": 0}


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
    global tracer, _provider, _configured
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
    tracer = provider.get_tracer("app")
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
    global tracer, _provider
    provider, _provider, tracer = _provider, None, None
    if provider is not None:
        provider.force_flush(5000)
        provider.shutdown()


def on() -> bool:
    return tracer is not None


def spans_dropped() -> dict[str, int]:
    """Spans this process dropped since it started, by reason (``queue_full``,
    ``export_failed``)."""
    return dict(_dropped)
