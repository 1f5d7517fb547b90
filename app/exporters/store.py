"""Writing a model store: trace the split model, check the traces, write files and manifest."""

from __future__ import annotations

import contextlib
import warnings
from collections.abc import Collection
from pathlib import Path

import torch
from torch import nn

from app.exporters.aoti import derive_aoti, remove_aoti
from app.exporters.base import ExportError, SplitModel, features_dim, random_images, run
from app.exporters.measure import content_of, speeds_of
from app.exporters.openvino_ir import Source, derive_openvino, remove_derived
from app.exporters.precision import GOLDEN_FILE, PrecisionRequest, lower_precision
from app.exporters.program import export_programs
from app.manifest import (
    MANIFEST_NAME,
    FileEntry,
    Imported,
    InputSpec,
    Manifest,
    sha256_file,
)
from app.workers.models import quiet_torchscript

REPO_ROOT = Path(__file__).resolve().parent.parent.parent
IMAGENET_CLASSES = REPO_ROOT / "imagenet_classes.txt"
EMBEDDING_FILE, CLASSIFIER_FILE, CLASSES_FILE = "embedding.pt", "classifier.pt", "classes.txt"
DERIVED_RUNTIMES = ("openvino",)  # models derived by default, besides TorchScript
# AOTInductor compiles for minutes and needs a C++ compiler: asked for (--runtimes).
KNOWN_RUNTIMES = ("openvino", "aoti")


def read_labels(path: Path) -> list[str]:
    """Class names from a text file, one per line, in the classifier's output order."""
    try:
        lines = path.read_text(encoding="utf-8").splitlines()
    except (OSError, UnicodeDecodeError) as exc:
        raise ExportError(f"cannot read class names from {path}: {exc}") from None
    while lines and not lines[-1].strip():
        lines.pop()
    labels = [line.strip() for line in lines]
    if not labels:
        raise ExportError(f"{path} lists no class names")
    if "" in labels:
        raise ExportError(f"{path}: line {labels.index('') + 1} is empty; one name per line")
    return labels


def labels_for(num_classes: int, classes: list[str] | None, what: str) -> list[str]:
    """``classes`` if they fit a ``num_classes``-way head; without them, ImageNet's 1000."""
    if classes is not None:
        if len(classes) != num_classes:
            raise ExportError(
                f"{what}'s classifier has {num_classes} outputs, {len(classes)} class names given"
            )
        return classes
    imagenet = IMAGENET_CLASSES.read_text(encoding="utf-8").splitlines()
    if num_classes != len(imagenet):
        raise ExportError(
            f"{what}'s classifier has {num_classes} outputs and no --classes was given (the "
            f"default labels are ImageNet's {len(imagenet)}): pass --classes FILE with "
            f"{num_classes} names, one per line, or --no-classifier"
        )
    return imagenet


def _eval(module: nn.Module) -> None:
    with contextlib.suppress(NotImplementedError):  # torch.export's: captured in one mode
        module.eval()


def _trace(
    module: nn.Module, example: torch.Tensor, role: str
) -> tuple[torch.jit.ScriptModule, torch.Tensor]:
    """``module`` as TorchScript, checked against itself, and its output on ``example``."""
    if isinstance(module, torch.jit.ScriptModule):  # already compiled (scripted by the caller)
        return module, run(module, example, f"the {role} model")
    try:
        with warnings.catch_warnings(), quiet_torchscript():
            # Shape arithmetic (e.g. TF "same" padding) is fixed at the exported input size.
            warnings.filterwarnings("ignore", category=torch.jit.TracerWarning)  # type: ignore[attr-defined]
            traced: torch.jit.ScriptModule = torch.jit.trace(module, example)  # type: ignore[no-untyped-call]
    except Exception as exc:
        raise ExportError(f"cannot trace the {role} model: {type(exc).__name__}: {exc}") from None
    # The server runs batches of every size: a trace that fixed the batch size fails here.
    on_example = run(module, example, f"the {role} model")
    bigger = torch.rand(example.shape[0] + 1, *example.shape[1:])
    for x, expected in ((example, on_example), (bigger, run(module, bigger, f"the {role} model"))):
        with torch.no_grad():
            try:
                got = traced(x)
            except Exception as exc:
                raise ExportError(
                    f"the traced {role} model fails on a batch of {x.shape[0]} (traced on "
                    f"{example.shape[0]}): {type(exc).__name__}"
                ) from None
        if got.shape != expected.shape or not torch.allclose(expected, got, atol=1e-4, rtol=1e-4):
            raise ExportError(f"traced {type(module).__name__} does not reproduce the eager model")
    return traced, on_example


