"""The Open Inference Protocol over gRPC (``inference.GRPCInferenceService``, as Triton and
KServe serve it), on ``MB_GRPC_PORT``, in the same process and event loop as HTTP: the same
engine, admission, Streamer, deadlines, pins and metrics, so a gRPC request and an HTTP
request can share a batch.

- ``inference.GRPCInferenceService``: every RPC of the protocol (``app.v2.grpc_service``:
  inputs and outputs as over HTTP, API keys, deadlines, refusals).
- ``grpc.health.v1.Health`` answers SERVING while the server is ready (Kubernetes' gRPC
  probe), for the server (``""``) and for ``inference.GRPCInferenceService``.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import TYPE_CHECKING, Any

import grpc
from grpc_health.v1 import health_pb2, health_pb2_grpc

from app.settings import Settings
from app.tenancy import Tenancy
from app.v2.grpc_calls import SERVICE
from app.v2.grpc_service import InferenceService
from app.v2.proto import inference_pb2_grpc as pb_grpc

if TYPE_CHECKING:  # the engine is wired by app.main, which hands it over
    from app.engine import Engine


class Health(health_pb2_grpc.HealthServicer):
    """``grpc.health.v1``: SERVING while the server is ready, for the server and the v2
    service; NOT_FOUND for another service."""

    def __init__(self, ready: Callable[[], bool]) -> None:
        self.ready = ready

    async def Check(self, request: Any, context: Any) -> Any:
        if request.service not in ("", SERVICE):
            await context.abort(grpc.StatusCode.NOT_FOUND, f"unknown service {request.service!r}")
        status = health_pb2.HealthCheckResponse
        return status(status=status.SERVING if self.ready() else status.NOT_SERVING)


async def start(
    engine: Engine,
    settings: Settings,
    tenancy: Tenancy,
    ready: Callable[[], bool],
    host: str,
    port: int,
    closing: Callable[[], bool] = lambda: False,
) -> tuple[grpc.aio.Server, int]:
    """A started gRPC server serving the v2 service and health on ``host:port`` (port 0:
    any free one), and the port it bound; ``closing``: whether the server is stopping."""
    server = grpc.aio.server(
        options=[
            ("grpc.max_receive_message_length", settings.max_upload_bytes + (1 << 20)),
            ("grpc.max_send_message_length", 64 << 20),
        ]
    )
    pb_grpc.add_GRPCInferenceServiceServicer_to_server(
        InferenceService(engine, settings, tenancy, ready, closing), server
    )
    health_pb2_grpc.add_HealthServicer_to_server(Health(ready), server)
    bound = server.add_insecure_port(f"{host}:{port}")
    if not bound:
        raise OSError(f"gRPC cannot bind {host}:{port}")
    await server.start()
    return server, bound
