"""Reading a TorchServe model archive (``.mar``, a zip written by ``torch-model-archiver``)
safely, for ``python -m app.export --from-mar``: what ``MAR-INF/MANIFEST.json`` says, the
class names (``index_to_name.json``, both forms TorchServe's handlers take), the batching
``model-config.yaml`` asks for (a suggestion, printed), and the serialized model, unpacked.

Nothing in an archive is trusted: a member outside the archive's folder (absolute, ``..``),
a symlink, or more bytes than ``max_bytes`` unpacked (counted while unpacking, not taken
from the zip's headers) refuses the archive. Nothing here loads a pickle or imports code:
the serialized file is loaded later, by ``torch.jit.load`` only.
"""

from __future__ import annotations

import json
import stat
import zipfile
from dataclasses import dataclass, field
from pathlib import Path, PurePosixPath
from typing import Any

from app.exporters.base import ExportError

MANIFEST = "MAR-INF/MANIFEST.json"
CLASSES = "index_to_name.json"
# TorchServe's stock handler for image classification, by its short and its module name.
STOCK_HANDLERS = frozenset({"image_classifier", "ts.torch_handler.image_classifier"})
# TorchServe's other stock handlers (ts/torch_handler/, 0.12), and what their models answer
# instead of an image's classes: nothing this server serves.
OTHER_STOCK_HANDLERS = {
    "image_segmenter": "a score per class and pixel (segmentation)",
    "object_detector": "boxes, labels and scores (detection)",
    "text_classifier": "the classes of a text",
}
MAX_BYTES = 4 << 30  # unpacked, by default: the largest models people serve are ~2 GB
CHUNK = 1 << 20
# What model-config.yaml may say about batching and workers, and this server's setting for it.
SUGGESTED_SETTINGS = {
    "batchSize": "MB_BATCH_SIZE",
    "maxBatchDelay": "MB_MAX_LATENCY",  # milliseconds there, seconds here
    "minWorkers": "MB_WORKER_NUM",
    "responseTimeout": "MB_REQUEST_TIMEOUT",  # seconds in both
}


@dataclass(frozen=True)
class Archive:
    """What an archive holds, unpacked into ``folder``."""

    path: Path
    folder: Path
    name: str
    version: str
    handler: str
    serialized: Path  # the model file, unpacked
    model_file: str | None  # an eager archive's Python model definition
    classes: list[str] | None  # from index_to_name.json, in index order
    config: dict[str, Any] = field(default_factory=dict)  # model-config.yaml, as read

    @property
    def stock_handler(self) -> bool:
        return self.handler in STOCK_HANDLERS

    @property
    def other_stock_answer(self) -> str | None:
        """What the archive's model answers, where its handler is one of TorchServe's other
        stock handlers (``OTHER_STOCK_HANDLERS``); None otherwise."""
        return OTHER_STOCK_HANDLERS.get(self.handler.removeprefix("ts.torch_handler."))

    def suggestions(self) -> list[str]:
        """This server's settings for what model-config.yaml asked of TorchServe."""
        lines = []
        for key, setting in SUGGESTED_SETTINGS.items():
            value = self.config.get(key)
            if not isinstance(value, int | float) or isinstance(value, bool):
                continue
            if key == "maxBatchDelay":
                lines.append(f"{setting}={value / 1000:g}  (maxBatchDelay: {value} ms)")
            else:
                lines.append(f"{setting}={value:g}  ({key}: {value})")
        return lines


def unpack(path: Path, into: Path, *, max_bytes: int = MAX_BYTES) -> Archive:
    """Check and unpack the archive at ``path`` into ``into`` (an empty folder) and read
    its manifest; ``ExportError`` says why an archive is refused."""
    if not zipfile.is_zipfile(path):
        raise ExportError(
            f"{path} is not a zip .mar archive (torch-model-archiver's default format; "
            "unpack a tgz or no-archive one and pass its folder's files to --from-torchscript)"
        )
    with zipfile.ZipFile(path) as archive:
        members = archive.infolist()
        _check_members(members, path)
        budget = max_bytes
        for member in members:
            budget = _extract(archive, member, into, budget, path, max_bytes)
    return _read(path, into)


def _check_members(members: list[zipfile.ZipInfo], path: Path) -> None:
    names = set()
    for member in members:
        name = member.filename
        pure = _member_path(member)
        if pure.is_absolute() or ".." in pure.parts or ":" in name or not pure.parts:
            raise ExportError(f"{path}: member {name!r} would land outside the archive's folder")
        if stat.S_ISLNK(member.external_attr >> 16):
            raise ExportError(f"{path}: member {name!r} is a symlink; archives may hold none")
        if str(pure) in names:
            raise ExportError(f"{path}: member {name!r} appears twice")
        names.add(str(pure))


