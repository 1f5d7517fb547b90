"""Loading exported models, behind one small interface (a model is a function of a tensor):
TorchScript, which every store holds, and the runtimes whose models the export derived
(``Manifest.runtimes``: OpenVINO IR). Which one serves is chosen in ``app.workers.runtimes``."""

from __future__ import annotations

import os
import threading
import warnings
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any, Literal

import torch

from app.errors import ContentMismatch, ModelStoreError
from app.manifest import InputSpec, Manifest, RuntimeName, read_manifest
from app.workers.content import module_digest

Model = Callable[[torch.Tensor], torch.Tensor]
Runtime = Literal["torchscript"] | RuntimeName

# TorchScript is deprecated upstream (torch >= 2.11) and warns on every save/load/trace; the
# format still works and is what we ship, so keep those warnings away from users.
TORCHSCRIPT_DEPRECATION = r"`torch\.jit\.\w+` is deprecated"


@contextmanager
def quiet_torchscript() -> Iterator[None]:
    """Hide TorchScript's deprecation warnings (and nothing else) inside the block."""
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message=TORCHSCRIPT_DEPRECATION, category=FutureWarning)
        yield


@dataclass
class LoadedModels:
    manifest: Manifest
    embedding: Model
    classifier: Model | None  # None: an embedding-only export
    dtype: torch.dtype = torch.float32  # what the models take as input
    runtime: Runtime = "torchscript"
    # The embedding model takes the uint8 [n, H, W, 3] pixels and normalises them itself.
    pixels_in: bool = False
    precision: str = "float32"  # what computes: float32, bfloat16, float16 or int8
    # The embedding and the classifier head in one call, (features, logits): OpenVINO's
    # graph of both (one inference per batch, no hand-over between two); None elsewhere.
    joint: Callable[[torch.Tensor], tuple[torch.Tensor, torch.Tensor]] | None = None
    # The batch sizes also compiled for that one size (OpenVINO's ``static_batches``).
    static_batches: tuple[int, ...] = ()


@dataclass(frozen=True)
class LoadOptions:
    """How a worker prepares the models it loads."""

    dtype: torch.dtype = torch.float32
    # Freeze and optimise for inference (constant folding, conv+batchnorm fusion, oneDNN
    # layouts on CPU): much faster small batches on a CPU (docs/performance.md).
    optimize: bool = True
    threads: int = 1  # for runtimes that fix their thread count when they compile (OpenVINO)
    # Set for an embedding model of a runtime in PIXELS_IN: the model takes uint8 NHWC pixels
    # and normalises them as this says, inside its compiled graph.
    normalise: InputSpec | None = None
    # The TorchScript module's content digest the manifest records (``Manifest.content``):
    # checked on the module as loaded, before anything rewrites it.
    digest: str | None = None
    # int8 on OpenVINO: the layers left in float compute in bf16 (else f32).
    bf16_floats: bool = False
    # OpenVINO: batch sizes also compiled for that one size, beside the model of any size
    # (the lone request's 1 and the largest batch: 9 to 17% faster than the dynamic model
    # at those sizes, measured in docs/performance.md).
    static_batches: tuple[int, ...] = ()
    # OpenVINO: the classifier head's file, compiled into the embedding's graph (one
    # inference gives both: ``LoadedModels.joint``).
    head: Path | None = None


def _load_torchscript(path: Path, device: torch.device, options: LoadOptions) -> Model:
    if options.dtype == torch.int8:
        raise ModelStoreError("TorchScript has no int8 models: int8 runs on OpenVINO")
    with quiet_torchscript():
        module = torch.jit.load(str(path), map_location=device)  # type: ignore[no-untyped-call]
        if options.digest is not None and module_digest(module) != options.digest:
            raise ContentMismatch(
                f"{path.name} does not compute what its manifest's id says (its weights or "
                "graph differ from the export's): re-export the model"
            )
        module.eval()
        if options.dtype != torch.float32:
            module = module.to(options.dtype)
        if options.optimize:
            module = torch.jit.optimize_for_inference(torch.jit.freeze(module))
    return module  # type: ignore[no-any-return]


