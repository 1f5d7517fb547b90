"""The serving plan: every decision the settings imply about how this process serves, taken
once, at start-up, into one frozen ``ServingPlan`` that the engine, the app, the worker pool
and the broker workers receive. Nobody reads those settings again.

``plan_workers`` is pure (the GPUs and cores come in as arguments) so the rules are tested
without hardware; ``plan_serving`` asks the machine (``count_gpus``, ``os.cpu_count``).
Why each rule is what it is: ``docs/design.md``.
"""

from __future__ import annotations

import enum
import logging
import os
import re
import socket
from dataclasses import dataclass, field
from pathlib import Path
from typing import Literal

from app.errors import WorkerStartError
from app.plan.decode import DecodePlan, DecodeSetting, plan_decode
from app.plan.devices import assign_workers, count_gpus, resolve_devices
from app.settings import PriorityLevel, Settings
from app.settings_values import BrokerAddress

log = logging.getLogger(__name__)

RuntimeSetting = Literal["auto", "torchscript", "openvino", "aoti"]


class Role(enum.Enum):
    """What this process is: one server with its own workers, or a part of broker mode."""

    SERVER = "server"  # HTTP and model workers on this machine (the default)
    FRONT_END = "front_end"  # broker mode, HTTP side: no model, uploads go to Redis encoded
    WORKERS = "workers"  # broker mode, the model workers of one host (python -m app.broker.worker)


@dataclass(frozen=True)
class WorkerConfig:
    """How every model worker loads and runs the models it is given (``ModelSpec``s)."""

    max_batch_size: int
    auto_batch: bool = False  # measure throughput per batch size and pick the knee
    dtype: str = "auto"  # MB_DTYPE; "auto": measured (app.workers.runtimes.candidate_dtypes)
    bf16_units: bool | None = None  # testing only (MB_TEST_CPU_BF16); None: this CPU's
    fastest_dtype: str | None = None  # testing only (MB_TEST_FASTEST_DTYPE): wins the timing
    runtime: RuntimeSetting = "auto"  # MB_RUNTIME: see app.workers.runtimes
    optimize: bool = True
    decode_threads: int = 0  # > 0: batches may arrive encoded and this many threads decode
    decode_on_device: bool = False  # JPEGs are decoded on the worker's device
    max_pixels: int = 40_000_000  # the largest image a worker decodes
    memory_budget_bytes: int | None = None  # MB_MODEL_MEMORY: what its models may take
    log_level: str = "info"
    log_format: str = "text"  # "json": each record (a traceback too) one JSON line
    load_delays_s: tuple[float, ...] = ()  # testing only: MB_TEST_LOAD_DELAY_S, by worker
    retire_s: float | None = None  # testing only: MB_TEST_RETIRE_S (None: the lifecycle's)
    state_dir: Path | None = None  # MB_STATE_DIR: the precisions chosen, kept (None: memory)

    def load_delay_for(self, index: int) -> float:
        """How long worker ``index`` sleeps in each load (testing only; 0 normally)."""
        return self.load_delays_s[index % len(self.load_delays_s)] if self.load_delays_s else 0.0


@dataclass(frozen=True)
class Placement:
    """One entry of ``devices`` per worker process, the torch threads each runs on, and who
    decodes the uploads.

    >>> placement = plan_workers(cuda_devices=None, worker_num=None, worker_threads=None,
    ...                          decode="auto", decode_threads=None, gpus=2, cpu_count=16)
    >>> placement.devices, placement.threads, placement.decode.worker_threads
    (('cuda:0', 'cuda:1'), 1, 8)
    """

    devices: tuple[str, ...]
    threads: int
    decode: DecodePlan

    @property
    def on_cpu(self) -> bool:
        return all(device == "cpu" for device in self.devices)


@dataclass(frozen=True)
class Limits:
    """The batching and time limits the engine and the workers run under."""

    max_batch_size: int  # the most items in one model call (the buffer size for auto)
    max_latency_s: float
    max_queue: int
    request_timeout_s: float
    batch_timeout_s: float
    start_timeout_s: float
    max_image_bytes: int  # a broker worker's bound on one encoded upload
    levels: tuple[PriorityLevel, ...] = (PriorityLevel(),)  # MB_PRIORITY_LEVELS


