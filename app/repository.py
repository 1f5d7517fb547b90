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
from collections.abc import Callable, Collection, Mapping
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import TYPE_CHECKING

from app.errors import InvalidRequest, ModelNotFound, ModelStoreError
from app.lifecycle import UNKNOWN, AdminPin, ModelSpec, chosen_version
from app.manifest import MANIFEST_NAME, Manifest, read_classes, read_manifest
from app.settings_values import MODEL_NAME_PATTERN, VERSION_PATTERN

if TYPE_CHECKING:
    from app.plan import RepositoryPlan

_NAME = re.compile(MODEL_NAME_PATTERN)
_VERSION = re.compile(VERSION_PATTERN)
STAGING_PREFIX = ".incoming-"


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
    lone store (``MODEL_STORE``). ``pins``: versions to serve instead of the newest;
    ``dtypes``: MB_DTYPE by model, over the one every ``read`` is given.

    >>> # repo = Repository(Path("models"))
    >>> # repo.names(), repo.versions("tagger"), repo.chosen("tagger")   # newest unless pinned
    >>> # repo.read("tagger", 2, "auto").spec   # the ModelSpec the workers load
    """

    root: Path
    single: str | None = None
    pins: dict[str, int] = field(default_factory=dict)
    dtypes: dict[str, str] = field(default_factory=dict)

    @classmethod
    def of_store(cls, store: Path, pins: dict[str, int] | None = None) -> Repository:
        """A lone store as a repository of one model (``ModelStoreError`` if it holds none)."""
        return cls(store, name_of_export(read_manifest(store, verify=False).arch), pins or {})

    @classmethod
    def of_plan(cls, plan: RepositoryPlan) -> Repository:
        """The repository a plan names: a repository, or a lone store as one."""
        if plan.single:
            return replace(cls.of_store(plan.root, plan.pins), dtypes=plan.dtypes)
        return cls(plan.root, pins=plan.pins, dtypes=plan.dtypes)

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

    def chosen(self, name: str, admin: AdminPin | None = None) -> int | None:
        """The version ``name`` should serve (``app.lifecycle.chosen_version``): ``admin``
        (what the admin route loaded), else its pin (``MB_MODEL_VERSIONS``), else its
        newest; None if the admin route unloaded it. ``ModelNotFound`` if it has none, or
        not the one asked for."""
        return chosen_version(name, self.versions(name), self.pins.get(name), admin)

    def targets(
        self, pins: Mapping[str, AdminPin], on_error: Callable[[str], None]
    ) -> dict[str, int | None]:
        """Each model's target (``chosen``, with the admin route's ``pins``): a number, None
        if the admin route unloaded it, or ``app.lifecycle.UNKNOWN`` where it cannot be read
        (what serves it stays; ``on_error`` hears why)."""
        targets: dict[str, int | None] = {}
        for name in self.names():
            try:
                targets[name] = self.chosen(name, pins.get(name))
            except ModelNotFound as exc:
                on_error(f"reload: {exc.message}")
                targets[name] = UNKNOWN
        return targets

    def read(
        self,
        name: str,
        version: int,
        dtype: str,
        *,
        verify: bool = True,
        roles: Collection[str] | None = None,
    ) -> VersionOnDisk:
        """``name``'s ``version`` as the server loads it: what to hand the workers (its
        served id under MB_DTYPE ``dtype``, or the model's own in ``dtypes``), its manifest
        and its class names. With ``verify``, every file's sha256 is checked (or those of
        ``roles`` only: a broker front end needs its class names, not its weights).
        ``ModelNotFound``, ``ModelStoreError``."""
        store = self.path(name, version)
        manifest = read_manifest(store, verify=verify, roles=roles)
        classes = read_classes(store, manifest)
        dtype = self.dtypes.get(name, dtype)
        served_id = manifest.served_id(dtype)
        spec = ModelSpec(name, version, str(store), served_id, manifest.input.image_shape, dtype)
        return VersionOnDisk(spec, manifest, classes)

    def spec(self, name: str, version: int, dtype: str, *, verify: bool) -> ModelSpec:
        """What a worker loads of ``name``'s ``version`` (``read``'s spec), its errors
        without this machine's paths (``scrub``: they reach answers and the index)."""
        try:
            return self.read(name, version, dtype, verify=verify).spec
        except ModelStoreError as exc:
            raise ModelStoreError(scrub(self, str(exc))) from None

    def read_chosen(
        self,
        dtype: str,
        *,
        default: str | None = None,
        verify: bool = True,
        roles: Collection[str] | None = None,
    ) -> list[VersionOnDisk]:
        """The chosen version of every model (its pin, else its newest), as a process
        serves them at start; ``default``: ``MB_DEFAULT_MODEL``, which must be one of them.
        ``ModelStoreError`` for an empty repository or an unknown default."""
        names = self.names()
        if not names:
            raise ModelStoreError(
                f"no model in {self.root}: export one with `python -m app.export` (or `make "
                "model`); a repository holds DIR/<name>/<version>/ stores"
            )
        if default is not None and default not in names:
            raise ModelStoreError(
                f"MB_DEFAULT_MODEL={default}, but the repository holds {', '.join(names)}"
            )
        chosen = [(name, self.chosen(name)) for name in names]
        return [
            self.read(name, number, dtype, verify=verify, roles=roles)
            for name, number in chosen
            if number is not None
        ]

    def claimed_id(self, name: str, version: int, dtype: str) -> str:
        """The served id a version's manifest claims, unverified ("" if it has none): what
        a version that failed its checks is shown as."""
        try:
            manifest = read_manifest(self.path(name, version), verify=False)
            return manifest.served_id(self.dtypes.get(name, dtype))
        except (ModelStoreError, ModelNotFound):
            return ""


@dataclass(frozen=True)
class VersionOnDisk:
    """A version read from the repository: what to load, and what a Predictor needs."""

    spec: ModelSpec
    manifest: Manifest
    classes: list[str]


def scrub(repository: Repository, message: str) -> str:
    """``message`` without the paths of this machine's repository (it goes into answers,
    the index and ``/info``, which need no key): ``<repository>`` instead.

    >>> scrub(Repository(Path("/srv/models")), "file /srv/models/t/3/x.pt is bad")
    'file <repository>/t/3/x.pt is bad'
    """
    root = repository.root
    for where in sorted({str(root.resolve()), str(root)}, key=len, reverse=True):
        message = message.replace(where, "<repository>")
    return message


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