class _OpenVinoModel:
    """An OpenVINO compiled model as a ``Model``: float32 NCHW in (or, normalising inside,
    uint8 NHWC pixels), float32 out. One infer request per compiled model, reused: a worker
    runs one batch at a time. A batch of a size compiled on its own (``static``) runs there.
    An embedding compiled with its head (``_with_head``) gives both from one call (``both``);
    called as a ``Model``, its features."""

    def __init__(self, compiled: Any, static: dict[int, Any] | None = None) -> None:
        self._request = compiled.create_infer_request()
        self._static = {size: c.create_infer_request() for size, c in (static or {}).items()}
        self.joint = len(compiled.outputs) == 2  # features, then logits

    def _infer(self, x: torch.Tensor) -> Any:
        x = x.detach() if x.dtype == torch.uint8 else x.detach().float()
        request = self._static.get(x.shape[0], self._request)
        request.infer({0: x.contiguous().numpy()})
        return request

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        return torch.from_numpy(self._infer(x).get_output_tensor(0).data.copy())

    def both(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        request = self._infer(x)
        features, logits = (request.get_output_tensor(i).data.copy() for i in range(2))
        return torch.from_numpy(features), torch.from_numpy(logits)


def _with_head(model: Any, head: Any) -> Any:
    """One graph of ``model`` (the embedding) and ``head`` (the classifier) fed by its
    output: outputs the features, then the logits. Measured on a lone image (2-core EPYC,
    bf16): one inference instead of two saves the head's own call, 0.08 ms, and the copies
    and wake-ups between them; the outputs are bit-identical."""
    import openvino as ov

    features = model.get_results()[0].input_value(0)
    for target in head.get_parameters()[0].output(0).get_target_inputs():
        target.replace_source_output(features)
    logits = head.get_results()[0].input_value(0)
    return ov.Model([features, logits], model.get_parameters(), "embedding_and_head")


def _with_normalisation(model: Any, spec: InputSpec) -> Any:
    """``model`` taking uint8 NHWC pixels: layout, float conversion and mean/std in its
    graph. Measured: no torch op runs in the worker, whose OpenMP threads would otherwise
    spin against OpenVINO's (docs/performance.md)."""
    import openvino as ov
    from openvino.preprocess import PrePostProcessor

    steps = PrePostProcessor(model)
    steps.input().tensor().set_element_type(ov.Type.u8).set_layout(ov.Layout("NHWC"))
    steps.input().model().set_layout(ov.Layout("NCHW"))
    steps.input().preprocess().convert_element_type(ov.Type.f32).mean(
        [255 * m for m in spec.mean]
    ).scale([255 * s for s in spec.std])
    return steps.build()


_core: Any = None
_core_lock = threading.Lock()


def openvino_core() -> Any:
    """This process's one OpenVINO ``Core``, made on first use and kept for its life.

    Not one per model: OpenVINO's CPU plugin, made once per ``Core``, gives the thread that
    makes it an alternate signal stack of its own (``sigaltstack``, sized for AMX state) and,
    destroyed, restores the one it replaced and unmaps its own. Plugins destroyed in another
    order than the reverse of their making (a model's embedding before its classifier, an
    older version after a newer one) left the thread's alternate stack on unmapped memory,
    and the next signal handled in Python (a broker worker's SIGHUP or SIGTERM: every Python
    handler runs on that stack) killed the worker with SIGSEGV before any handler ran. One
    ``Core``: one plugin, one ``sigaltstack``, never undone while the process serves."""
    global _core
    with _core_lock:
        if _core is None:
            import openvino as ov

            _core = ov.Core()
        return _core


def pins_threads(threads: int) -> bool:
    """Whether OpenVINO pins a model's ``threads`` to cores: only where they are one per
    core this process may use (one worker holds them all); worker processes that share the
    cores would be pinned to the same ones. Measured on a 2-core EPYC, bf16 at batch 1:
    pinned, a call after a second of idle took 3.5-4.2 ms against 4.0-4.9 unpinned, and
    back-to-back calls 2.5-2.8 ms against 2.5-3.8 (unpinned threads that land on one core)."""
    return threads >= len(os.sched_getaffinity(0))


def _load_openvino(path: Path, device: torch.device, options: LoadOptions) -> _OpenVinoModel:
    """The model at ``path`` (with ``options.head`` in its graph, when given) compiled for
    the CPU, at every batch size and at each of ``static_batches``."""
    if device.type != "cpu":
        raise ValueError(f"OpenVINO runs on the CPU here, not on {device}")
    # The precision is pinned, or OpenVINO may compute in bf16 on CPUs that have it (an int8
    # model's layers left unquantized run in f32).
    precision = "bf16" if options.dtype == torch.bfloat16 or options.bf16_floats else "f32"
    config = {
        "INFERENCE_NUM_THREADS": options.threads,
        "ENABLE_CPU_PINNING": pins_threads(options.threads),
        "PERFORMANCE_HINT": "LATENCY",
        "INFERENCE_PRECISION_HINT": precision,
    }
    core = openvino_core()
    model = core.read_model(str(path))
    if options.normalise is not None:
        model = _with_normalisation(model, options.normalise)
    if options.head is not None:
        model = _with_head(model, core.read_model(str(options.head)))
    static = {}
    for size in sorted(set(options.static_batches)):
        one_size = model.clone()
        shape = one_size.input(0).get_partial_shape()
        shape[0] = size
        one_size.reshape({0: shape})
        static[size] = core.compile_model(one_size, "CPU", config)
    return _OpenVinoModel(core.compile_model(model, "CPU", config), static)


class _AotiModel:
    """An AOTInductor package as a ``Model``: it was compiled for contiguous NCHW float32."""

    def __init__(self, package: Callable[[torch.Tensor], torch.Tensor]) -> None:
        self._package = package

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        return self._package(x.float().contiguous())


def _load_aoti(path: Path, device: torch.device, options: LoadOptions) -> Model:
    if device.type != "cpu":
        raise ValueError(f"the AOTInductor packages are compiled for the CPU, not {device}")
    from torch._inductor import aoti_load_package

    return _AotiModel(aoti_load_package(str(path)))


def host_mismatch(built_for: dict[str, str]) -> str | None:
    """Why native code built for ``built_for`` (``RuntimeArtifact.built_for``) must not run
    on this host; None if it may. Reads the CPU's features, compiling nothing."""
    import platform

    from torch._inductor.cpu_vec_isa import x86_isa_checker

    machine = built_for.get("machine")
    if machine is not None and machine != platform.machine():
        return f"built for {machine}, this host is {platform.machine()}"
    if platform.machine() in ("x86_64", "AMD64"):
        have = x86_isa_checker()
        missing = [name for name in built_for.get("isa", "").split() if name not in have]
        if missing:
            return (
                f"built for {' '.join(missing)}, which this CPU lacks (it has "
                f"{' '.join(have) or 'none of avx2, avx512'})"
            )
    threads = built_for.get("threads", "dynamic")
    if threads != "dynamic":
        return f"built for {threads} threads, not for the worker's own"
    return None


# The runtimes whose embedding models take the pixels and normalise them in their graph.
PIXELS_IN: frozenset[Runtime] = frozenset({"openvino"})
# The runtimes that compile the classifier head into the embedding's graph (``joint``).
JOINT: frozenset[Runtime] = frozenset({"openvino"})

# By runtime: how to load one model file of it.
LOADERS: dict[Runtime, Callable[[Path, torch.device, LoadOptions], Model]] = {
    "torchscript": _load_torchscript,
    "openvino": _load_openvino,
    "aoti": _load_aoti,
}


def load_models(
    store: Path,
    device: torch.device,
    options: LoadOptions | None = None,
    runtime: Runtime = "torchscript",
    manifest: Manifest | None = None,
) -> LoadedModels:
    """Verify ``store`` against its manifest, then load its models (the embedding model, and
    the classifier head unless the export has none) for ``runtime`` onto ``device``, in
    ``options.dtype`` (``torch.int8``: the export's int8 models). ``manifest``: the store's,
    already read and verified by the caller (who loads several runtimes and checks every
    file's sha256 once). ``ModelStoreError`` when the store holds no models for that
    runtime and precision."""
    options = options or LoadOptions()
    manifest = manifest or read_manifest(store, verify=True)
    files: dict[str, str] = {role: entry.path for role, entry in manifest.files.items()}
    dtype = options.dtype
    if runtime != "torchscript":
        artifact = manifest.runtimes.get(runtime)
        if artifact is None:
            raise ModelStoreError(
                f"{store} holds no {runtime} models: re-export it with `python -m app.export`"
            )
        mismatch = host_mismatch(artifact.built_for)
        if mismatch is not None:
            raise ModelStoreError(
                f"{store}'s {runtime} models were not built for this host ({mismatch}): "
                "re-export them here, or serve with another MB_RUNTIME"
            )
        if runtime == "aoti" and options.dtype != torch.float32:
            raise ModelStoreError("the AOTInductor packages compute in float32 only")
        files = {role: entry.path for role, entry in artifact.files.items()}
        if options.dtype == torch.int8:
            if not manifest.int8_files:
                raise ModelStoreError(
                    f"{store} holds no int8 models: export it with `python -m app.export "
                    "--precision int8 --calibrate DIR`"
                )
            files |= {role: entry.path for role, entry in manifest.int8_files.items()}
        dtype = torch.float32  # the derived models take float32 whatever they compute in
    load = LOADERS[runtime]
    pixels_in = runtime in PIXELS_IN
    digests = manifest.content.modules if manifest.content and runtime == "torchscript" else {}
    first = replace(options, digest=digests.get("embedding"))
    first = replace(first, normalise=manifest.input) if pixels_in else first
    head = replace(options, digest=digests.get("classifier"))
    if runtime in JOINT and manifest.has_classifier:
        first = replace(first, head=store / files["classifier"])
    embedding = load(store / files["embedding"], device, first)
    joint = embedding.both if isinstance(embedding, _OpenVinoModel) and embedding.joint else None
    return LoadedModels(
        manifest=manifest,
        embedding=embedding,
        classifier=(
            load(store / files["classifier"], device, head) if manifest.has_classifier else None
        ),
        dtype=dtype,
        runtime=runtime,
        pixels_in=pixels_in,
        precision=str(options.dtype).removeprefix("torch."),
        joint=joint,
        static_batches=options.static_batches if runtime == "openvino" else (),
    )
