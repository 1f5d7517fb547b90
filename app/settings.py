"""All configuration, read from the environment (or a ``.env`` file) in one place.

Every field maps to the upper-case environment variable of the same name, e.g.
``mb_batch_size`` <- ``MB_BATCH_SIZE``. ``os.environ`` is read elsewhere only for what other
libraries define: ``OTEL_*`` (tracing), the allocator's ``LD_PRELOAD``/``MALLOC_CONF``, ``CXX``,
``TBB_ENABLE_SANITIZERS``.
"""

from __future__ import annotations

import os
import re
from functools import lru_cache
from pathlib import Path
from typing import Literal, get_args

import pydantic_settings
from pydantic import (
    BaseModel,
    ByteSize,
    ConfigDict,
    Field,
    SecretStr,
    ValidationError,
    field_validator,
    model_validator,
)
from pydantic_settings import BaseSettings, SettingsConfigDict

from app.errors import SettingsError
from app.settings_broker import BrokerSettings
from app.settings_testing import TestHooks
from app.settings_values import (
    MODEL_NAME_PATTERN,
    parse_cuda_devices,
    parse_model_dtypes,
    parse_pins,
)

# Settings for which "" is a value of its own: the CPU, and precisions kept in memory only.
KEEP_EMPTY = frozenset({"cuda_devices", "mb_state_dir"})


