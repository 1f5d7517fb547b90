"""What a v2 ``infer`` means on this server, whichever protocol carried it (HTTP or gRPC):
the inputs it takes, the outputs it answers, and the metadata that lists them.

Inputs, one per request:

- ``image``, BYTES ``[N]`` or ``[N, 1]``: encoded images (JPEG, PNG, WebP...), decoded and
  preprocessed as ``/predict`` does;
- ``pixels``, FP32 ``[N, 3, H, W]``: images already preprocessed as the manifest says (RGB,
  NCHW, ``H`` and ``W`` the crop size, normalised with its mean and std). They join the
  batches of decoded images: the server holds pixels as 8-bit levels, so a value is rounded
  to the nearest level (at most half of 1/255 of the range; exact for a tensor made from an
  8-bit image), and a value that is no level at all (outside 0-255 once un-normalised) is
  refused, as it means another normalisation.

Outputs (all of them when none is asked): ``embedding`` FP32 ``[N, dim]``, and for a model
with a classifier ``top_k_probs`` FP32 ``[N, k]`` and ``top_k_indices`` INT64 ``[N, k]``,
``k`` from the request's ``parameters.k`` (5 by default, or every class of a smaller model).
The classification extension: ``class_count`` on either classifier output answers it as
BYTES ``[N, class_count]``, each ``"score:index:label"``, as Triton does.
"""

from __future__ import annotations

import time
from collections.abc import Awaitable, Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

import numpy as np
import numpy.typing as npt

from app.batching import Ticket, Trace
from app.cache import CacheUse
from app.errors import InvalidRequest, PayloadTooLarge
from app.manifest import InputSpec, Manifest
from app.services.predictor import Predictor, parse_k
from app.services.registry import ModelVersion
from app.v2.tensors import BYTES, Tensor

IMAGE = "image"
PIXELS = "pixels"
EMBEDDING = "embedding"
TOP_K_PROBS = "top_k_probs"
TOP_K_INDICES = "top_k_indices"
CLASSIFIER_OUTPUTS = (TOP_K_PROBS, TOP_K_INDICES)
# How far outside 0-255 an un-normalised value may fall and still be taken as a level (float
# rounding of a client's own normalisation), in levels.
LEVEL_SLACK = 0.5


@dataclass(frozen=True)
class Requested:
    """An output asked for; ``class_count`` > 0 asks it as classification strings."""

    name: str
    class_count: int = 0

    @classmethod
    def of(cls, name: str, parameters: dict[str, Any]) -> Requested:
        """An output as a request's ``outputs`` list it, with its ``parameters``: tritonclient
        sends the class count as ``classification``, the extension's text says ``class_count``."""
        count = parameters.get("classification", parameters.get("class_count", 0))
        if not isinstance(count, int) or isinstance(count, bool) or count < 0:
            raise InvalidRequest(f"output {name!r}: class_count must be a whole number")
        return cls(name, count)


@dataclass(frozen=True)
class InferCall:
    """A v2 infer as the protocols hand it over: its one input, the outputs asked (none:
    every output) and the request's ``parameters``."""

    inputs: Sequence[Tensor]
    outputs: Sequence[Requested] = ()
    parameters: dict[str, Any] = field(default_factory=dict)


def tensor_specs(manifest: Manifest) -> tuple[list[dict[str, Any]], list[dict[str, Any]]]:
    """The inputs and outputs a model takes and answers, as v2 metadata lists them."""
    crop = manifest.input.crop_size
    inputs = [
        {"name": IMAGE, "datatype": BYTES, "shape": [-1]},
        {"name": PIXELS, "datatype": "FP32", "shape": [-1, 3, crop, crop]},
    ]
    outputs = []
    if manifest.embedding_served:
        outputs.append(
            {"name": EMBEDDING, "datatype": "FP32", "shape": [-1, manifest.embedding_dim]}
        )
    if manifest.has_classifier:
        outputs += [
            {"name": TOP_K_PROBS, "datatype": "FP32", "shape": [-1, -1]},
            {"name": TOP_K_INDICES, "datatype": "INT64", "shape": [-1, -1]},
        ]
    return inputs, outputs


