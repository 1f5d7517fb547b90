"""The model store's manifest: what was exported, how to feed it, and file checksums.

Written by ``app.export``, read by the server (no torch needed to read or verify it).
"""

from __future__ import annotations

import hashlib
import json
from collections.abc import Collection
from pathlib import Path
from typing import Literal

from pydantic import BaseModel, Field, ValidationError, model_validator

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
    # reduced_decode: a large JPEG decoded at 1/2..1/8 scale (libjpeg's DCT scaling, both
    # sides >= resize_size: faster, nearly the same pixels), or at full size. resize: "window"
    # resamples the crop's source window in one pass (fast); "pil-resize-then-crop" is, to the
    # pixel, torchvision's Resize then CenterCrop on a Pillow image (a TorchServe import's).
    reduced_decode: bool = True
    resize: Literal["window", "pil-resize-then-crop"] = "window"

    @model_validator(mode="after")
    def _stock_resize_decodes_at_full_size(self) -> InputSpec:
        if self.resize == "pil-resize-then-crop" and self.reduced_decode:
            raise ValueError("pil-resize-then-crop decodes at full size: reduced_decode false")
        return self

    @property
    def image_shape(self) -> tuple[int, int, int]:
        """One preprocessed image as uint8 pixels: (height, width, RGB)."""
        return (self.crop_size, self.crop_size, 3)


def _defaults_left_out(spec: InputSpec) -> set[str]:
    """InputSpec fields left out of an identity at their default: a store exported before
    they existed keeps its served id."""
    defaults = {"reduced_decode": True, "resize": "window"}
    return {name for name, value in defaults.items() if getattr(spec, name) == value}


class FileEntry(BaseModel):
    path: str
    sha256: str = Field(pattern=r"^[0-9a-f]{64}$")


RuntimeName = Literal["openvino", "aoti"]
# The int8 models' roles in a runtime's files: ``embedding+int8`` (and ``embedding+int8.bin``).
INT8_SUFFIX = "+int8"


class RuntimeArtifact(BaseModel):
    """A model derived at export for another runtime than TorchScript, and what it was built
    for: the runtime's files by role (``embedding.xml``, ``embedding.bin``, ...), the
    versions that built it, its precision, and how far its outputs were from the TorchScript
    models' on the export's check batch (``max_abs_diff``, over every output)."""

    files: dict[str, FileEntry]
    precision: Literal["fp32"] = "fp32"
    versions: dict[str, str]
    # The host it runs on, for native code (AOTInductor: machine, vector ISA, threads); a
    # worker refuses a package built for a host it is not. Empty: runs anywhere (IR).
    built_for: dict[str, str] = Field(default_factory=dict)
    max_abs_diff: float = Field(ge=0)
    source: Literal["program", "torchscript"] = "torchscript"  # what it was converted from


class ProgramArtifact(BaseModel):
    """The models as ``torch.export`` programs (``embedding.pt2``, ``classifier.pt2``; dynamic
    batch): the export's runtime-neutral record. ``versions``: the torch that wrote them;
    ``max_abs_diff``: how far from the TorchScript models on the check batch and on one
    image."""

    files: dict[Literal["embedding", "classifier"], FileEntry]
    versions: dict[str, str]
    max_abs_diff: float = Field(ge=0)


# The precisions an export can be made to serve in, and MB_DTYPE's name for each.
Precision = Literal["fp32", "bf16", "int8"]
DTYPES: dict[str, str] = {"fp32": "float32", "bf16": "bfloat16", "int8": "int8"}


class Agreement(BaseModel):
    """How a precision below fp32 agrees with fp32 on the same real images: the shares given
    the same top 1 and top 5 in order, the top-5 overlap (None without a classifier), cosine."""

    images: int = Field(gt=0)
    top1: float | None = Field(None, ge=0, le=1)
    top5: float | None = Field(None, ge=0, le=1)
    top5_same: float | None = Field(None, ge=0, le=1)
    cosine_mean: float
    cosine_min: float


class Gate(BaseModel):
    """The least agreement with fp32 (``Agreement``) an export accepts for a precision."""

    top1: float = Field(ge=0, le=1)
    cosine_mean: float = Field(ge=-1, le=1)
    top5_same: float | None = Field(None, ge=0, le=1)

    def failures(self, measured: Agreement) -> list[str]:
        """What ``measured`` falls short of (nothing: it passes)."""
        short = []
        if measured.top1 is not None and measured.top1 < self.top1:
            short.append(f"top-1 agreement {measured.top1:.3f} < {self.top1}")
        if self.top5_same is not None and (measured.top5_same or 0.0) < self.top5_same:
            short.append(f"top 5 kept in order on {measured.top5_same} < {self.top5_same}")
        if measured.cosine_mean < self.cosine_mean:
            short.append(f"mean embedding cosine {measured.cosine_mean:.4f} < {self.cosine_mean}")
        return short