@dataclass(frozen=True)
class RepositoryPlan:
    """Where the models come from and which versions serve (``app.repository``).

    ``root`` is a repository, or with ``single`` a lone store (``MODEL_STORE``) serving as a
    repository of one model."""

    root: Path
    single: bool
    pins: dict[str, int] = field(default_factory=dict)  # MB_MODEL_VERSIONS
    dtypes: dict[str, str] = field(default_factory=dict)  # MB_MODEL_DTYPES
    default_model: str | None = None  # MB_DEFAULT_MODEL
    poll_s: float | None = None  # MB_REPOSITORY_POLL_S
    switch_min_workers: int | None = None  # broker mode: None is every live worker ("all")


@dataclass(frozen=True)
class BrokerPlan:
    """Broker mode: where Redis is and how this host's workers are named there."""

    url: str = field(repr=False)  # may hold a password
    prefix: str
    max_deliveries: int
    host_name: str  # this host's workers are ``<host_name>:<index>``
    health_port: int | None = None  # workers: where their probes answer (app.broker.worker.probes)
    scale_from_zero: bool = False  # front ends: queue for the last routes with no worker live
    admin_url: str | None = field(default=None, repr=False)  # front ends: pins written here
    tenant_lanes: bool = False  # front ends: a lane per tenant (a keys file names them)

    @property
    def address(self) -> str:
        """The URL without credentials, for logs and ``/info``."""
        return BrokerAddress.parse(self.url).shown


@dataclass(frozen=True)
class CachePlan:
    """The response cache (``app.cache``): this process's share, and a shared Redis."""

    max_bytes: int = 0  # MB_CACHE_BYTES; 0: none in the process
    redis_url: str | None = field(default=None, repr=False)  # MB_CACHE_REDIS; may hold a password
    prefix: str = "mb"  # its keys are <prefix>:cache:<sha-256>
    ttl_s: float = 3600.0

    @property
    def on(self) -> bool:
        return self.max_bytes > 0 or self.redis_url is not None


@dataclass(frozen=True)
class ServingPlan:
    """How this process serves, decided once from the settings.

    >>> from app.settings import Settings
    >>> plan = plan_serving(Settings(cuda_devices="cpu", mb_worker_num=2), gpus=0, cpu_count=4)
    >>> plan.role.value, plan.placement.devices, plan.placement.threads
    ('server', ('cpu', 'cpu'), 2)
    """

    role: Role
    repository: RepositoryPlan
    placement: Placement
    worker: WorkerConfig
    limits: Limits
    batch_size_setting: int | str  # MB_BATCH_SIZE as given ("auto" or a number), for /info
    broker: BrokerPlan | None = None
    cache: CachePlan = CachePlan()

    @property
    def decode(self) -> DecodePlan:
        return self.placement.decode

    @property
    def remote_workers(self) -> bool:
        """The model workers are other processes behind the broker (a front end)."""
        return self.role is Role.FRONT_END

    def describe(self) -> str:
        """What serves the batches, for the start-up log line and ``/info``."""
        if self.broker is not None and self.role is Role.FRONT_END:
            return f"through the broker at {self.broker.address}"
        devices = self.placement.devices
        return (
            f"batch<={self.limits.max_batch_size}, max latency {self.limits.max_latency_s:g} s, "
            f"{len(devices)} worker(s) on {', '.join(sorted(set(devices)))}"
        )