def _member_path(member: zipfile.ZipInfo) -> PurePosixPath:
    """A member's name as a path, backslashes read as separators (as Windows writes them)."""
    return PurePosixPath(member.filename.replace("\\", "/"))


def _extract(
    archive: zipfile.ZipFile,
    member: zipfile.ZipInfo,
    into: Path,
    budget: int,
    path: Path,
    max_bytes: int,
) -> int:
    """Unpack one member, counting its bytes against ``budget`` as they come (a zip's
    headers may lie about sizes); what is left of the budget."""
    target = into.joinpath(*_member_path(member).parts)
    if not target.resolve().is_relative_to(into.resolve()):
        raise ExportError(f"{path}: member {member.filename!r} lands outside the archive")
    if member.is_dir():
        target.mkdir(parents=True, exist_ok=True)
        return budget
    if member.file_size > budget:
        raise ExportError(f"{path} unpacks to more than {max_bytes} bytes: refused")
    target.parent.mkdir(parents=True, exist_ok=True)
    with archive.open(member) as source, target.open("wb") as sink:
        while chunk := source.read(CHUNK):
            budget -= len(chunk)
            if budget < 0:
                raise ExportError(f"{path} unpacks to more than {max_bytes} bytes: refused")
            sink.write(chunk)
    return budget


def _read(path: Path, folder: Path) -> Archive:
    manifest_path = folder / MANIFEST
    if not manifest_path.is_file():
        raise ExportError(f"{path} has no {MANIFEST}: not a TorchServe model archive")
    manifest = _json(manifest_path, MANIFEST)
    model = manifest.get("model")
    if not isinstance(model, dict):
        raise ExportError(f"{path}: {MANIFEST} has no model section")
    runtime = manifest.get("runtime", "python")
    if runtime not in ("python", "python3"):
        raise ExportError(f"{path}: runtime {runtime!r}; only Python-handler archives import")
    serialized = model.get("serializedFile")
    if not isinstance(serialized, str) or not serialized:
        raise ExportError(f"{path}: {MANIFEST} names no serializedFile")
    serialized_path = folder / PurePosixPath(serialized).name
    if not serialized_path.is_file():
        raise ExportError(f"{path}: its serializedFile {serialized!r} is not in the archive")
    config_name = model.get("configFile")
    config = _config(folder / PurePosixPath(config_name).name) if config_name else {}
    classes_path = folder / CLASSES
    return Archive(
        path=path,
        folder=folder,
        name=str(model.get("modelName") or path.stem),
        version=str(model.get("modelVersion") or "1.0"),
        handler=str(model.get("handler") or ""),
        serialized=serialized_path,
        model_file=model.get("modelFile") or None,
        classes=read_classes(classes_path) if classes_path.is_file() else None,
        config=config,
    )


def _json(file: Path, what: str) -> Any:
    try:
        return json.loads(file.read_text(encoding="utf-8"))
    except (UnicodeDecodeError, json.JSONDecodeError) as exc:
        raise ExportError(f"{what} is not valid JSON: {exc}") from None


def read_classes(file: Path) -> list[str]:
    """``index_to_name.json`` in index order: ``{"0": "tench"}`` or ImageNet's
    ``{"0": ["n01440764", "tench"]}`` (the name is the last item), every index from 0."""
    mapping = _json(file, CLASSES)
    if not isinstance(mapping, dict) or not mapping:
        raise ExportError(f"{CLASSES} is not an object of index: name")
    names: dict[int, str] = {}
    for key, value in mapping.items():
        try:
            index = int(key)
        except ValueError:
            raise ExportError(f"{CLASSES}: key {key!r} is not a class index") from None
        if isinstance(value, list) and value and all(isinstance(v, str) for v in value):
            value = value[-1]
        if not isinstance(value, str):
            raise ExportError(f"{CLASSES}: class {key} is not a name or [id, name]")
        names[index] = value
    if sorted(names) != list(range(len(names))):
        raise ExportError(f"{CLASSES}: the indices are not 0..{len(names) - 1}")
    return [names[index] for index in range(len(names))]


def _config(file: Path) -> dict[str, Any]:
    import yaml

    if not file.is_file():
        raise ExportError(f"the archive's configFile {file.name!r} is not in it")
    try:
        config = yaml.safe_load(file.read_text(encoding="utf-8"))
    except (UnicodeDecodeError, yaml.YAMLError) as exc:
        raise ExportError(f"{file.name} is not valid YAML: {exc}") from None
    return config if isinstance(config, dict) else {}
