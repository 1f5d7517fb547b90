"""How the settings' text values read: the GPU list (``CUDA_DEVICES``), version pins
(``MB_MODEL_VERSIONS``), what a model name and a version number look like (also checked
wherever a name from a request meets a path), and where broker mode's Redis is (``MB_BROKER``:
a plain URL or Sentinel's, ``BrokerAddress``; ``app.broker.wire.connect`` connects to it)."""

from __future__ import annotations

import re
from dataclasses import dataclass, field
from typing import Any
from urllib.parse import parse_qsl, urlencode, urlsplit

AUTO = None  # sentinel returned by parse_cuda_devices: "every visible CUDA device"

MODEL_NAME_PATTERN = r"^[A-Za-z0-9._-]{1,64}$"  # a model's name (its repository folder)
VERSION_PATTERN = r"^[1-9][0-9]{0,8}$"  # a version number (its folder in the model's)


def parse_cuda_devices(text: str | None) -> list[int] | None:
    """Parse ``CUDA_DEVICES``.

    ``None`` or ``"auto"`` -> ``None`` (all visible CUDA devices, CPU when there are none);
    ``""`` or ``"cpu"`` -> ``[]`` (CPU only); ``"0,2"`` -> ``[0, 2]``. GPU 0 is a device like
    any other. Raises ``ValueError`` for negatives, non-integers and duplicates.

    >>> parse_cuda_devices("0, 1")
    [0, 1]
    """
    if text is None:
        return AUTO
    cleaned = text.strip().lower()
    if cleaned == "auto":
        return AUTO
    if cleaned in ("", "cpu", "none"):
        return []
    ids: list[int] = []
    for part in cleaned.split(","):
        token = part.strip()
        if not token.isdigit():
            raise ValueError(
                f"expected comma-separated GPU indices like '0,1', 'cpu' or 'auto', got {text!r}"
            )
        index = int(token)
        if index in ids:
            raise ValueError(f"GPU {index} is listed twice in {text!r}")
        ids.append(index)
    return ids


DTYPE_SETTINGS = ("auto", "float32", "bfloat16", "float16", "int8")


def parse_model_dtypes(text: str | None) -> dict[str, str]:
    """``MB_MODEL_DTYPES``: ``name=dtype`` pairs, comma-separated (MB_DTYPE per model).

    >>> parse_model_dtypes("tagger=float32, embedder=auto")
    {'tagger': 'float32', 'embedder': 'auto'}
    """
    dtypes: dict[str, str] = {}
    for name, dtype in _pairs(text, "name=dtype", "tagger=float32"):
        if dtype not in DTYPE_SETTINGS:
            raise ValueError(f"{dtype!r} is not one of {', '.join(DTYPE_SETTINGS)}")
        if name in dtypes:
            raise ValueError(f"{name!r} is given twice")
        dtypes[name] = dtype
    return dtypes


def _pairs(text: str | None, shape: str, example: str) -> list[tuple[str, str]]:
    """``name=value`` pairs, comma-separated, each name a model name."""
    pairs = []
    for part in (text or "").split(","):
        if not part.strip():
            continue
        name, sep, value = (piece.strip() for piece in part.partition("="))
        if not sep:
            raise ValueError(f"expected {shape} pairs like {example!r}, got {part.strip()!r}")
        if not re.match(MODEL_NAME_PATTERN, name) or name in (".", ".."):
            raise ValueError(f"{name!r} is not a model name ({MODEL_NAME_PATTERN})")
        pairs.append((name, value))
    return pairs


def parse_pins(text: str | None) -> dict[str, int]:
    """``MB_MODEL_VERSIONS``: ``name=version`` pairs, comma-separated.

    >>> parse_pins("tagger=3, embedder=1")
    {'tagger': 3, 'embedder': 1}
    """
    pins: dict[str, int] = {}
    for name, version in _pairs(text, "name=version", "tagger=3"):
        if not re.match(VERSION_PATTERN, version):
            raise ValueError(f"expected name=version pairs like 'tagger=3', got {version!r}")
        if name in pins:
            raise ValueError(f"{name!r} is pinned twice")
        pins[name] = int(version)
    return pins


def byte_unit(size: int) -> tuple[int, str]:
    """The unit a byte size was most likely written in (``MB_MODEL_MEMORY=680MB`` is 680 *
    10**6 bytes, ``4GiB`` is 4 * 2**30), so a message quotes it as it was set and gives
    other figures beside it in the same unit.

    >>> byte_unit(680 * 10**6), byte_unit(4 << 30), byte_unit(512 << 20), byte_unit(1000)
    ((1000000, 'MB'), (1073741824, 'GiB'), (1048576, 'MiB'), (1000, 'kB'))
    """
    for unit, name in ((1 << 30, "GiB"), (10**9, "GB"), (1 << 20, "MiB"), (10**6, "MB")):
        if size >= unit and size % unit == 0:
            return unit, name
    return (1000, "kB") if size % 1000 == 0 else (1 << 20, "MiB")


