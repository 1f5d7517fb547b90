"""The model repository on disk: which models and versions there are, read without torch.

    MODEL_REPOSITORY/
      tagger/1/manifest.json, ...    numbered versions, each a model store (python -m app.export)
      tagger/2/manifest.json, ...
      embedder/manifest.json, ...    a store placed directly in the name's folder: version 1

``MODEL_STORE=DIR`` is a repository of one model, named after its export (the manifest's
``arch``). A version counts once its ``manifest.json`` is there: ``python -m app.export
--repository DIR --name NAME`` writes into a hidden folder beside the versions and renames it
into place once the store is whole (``publish``), so nobody ever sees half a version.
Versions are immutable: a new export is a new number.

Names are ``[A-Za-z0-9._-]``, at most 64 characters, and never ``.`` or ``..``: a name from a
request is checked here before it touches a path, and every folder read resolves inside the
repository.
"""

from __future__ import annotations

import errno
import os
import re
import uuid
from dataclasses import dataclass, field
from enum import StrEnum
from pathlib import Path
from typing import NamedTuple

from app.errors import InvalidRequest, ModelNotFound, ModelStoreError
from app.manifest import MANIFEST_NAME, read_manifest
from app.settings import MODEL_NAME_PATTERN, VERSION_PATTERN

_NAME = re.compile(MODEL_NAME_PATTERN)
_VERSION = re.compile(VERSION_PATTERN)
STAGING_PREFIX = ".incoming-"


class ModelState(StrEnum):
    """Where one loaded version is in its life (``app.services.registry`` owns the moves):

    LOADING -> READY -> DRAINING -> GONE, and LOADING -> FAILED (the old version serves on).
    A READY version takes requests; a DRAINING one finishes those it has and takes no more.
    """

    LOADING = "loading"
    READY = "ready"
    DRAINING = "draining"
    FAILED = "failed"
    GONE = "gone"


@dataclass(frozen=True)
class ModelSpec:
    """One version to load, as the engine hands it to the workers (picklable): its name and
    number, its store's folder, the id its answers carry (``Manifest.served_id``), and the
    shape of one preprocessed image (height, width, 3) it takes."""

    name: str
    version: int
    store: str
    served_id: str
    image_shape: tuple[int, int, int] = (224, 224, 3)


class Route(NamedTuple):
    """The version a name serves: its number and served id (broker mode: as the workers'
    heartbeats decide it, ``app.broker.routing``)."""

    version: int
    served_id: str


def check_name(name: str) -> str:
    """``name`` if it is a valid model name; ``InvalidRequest`` (422) otherwise, before it
    reaches any path.

    >>> check_name("tagger-v2.onnx_free")
    'tagger-v2.onnx_free'
    >>> check_name("../etc")
    Traceback (most recent call last):
    app.errors.InvalidRequest: a model name is 1 to 64 of A-Z a-z 0-9 . _ -, got '../etc'
    """
    if not _valid(name):
        raise InvalidRequest(f"a model name is 1 to 64 of A-Z a-z 0-9 . _ -, got {name[:80]!r}")
    return name


def _valid(name: str) -> bool:
    return bool(_NAME.match(name)) and name not in (".", "..")


def name_of_export(arch: str) -> str:
    """The name a lone store (``MODEL_STORE``) serves under: its export's ``arch``, with any
    character a name may not hold replaced (``timm:convnext`` -> ``timm-convnext``)."""
    name = re.sub(r"[^A-Za-z0-9._-]", "-", arch)[:64]
    return name if name not in ("", ".", "..") else "model"


