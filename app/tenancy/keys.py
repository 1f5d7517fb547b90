"""Who calls: API keys, the tenant each belongs to, what it may do, and its quota.

A keys file (``MB_KEYS_FILE``, YAML or TOML) names the tenants and maps each key, stored only
as its SHA-256 (``python -m app.tenancy hash`` prints it), to a tenant and its scopes::

    tenants:
      shop: {rate: 100, burst: 200, weight: 4}   # images/s, the most at once, fair share
      catalogue: {rate: 20}
    keys:
      - sha256: 9f86d081884c7d659a2feaa0c55ad015a3bf4f1b2b0b822cd15d6c15b0f00a08
        tenant: shop
        scopes: [infer]
        priority: 2          # this key's requests, unless they ask (1 is the highest)
        top_priority: 1      # the highest it may ask for (default: its priority)
      - sha256: ...
        tenant: ops
        scopes: [admin, metrics]
    anonymous: {tenant: public, scopes: [metrics]}   # no key sent (default: nothing allowed)

Without a file, ``API_KEY`` and ``ADMIN_API_KEY`` are the one-line special case they always
were (``Keyring.of_settings``): ``API_KEY`` is tenant ``default`` with ``infer``,
``ADMIN_API_KEY`` tenant ``admin`` with ``admin``, and a request without a key may read the
metrics, and predict too when ``API_KEY`` is unset.

>>> ring = Keyring.parse({"tenants": {"t": {"rate": 5}},
...                       "keys": [{"sha256": key_hash("k"), "tenant": "t", "scopes": ["infer"]}]})
>>> ring.caller("k").tenant, ring.caller("k").allows(Scope.INFER), ring.caller("x")
('t', True, None)
>>> ring.anonymous is None   # without a key: nothing, unless the file says
True
>>> ring.tenant("t").burst   # one second of its rate, at least one image
5.0
"""

from __future__ import annotations

import enum
import hashlib
import re
import tomllib
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import yaml
from pydantic import BaseModel, ConfigDict, Field, ValidationError, model_validator

from app.broker.wire.lanes import MAX_WEIGHT
from app.errors import SettingsError, validation_message

TENANT_PATTERN = r"^[A-Za-z0-9_.-]{1,64}$"  # also a metrics label value: bounded by the file
ANONYMOUS = "anonymous"  # the tenant of a request without a key, unless the file names one


class Scope(enum.StrEnum):
    """What a key may do: predict, load and unload models, read the metrics."""

    INFER = "infer"
    ADMIN = "admin"
    METRICS = "metrics"


def bearer_token(authorization: str | None) -> str | None:
    """The token of an ``Authorization: Bearer <token>`` value (HTTP's header, gRPC's
    metadata), or None.

    >>> bearer_token("Bearer s3cret"), bearer_token("s3cret"), bearer_token(None)
    ('s3cret', None, None)
    """
    scheme, _, token = (authorization or "").partition(" ")
    return token.strip() if scheme.lower() == "bearer" else None


def key_hash(key: str) -> str:
    """The hex SHA-256 a keys file stores for ``key``."""
    return hashlib.sha256(key.encode()).hexdigest()


@dataclass(frozen=True, slots=True)
class Tenant:
    """A tenant's share: ``rate`` images/s refilled into a bucket of ``burst`` (no quota
    when ``rate`` is None), and its ``weight`` in fair batches."""

    name: str
    rate: float | None = None
    burst: float = 0.0
    weight: float = 1.0


@dataclass(frozen=True, slots=True)
class Caller:
    """Who a request comes from: the key's tenant, scopes and priorities (None: the
    server's default priority)."""

    tenant: str
    scopes: frozenset[Scope]
    priority: int | None = None
    top_priority: int | None = None

    def allows(self, scope: Scope) -> bool:
        return scope in self.scopes


class _Strict(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True)


class _TenantEntry(_Strict):
    rate: float | None = Field(None, gt=0, description="images per second")
    burst: float | None = Field(None, ge=1, description="the most images at once")
    weight: float = Field(
        1.0, gt=0, le=MAX_WEIGHT, description="share of a batch against other tenants"
    )


class _CallerEntry(_Strict):
    tenant: str = Field(pattern=TENANT_PATTERN)
    scopes: list[Scope] = Field(min_length=1)
    priority: int | None = Field(None, ge=1)
    top_priority: int | None = Field(None, ge=1)

    @model_validator(mode="after")
    def _priorities(self) -> _CallerEntry:
        if (
            self.top_priority is not None
            and self.priority is not None
            and self.top_priority > self.priority
        ):
            raise ValueError(
                f"top_priority {self.top_priority} is below the key's own priority "
                f"{self.priority} (1 is the highest)"
            )
        return self


class _KeyEntry(_CallerEntry):
    sha256: str = Field(pattern=r"^[0-9a-f]{64}$", description="python -m app.tenancy hash")


class _KeysFile(_Strict):
    tenants: dict[str, _TenantEntry] = Field(default_factory=dict)
    keys: list[_KeyEntry] = Field(default_factory=list)
    anonymous: _CallerEntry | None = None

    @model_validator(mode="after")
    def _consistent(self) -> _KeysFile:
        seen: set[str] = set()
        for index, key in enumerate(self.keys):
            if key.sha256 in seen:
                raise ValueError(f"keys.{index}: the same key hash is given twice")
            seen.add(key.sha256)
        return self


