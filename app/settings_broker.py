"""The settings of broker mode and of the shared response cache: where their Redis is, how
its keys are named, how workers are named and probed. Part of ``app.settings.Settings``,
read from the environment with the rest."""

from __future__ import annotations

from pydantic import BaseModel, ByteSize, Field, SecretStr, field_validator

from app.settings_values import BrokerAddress


class BrokerSettings(BaseModel):
    """``MB_BROKER*``, the workers' names and probes, and ``MB_CACHE_*``."""

    mb_cache_bytes: ByteSize = Field(
        ByteSize(0),
        description=(
            "A response cache in each server process, this large ('256MiB'; 0: none): an "
            "image's answer by its bytes and the served id, identical requests in flight "
            "computed once (docs/cache.md)."
        ),
    )
    mb_cache_redis: SecretStr | None = Field(
        None,
        description=(
            "A Redis URL for a response cache every front end shares (best a Redis of its "
            "own with maxmemory and allkeys-lru; docs/cache.md). Down or slow: served without."
        ),
    )
    mb_cache_ttl_s: float = Field(
        3600.0, gt=0, description="How long the shared cache (MB_CACHE_REDIS) keeps an answer."
    )
    mb_broker: SecretStr | None = Field(
        None,
        description=(
            "Broker mode: a Redis URL (redis://host:port/db, rediss:// for TLS, a password as "
            "redis://:secret@host), or Sentinel's (redis+sentinel://host:26379,host2/service, "
            "rediss+sentinel:// for TLS). Front ends then start no model workers; `python -m "
            "app.broker.worker` runs them, on any host."
        ),
    )
    mb_broker_admin: SecretStr | None = Field(
        None,
        description=(
            "Broker mode, front ends: the Redis URL the admin routes write the version pins "
            "through (an ACL user allowed to; docs/scaling.md). Default: MB_BROKER, whose "
            "user then needs the same rights."
        ),
    )
    mb_broker_prefix: str = Field(
        "mb",
        pattern=r"^[A-Za-z0-9_.-]{1,32}$",
        description="Prefix of every Redis key broker mode uses (an ACL can be limited to it).",
    )
    mb_max_deliveries: int = Field(
        3,
        ge=1,
        le=100,
        description=(
            "Broker mode: a request whose worker died this many times is answered 500 instead "
            "of being run again."
        ),
    )
    mb_worker_name: str | None = Field(
        None,
        pattern=r"^[A-Za-z0-9_.-]{1,64}$",
        description=(
            "Broker mode: this host's name in the workers' names (default: the host name); "
            "worker i is '<name>:<i>', the same across restarts."
        ),
    )
    mb_health_port: int | None = Field(
        None,
        ge=1,
        le=65535,
        description=(
            "Broker mode: the port `python -m app.broker.worker` answers GET /healthz and "
            "/readyz on (Kubernetes probes), from its workers' heartbeats; unset: no port."
        ),
    )
    mb_scale_from_zero: bool = Field(
        False,
        description=(
            "Broker mode, front ends: while no worker is live (an autoscaler scaled them to "
            "zero), stay ready and queue each request for the version its model last served, "
            "up to its deadline, so the queue's lag can start workers; off: such requests get "
            "503 at once."
        ),
    )

    @field_validator("mb_broker", "mb_broker_admin", "mb_cache_redis")
    @classmethod
    def _check_broker(cls, value: SecretStr | None) -> SecretStr | None:
        if value is not None:
            BrokerAddress.parse(value.get_secret_value())  # raises ValueError
        return value