def metadata(version: ModelVersion) -> dict[str, Any]:
    """The v2 model metadata of a serving version."""
    assert version.manifest is not None, "a serving version has its manifest"
    inputs, outputs = tensor_specs(version.manifest)
    return {
        "name": version.name,
        "versions": [str(version.version)],
        "platform": "pytorch_torchscript",
        "inputs": inputs,
        "outputs": outputs,
    }


def images_of(
    call: InferCall, spec: InputSpec, max_images: int
) -> list[bytes] | list[npt.NDArray[np.uint8]]:
    """The request's images: encoded uploads, or pixels from a preprocessed tensor."""
    if len(call.inputs) != 1:
        raise InvalidRequest(
            f"give one input, {IMAGE!r} (BYTES) or {PIXELS!r} (FP32), not {len(call.inputs)}"
        )
    (given,) = call.inputs
    if given.name == IMAGE:
        if (
            given.datatype != BYTES
            or len(given.shape) not in (1, 2)
            or given.shape[1:]
            not in (
                (),
                (1,),
            )
        ):
            raise InvalidRequest(
                f"input {IMAGE!r} is BYTES shaped [N] or [N, 1], got {given.datatype} "
                f"{list(given.shape)}"
            )
        assert isinstance(given.value, list)
        images: list[bytes] | list[npt.NDArray[np.uint8]] = given.value
    elif given.name == PIXELS:
        images = list(to_pixels(given, spec))
    else:
        raise InvalidRequest(f"unknown input {given.name!r}: give {IMAGE!r} or {PIXELS!r}")
    if not images:
        raise InvalidRequest("the input holds no image")
    if len(images) > max_images:
        raise PayloadTooLarge(f"at most {max_images} images per request")
    return images


def to_pixels(tensor: Tensor, spec: InputSpec) -> npt.NDArray[np.uint8]:
    """``[N, 3, crop, crop]`` normalised FP32 -> ``[N, crop, crop, 3]`` uint8 levels."""
    crop = spec.crop_size
    if tensor.datatype != "FP32" or len(tensor.shape) != 4 or tensor.shape[1:] != (3, crop, crop):
        raise InvalidRequest(
            f"input {PIXELS!r} is FP32 shaped [N, 3, {crop}, {crop}] (RGB, normalised), got "
            f"{tensor.datatype} {list(tensor.shape)}"
        )
    assert isinstance(tensor.value, np.ndarray)
    mean = np.asarray(spec.mean, dtype=np.float32).reshape(1, 3, 1, 1)
    std = np.asarray(spec.std, dtype=np.float32).reshape(1, 3, 1, 1)
    levels = (tensor.value * std + mean) * np.float32(255.0)
    low, high = float(np.min(levels, initial=0.0)), float(np.max(levels, initial=0.0))
    if (
        not (np.isfinite(low) and np.isfinite(high))
        or low < -LEVEL_SLACK
        or high > 255 + LEVEL_SLACK
    ):
        raise InvalidRequest(
            f"input {PIXELS!r}: values from {low:.4g} to {high:.4g} once un-normalised (x * std "
            f"+ mean, times 255), outside 0-255: normalise with mean {list(spec.mean)} and std "
            f"{list(spec.std)} of pixels scaled to 0-1"
        )
    rounded = np.clip(np.rint(levels), 0, 255).astype(np.uint8)
    return np.ascontiguousarray(rounded.transpose(0, 2, 3, 1))


PRIORITY_PARAMETER = "parameters.priority"  # as Triton's clients send it (0: the default)


def shortened(deadline: float, parameters: dict[str, Any]) -> float:
    """``deadline`` (monotonic), sooner when the request's ``parameters.timeout`` asks (in
    microseconds, as Triton's clients send it): a client can shorten it, never extend it."""
    timeout = parameters.get("timeout")
    if timeout is None:
        return deadline
    if not isinstance(timeout, int) or isinstance(timeout, bool) or timeout <= 0:
        raise InvalidRequest("parameters.timeout must be a positive number of microseconds")
    return min(deadline, time.monotonic() + timeout / 1e6)