class Keyring:
    """Keys (by hash) to callers, and tenants by name. Immutable: a reload builds a new one."""

    def __init__(
        self,
        callers: Mapping[str, Caller],
        tenants: Mapping[str, Tenant],
        anonymous: Caller | None,
        source: str,
    ) -> None:
        self._callers = dict(callers)
        self._tenants = dict(tenants)
        self.anonymous = anonymous
        self.source = source  # what it was read from, for logs

    def caller(self, key: str) -> Caller | None:
        """The caller ``key`` belongs to, or None when it is unknown. Looked up by hash: the
        keys themselves are never held (``anonymous`` is the caller without a key)."""
        return self._callers.get(key_hash(key))

    @property
    def callers(self) -> list[Caller]:
        """Every caller: the keys' and the anonymous one."""
        return [*self._callers.values(), *([self.anonymous] if self.anonymous else [])]

    def tenant(self, name: str) -> Tenant:
        """A tenant's share (a tenant the file does not describe has no quota)."""
        return self._tenants.get(name) or Tenant(name)

    @property
    def tenants(self) -> list[str]:
        """Every tenant a request can be counted under: the metrics' label values."""
        names = {c.tenant for c in self._callers.values()} | set(self._tenants)
        if self.anonymous is not None:
            names.add(self.anonymous.tenant)
        return sorted(names)

    def any_allows(self, scope: Scope) -> bool:
        """Whether some caller has ``scope`` (the admin routes exist only then)."""
        return any(c.allows(scope) for c in self.callers)

    def needs_key(self, scope: Scope) -> bool:
        """Whether a request without a key is refused ``scope`` (the OpenAPI docs say so)."""
        return self.anonymous is None or not self.anonymous.allows(scope)

    @classmethod
    def of_settings(cls, api_key: str | None, admin_api_key: str | None) -> Keyring:
        """``API_KEY`` and ``ADMIN_API_KEY``, as they always worked."""
        # One tenant: its requests may ask any priority (their own work's order).
        callers = {}
        if api_key is not None:
            callers[key_hash(api_key)] = Caller("default", frozenset({Scope.INFER}), None, 1)
        if admin_api_key is not None:
            callers[key_hash(admin_api_key)] = Caller("admin", frozenset({Scope.ADMIN}))
        open_scopes = {Scope.METRICS} | ({Scope.INFER} if api_key is None else set())
        anonymous = Caller(ANONYMOUS, frozenset(open_scopes), None, 1)
        return cls(callers, {}, anonymous, "API_KEY")

    @classmethod
    def parse(cls, data: Any, source: str = "<keys>") -> Keyring:
        """A keyring from a keys file's parsed content; ``SettingsError`` naming what is wrong."""
        try:
            parsed = _KeysFile.model_validate(data if data is not None else {})
        except ValidationError as exc:
            raise SettingsError(f"{source}: {validation_message(exc.errors())}") from None
        tenants = {
            name: Tenant(
                name,
                entry.rate,
                entry.burst if entry.burst is not None else max(1.0, entry.rate or 0.0),
                entry.weight,
            )
            for name, entry in parsed.tenants.items()
        }
        bad = [name for name in tenants if not _valid_tenant(name)]
        if bad:
            raise SettingsError(f"{source}: tenant names must match {TENANT_PATTERN}: {bad}")
        if not parsed.keys and parsed.anonymous is None:  # an empty file, one half written
            raise SettingsError(f"{source}: it grants nothing: no keys, and no anonymous entry")
        callers = {key.sha256: _caller(key) for key in parsed.keys}
        anonymous = _caller(parsed.anonymous) if parsed.anonymous is not None else None
        return cls(callers, tenants, anonymous, source)

    @classmethod
    def read(cls, path: Path) -> Keyring:
        """A keys file: YAML (``.yaml``, ``.yml``) or TOML (``.toml``)."""
        try:
            text = path.read_text(encoding="utf-8")
        except OSError as exc:
            raise SettingsError(f"MB_KEYS_FILE {path}: cannot read it: {exc.strerror}") from None
        except UnicodeDecodeError as exc:
            raise SettingsError(f"MB_KEYS_FILE {path}: not UTF-8 text: {exc.reason}") from None
        try:
            if path.suffix == ".toml":
                data: Any = tomllib.loads(text)
            elif path.suffix in (".yaml", ".yml"):
                data = yaml.safe_load(text)
            else:
                raise SettingsError(f"MB_KEYS_FILE {path}: name a .yaml, .yml or .toml file")
        except (tomllib.TOMLDecodeError, yaml.YAMLError) as exc:
            kind = path.suffix[1:]
            raise SettingsError(f"MB_KEYS_FILE {path}: not valid {kind}: {exc}") from None
        return cls.parse(data, f"MB_KEYS_FILE {path}")


def _valid_tenant(name: str) -> bool:
    return re.fullmatch(TENANT_PATTERN, name) is not None


def _caller(entry: _CallerEntry) -> Caller:
    return Caller(
        entry.tenant,
        frozenset(entry.scopes),
        entry.priority,
        entry.top_priority if entry.top_priority is not None else entry.priority,
    )
