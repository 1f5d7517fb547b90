"""The world of the model-based lifecycle test (``tests/integration/test_lifecycle_model.py``):
the exports it publishes, a real deployment in each mode (``python -m app`` with its own
workers, or Redis, a host of broker workers and a front end), every protocol a client
speaks, and the checks every answer must pass.

An answer passes when its status is 200 or a refusal documented for the reason it had, and
when a 200's embedding is the one the export named by its ``X-Model-Id`` computes, within
that precision's tolerance (and nearer it than any other export's). The references are the
fp32 TorchScript embeddings of each export, run here.
"""

from __future__ import annotations

import base64
import contextlib
import functools
import os
import shutil
import signal
import threading
import time
from collections import Counter
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Literal

import httpx
import numpy as np
import torch

from app.exporters.precision import PrecisionRequest
from app.images import preprocess
from app.jobs import Task
from app.manifest import Gate, read_manifest, split_served_id
from app.tenancy import key_hash
from app.workers.models import load_models
from app.workers.runner import BatchRunner
from tests.broker import RedisServer, Workers, broker_env
from tests.conftest import distinct_images
from tests.models import ConvEmbedding, ScaledEmbedding, export_test_model
from tests.sentinel import SentinelSet
from tests.server import ServerProcess, alive, free_port

NAME = "tagger"
ADMIN_KEY = "admin-secret"
ADMIN = {"Authorization": f"Bearer {ADMIN_KEY}"}
# Tenants (docs/tenants.md) in every deployment: traffic comes from two tenants at two
# priorities and a weight apart, pinned requests from one of them, probes without a key.
# No quotas: every answer must still be its own result or a documented refusal.
TENANT_KEYS = {"shop": "shop-secret", "bulk": "bulk-secret"}
PRIORITY = {"shop": "1", "bulk": "2"}
KEYS_FILE = f"""
tenants:
  shop: {{weight: 3}}
  bulk: {{weight: 1}}
keys:
  - {{sha256: {key_hash(ADMIN_KEY)}, tenant: ops, scopes: [admin, metrics]}}
  - {{sha256: {key_hash(TENANT_KEYS["shop"])}, tenant: shop, scopes: [infer], top_priority: 1}}
  - {{sha256: {key_hash(TENANT_KEYS["bulk"])}, tenant: bulk, scopes: [infer]}}
anonymous: {{tenant: public, scopes: [infer, metrics]}}
"""


def as_tenant(tenant: str) -> dict[str, str]:
    """A tenant's key and priority, as its requests send them."""
    return {"Authorization": f"Bearer {TENANT_KEYS[tenant]}", "X-Priority": PRIORITY[tenant]}


IMAGES = distinct_images(4)  # the last for the broker's two front ends at once
Mode = Literal["inprocess", "broker"]
Outcome = Literal["fp32", "bf16", "int8"]
# How far an answer may be from its export's fp32 reference (relative L2 error), by the
# precision its id names: exports in the catalog differ by a factor of two or more.
TOLERANCE = {"float32": 1e-4, "bfloat16": 3e-2, "int8": 0.2}
LENIENT = Gate(top1=0.0, cosine_mean=0.0)


class ScaledConv(ConvEmbedding):
    """ConvEmbedding times ``scale``: a model with weights for int8 to quantize, whose every
    answer tells which version computed it."""

    def __init__(self, scale: float) -> None:
        super().__init__()
        self.scale = scale

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return super().forward(x) * self.scale


@dataclass
class Export:
    """A store the test may publish as a version: its folder, the id its answers must carry
    under the deployment's precision outcome ("" for a corrupt one, which never serves), and
    its fp32 reference embedding of each test image."""

    key: str
    store: Path
    served_id: str
    references: list[np.ndarray] = field(default_factory=list)
    weights: str = ""  # exports of the same weights (fp32 and its int8) share this

    @property
    def good(self) -> bool:
        return bool(self.served_id)

    @property
    def model_id(self) -> str:
        return split_served_id(self.served_id)[0]


def references(store: Path) -> list[np.ndarray]:
    """The fp32 TorchScript embeddings of ``IMAGES`` by ``store``'s model."""
    manifest = read_manifest(store)
    pixels = np.stack([preprocess(image, manifest.input) for image in IMAGES])
    runner = BatchRunner(load_models(store, torch.device("cpu")), torch.device("cpu"))
    return list(runner.run(Task.EMBEDDING, pixels, 0)["embedding"])


