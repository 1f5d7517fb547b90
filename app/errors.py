"""Domain errors and the one table that turns them into HTTP answers.

Lower layers raise these; only the edges translate them: HTTP (``app.main``) through
``HTTP_STATUS``, gRPC (``app.v2.grpc_service``) through ``GRPC_STATUS``. Nothing here
imports a web framework, so ``app.batching`` and ``app.workers`` can raise them freely.

    ServerError                      every error this project raises on purpose
    ├── ClientError                  the request is at fault (4xx)
    │   ├── InvalidImage             not an image, truncated or corrupt        400
    │   ├── UnsupportedImageFormat   an image, but not an allowed format       415
    │   ├── PayloadTooLarge          upload or image over its limit            413
    │   ├── InvalidRequest           breaks a fixed rule of the API (below)    422
    │   ├── InvalidParameter         a value this server refuses (below)       422
    │   ├── Unauthorized             no key, or an unknown one                 401
    │   ├── Forbidden                the key may not do this (its scopes)      403
    │   ├── QuotaExceeded            the tenant is over its quota (+ Retry-After) 429
    │   ├── Shed                     its priority gives way to higher ones     429
    │   ├── NoClassifier             tags asked of an embedding-only model     404
    │   ├── NoEmbedding              an embedding asked of a whole-model import 404
    │   ├── ModelNotFound            no such model (or version) here            404
    │   ├── ModelVersionUnavailable  the X-Model-Id pinned is not served now     409
    │   └── ClientDisconnected       the client left before its answer         499
    ├── Unavailable                  the server cannot take it now (503 + Retry-After)
    │   ├── QueueFull                the bounded queue is full
    │   ├── NotReady                 workers still loading, or shutting down
    │   ├── WorkerDied               the worker running the batch died, or none is alive
    │   └── BrokerUnavailable        broker mode: Redis cannot be reached
    ├── DeadlineExceeded             the request's deadline passed              504
    ├── ModelLoadFailed              an admin load failed; the old version serves 422
    │   └── ModelMemoryBudget        it would pass MB_MODEL_MEMORY                507
    ├── InferenceError               the model call failed for this item        500
    └── BatchContractError           a batch function broke its contract        500

The two 422s differ in whose rule the request breaks:

- ``InvalidRequest`` (``invalid_request``): a fixed rule of the API, the same whatever model
  is served: no ``image`` form field, a body that is neither a form nor an image, a form text
  field over 1 KB, ``k`` not an integer from 1 to 1000. FastAPI's own validation errors
  answer with the same type.
- ``InvalidParameter`` (``invalid_parameter``): a value checked against this server: ``k``
  above the served model's class count, an ``X-Request-Timeout`` header that is not a
  positive number of seconds (it can only shorten the server's own timeout).

``reject_reason`` is the ``reason`` label under which ``app.metrics`` counts an error in
``microbatch_rejected_total``; subclasses inherit it:

    ClientError          bad_input
    ClientDisconnected   client_disconnected
    QuotaExceeded        over_quota
    Shed                 shed
    QueueFull            queue_full
    NotReady             not_ready
    WorkerDied           worker_died
    BrokerUnavailable    broker_unavailable
    DeadlineExceeded     timeout

Errors without one (``InferenceError``, ``BatchContractError``) are failures, not
refusals, and are not counted there. Every refusal is answered and counted at one place,
``app.routers.errors.refusal``.

Startup problems are not request errors and have their own branch:

    StartupError                     configuration, model store or worker start-up failure
    ├── SettingsError
    ├── ModelStoreError
    │   └── ContentMismatch          a model is not what its manifest's id says
    └── WorkerStartError
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from typing import Any, ClassVar


class ServerError(Exception):
    """Base of every error a request can end in. ``code`` is the stable machine name (the
    ``type`` of the error body); ``reject_reason`` the ``microbatch_rejected_total`` label,
    or None when the error is not a refusal."""

    code = "server_error"
    reject_reason: ClassVar[str | None] = None

    def __init__(self, message: str) -> None:
        super().__init__(message)
        self.message = message


class ClientError(ServerError):
    code = "bad_request"
    reject_reason = "bad_input"


class InvalidImage(ClientError):
    code = "invalid_image"


class UnsupportedImageFormat(ClientError):
    code = "unsupported_image_format"


class PayloadTooLarge(ClientError):
    code = "payload_too_large"


class InvalidRequest(ClientError):
    code = "invalid_request"


class InvalidParameter(ClientError):
    code = "invalid_parameter"


class Unauthorized(ClientError):
    code = "unauthorized"


class Forbidden(ClientError):
    """A known key without the scope this asks for (``infer``, ``admin``, ``metrics``)."""

    code = "forbidden"


class QuotaExceeded(ClientError):
    """This caller's tenant is over its share (429): retry after ``retry_after_s``, when
    its bucket holds the images again. Kept apart from ``Unavailable`` (503): there the
    server is full, whoever asks. ``headers``: the IETF RateLimit fields to answer with."""

    code = "over_quota"
    reject_reason = "over_quota"

    def __init__(
        self, message: str, retry_after_s: float = 1.0, headers: Mapping[str, str] | None = None
    ) -> None:
        super().__init__(message)
        self.retry_after_s = retry_after_s
        self.headers = dict(headers or {})


class NoClassifier(ClientError):
    """The served model is embedding-only: it has no classes to tag with."""

    code = "no_classifier"


class NoEmbedding(ClientError):
    """The served model answers tags only: it was imported whole (a TorchServe archive
    whose head could not be split off), so its only features are its logits."""

    code = "no_embedding"


class ModelNotFound(ClientError):
    """A request names a model (or a version of one) this server does not have."""

    code = "model_not_found"


class ModelVersionUnavailable(ClientError):
    """A request pins an export (``X-Model-Id``, or a v2 version) that is not served now:
    answered 409 with the ids that are, never with a substitute."""

    code = "model_version_unavailable"


class ClientDisconnected(ClientError):
    """Nobody reads this answer; it exists so the request ends in a known state."""

    code = "client_closed_request"
    reject_reason = "client_disconnected"


class Shed(QuotaExceeded):
    """Busy with higher priorities (429): this request's priority level is full, or it
    waited its level's queue timeout, or work of a higher level took its place in a full
    queue. Retry later, or at a higher priority if the key allows one."""

    code = "shed"
    reject_reason = "shed"


class Unavailable(ServerError):
    """The server cannot serve the request now; ``retry_after_s`` says when to try again."""

    code = "unavailable"

    def __init__(self, message: str, retry_after_s: float = 1.0) -> None:
        super().__init__(message)
        self.retry_after_s = retry_after_s


class QueueFull(Unavailable):
    code = "queue_full"
    reject_reason = "queue_full"


class NotReady(Unavailable):
    code = "not_ready"
    reject_reason = "not_ready"


class WorkerDied(Unavailable):
    code = "worker_died"
    reject_reason = "worker_died"


class DiedRunning(WorkerDied):
    """The worker died while it ran this request's batch (not killed for a batch past its
    timeout, nor stopped): maybe by an input of that batch, so its items are tried again
    alone (``app.batching.contract.answer``); to the caller a 503 ``worker_died``."""


class BrokerUnavailable(Unavailable):
    """Broker mode: Redis cannot be reached, or lost the request (its answer cannot come)."""

    code = "broker_unavailable"
    reject_reason = "broker_unavailable"


class DeadlineExceeded(ServerError):
    """No answer by the request's deadline (504): the server is busy; try again later."""

    code = "deadline_exceeded"
    reject_reason = "timeout"
    retry_after_s = 1.0


