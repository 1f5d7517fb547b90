"""A serving version's configuration in Triton's form (the model configuration extension):
what ``tritonclient``'s ``get_model_config`` and Triton's tools read. Built from what this
server does, not stored: the batch cap and wait are the Streamer's, the instance groups
the workers that run it. One dict for HTTP (as JSON) and gRPC (parsed into ``ModelConfig``).

>>> from app.batching import WorkerStatus
>>> workers = [WorkerStatus(0, "cpu", 2, None, True, True, 16, 0, 0)]
>>> instance_groups(workers)
[{'name': 'cpu', 'kind': 'KIND_CPU', 'count': 1, 'gpus': []}]
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Sequence
from typing import Any

from app.batching import WorkerStatus
from app.services.registry import ModelVersion
from app.v2.inference import tensor_specs

# The protocol's datatypes as Triton's configuration names them.
CONFIG_TYPES = {"BYTES": "TYPE_STRING", "FP32": "TYPE_FP32", "INT64": "TYPE_INT64"}


def instance_groups(workers: Sequence[WorkerStatus]) -> list[dict[str, Any]]:
    """The workers alive, grouped by device as Triton's instance groups: one CPU group, one
    group per GPU."""
    counts = Counter(worker.device for worker in workers if worker.alive)
    groups = []
    for device, count in sorted(counts.items()):
        gpu = device.startswith("cuda")
        groups.append(
            {
                "name": device,
                "kind": "KIND_GPU" if gpu else "KIND_CPU",
                "count": count,
                "gpus": [int(device.partition(":")[2] or 0)] if gpu else [],
            }
        )
    return groups


def model_config(
    version: ModelVersion, workers: Sequence[WorkerStatus], batch_limit: int, wait_s: float
) -> dict[str, Any]:
    """The configuration of ``version``, run by ``workers`` in batches that wait at most
    ``wait_s`` to fill, of at most ``batch_limit`` images (``MB_BATCH_SIZE``), or of the
    largest batch a ready worker chose (``MB_BATCH_SIZE=auto``)."""
    assert version.manifest is not None, "a serving version has its manifest"
    max_batch_size = max((w.batch_size for w in workers if w.ready), default=batch_limit)
    inputs, outputs = tensor_specs(version.manifest)

    def listed(spec: dict[str, Any], **extra: Any) -> dict[str, Any]:
        # Triton leaves the batch dimension out of a batching model's dims.
        return {
            "name": spec["name"],
            "data_type": CONFIG_TYPES[spec["datatype"]],
            "dims": spec["shape"][1:] or [1],
            **extra,
        }

    image, pixels = inputs
    return {
        "name": version.name,
        "platform": "pytorch_torchscript",
        "backend": "microbatch",
        "version_policy": {"specific": {"versions": [version.version]}},
        "max_batch_size": max_batch_size,
        "input": [
            listed(image, format="FORMAT_NONE"),
            listed(pixels, format="FORMAT_NCHW"),
        ],
        "output": [listed(spec) for spec in outputs],
        "dynamic_batching": {
            "preferred_batch_size": [max_batch_size],
            "max_queue_delay_microseconds": round(wait_s * 1e6),
            "preserve_ordering": False,
        },
        "instance_group": instance_groups(workers),
        "parameters": {
            "model_id": {"string_value": version.served_id},
        },
    }
