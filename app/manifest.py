"""The model store's manifest: what was exported, how to feed it, and file checksums.

Written by ``app.export``, read by the server (no torch needed to read or verify it).
"""

from __future__ import annotations

import hashlib
from collections.abc import Collection
from pathlib import Path
from typing import Literal

from pydantic import BaseModel, Field, ValidationError

from app.errors import ModelStoreError

MANIFEST_NAME = "manifest.json"
FORMAT_VERSION: Literal[1] = 1


class InputSpec(BaseModel):
    """Preprocessing: resize the shorter side to ``resize_size``, center-crop ``crop_size``,
    scale to [0, 1], then normalise with ``mean``/``std`` per RGB channel."""

    crop_size: int = Field(gt=0)
    resize_size: int = Field(gt=0)
    interpolation: Literal["bilinear", "bicubic"] = "bilinear"
    mean: tuple[float, float, float]
    std: tuple[float, float, float]


class FileEntry(BaseModel):
    path: str
    sha256: str = Field(pattern=r"^[0-9a-f]{64}$")


class Manifest(BaseModel):
    format_version: Literal[1] = FORMAT_VERSION
    format: Literal["torchscript"] = "torchscript"
    arch: str
    weights: str = Field(description="where the weights came from; 'random' for test models")
    input: InputSpec
    embedding_dim: int = Field(gt=0)
    num_classes: int = Field(gt=0)
    files: dict[Literal["embedding", "classifier", "classes"], FileEntry]


def sha256_file(path: Path) -> str:
    digest = hashlib.sha256()
    with path.open("rb") as handle:
        for chunk in iter(lambda: handle.read(1 << 20), b""):
            digest.update(chunk)
    return digest.hexdigest()


def read_manifest(
    store: Path, *, verify: bool = True, roles: Collection[str] | None = None
) -> Manifest:
    """Read ``store/manifest.json``; with ``verify``, check the sha256 of every file (or of
    the ``roles`` given: a broker front end needs only the class names, not the weights).

    Raises ``ModelStoreError`` with a message saying what to do.
    """
    path = store / MANIFEST_NAME
    if not path.is_file():
        raise ModelStoreError(
            f"no model in {store}: {MANIFEST_NAME} is missing. Export one with "
            "`python -m app.export` (or `make model`)."
        )
    try:
        manifest = Manifest.model_validate_json(path.read_bytes())
    except ValidationError as exc:
        raise ModelStoreError(f"{path} is not a valid manifest: {exc}") from None
    if verify:
        for role, entry in manifest.files.items():
            if roles is not None and role not in roles:
                continue
            file = store / entry.path
            if Path(entry.path).is_absolute() or ".." in Path(entry.path).parts:
                raise ModelStoreError(f"{role} file {entry.path!r} must stay inside {store}")
            if not file.is_file():
                raise ModelStoreError(f"{role} file {file} named in the manifest is missing")
            if sha256_file(file) != entry.sha256:
                raise ModelStoreError(
                    f"{role} file {file} does not match the sha256 in {path}; re-export the model"
                )
    return manifest


def read_classes(store: Path, manifest: Manifest) -> list[str]:
    names = (store / manifest.files["classes"].path).read_text(encoding="utf-8").splitlines()
    if len(names) != manifest.num_classes:
        raise ModelStoreError(
            f"{len(names)} class names for a model with {manifest.num_classes} classes"
        )
    return names