def corrupt_copy(good: Path, out: Path) -> Path:
    """``good`` with one byte of its embedding model changed and its manifest as it was: a
    version that fails its sha256 check and claims the served id of ``good``."""
    shutil.copytree(good, out)
    model = out / read_manifest(good).files["embedding"].path
    data = bytearray(model.read_bytes())
    data[-1] ^= 0xFF
    model.write_bytes(bytes(data))
    return out


class Catalog:
    """The exports of one precision outcome: ``good`` ones (distinct models) and one
    ``corrupt``. fp32 and bf16: the tiny model at scales 1, 2, 4, 8, served in that precision
    under MB_DTYPE=auto. int8: a convolution at scales 1 and 4, each as an fp32 export and as
    its int8 quantization, the two sharing their weights."""

    def __init__(self, root: Path, outcome: Outcome, photos: Path | None = None) -> None:
        self.outcome = outcome
        self.good: list[Export] = []
        suffix = {"fp32": "", "bf16": "+bf16", "int8": ""}[outcome]
        if outcome == "int8":
            assert photos is not None
            for scale in (1.0, 4.0):
                conv = functools.partial(ScaledConv, scale)
                fp32 = self._export(root, f"conv{scale:g}", conv, "conv-test", "")
                int8 = self._export(
                    root, f"conv{scale:g}-int8", conv, "conv-test", "+int8",
                    PrecisionRequest("int8", photos, accept_accuracy_loss=True, gate=LENIENT),
                )  # fmt: skip
                int8.references = fp32.references  # the same weights: fp32 is its reference
                self.good += [fp32, int8]
        else:
            for scale in (1.0, 2.0, 4.0, 8.0):
                model = functools.partial(ScaledEmbedding, scale)
                self.good.append(self._export(root, f"tiny{scale:g}", model, "tiny-test", suffix))
        first = self.good[0]
        self.corrupt = Export("corrupt", corrupt_copy(first.store, root / "corrupt"), "")

    def _export(
        self,
        root: Path,
        key: str,
        model: Callable[[], torch.nn.Module],
        arch: str,
        suffix: str,
        precision: PrecisionRequest | None = None,
    ) -> Export:
        """``model()``'s export; made after seeding, so that two exports of one model (fp32
        and its int8) share their weights whatever ran before (they did not: the int8 test
        failed or passed with the test order)."""
        torch.manual_seed(0)
        built = model()
        runtimes = ("openvino",) if self.outcome == "int8" else ()
        store = export_test_model(root / key, built, arch, runtimes, precision)
        served_id = read_manifest(store).model_id + suffix
        return Export(key, store, served_id, references(store), weights=key.split("-")[0])

    def by_id(self, served_id: str) -> Export | None:
        return next((e for e in self.good if e.served_id == served_id), None)


def relative_error(vector: np.ndarray, reference: np.ndarray) -> float:
    scale = max(float(np.linalg.norm(reference)), 1e-12)
    return float(np.linalg.norm(vector - reference)) / scale


def computed_by(catalog: Catalog, served_id: str, image: int, vector: Any) -> str | None:
    """Why ``vector`` was not computed by the export ``served_id`` names (None: it was):
    within its precision's tolerance of that export's reference, and nearer to it than to any
    other export's."""
    export = catalog.by_id(served_id)
    if export is None:
        return f"{served_id!r} names no export this test published"
    got = np.asarray(vector, dtype=np.float32).reshape(-1)
    tolerance = TOLERANCE[split_served_id(served_id)[1]]
    error = relative_error(got, export.references[image])
    if error > tolerance:
        return f"{served_id}: relative error {error:.3g} > {tolerance:g} on image {image}"
    for other in catalog.good:
        if (
            other.weights != export.weights
            and relative_error(got, other.references[image]) <= error
        ):
            return f"{served_id}: nearer to {other.served_id}'s reference on image {image}"
    return None


@dataclass(frozen=True)
class Config:
    """One deployment: its mode, its workers, the precision outcome and whether it polls the
    repository (``MB_REPOSITORY_POLL_S``)."""

    mode: Mode
    workers: int
    outcome: Outcome
    poll: bool = False
    sentinel: bool = False  # broker mode: Redis as a primary, two replicas, three Sentinels

    @property
    def name(self) -> str:
        extras = ("-poll" if self.poll else "") + ("-sentinel" if self.sentinel else "")
        return f"{self.mode}-{self.workers}-{self.outcome}{extras}"

    def env(self, state_dir: Path) -> dict[str, str]:
        """Every setting at its default (MB_DTYPE=auto above all), but for the test hooks
        that fix the precision outcome on any CPU, and what the test needs to drive it."""
        env = {
            "MB_DTYPE": "auto",
            "MB_WORKER_NUM": str(self.workers),
            "MB_WORKER_THREADS": "1",
            "MB_PRIORITY_LEVELS": "2",
            "MB_CACHE_BYTES": "32MiB",  # answers kept: each must still be its own id's
            "MB_STATE_DIR": str(state_dir),
            "MB_TEST_FASTEST_DTYPE": "bfloat16" if self.outcome == "bf16" else "float32",
            "LOG_LEVEL": "info",
        }
        if self.outcome == "bf16":
            env["MB_TEST_CPU_BF16"] = "1"  # a CPU without bf16 units tries it too
        if self.poll:
            env["MB_REPOSITORY_POLL_S"] = "1"
        return env