def in_unit(size: int, unit: tuple[int, str]) -> str:
    """``size`` in ``unit`` (``byte_unit``), as a person reads it: ``680MB``, ``702.3MB``.

    >>> in_unit(680 * 10**6, (10**6, "MB")), in_unit(702_345_678, (10**6, "MB"))
    ('680MB', '702.3MB')
    """
    value = size / unit[0]
    shown = f"{value:.0f}" if value == int(value) else f"{value:.1f}"
    return f"{shown}{unit[1]}"


BROKER_PLAIN = ("redis", "rediss", "unix")
BROKER_SENTINEL = ("redis+sentinel", "rediss+sentinel")
DEFAULT_SENTINEL_PORT = 26379


@dataclass(frozen=True)
class BrokerAddress:
    """A parsed broker URL: a plain one (``sentinels`` empty), or Sentinel's.

    >>> a = BrokerAddress.parse("redis+sentinel://u:pw@s1:26379,s2/mymaster/2")
    >>> a.sentinels, a.service, a.options["db"], a.shown
    ((('s1', 26379), ('s2', 26379)), 'mymaster', 2, 'redis+sentinel://s1:26379,s2:26379/mymaster')
    >>> BrokerAddress.parse("redis://:pw@cache:6380/0").shown
    'redis://cache:6380'
    """

    url: str = field(repr=False)  # may hold a password
    scheme: str
    sentinels: tuple[tuple[str, int], ...] = ()
    service: str = ""
    options: dict[str, Any] = field(default_factory=dict, repr=False)
    sentinel_options: dict[str, Any] = field(default_factory=dict, repr=False)

    @classmethod
    def parse(cls, url: str) -> BrokerAddress:
        """Raises ``ValueError`` for a URL neither kind."""
        from redis.connection import parse_url  # the options, as redis-py reads them

        scheme = url.partition("://")[0]
        if scheme in BROKER_PLAIN:
            parse_url(url)  # type: ignore[no-untyped-call]  # a bad port or db: ValueError
            return cls(url, scheme)
        if scheme not in BROKER_SENTINEL:
            raise ValueError(
                "must be a redis://, rediss://, unix://, redis+sentinel:// or "
                "rediss+sentinel:// URL"
            )
        parts = urlsplit(url)
        credentials, _, hosts = parts.netloc.rpartition("@")
        sentinels = tuple(_host_port(h) for h in hosts.split(",") if h)
        path = [p for p in parts.path.split("/") if p]
        if not sentinels or not path or len(path) > 2:
            raise ValueError(f"a Sentinel URL is {scheme}://host:port[,host:port]/service[/db]")
        query = dict(parse_qsl(parts.query))
        own = {k: query.pop(k) for k in ("sentinel_username", "sentinel_password") if k in query}
        # The data nodes' options, as redis-py reads a plain URL of the same kind.
        data_scheme = "rediss" if scheme.startswith("rediss") else "redis"
        auth = f"{credentials}@" if credentials else ""
        db = f"/{path[1]}" if len(path) > 1 else ""
        plain = f"{data_scheme}://{auth}sentinel-primary{db}?{urlencode(query)}"
        options = parse_url(plain)  # type: ignore[no-untyped-call]
        for key in ("host", "port", "connection_class"):  # Sentinel says where; ssl picks it
            options.pop(key, None)
        if data_scheme == "rediss":
            options["ssl"] = True
        tls = {k: v for k, v in options.items() if k.startswith("ssl")}
        sentinel_options = {k.removeprefix("sentinel_"): v for k, v in own.items()} | tls
        return cls(url, scheme, sentinels, path[0], options, sentinel_options)

    @property
    def sentinel(self) -> bool:
        return bool(self.sentinels)

    @property
    def shown(self) -> str:
        """The address without credentials, for logs and ``/info``."""
        if self.sentinel:
            hosts = ",".join(f"{h}:{p}" for h, p in self.sentinels)
            return f"{self.scheme}://{hosts}/{self.service}"
        where = urlsplit(self.url)
        return f"{where.scheme}://{where.hostname}:{where.port or 6379}"


def _host_port(text: str) -> tuple[str, int]:
    host, _, port = text.rpartition(":") if ":" in text else (text, "", "")
    return host, int(port) if port else DEFAULT_SENTINEL_PORT