class ModelLoadFailed(ServerError):
    """Loading a version failed at ``step`` (verify, load, self-test, warm-up, budget, a
    worker crash, or ``interrupted``: its worker killed for something else, which loads it
    again once restarted); whatever served before serves on."""

    code = "model_load_failed"

    def __init__(self, message: str, step: str = "load") -> None:
        super().__init__(message)
        self.step = step


class ModelMemoryBudget(ModelLoadFailed):
    """A load refused because the worker's models would pass ``MB_MODEL_MEMORY``."""

    code = "model_memory_budget"

    def __init__(self, message: str) -> None:
        super().__init__(message, "budget")


class InferenceError(ServerError):
    code = "inference_error"


class BatchContractError(ServerError):
    code = "batch_contract_error"


# The one table: most specific class first; the first isinstance match wins.
HTTP_STATUS: tuple[tuple[type[ServerError], int], ...] = (
    (InvalidImage, 400),
    (Unauthorized, 401),
    (Forbidden, 403),
    (QuotaExceeded, 429),
    (NoClassifier, 404),
    (NoEmbedding, 404),
    (ModelNotFound, 404),
    (ModelVersionUnavailable, 409),
    (PayloadTooLarge, 413),
    (UnsupportedImageFormat, 415),
    (InvalidRequest, 422),
    (InvalidParameter, 422),
    (ClientDisconnected, 499),
    (ClientError, 400),
    (Unavailable, 503),
    (DeadlineExceeded, 504),
    (ModelMemoryBudget, 507),
    (ModelLoadFailed, 422),
    (ServerError, 500),
)