def _asked(call: InferCall, manifest: Manifest) -> tuple[list[Requested], int | None]:
    """The outputs to answer and ``k``: one value, from ``parameters.k`` or a class count."""
    known = [
        *((EMBEDDING,) if manifest.embedding_served else ()),
        *(CLASSIFIER_OUTPUTS if manifest.has_classifier else ()),
    ]
    asked = list(call.outputs) or [Requested(name) for name in known]
    counts: set[int] = set()
    for output in asked:
        if output.name not in known:
            raise InvalidRequest(f"unknown output {output.name!r}: this model answers {known}")
        if output.class_count:
            if output.name not in CLASSIFIER_OUTPUTS:
                raise InvalidRequest(
                    f"class_count applies to {' or '.join(CLASSIFIER_OUTPUTS)}, not {output.name!r}"
                )
            counts.add(parse_k(output.class_count, "class_count") or 0)
    given = parse_k(call.parameters.get("k"), "parameters.k")
    if given is not None:
        counts.add(given)
    if len(counts) > 1:
        raise InvalidRequest(f"k and class_count ask for different counts: {sorted(counts)}")
    return asked, (counts.pop() if counts else None)


async def infer(
    version: ModelVersion,
    call: InferCall,
    deadline: float,
    trace: Trace | None,
    *,
    max_images: int,
    wait: Callable[[Awaitable[Any]], Awaitable[Any]] | None = None,
    ticket: Ticket | None = None,
    cache: CacheUse | None = None,
) -> list[Tensor]:
    """Run ``call`` on a serving ``version``: each image once through the model, whichever
    outputs are asked. ``wait`` wraps the wait for the answer (HTTP: drop it when the client
    leaves). ``ticket``: whose quota the images are drawn from, and where they queue;
    ``cache``: how the response cache answers them."""
    predictor: Predictor | None = version.predictor
    assert predictor is not None and version.manifest is not None, "a serving version"
    manifest = version.manifest
    asked, k = _asked(call, manifest)
    images = images_of(call, manifest.input, max_images)
    names = {output.name for output in asked}
    top_k = bool(names & set(CLASSIFIER_OUTPUTS))
    work = predictor.infer(
        images,
        k,
        deadline,
        trace,
        embedding=EMBEDDING in names,
        top_k=top_k,
        ticket=ticket,
        cache=cache,
    )
    inferred = await (wait(work) if wait is not None else work)
    outputs: list[Tensor] = []
    for output in asked:
        if output.name == EMBEDDING:
            assert inferred.embeddings is not None
            outputs.append(Tensor.of(EMBEDDING, inferred.embeddings, "FP32"))
            continue
        assert inferred.top_k is not None
        if output.class_count:
            outputs.append(_classification(output.name, inferred.top_k, predictor.classes))
        elif output.name == TOP_K_PROBS:
            probs = np.stack([top.probs for top in inferred.top_k])
            outputs.append(Tensor.of(TOP_K_PROBS, probs, "FP32"))
        else:
            indices = np.stack([top.indices for top in inferred.top_k])
            outputs.append(Tensor.of(TOP_K_INDICES, indices, "INT64"))
    return outputs


def _classification(name: str, top: Sequence[Any], classes: Sequence[str]) -> Tensor:
    """The classification extension's answer: ``"score:index:label"`` per class, most
    probable first (the score as Triton prints it, 6 decimals)."""
    rows = [
        [
            f"{float(prob):f}:{int(index)}:{classes[int(index)]}".encode()
            for index, prob in zip(each.indices, each.probs, strict=True)
        ]
        for each in top
    ]
    width = len(rows[0]) if rows else 0
    return Tensor(name, BYTES, (len(rows), width), [cell for row in rows for cell in row])