def _save(module: torch.jit.ScriptModule, path: Path) -> FileEntry:
    with quiet_torchscript():
        torch.jit.save(module, str(path))
    return FileEntry(path=path.name, sha256=sha256_file(path))


def export_split(
    split: SplitModel,
    *,
    arch: str,
    weights: str,
    out: Path,
    classes: list[str] | None = None,
    runtimes: Collection[str] = DERIVED_RUNTIMES,
    precision: PrecisionRequest | None = None,
    imported: Imported | None = None,
) -> Manifest:
    """Trace the embedding model (and the classifier, if any), write them with ``classes``
    into ``out`` with their ``torch.export`` programs, derive the other ``runtimes``' models
    from the traces (each only if it agrees with them), and write the manifest last (so a
    half-written store is never taken for a valid one). An embedding-only split takes no
    ``classes``. With a ``precision`` below fp32, the fp32 store is then made that
    precision (``app.exporters.precision``; a refusal leaves it fp32)."""
    if split.classifier is None and classes:
        raise ExportError(f"{len(classes)} class names for a model without a classifier")
    if split.classifier is not None and (classes is None or len(classes) != split.num_classes):
        raise ExportError(f"{len(classes or [])} class names for {split.num_classes} classes")
    precision = precision or PrecisionRequest()
    if precision.precision == "int8" and "openvino" not in runtimes:
        raise ExportError(
            "--precision int8 quantizes the OpenVINO models: keep --runtimes openvino"
        )
    calibration_images = precision.read_images(split.input)  # before anything is written
    out.mkdir(parents=True, exist_ok=True)
    (out / MANIFEST_NAME).unlink(missing_ok=True)
    (out / GOLDEN_FILE).unlink(missing_ok=True)
    images = random_images(split.input)
    embedding, features = _trace(split.embedding, images, "embedding")
    if features.shape != (len(images), split.embedding_dim):
        raise ExportError(f"embedding output shape {tuple(features.shape)} is not (N, dim)")
    files = {"embedding": _save(embedding, out / EMBEDDING_FILE)}
    traced = {"embedding": (embedding, images, features)}
    eager: dict[str, tuple[nn.Module, torch.Tensor, torch.Tensor]] = {
        "embedding": (split.embedding, images, features)
    }
    if split.classifier is not None and classes is not None:
        classifier, logits = _trace(split.classifier, features, "classifier")
        files["classifier"] = _save(classifier, out / CLASSIFIER_FILE)
        traced["classifier"] = (classifier, features, logits)
        eager["classifier"] = (split.classifier, features, logits)
        (out / CLASSES_FILE).write_text("\n".join(classes) + "\n", encoding="utf-8")
        files["classes"] = FileEntry(path=CLASSES_FILE, sha256=sha256_file(out / CLASSES_FILE))
    else:  # files of an earlier export that the manifest would no longer vouch for
        (out / CLASSIFIER_FILE).unlink(missing_ok=True)
        (out / CLASSES_FILE).unlink(missing_ok=True)
    exported = export_programs(out, eager)
    program, programs = exported if exported is not None else (None, {})
    derived = {}
    if "openvino" in runtimes:
        # From the programs where the export has them (the runtime-neutral record), else
        # from the traces; either way checked against the TorchScript models.
        sources: dict[str, tuple[Source, torch.Tensor, torch.Tensor]] = {
            role: (programs.get(role, module), example, expected)
            for role, (module, example, expected) in traced.items()
        }
        artifact = derive_openvino(out, sources)
        if artifact is not None:
            derived["openvino"] = artifact
    else:  # an earlier export's IR, which the manifest would no longer vouch for
        remove_derived(out)
    if "aoti" in runtimes:
        compiled = derive_aoti(out, {role: (programs[role], *eager[role][1:]) for role in programs})
        if compiled is not None:
            derived["aoti"] = compiled
    else:
        remove_aoti(out)
    manifest = Manifest(
        arch=arch,
        weights=weights,
        input=split.input,
        embedding_dim=split.embedding_dim,
        num_classes=split.num_classes if split.classifier is not None else 0,
        files=files,
        runtimes=derived,
        program=program,
        embedding_served=split.embedding_served,
        imported=imported,
    )
    manifest = manifest.model_copy(
        update={"content": content_of(out, manifest), "speeds": speeds_of(out, manifest)}
    )
    _write_manifest(out, manifest)
    if precision.precision != "fp32":
        manifest = lower_precision(out, manifest, precision, calibration_images)
        _write_manifest(out, manifest)
    return manifest