class Calibration(BaseModel):
    """How the export's precision below fp32 was made and checked: on ``images`` of the
    user's photos (``calibration_images`` of them to quantize with, the rest held back),
    what ``runtime`` measured on the held-back ones against the gate, and the self-test
    images (``golden``: uint8 pixels, a .npy) with what they measured, which a worker
    reproduces on its own host before it serves in this precision."""

    precision: Literal["bf16", "int8"]
    runtime: str
    method: str
    calibration_images: int = Field(ge=0)
    held_back: Agreement
    gate: Gate
    passed: bool  # False: written anyway, with --accept-accuracy-loss
    golden: FileEntry
    golden_agreement: Agreement


class Content(BaseModel):
    """What computes the answers, by module: each TorchScript module's digest (weights,
    graph and captured constants: ``app.workers.content``), taken at export on the module as
    saved. The served id is built from these and the rest of what shapes an answer
    (``Manifest.identity``), so two exports of the same weights share it."""

    scheme: Literal[1] = 1
    modules: dict[Literal["embedding", "classifier"], str]


class Speeds(BaseModel):
    """How fast each runtime of the export ran on the export's host: images/s of full-task
    batches of ``batch_size`` (best of a few rounds), and that host's CPU. A worker serving
    with a slower runtime than one that failed its self-test says how much slower by these
    (a ratio travels between hosts better than a rate)."""

    images_per_s: dict[str, float]
    batch_size: int = Field(gt=0)
    cpu: str = ""


class Imported(BaseModel):
    """Where an imported model came from (``python -m app.export --from-mar``): the archive's
    file name, its model name, version and handler, and whether the preprocessing is the
    stock handler's or was given by hand (a custom handler is never run)."""

    kind: Literal["torchserve-mar"] = "torchserve-mar"
    archive: str
    model_name: str
    model_version: str
    handler: str
    preprocessing: Literal["stock image_classifier", "given by hand"]


class Manifest(BaseModel):
    """What ``manifest.json`` says. An embedding-only export has ``num_classes`` 0 and no
    ``classifier`` or ``classes`` file. ``runtimes`` lists the artifacts derived for other
    runtimes (none in a store exported before they existed: it serves with TorchScript).
    ``precision``: what the store serves in unless MB_DTYPE says otherwise (fp32 for a
    store from before precisions); below fp32, with what ``calibration`` measured."""

    format_version: Literal[1] = FORMAT_VERSION
    format: Literal["torchscript"] = "torchscript"
    arch: str
    weights: str = Field(description="where the weights came from; 'random' for test models")
    input: InputSpec
    embedding_dim: int = Field(gt=0)
    num_classes: int = Field(ge=0)
    files: dict[Literal["embedding", "classifier", "classes"], FileEntry]
    runtimes: dict[RuntimeName, RuntimeArtifact] = Field(default_factory=dict)
    program: ProgramArtifact | None = None  # absent from older stores and uncapturable models
    precision: Precision = "fp32"
    calibration: Calibration | None = None
    speeds: Speeds | None = None  # absent from stores exported before they were measured
    content: Content | None = None  # absent from older stores: their id is the manifest's
    # False: the embedding model gives the logits (a whole model imported unsplit, such as a
    # TorchServe archive's): it answers tags only, never those logits as an embedding.
    embedding_served: bool = True
    imported: Imported | None = None
    # sha256 of manifest.json as read (not part of it): the export's identity.
    digest: str = Field(default="", exclude=True)

    @model_validator(mode="after")
    def _classifier_and_classes_go_together(self) -> Manifest:
        has_head = "classifier" in self.files
        if "embedding" not in self.files:
            raise ValueError("the embedding model is missing from files")
        if has_head != ("classes" in self.files) or has_head != (self.num_classes > 0):
            raise ValueError("a classifier comes with its classes file and num_classes > 0")
        if not self.embedding_served and not has_head:
            raise ValueError("a model that serves no embedding must have a classifier")
        if self.calibration is not None and self.calibration.precision != self.precision:
            raise ValueError("the calibration is for another precision than the export's")
        if self.precision == "int8" and (self.calibration is None or not self.int8_files):
            raise ValueError("an int8 export comes with its calibration and int8 models")
        return self

    @property
    def has_classifier(self) -> bool:
        return "classifier" in self.files

    @property
    def top5_contract(self) -> bool:
        """Below fp32, keep fp32's top 5 in order on every image checked (TorchServe's)."""
        return self.imported is not None and self.has_classifier

    @property
    def int8_files(self) -> dict[str, FileEntry]:
        """The int8 models by role (OpenVINO IR; the embedding model: the classifier head
        stays fp32); empty unless the export was quantized."""
        openvino = self.runtimes.get("openvino")
        files = openvino.files if openvino is not None else {}
        return {
            role.removesuffix(INT8_SUFFIX): entry
            for role, entry in files.items()
            if role.endswith(INT8_SUFFIX)
        }

    def serving_dtype(self, setting: str) -> str:
        """MB_DTYPE resolved for this store before any measurement: ``auto`` is the precision
        it was exported for (a worker may then choose a faster one that passes its gate:
        ``app.workers.runtimes``; its answers' id says which)."""
        return DTYPES[self.precision] if setting == "auto" else setting

    def served_id(self, setting: str) -> str:
        """The id answers carry when this export is served under MB_DTYPE=``setting``."""
        return served_model_id(self.model_id, self.serving_dtype(setting))

    @property
    def identity(self) -> str:
        """The sha256 of what computes this export's answers: its modules' content digests,
        its preprocessing, its class names, its architecture and dimensions, and the int8
        models (graph and weights) of an int8 export; never a timestamp, a measurement, a
        path or a version of the tools that wrote it. Two exports of the same weights have
        the same identity. A store exported before ``content`` existed has the sha256 of its
        manifest."""
        if self.content is None:
            return self.digest
        fields = {
            "scheme": self.content.scheme,
            "arch": self.arch,
            "input": self.input.model_dump(mode="json", exclude=_defaults_left_out(self.input)),
            "embedding_dim": self.embedding_dim,
            "num_classes": self.num_classes,
            "classes": self.files["classes"].sha256 if "classes" in self.files else None,
            "modules": dict(sorted(self.content.modules.items())),
            "int8": self._int8_digests() or None,
        }
        canonical = json.dumps(fields, sort_keys=True, separators=(",", ":"))
        return hashlib.sha256(canonical.encode()).hexdigest()

    def _int8_digests(self) -> dict[str, str]:
        """The sha256 of every int8 model file (its graph and its weights), by role: an int8
        export computes with these, not with the fp32 modules it was made from."""
        openvino = self.runtimes.get("openvino")
        files = openvino.files if openvino is not None else {}
        return {role: e.sha256 for role, e in sorted(files.items()) if INT8_SUFFIX in role}

    @property
    def version(self) -> str:
        """The first 12 hex of ``identity``: the same for every export of the same weights
        and preprocessing, different for any other."""
        return self.identity[:12]

    @property
    def model_id(self) -> str:
        """``<arch>@<version>``: which export this is, in ``X-Model-Id`` and ``/info``."""
        return f"{self.arch}@{self.version}"


