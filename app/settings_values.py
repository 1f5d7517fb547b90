"""How the settings' text values read: the GPU list (``CUDA_DEVICES``), version pins
(``MB_MODEL_VERSIONS``), and what a model name and a version number look like (also checked
wherever a name from a request meets a path)."""

from __future__ import annotations

import re

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