def _write_manifest(out: Path, manifest: Manifest) -> None:
    tmp = out / (MANIFEST_NAME + ".tmp")
    tmp.write_text(manifest.model_dump_json(indent=2) + "\n", encoding="utf-8")
    tmp.replace(out / MANIFEST_NAME)


def load_torchscript(path: Path, what: str = "", hint: str = "") -> torch.jit.ScriptModule:
    """The TorchScript module in ``path``, on the CPU; ``ExportError`` when there is no such
    file or it holds none (``what`` names it, default its path; ``hint`` ends the message)."""
    if not path.is_file():
        raise ExportError(f"TorchScript file {path} does not exist")
    try:
        with quiet_torchscript():
            module: torch.jit.ScriptModule = torch.jit.load(str(path), map_location="cpu")  # type: ignore[no-untyped-call]
    except Exception as exc:
        kind = type(exc).__name__
        raise ExportError(f"{what or path} is not a TorchScript model: {kind}{hint}") from None
    return module


def export_module(
    embedding: nn.Module,
    out: Path,
    *,
    input: InputSpec,
    classifier: nn.Module | None = None,
    classes: list[str] | None = None,
    arch: str,
    weights: str = "custom",
    runtimes: Collection[str] = DERIVED_RUNTIMES,
    precision: PrecisionRequest | None = None,
    embedding_served: bool = True,
    imported: Imported | None = None,
) -> Manifest:
    """Export any model that timm and torchvision do not build: ``embedding`` maps normalised
    images [N, 3, S, S] (S = ``input.crop_size``) to features [N, D]; the optional
    ``classifier`` maps those to logits [N, K], named by ``classes`` (ImageNet's by default
    when K is 1000). Modules are traced as ``export_split`` does; TorchScript modules are
    saved as they are. For example, a ``torch.export`` program (its batch size dynamic)::

        program = torch.export.export(
            backbone.eval(),
            (torch.rand(2, 3, 224, 224),),
            dynamic_shapes=({0: torch.export.Dim.DYNAMIC},),
        )
        export_module(
            program.module(),
            Path("model_store"),
            input=InputSpec(crop_size=224, resize_size=256, interpolation="bicubic",
                            mean=(0.5, 0.5, 0.5), std=(0.5, 0.5, 0.5)),
            arch="my-model",
        )
    """
    _eval(embedding)
    images = random_images(input)
    features = run(embedding, images, "the embedding model")
    dim = features_dim(features, images, "the embedding model")
    num_classes = 0
    if classifier is not None:
        _eval(classifier)
        logits = run(classifier, features, "the classifier")
        if logits.ndim != 2:
            raise ExportError(f"the classifier gives {tuple(logits.shape)}, not [N, K] logits")
        num_classes = int(logits.shape[1])
        classes = labels_for(num_classes, classes, arch)
    elif classes:
        raise ExportError("class names need a classifier")
    split = SplitModel(
        embedding=embedding,
        classifier=classifier,
        input=input,
        embedding_dim=dim,
        num_classes=num_classes,
        embedding_served=embedding_served,
    )
    return export_split(
        split,
        arch=arch,
        weights=weights,
        out=out,
        classes=classes,
        runtimes=runtimes,
        precision=precision,
        imported=imported,
    )
