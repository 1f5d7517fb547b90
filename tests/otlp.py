"""An OTLP/HTTP trace receiver for tests: what a collector would get from every process of a
server (front ends and model workers alike), decoded from the protobuf the SDK sends."""

from __future__ import annotations

import threading
import time
from collections.abc import Callable, Generator
from dataclasses import dataclass, field
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any

from opentelemetry.proto.collector.trace.v1.trace_service_pb2 import (
    ExportTraceServiceRequest,
    ExportTraceServiceResponse,
)


@dataclass(frozen=True)
class Received:
    """One span as exported: ids in hex, as traceparent headers write them."""

    name: str
    trace_id: str
    span_id: str
    parent_id: str
    kind: int  # the OTLP enum: 1 internal, 2 server, 3 client, 4 producer, 5 consumer
    attributes: dict[str, Any]
    links: tuple[tuple[str, str], ...]  # (trace_id, span_id)
    status: int  # 0 unset, 1 ok, 2 error
    service: str
    start_ns: int
    end_ns: int


@dataclass
class Receiver:
    """Started by ``receiving()``: ``endpoint`` for OTEL_EXPORTER_OTLP_ENDPOINT."""

    endpoint: str
    spans: list[Received] = field(default_factory=list)
    posts: int = 0

    def wait_for(
        self, condition: Callable[[list[Received]], bool], timeout_s: float = 20
    ) -> list[Received]:
        deadline = time.monotonic() + timeout_s
        while not condition(list(self.spans)):
            if time.monotonic() > deadline:
                names = sorted({span.name for span in self.spans})
                batches = [s.attributes for s in self.spans if s.name == "batch"]
                raise AssertionError(f"spans never arrived as expected; got {names}, {batches}")
            time.sleep(0.05)
        return list(self.spans)


def _value(any_value: Any) -> Any:
    kind = any_value.WhichOneof("value")
    return getattr(any_value, kind) if kind else None


def decode(body: bytes) -> list[Received]:
    request = ExportTraceServiceRequest.FromString(body)
    found = []
    for resource_spans in request.resource_spans:
        resource = {a.key: _value(a.value) for a in resource_spans.resource.attributes}
        for scope_spans in resource_spans.scope_spans:
            for span in scope_spans.spans:
                found.append(
                    Received(
                        name=span.name,
                        trace_id=span.trace_id.hex(),
                        span_id=span.span_id.hex(),
                        parent_id=span.parent_span_id.hex(),
                        kind=span.kind,
                        attributes={a.key: _value(a.value) for a in span.attributes},
                        links=tuple((lk.trace_id.hex(), lk.span_id.hex()) for lk in span.links),
                        status=span.status.code,
                        service=str(resource.get("service.name", "")),
                        start_ns=span.start_time_unix_nano,
                        end_ns=span.end_time_unix_nano,
                    )
                )
    return found


class _Handler(BaseHTTPRequestHandler):
    receiver: Receiver
    keep: bool

    def do_POST(self) -> None:
        body = self.rfile.read(int(self.headers.get("Content-Length", 0)))
        if self.path == "/v1/traces":
            if self.keep:
                self.receiver.spans.extend(decode(body))
            self.receiver.posts += 1
            answer = ExportTraceServiceResponse().SerializeToString()
            self.send_response(200)
            self.send_header("Content-Type", "application/x-protobuf")
        else:
            answer = b""
            self.send_response(404)
        self.send_header("Content-Length", str(len(answer)))
        self.end_headers()
        self.wfile.write(answer)

    def log_message(self, *args: Any) -> None:
        pass


def receiving(keep: bool = True) -> Generator[Receiver, None, None]:
    """A receiver on a free loopback port, while the generator runs (a fixture's body);
    ``keep=False``: it answers without decoding or keeping anything (a collector that costs
    this machine little, for a benchmark)."""
    server = ThreadingHTTPServer(("127.0.0.1", 0), _Handler)
    receiver = Receiver(f"http://127.0.0.1:{server.server_address[1]}")
    server.RequestHandlerClass = type("Handler", (_Handler,), {"receiver": receiver, "keep": keep})
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    try:
        yield receiver
    finally:
        server.shutdown()
        server.server_close()


def tracing_env(receiver: Receiver, **env: str) -> dict[str, str]:
    """What a server process needs to send its spans to ``receiver``, soon after they end."""
    return {
        "OTEL_EXPORTER_OTLP_ENDPOINT": receiver.endpoint,
        "OTEL_BSP_SCHEDULE_DELAY": "100",
        **env,
    }


def by_id(spans: list[Received]) -> dict[str, Received]:
    return {span.span_id: span for span in spans}


def children(spans: list[Received], parent: Received) -> list[Received]:
    return [span for span in spans if span.parent_id == parent.span_id]