class Deployment:
    """A real server of ``config`` serving the repository ``root`` (its model ``NAME``):
    ``base_url`` (HTTP) and ``grpc_url``; ``sighup()``, ``kill_worker()``, ``worker_pids()``
    and ``orphans()`` (worker processes it ever reported that live on outside its status)."""

    def __init__(self, config: Config, root: Path, scratch: Path) -> None:
        self.config = config
        self.root = root
        self.grpc_port = free_port()
        keys = scratch / "keys.yaml"
        keys.parent.mkdir(parents=True, exist_ok=True)
        keys.write_text(KEYS_FILE)
        self.env = {
            **config.env(scratch / "state"),
            "MB_GRPC_PORT": str(self.grpc_port),
            "MB_KEYS_FILE": str(keys),
        }
        self.seen_pids: set[int] = set()
        self._stack = contextlib.ExitStack()
        self.server: ServerProcess | None = None
        # Broker mode: a second front end, without the shared Redis cache (so identical
        # requests through both meet only at a worker).
        self.other: ServerProcess | None = None
        self.workers: Workers | None = None
        self.redis: Any = None  # broker mode: its RedisServer, or SentinelSet

    @property
    def base_url(self) -> str:
        assert self.server is not None
        return self.server.base_url

    @property
    def grpc_url(self) -> str:
        return f"127.0.0.1:{self.grpc_port}"

    def __enter__(self) -> Deployment:
        try:
            self._start()
        except BaseException:
            self._stack.close()
            raise
        return self

    def _start(self) -> None:
        repository = {"MODEL_REPOSITORY": str(self.root)}
        if self.config.mode == "broker":
            redis_server: Any = SentinelSet() if self.config.sentinel else RedisServer()
            self._stack.push(redis_server)  # stopped however the start ends
            redis_server.start()
            self.redis = redis_server
            workers = Workers(
                redis_server, self.root, count=self.config.workers, MODEL_REPOSITORY=str(self.root)
            )
            workers.env.update(self.env)
            self._stack.push(workers)
            self.workers = workers.start(timeout_s=180)
            env = broker_env(redis_server.url, self.root, **repository, **self.env)
            env.pop("MB_WORKER_NUM")  # a front end has no workers
            env["MB_CACHE_REDIS"] = redis_server.url  # the shared cache too (its own is best)
        else:
            env = {**repository, **self.env}
        server = ServerProcess(**env)
        self._stack.push(server)
        self.server = server.start(ready_timeout_s=180)
        if self.config.mode == "broker":
            alone = {k: v for k, v in env.items() if k not in ("MB_CACHE_REDIS", "MB_GRPC_PORT")}
            other = ServerProcess(**alone)
            self._stack.push(other)
            self.other = other.start(ready_timeout_s=180)
        self.worker_pids()

    def __exit__(self, *exc_info: object) -> None:
        self._stack.close()

    def output(self) -> str:
        """What the processes logged (once stopped)."""
        parts = [p.output for p in (self.server, self.other, self.workers) if p is not None]
        return "\n".join(parts)

    def sighup(self) -> None:
        """``kill -HUP`` where the operator sends it: the server, or the workers' host."""
        process = self.server if self.workers is None else self.workers
        assert process is not None and process.process is not None
        os.kill(process.process.pid, signal.SIGHUP)

    def worker_pids(self) -> list[int]:
        """The model workers' pids as the server reports them now (``/readyz``: in broker
        mode, the front end's last look at the heartbeats, which the index is built from)."""
        readiness = httpx.get(f"{self.base_url}/readyz", timeout=60).json()
        pids = [w["pid"] for w in readiness["workers"] if w["alive"] and w["pid"]]
        self.seen_pids.update(pids)
        return pids

    def fail_over_redis(self) -> None:
        """``kill -9`` of Redis's primary (behind Sentinel): a replica takes over, and the
        killed one comes back as a replica once it has."""
        assert isinstance(self.redis, SentinelSet)
        self.redis.settled()
        old = self.redis.primary_port()
        assert old is not None
        self.redis.restart(self.redis.kill_primary())
        self.redis.after_fault(old)
        # Only the new primary stamps heartbeats now (the old one is back as a replica):
        # every worker has reached it once each has sent one since.
        assert self.workers is not None
        since = self.workers.now_ms()
        until(
            lambda: self.workers is not None and self.workers.beat_since(since),
            "every worker's heartbeat on the new primary",
            timeout_s=60,
        )

    def kill_worker(self) -> int:
        pid = sorted(self.worker_pids())[0]
        os.kill(pid, signal.SIGKILL)
        return pid

    def orphans(self) -> list[int]:
        """Worker processes this deployment reported once that still run, though it no
        longer reports them."""
        now = set(self.worker_pids())
        return sorted(pid for pid in self.seen_pids - now if alive(pid))