def plan_workers(
    *,
    cuda_devices: list[int] | None,
    worker_num: int | None,
    worker_threads: int | None,
    decode: DecodeSetting,
    decode_threads: int | None,
    gpus: int,
    cpu_count: int,
) -> Placement:
    """Place ``worker_num`` workers (``MB_WORKER_NUM``; default one per device) over
    ``cuda_devices`` (parsed ``CUDA_DEVICES``: ``None`` all GPUs, ``[]`` the CPU).

    Threads per worker (``MB_WORKER_THREADS``) default to the cores shared evenly among CPU
    workers, and to 1 for a GPU worker, whose CPU threads only feed its device. Raises
    ``WorkerStartError`` for a GPU that does not exist."""
    try:
        available = resolve_devices(cuda_devices, gpus)
    except ValueError as exc:
        raise WorkerStartError(str(exc)) from None
    if cuda_devices and gpus == 0:
        log.warning(
            "CUDA_DEVICES=%s but no CUDA device is usable: running on CPU",
            ",".join(map(str, cuda_devices)),
        )
    devices = tuple(assign_workers(available, worker_num))
    if worker_threads is not None:
        threads = worker_threads
    elif all(device == "cpu" for device in devices):
        threads = max(1, cpu_count // len(devices))
    else:
        threads = 1
    return Placement(
        devices=devices,
        threads=threads,
        decode=plan_decode(
            decode, devices, torch_threads=threads, decode_threads=decode_threads,
            cpu_count=cpu_count,
        ),
    )  # fmt: skip


def _host_name(settings: Settings) -> str:
    return settings.mb_worker_name or re.sub(r"[^A-Za-z0-9_.-]", "-", socket.gethostname())[:64]


def plan_serving(
    settings: Settings,
    role: Role | None = None,
    *,
    gpus: int | None = None,
    cpu_count: int | None = None,
) -> ServingPlan:
    """The plan for ``settings`` in ``role`` (default: a broker front end when ``MB_BROKER``
    is set, else a server with its own workers). ``gpus`` and ``cpu_count`` default to this
    machine's; a front end, which runs no model, never asks."""
    if role is None:
        role = Role.FRONT_END if settings.mb_broker is not None else Role.SERVER
    if role is not Role.SERVER and settings.mb_broker is None:
        raise WorkerStartError("set MB_BROKER to the Redis URL the front ends use")
    if role is Role.FRONT_END:
        placement = Placement(devices=(), threads=0, decode=DecodePlan.front_end())
    else:
        decode = settings.mb_decode
        if role is Role.WORKERS:  # uploads cross the broker encoded: the workers decode them
            decode = "device" if decode == "device" else "worker"
        placement = plan_workers(
            cuda_devices=settings.cuda_device_ids,
            worker_num=settings.mb_worker_num,
            worker_threads=settings.mb_worker_threads,
            decode=decode,
            decode_threads=settings.mb_decode_threads,
            gpus=count_gpus() if gpus is None else gpus,
            cpu_count=(os.cpu_count() or 1) if cpu_count is None else cpu_count,
        )
    broker = None
    if settings.mb_broker is not None:
        broker = BrokerPlan(
            url=settings.mb_broker.get_secret_value(),
            prefix=settings.mb_broker_prefix,
            max_deliveries=settings.mb_max_deliveries,
            host_name=_host_name(settings),
            health_port=settings.mb_health_port,
            scale_from_zero=settings.mb_scale_from_zero,
            admin_url=(
                settings.mb_broker_admin.get_secret_value() if settings.mb_broker_admin else None
            ),
            tenant_lanes=settings.mb_keys_file is not None,
        )
    repository_root = settings.model_repository or settings.model_store
    return ServingPlan(
        role=role,
        repository=RepositoryPlan(
            root=repository_root,
            single=settings.model_repository is None,
            pins=settings.model_pins,
            dtypes=settings.model_dtypes,
            default_model=settings.mb_default_model,
            poll_s=settings.mb_repository_poll_s,
            switch_min_workers=(
                None
                if settings.mb_switch_min_workers == "all"
                else int(settings.mb_switch_min_workers)
            ),
        ),
        placement=placement,
        worker=WorkerConfig(
            max_batch_size=settings.max_batch_size,
            auto_batch=settings.mb_batch_size == "auto",
            dtype=settings.mb_dtype,
            runtime=settings.mb_runtime,
            optimize=settings.mb_optimize,
            decode_threads=placement.decode.worker_threads,
            decode_on_device=placement.decode.on_device,
            max_pixels=settings.max_image_pixels,
            memory_budget_bytes=(
                None if settings.mb_model_memory is None else int(settings.mb_model_memory)
            ),
            log_level=settings.log_level,
            log_format=settings.log_format,
            load_delays_s=settings.mb_test_load_delay_s,
            retire_s=settings.mb_test_retire_s,
            bf16_units=settings.mb_test_cpu_bf16,
            fastest_dtype=settings.mb_test_fastest_dtype,
            state_dir=settings.mb_state_dir,
        ),
        limits=Limits(
            max_batch_size=settings.max_batch_size,
            max_latency_s=settings.mb_max_latency,
            max_queue=settings.mb_max_queue,
            request_timeout_s=settings.mb_request_timeout,
            batch_timeout_s=settings.mb_batch_timeout,
            start_timeout_s=settings.mb_worker_start_timeout,
            max_image_bytes=settings.max_upload_bytes,
            levels=tuple(settings.mb_priority_levels),
        ),
        batch_size_setting=settings.mb_batch_size,
        broker=broker,
        cache=CachePlan(
            max_bytes=int(settings.mb_cache_bytes),
            redis_url=(
                settings.mb_cache_redis.get_secret_value() if settings.mb_cache_redis else None
            ),
            prefix=settings.mb_broker_prefix,
            ttl_s=settings.mb_cache_ttl_s,
        ),
    )