@dataclass(frozen=True)
class Repository:
    """The models under ``root``; ``single``: the name of the one model when ``root`` is a
    lone store (``MODEL_STORE``). ``pins``: versions to serve instead of the newest.

    >>> # repo = Repository(Path("models"))
    >>> # repo.names(), repo.versions("tagger"), repo.chosen("tagger")   # newest unless pinned
    """

    root: Path
    single: str | None = None
    pins: dict[str, int] = field(default_factory=dict)

    @classmethod
    def of_store(cls, store: Path, pins: dict[str, int] | None = None) -> Repository:
        """A lone store as a repository of one model (``ModelStoreError`` if it holds none)."""
        return cls(store, name_of_export(read_manifest(store, verify=False).arch), pins or {})

    def names(self) -> list[str]:
        """The models there are, sorted (a folder counts once it holds a version)."""
        if self.single is not None:
            return [self.single]
        if not self.root.is_dir():
            return []
        return sorted(
            entry.name
            for entry in self.root.iterdir()
            if _NAME.match(entry.name)
            and entry.name not in (".", "..")
            and self.versions(entry.name)
        )

    def _inside(self, path: Path) -> bool:
        return path.resolve().is_relative_to(self.root.resolve())

    def versions(self, name: str) -> dict[int, Path]:
        """Version number -> store folder, for ``name`` (empty if it has none)."""
        check_name(name)
        if self.single is not None:
            return {1: self.root} if name == self.single else {}
        folder = self.root / name
        if not folder.is_dir() or not self._inside(folder):
            return {}
        found: dict[int, Path] = {}
        for entry in folder.iterdir():
            complete = (entry / MANIFEST_NAME).is_file()
            if _VERSION.match(entry.name) and complete and self._inside(entry):
                found[int(entry.name)] = entry
        if 1 not in found and (folder / MANIFEST_NAME).is_file():
            found[1] = folder  # a store placed directly in the name's folder
        return dict(sorted(found.items()))

    def path(self, name: str, version: int) -> Path:
        """The store of ``name``'s ``version``; ``ModelNotFound`` if there is none."""
        versions = self.versions(name)
        if not versions:
            raise ModelNotFound(f"no model named {name!r} in the repository")
        if version not in versions:
            raise ModelNotFound(
                f"model {name!r} has no version {version} (it has {_listed(versions)})"
            )
        return versions[version]

    def chosen(self, name: str) -> int:
        """The version of ``name`` to serve: its pin (``MB_MODEL_VERSIONS``), else its
        newest. ``ModelNotFound`` if it has none, or not the pinned one."""
        versions = self.versions(name)
        if not versions:
            raise ModelNotFound(f"no model named {name!r} in the repository")
        pinned = self.pins.get(name)
        if pinned is None:
            return max(versions)
        if pinned not in versions:
            raise ModelNotFound(
                f"MB_MODEL_VERSIONS pins {name}={pinned}, but it has {_listed(versions)}"
            )
        return pinned


def _listed(versions: dict[int, Path]) -> str:
    return "versions " + ", ".join(map(str, versions)) if versions else "no version"


def staging_folder(model_folder: Path) -> Path:
    """A new, hidden folder beside ``model_folder``'s versions to write a store into."""
    model_folder.mkdir(parents=True, exist_ok=True)
    staging = model_folder / f"{STAGING_PREFIX}{uuid.uuid4().hex[:12]}"
    staging.mkdir()
    return staging


def publish(staging: Path, model_folder: Path) -> int:
    """Rename the whole store in ``staging`` into ``model_folder`` as its next version (one
    rename: the version appears complete or not at all); returns the number. Two exports at
    once get two numbers."""
    repository = Repository(model_folder.parent)
    taken = repository.versions(check_name(model_folder.name))
    number = max(taken, default=0) + 1
    for _ in range(1000):
        target = model_folder / str(number)
        try:
            if target.exists():
                raise FileExistsError(target)
            os.rename(staging, target)
            return number
        except OSError as exc:
            if not isinstance(exc, FileExistsError) and exc.errno not in (
                errno.EEXIST,
                errno.ENOTEMPTY,
            ):
                raise
            number += 1
    raise ModelStoreError(f"could not find a free version number in {model_folder}")