def publish(root: Path, export: Export) -> int:
    """Copy ``export``'s store into the repository as ``NAME``'s next version (written aside,
    renamed into place whole, as ``python -m app.export --repository`` does)."""
    from app.repository import publish as rename_into_place
    from app.repository import staging_folder

    folder = root / NAME
    staging = staging_folder(folder)
    staging.rmdir()
    shutil.copytree(export.store, staging)
    return rename_into_place(staging, folder)


# -- every protocol -----------------------------------------------------------------------------


@dataclass
class Answer:
    """One answer, in any protocol: its status, the id it says computed it (None where the
    protocol does not say), the embedding of ``image`` it carries (if any), its error type."""

    protocol: str
    status: int
    served_id: str | None = None
    embedding: Any = None
    image: int = 0
    error: str = ""
    message: str = ""
    version: str | None = None  # the version number it names, where the protocol says
    cache: str | None = None  # X-Cache: hit, coalesced or miss (HTTP only)


def _error(response: httpx.Response) -> tuple[str, str]:
    try:
        body = response.json()
    except ValueError:
        return "", response.text[:300]
    error = body.get("error") if isinstance(body, dict) else None
    if isinstance(error, dict):
        return str(error.get("type", "")), str(error.get("message", ""))
    if isinstance(error, str):
        return str(body.get("type", "")), error
    return "", str(body)[:300]


def _answer(protocol: str, response: httpx.Response, image: int) -> Answer:
    answer = Answer(protocol, response.status_code, response.headers.get("X-Model-Id"))
    answer.image, answer.cache = image, response.headers.get("X-Cache")
    if response.status_code != 200:
        answer.error, answer.message = _error(response)
    return answer


def http_embedding(
    http: httpx.Client,
    image: int,
    *,
    model: str | None = NAME,
    pin: str | None = None,
    tenant: str | None = None,
    fresh: bool = False,
) -> Answer:
    """``fresh``: past the response cache (a hit answers without the workers)."""
    params = {"model": model} if model else {}
    headers = {"X-Model-Id": pin} if pin else {}
    if fresh:
        headers["Cache-Control"] = "no-cache"
    if tenant is not None:
        headers |= as_tenant(tenant)
    files = {"image": ("x.png", IMAGES[image])}
    response = http.post("/predict/embedding", params=params, files=files, headers=headers)
    answer = _answer("embedding" + (" pinned" if pin else ""), response, image)
    if response.status_code == 200:
        answer.embedding = response.json()
    return answer


def http_tag(http: httpx.Client, image: int) -> Answer:
    files = {"image": ("x.png", IMAGES[image])}
    response = http.post("/predict/tag", params={"model": NAME}, files=files)
    answer = _answer("tag", response, image)
    if response.status_code == 200:
        tags = response.json()
        assert len(tags) == 5 and all(0 <= t["prob"] <= 1 for t in tags), tags
    return answer


def v2_json(http: httpx.Client, image: int) -> Answer:
    body = {
        "inputs": [
            {
                "name": "image",
                "datatype": "BYTES",
                "shape": [1],
                "data": [base64.b64encode(IMAGES[image]).decode()],
            }
        ],
        "outputs": [{"name": "embedding"}],
    }
    response = http.post(f"/v2/models/{NAME}/infer", json=body)
    answer = _answer("v2 json", response, image)
    if response.status_code == 200:
        output = response.json()["outputs"][0]
        answer.embedding, answer.version = output["data"], response.json()["model_version"]
    return answer


def predictions(http: httpx.Client, image: int) -> Answer:
    """TorchServe's inference API: the top 5 as {label: probability}."""
    response = http.post(f"/predictions/{NAME}", content=IMAGES[image])
    answer = _answer("predictions", response, image)
    if response.status_code == 200:
        assert len(response.json()) == 5, response.text
    return answer