# A precision below fp32 is part of the id of what answers (``X-Model-Id``, /info, the
# broker's streams), so vectors of two precisions are never taken for one another.
PRECISION_TAGS = {"float32": "", "bfloat16": "+bf16", "float16": "+fp16", "int8": "+int8"}


def served_model_id(model_id: str, dtype: str) -> str:
    """The id answers carry when ``model_id``'s export is computed in ``dtype`` (MB_DTYPE).

    >>> served_model_id("efficientnet_lite0@89e9be0d4f64", "bfloat16")
    'efficientnet_lite0@89e9be0d4f64+bf16'
    >>> served_model_id("efficientnet_lite0@89e9be0d4f64", "float32")
    'efficientnet_lite0@89e9be0d4f64'
    """
    return model_id + PRECISION_TAGS[dtype]


def split_served_id(served_id: str) -> tuple[str, str]:
    """A served id's export (``<arch>@<version>``) and the dtype that computes it.

    >>> split_served_id("efficientnet_lite0@89e9be0d4f64+bf16")
    ('efficientnet_lite0@89e9be0d4f64', 'bfloat16')
    >>> split_served_id("efficientnet_lite0@89e9be0d4f64")
    ('efficientnet_lite0@89e9be0d4f64', 'float32')
    """
    for dtype, tag in PRECISION_TAGS.items():
        if tag and served_id.endswith(tag):
            return served_id[: -len(tag)], dtype
    return served_id, "float32"


def model_version(model_id: str) -> str:
    """The version part of a model id (``<arch>@<version>``), e.g. from a worker's heartbeat.

    >>> model_version("efficientnet_lite0@89e9be0d4f64")
    '89e9be0d4f64'
    >>> model_version("efficientnet_lite0@89e9be0d4f64+bf16")
    '89e9be0d4f64+bf16'
    """
    return model_id.rsplit("@", 1)[-1]


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
    raw = path.read_bytes()
    try:
        manifest = Manifest.model_validate_json(raw)
    except ValidationError as exc:
        raise ModelStoreError(f"{path} is not a valid manifest: {exc}") from None
    manifest.digest = hashlib.sha256(raw).hexdigest()
    if verify:
        checked: dict[str, FileEntry] = dict(manifest.files.items())
        for runtime, artifact in manifest.runtimes.items():
            checked |= {f"{runtime} {role}": entry for role, entry in artifact.files.items()}
        if manifest.program is not None:
            checked |= {f"program {role}": entry for role, entry in manifest.program.files.items()}
        if manifest.calibration is not None:
            checked["golden"] = manifest.calibration.golden
        for role, entry in checked.items():
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
    """The class names in the classifier's index order; none for an embedding-only export."""
    if not manifest.has_classifier:
        return []
    names = (store / manifest.files["classes"].path).read_text(encoding="utf-8").splitlines()
    if len(names) != manifest.num_classes:
        raise ModelStoreError(
            f"{len(names)} class names for a model with {manifest.num_classes} classes"
        )
    return names