class PriorityLevel(BaseModel):
    """One priority level's queue policy (``MB_PRIORITY_LEVELS``), in Triton's terms."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    max_queue: int | None = Field(None, ge=1, description="most items waiting at this level")
    timeout_s: float | None = Field(None, gt=0, description="longest wait in the queue")
    on_timeout: Literal["reject", "delay"] = Field("reject", description="then: 429, or last")
    max_batch: int | None = Field(
        None, ge=1, description="its work joins a batch only while it holds fewer images"
    )


class Settings(BaseSettings, TestHooks, BrokerSettings):
    """Server settings. Construct with keyword arguments in tests; env vars otherwise. The
    hooks only tests set (``MB_TEST_*``) are ``app.settings_testing.TestHooks``."""

    model_config = SettingsConfigDict(
        env_file=".env", env_file_encoding="utf-8", extra="ignore", case_sensitive=False
    )

    host: str = Field("127.0.0.1", description="Address to bind (python -m app / make run).")
    port: int = Field(8000, ge=0, le=65535, description="Port to bind.")
    mb_grpc_port: int | None = Field(
        None,
        ge=0,
        le=65535,
        description=(
            "Also serve the Open Inference Protocol over gRPC (Triton's and KServe's "
            "inference.GRPCInferenceService, and grpc.health.v1) on this port of HOST; "
            "unset: no gRPC. Triton uses 8001."
        ),
    )
    mb_batch_size: int | Literal["auto"] = Field(
        32,
        description=(
            "Most items in one model call, or 'auto': each worker measures its throughput per "
            "batch size at start-up and caps batches at the knee (at most MB_AUTO_BATCH_MAX)."
        ),
    )
    mb_auto_batch_max: int = Field(64, ge=1, le=4096, description="Upper bound for 'auto'.")
    mb_dtype: Literal["auto", "float32", "bfloat16", "float16", "int8"] = Field(
        "auto",
        description=(
            "Model precision in the workers: 'auto' serves an export made --precision bf16 "
            "or int8 as made, and an fp32 export in fp32 or, on a CPU with bf16 units, in "
            "bf16 where that is faster and passes its gate (X-Model-Id then ends +bf16); "
            "float32/bfloat16/float16 insist on any store; int8 needs a store exported with "
            "--precision int8 (OpenVINO, CPU)."
        ),
    )
    mb_state_dir: Path | None = Field(
        default_factory=lambda: Path.home() / ".local" / "state" / "microbatch",
        description=(
            "Where the precision MB_DTYPE=auto chose for each export on this class of host "
            "is kept between restarts, so served ids stay the same (precisions.json); empty: "
            "kept in memory only, measured again at each start."
        ),
    )
    mb_runtime: Literal["auto", "torchscript", "openvino", "aoti"] = Field(
        "auto",
        description=(
            "What runs the model in each worker: 'auto' self-tests every runtime the store "
            "holds models for against TorchScript on this host and serves with the fastest that "
            "agrees (one that crashes a worker is left out); 'torchscript', 'openvino' or 'aoti' "
            "(CPU) to insist."
        ),
    )
    mb_optimize: bool = Field(
        True, description="Freeze and optimise the TorchScript models for inference at load."
    )
    mb_max_latency: float = Field(
        0.005,
        ge=0,
        le=10,
        description=(
            "Seconds a batch may wait to fill while another batch is running. A request that "
            "finds every worker idle never waits."
        ),
    )
    mb_max_queue: int = Field(1024, ge=1, description="Items waiting beyond this get 503.")
    mb_worker_num: int | None = Field(
        None, ge=1, description="Worker processes in all; default one per device."
    )
    cuda_devices: str | None = Field(
        None,
        description="GPU indices like '0,1'; 'cpu' or empty for CPU; unset/'auto' for all GPUs.",
    )
    mb_worker_threads: int | None = Field(
        None, ge=1, description="torch threads per worker; default: CPU cores / workers, 1 on GPUs."
    )
    mb_request_timeout: float = Field(
        30.0, gt=0, description="Seconds before a waiting request is answered 504."
    )
    mb_keep_alive: int = Field(
        75,
        ge=1,
        description=(
            "Seconds an idle HTTP connection stays open, under python -m app and the gunicorn "
            "worker class (gunicorn's --keep-alive is ignored; uvicorn --factory takes its own). "
            "Keep it longer than the idle timeout of a load balancer in front (60 s on AWS), "
            "or the balancer may send a request on a connection the server is closing (502)."
        ),
    )
    mb_worker_start_timeout: float = Field(
        300.0, gt=0, description="Seconds the workers get to load and warm up."
    )
    mb_decode: Literal["auto", "server", "worker", "device"] = Field(
        "auto",
        description=(
            "Where uploads are decoded: 'worker' (each worker decodes its batch, JPEGs with "
            "libjpeg-turbo at a reduced scale; the HTTP process only serves HTTP), 'server' "
            "(threads in the HTTP process, with Pillow, overlapping the model), 'device' (like "
            "'worker', but JPEGs are decoded, resized and cropped on the worker's device: "
            "nvJPEG on a GPU), or 'auto': 'worker'."
        ),
    )
    mb_decode_threads: int | None = Field(
        None,
        ge=1,
        description=(
            "Decode threads: per worker when workers decode (default: a CPU worker's torch "
            "threads, cores / workers on GPU), or in the HTTP process with MB_DECODE=server "
            "(default min(8, cores))."
        ),
    )
    model_store: Path = Field(
        Path("model_store"),
        description="One exported model (a repository of one model); MODEL_REPOSITORY wins.",
    )
    model_repository: Path | None = Field(
        None,
        description=(
            "A model repository: DIR/<name>/<version>/ stores (a store directly in DIR/<name>/ "
            "is version 1). Every model in it serves, each at its newest version unless "
            "MB_MODEL_VERSIONS pins one."
        ),
    )
    mb_default_model: str | None = Field(
        None,
        pattern=MODEL_NAME_PATTERN,
        description="The model a request without ?model= gets (default: the only one).",
    )
    mb_model_versions: str | None = Field(
        None,
        description="Versions to serve instead of the newest: 'name=3,other=1'.",
    )
    mb_model_dtypes: str | None = Field(
        None,
        description="MB_DTYPE per model, over MB_DTYPE: 'tagger=float32,other=auto'.",
    )
    mb_model_memory: ByteSize | None = Field(
        None,
        description=(
            "Memory the models of one worker may take ('4GiB'): a load past it is refused, "
            "naming both figures. Unset: no bound."
        ),
    )
    mb_repository_poll_s: float | None = Field(
        None,
        gt=0,
        description=(
            "Look at the repository this often (seconds) and load what is new, as kill -HUP "
            "does. Unset: only on kill -HUP or the admin load route."
        ),
    )
    mb_switch_min_workers: int | Literal["all"] = Field(
        "all",
        description=(
            "Broker mode: a model name moves to a new version once it is ready on this many "
            "live workers ('all': every live worker serving that name)."
        ),
    )
    max_upload_bytes: int = Field(
        10 * 1024 * 1024,
        ge=1,
        description=(
            "Most bytes of image in one request, all its images together (413 beyond); a "
            "multipart body may be 64 KiB larger, for its envelope and form fields."
        ),
    )
    max_images_per_request: int = Field(
        64,
        ge=1,
        le=4096,
        description="Most images in one request (repeated image fields; 413 beyond).",
    )
    max_image_pixels: int = Field(
        40_000_000, ge=1, description="Largest image (width x height) decoded (413 beyond)."
    )
    mb_batch_timeout: float = Field(
        60.0, gt=0, description="Seconds a worker may spend on one batch before it is killed."
    )
    api_key: SecretStr | None = Field(
        None, description="When set, prediction routes need 'Authorization: Bearer <key>'."
    )
    admin_api_key: SecretStr | None = Field(
        None,
        description=(
            "When set, the model repository's load and unload routes exist, and need "
            "'Authorization: Bearer <key>' (without it they are not there at all)."
        ),
    )
    mb_priority_levels: list[PriorityLevel] = Field(
        default_factory=lambda: [PriorityLevel()],
        min_length=1,
        max_length=16,
        description=(
            "Priority levels, 1 the highest: their count (3), or each one's queue policy as "
            'JSON: [{}, {"max_queue": 256}, {"max_queue": 64, "timeout_s": 2, "on_timeout": '
            '"reject", "max_batch": 8}] (reject: 429; delay: run after everything else; '
            "max_batch: its work joins only batches smaller than that). Lower levels fill "
            "what a batch has left, and are refused (429) before higher ones wait."
        ),
    )
    mb_default_priority: int | None = Field(
        None,
        ge=1,
        description=(
            "The priority of a request that asks none and whose key sets none (default: the "
            "lowest level). X-Priority, v2's parameters.priority ask; a key caps them."
        ),
    )
    mb_keys_file: Path | None = Field(
        None,
        description=(
            "A keys file (YAML or TOML; docs/tenants.md): API keys by SHA-256, each with its "
            "tenant, scopes, priority and quota; re-read on SIGHUP. Replaces API_KEY and "
            "ADMIN_API_KEY."
        ),
    )
    prometheus_multiproc_dir: Path | None = Field(
        None,
        description=(
            "A directory several front-end processes (uvicorn --workers, gunicorn) share, so "
            "/metrics sums all of them (prometheus-client's multiprocess mode). Empty it "
            "before starting them. An environment variable, not only in .env: "
            "prometheus-client reads it as it is imported."
        ),
    )
    log_level: Literal["debug", "info", "warning", "error"] = Field(
        "info", description="debug, info, warning or error."
    )
    log_format: Literal["text", "json"] = Field("text", description="'json': one object a line.")

    @field_validator("prometheus_multiproc_dir")
    @classmethod
    def _check_multiprocess_dir(cls, value: Path | None) -> Path | None:
        """An existing, writable directory, named in the environment: prometheus-client
        switches to files only for the variable it saw at import (given in ``.env`` alone,
        every counter was left out of /metrics; a missing directory failed the first
        request that counted)."""
        if value is None:
            return value
        if Path(os.environ.get("PROMETHEUS_MULTIPROC_DIR") or "/nonexistent") != value:
            raise ValueError("must be set in the environment (prometheus-client reads it there)")
        if not value.is_dir() or not os.access(value, os.W_OK | os.X_OK):
            raise ValueError("must be an existing directory this process can write")
        return value

    @field_validator("cuda_devices")
    @classmethod
    def _check_devices(cls, value: str | None) -> str | None:
        parse_cuda_devices(value)  # raises ValueError with a precise message
        return value

    @field_validator("mb_model_versions")
    @classmethod
    def _check_pins(cls, value: str | None) -> str | None:
        parse_pins(value)  # raises ValueError naming the bad pair
        return value

    @field_validator("mb_model_dtypes")
    @classmethod
    def _check_model_dtypes(cls, value: str | None) -> str | None:
        parse_model_dtypes(value)  # raises ValueError naming the bad pair
        return value

    @field_validator("mb_state_dir", mode="before")
    @classmethod
    def _empty_is_none(cls, value: object) -> object:
        return None if value == "" else value

    @field_validator("mb_switch_min_workers")
    @classmethod
    def _check_switch(cls, value: int | str) -> int | str:
        if isinstance(value, int) and value < 1:
            raise ValueError("must be at least 1, or 'all'")
        return value

    @property
    def model_pins(self) -> dict[str, int]:
        """Parsed ``MB_MODEL_VERSIONS``: name -> the version to serve."""
        return parse_pins(self.mb_model_versions)

    @property
    def model_dtypes(self) -> dict[str, str]:
        """Parsed ``MB_MODEL_DTYPES``: name -> its MB_DTYPE."""
        return parse_model_dtypes(self.mb_model_dtypes)

    @field_validator("mb_batch_size")
    @classmethod
    def _check_batch_size(cls, value: int | str) -> int | str:
        if isinstance(value, int) and not 1 <= value <= 4096:
            raise ValueError("must be between 1 and 4096, or 'auto'")
        return value

    @property
    def max_batch_size(self) -> int:
        """The most images one model call may take (the buffer size for 'auto')."""
        return self.mb_auto_batch_max if self.mb_batch_size == "auto" else int(self.mb_batch_size)

    @model_validator(mode="before")
    @classmethod
    def _empty_means_default(cls, data: object) -> object:
        """``NAME=`` (as compose passes ``${NAME:-}``) means "not set": the default applies.
        The exceptions (``KEEP_EMPTY``): ``CUDA_DEVICES`` empty is documented as the CPU, and
        ``MB_STATE_DIR`` empty as precisions kept in memory only."""
        if isinstance(data, dict):
            return {
                key: value
                for key, value in data.items()
                if not (value == "" and str(key).lower() not in KEEP_EMPTY)
            }
        return data

    @field_validator("mb_priority_levels", mode="before")
    @classmethod
    def _levels_by_count(cls, value: object) -> object:
        """``MB_PRIORITY_LEVELS=3``: three levels with the default policy."""
        if isinstance(value, int | str) and str(value).strip().isdigit():
            return [{} for _ in range(int(value))]
        return value

    @model_validator(mode="after")
    def _default_priority_is_a_level(self) -> Settings:
        levels = len(self.mb_priority_levels)
        if self.mb_default_priority is not None and self.mb_default_priority > levels:
            raise ValueError(
                f"MB_DEFAULT_PRIORITY {self.mb_default_priority} is not one of the "
                f"{levels} levels of MB_PRIORITY_LEVELS"
            )
        return self

    @field_validator("log_level", mode="before")
    @classmethod
    def _lower(cls, value: object) -> object:
        return value.lower() if isinstance(value, str) else value

    @property
    def cuda_device_ids(self) -> list[int] | None:
        """Parsed ``CUDA_DEVICES``: ``None`` means all visible GPUs, ``[]`` means CPU."""
        return parse_cuda_devices(self.cuda_devices)


# Their values never appear in an error message (a Redis URL may hold a password): every
# setting typed SecretStr, so a new secret is hidden without another list to keep.
SECRET_SETTINGS = frozenset(
    name.upper()
    for name, info in Settings.model_fields.items()
    if SecretStr in (info.annotation, *get_args(info.annotation))
)


def load_settings(**overrides: object) -> Settings:
    """Build ``Settings``, turning validation errors into one message naming each setting."""
    try:
        return Settings(**overrides)  # type: ignore[arg-type]
    except pydantic_settings.SettingsError as exc:  # a JSON setting that is not JSON
        field = re.search(r'field "(\w+)"', str(exc))
        name = field.group(1).upper() if field else "settings"
        raise SettingsError(
            f"invalid settings:\n  {name}: not valid JSON ({exc.__cause__ or exc})"
        ) from None
    except ValidationError as exc:
        lines = []
        for error in exc.errors():
            name = ".".join(str(part) for part in error["loc"]).upper() or "settings"
            got = "(not shown: it may hold a secret)"
            if name not in SECRET_SETTINGS:
                got = f"(got {error.get('input')!r})"
            lines.append(f"{name}: {error['msg']} {got}")
        raise SettingsError("invalid settings:\n  " + "\n  ".join(lines)) from None


@lru_cache(maxsize=1)
def get_settings() -> Settings:
    """The process-wide settings, read once."""
    return load_settings()