GRPC_CODES = {"NOT_FOUND": 404, "FAILED_PRECONDITION": 409, "UNAVAILABLE": 503}


def triton_binary(url: str, image: int) -> Answer:
    """tritonclient.http, binary tensors (its default), as Triton's users send them."""
    import tritonclient.http as triton_http

    return _triton(triton_http, "v2 binary", url.removeprefix("http://"), image)


def triton_grpc(url: str, image: int) -> Answer:
    """tritonclient.grpc, as Triton's users send over gRPC."""
    import tritonclient.grpc as triton_grpc_client

    return _triton(triton_grpc_client, "grpc", url, image)


def _triton(module: Any, protocol: str, url: str, image: int) -> Answer:
    """One infer of image ``image`` by tritonclient's ``module`` (``http`` or ``grpc``); a
    refusal is its HTTP status (gRPC's code mapped by ``GRPC_CODES``)."""
    from tritonclient.utils import InferenceServerException

    client = module.InferenceServerClient(url)
    try:
        given = module.InferInput("image", [1, 1], "BYTES")
        given.set_data_from_numpy(np.array([[IMAGES[image]]], dtype=np.object_))
        wanted = [module.InferRequestedOutput("embedding")]
        try:
            result = client.infer(NAME, [given], outputs=wanted)
        except InferenceServerException as exc:
            status = str(exc.status() or 0)
            code = GRPC_CODES.get(status.removeprefix("StatusCode."), 500)
            return Answer(protocol, int(status) if status.isdigit() else code, image=image,
                          message=str(exc))  # fmt: skip
        answer = Answer(protocol, 200, image=image)
        answer.embedding = result.as_numpy("embedding")[0]
        response = result.get_response()
        answer.version = response["model_version"] if isinstance(response, dict) else (
            response.model_version
        )  # fmt: skip
        if not isinstance(response, dict):  # gRPC says which export computed it
            answer.served_id = response.parameters["model_id"].string_param
        return answer
    finally:
        client.close()


# -- traffic while the steps run ------------------------------------------------------------------


class Traffic:
    """``clients`` threads sending ``/predict/embedding`` for ``NAME`` without pause while a
    step runs, as the tenants ``bulk`` and ``shop`` in turn (each at its priority); every
    answer is kept, with when it was sent and received."""

    def __init__(self, base_url: str, clients: int = 3) -> None:
        self.base_url = base_url
        self.clients = clients
        self.answers: list[tuple[float, float, Answer]] = []
        self._stop = threading.Event()
        self._threads: list[threading.Thread] = []
        self._lock = threading.Lock()

    def _run(self, offset: int) -> None:
        tenant = sorted(TENANT_KEYS)[offset % len(TENANT_KEYS)]  # bulk, shop, bulk...
        with httpx.Client(base_url=self.base_url, timeout=60) as http:
            sent = offset
            while not self._stop.is_set():
                image = sent % len(IMAGES)
                started = time.monotonic()
                try:
                    answer = http_embedding(http, image, tenant=tenant)
                except httpx.TransportError as exc:
                    answer = Answer("embedding", 0, image=image, message=repr(exc))
                with self._lock:
                    self.answers.append((started, time.monotonic(), answer))
                sent += 1
                if answer.status != 200:  # as a client that honours Retry-After, a little
                    time.sleep(0.05)

    def __enter__(self) -> Traffic:
        self._stop.clear()
        self._threads = [
            threading.Thread(target=self._run, args=(i,), daemon=True) for i in range(self.clients)
        ]
        for thread in self._threads:
            thread.start()
        return self

    def __exit__(self, *exc_info: object) -> None:
        self._stop.set()
        for thread in self._threads:
            thread.join(timeout=90)

    def take(self) -> list[tuple[float, float, Answer]]:
        with self._lock:
            taken, self.answers = self.answers, []
        return taken


def statuses(answers: list[Answer]) -> Counter[str]:
    return Counter(f"{a.status} {a.error}".strip() for a in answers)


def until(check: Callable[[], Any], what: str | Callable[[], str], timeout_s: float = 90) -> Any:
    """Poll ``check`` until it returns something true; its last value (AssertionError with
    ``what``, or what it says then, at the deadline)."""
    deadline = time.monotonic() + timeout_s
    while True:
        value = check()
        if value:
            return value
        if time.monotonic() > deadline:
            said = what if isinstance(what, str) else what()
            raise AssertionError(f"{said}: not within {timeout_s:g} s (last: {value!r})")
        time.sleep(0.1)


@contextlib.contextmanager
def deployed(config: Config, root: Path, scratch: Path) -> Iterator[Deployment]:
    with Deployment(config, root, scratch) as deployment:
        yield deployment
