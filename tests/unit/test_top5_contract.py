"""The precision rule for an imported TorchServe archive (``Manifest.top5_contract``): below
fp32 it serves only where every image it is checked on keeps fp32's top 5, in order, at the
export's gate and at a worker's self-test alike; other exports keep their gates."""

from __future__ import annotations

import numpy as np
import torch

from app.exporters.precision import GATES, gate_for
from app.manifest import Agreement, FileEntry, Imported, InputSpec, Manifest
from app.workers.agreement import _compare
from app.workers.runtimes import SelfTest

DIGEST = "0" * 64


def manifest(imported: bool) -> Manifest:
    origin = Imported(
        archive="m.mar",
        model_name="m",
        model_version="1.0",
        handler="image_classifier",
        preprocessing="stock image_classifier",
    )
    return Manifest(
        arch="m",
        weights="random",
        input=InputSpec(crop_size=8, resize_size=8, mean=(0, 0, 0), std=(1, 1, 1)),
        embedding_dim=4,
        num_classes=10,
        files={
            role: FileEntry(path=role, sha256=DIGEST)
            for role in ("embedding", "classifier", "classes")
        },
        imported=origin if imported else None,
    )


def agreement(top5_same: float | None) -> Agreement:
    """Top 1 and embeddings as fp32's; the top 5 in order on ``top5_same`` of 4 images."""
    return Agreement(
        images=4, top1=1.0, top5=1.0, top5_same=top5_same, cosine_mean=0.999, cosine_min=0.998
    )


def test_the_share_of_images_keeping_the_top5_in_order_is_measured() -> None:
    features = torch.ones(2, 4)
    reference = torch.tensor([[9.0, 8, 7, 6, 5, 0, 0], [9, 8, 7, 6, 5, 0, 0]])
    swapped = torch.tensor([[9.0, 8, 7, 6, 5, 0, 0], [9, 8, 7, 5, 6, 0, 0]])  # 4th and 5th
    measured = _compare((features, reference), (features, swapped))
    assert (measured.top1, measured.top5, measured.top5_same) == (1.0, 1.0, 0.5)


def test_only_an_imported_archive_is_held_to_its_top5() -> None:
    assert manifest(imported=True).top5_contract
    assert not manifest(imported=False).top5_contract
    imported, own = gate_for(manifest(True), "bf16"), gate_for(manifest(False), "bf16")
    assert own == GATES["bf16"] and imported.top5_same == 1.0
    assert own.failures(agreement(0.75)) == []
    assert imported.failures(agreement(0.75)) == ["top 5 kept in order on 0.75 < 1.0"]
    assert imported.failures(agreement(1.0)) == []


def test_a_worker_refuses_bf16_for_an_archive_whose_top5_changes_and_says_why() -> None:
    images = np.zeros((4, 8, 8, 3), dtype=np.uint8)
    strict = SelfTest(images, torch.bfloat16, keep_top5=True)
    reason = strict.failure(agreement(0.75))
    assert reason is not None
    assert reason.startswith("top 5 not fp32's, in order, on 1 of 4 synthetic self-test images")
    assert "imported TorchServe archive" in reason
    assert strict.failure(agreement(1.0)) is None
    assert SelfTest(images, torch.bfloat16).failure(agreement(0.75)) is None  # own exports
    fp32 = SelfTest(images, torch.float32).failure(agreement(0.75))  # fp32 has its own gate
    assert SelfTest(images, torch.float32, keep_top5=True).failure(agreement(0.75)) == fp32
    # An export that measured its golden images below fp32 is held to what it measured.
    measured = SelfTest(images, torch.bfloat16, agreement(0.75), True, "golden images")
    assert measured.failure(agreement(0.75)) is None
    assert "on 2 of 4 golden images" in str(measured.failure(agreement(0.5)))