# The same for gRPC (``app.v2.grpc_service``): the name of the ``grpc.StatusCode`` that ends
# the call, by the same first-match rule.
GRPC_STATUS: tuple[tuple[type[ServerError], str], ...] = (
    (Unauthorized, "UNAUTHENTICATED"),
    (Forbidden, "PERMISSION_DENIED"),
    (QuotaExceeded, "RESOURCE_EXHAUSTED"),
    (NoClassifier, "NOT_FOUND"),
    (NoEmbedding, "NOT_FOUND"),
    (ModelNotFound, "NOT_FOUND"),
    (ModelVersionUnavailable, "FAILED_PRECONDITION"),
    (PayloadTooLarge, "RESOURCE_EXHAUSTED"),
    (ClientDisconnected, "CANCELLED"),
    (ClientError, "INVALID_ARGUMENT"),
    (Unavailable, "UNAVAILABLE"),
    (DeadlineExceeded, "DEADLINE_EXCEEDED"),
    (ModelMemoryBudget, "RESOURCE_EXHAUSTED"),
    (ModelLoadFailed, "FAILED_PRECONDITION"),
    (ServerError, "INTERNAL"),
)


# The errors one image can meet while it is decoded, by class name: what a worker may report
# back for an upload (it crosses a pipe or the broker by name; nothing else is rebuilt).
IMAGE_ERRORS: dict[str, type[ServerError]] = {
    cls.__name__: cls for cls in (InvalidImage, UnsupportedImageFormat, PayloadTooLarge)
}
# The same, as ``isinstance`` and ``except`` take them: the errors the same bytes always meet,
# so identical requests may share them (the response cache, a broker worker's sharing).
IMAGE_ERROR_TYPES: tuple[type[ServerError], ...] = tuple(IMAGE_ERRORS.values())


# The refusals that say when to try again (``Retry-After``; gRPC's ``retry-after``): the
# server busy or failing (503, 504), or the caller over its share (429).
RETRYABLE: tuple[type[ServerError], ...] = (Unavailable, QuotaExceeded, DeadlineExceeded)


def retry_after(error: ServerError) -> int:
    """Whole seconds for ``Retry-After`` (a ``RETRYABLE`` error's ``retry_after_s``): at
    least one (a 0 invites a tight retry loop)."""
    seconds = float(getattr(error, "retry_after_s", 1.0))
    return max(1, math.ceil(seconds - 0.05))


def http_status(error: ServerError) -> int:
    """The HTTP status that answers ``error``."""
    for kind, status in HTTP_STATUS:
        if isinstance(error, kind):
            return status
    return 500  # pragma: no cover - ServerError is the last row


def validation_message(problems: Sequence[Mapping[str, Any]], shown: int = 3) -> str:
    """One line for pydantic's validation ``problems`` (``ValidationError.errors()``): the
    first ``shown`` of them, and how many more, never a line per element of a long list.

    >>> validation_message([{"loc": ("data", 0), "msg": "bad"}] * 5)
    'data.0: bad; data.0: bad; data.0: bad (and 2 more)'
    """
    lines = [
        f"{'.'.join(str(part) for part in problem['loc']) or 'body'}: {problem['msg']}"
        for problem in problems[:shown]
    ]
    more = f" (and {len(problems) - shown} more)" if len(problems) > shown else ""
    return "; ".join(lines) + more


def grpc_status(error: ServerError) -> str:
    """The name of the gRPC status code that answers ``error``."""
    for kind, code in GRPC_STATUS:
        if isinstance(error, kind):
            return code
    return "INTERNAL"  # pragma: no cover - ServerError is the last row


class StartupError(Exception):
    """The server cannot start; the message says what to fix."""


class SettingsError(StartupError):
    pass


class ModelStoreError(StartupError):
    pass


class ContentMismatch(ModelStoreError):
    """A model file verifies against its checksum, but does not compute what its manifest's
    id says (its weights or graph were replaced, and the checksum rewritten to match)."""


class WorkerStartError(StartupError):
    pass
