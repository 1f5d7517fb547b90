"""A trained model's TorchServe archive answers as TorchServe's stock handler does: the
pretrained EfficientNet-Lite0, traced, archived by the real ``torch-model-archiver`` with the
stock ``image_classifier`` handler, imported with ``python -m app.export --from-mar`` and
served (``lite0_repository``). A trained model's probabilities are far from flat, so a
resampling or crop detail shows in its top 5 (random weights hide it).

- fp32: on every photo and odd upload, the top 5 of the stock transform run in-process on the
  archive's own model (what TorchServe computes), in order, every probability within 1e-4.
- Default settings (``MB_DTYPE=auto``, and with the hooks that make bf16 win wherever it
  passes its gate): the same top 1 on every photo; bf16 serves an archive only where its
  self-test kept fp32's top 5 in order on the golden photos, and ``/info`` says why when it
  does not."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import httpx
import pytest
import torch
from torch import nn

from app.exporters.from_mar import import_mar
from app.manifest import read_manifest
from app.workers.models import LoadOptions
from app.workers.runtimes import RuntimeChoice, choose_runtime
from tests.server import ServerProcess
from tests.torchserve import (
    LITE0,
    ODD,
    PHOTOS,
    TOLERANCE,
    archive,
    imagenet_classes,
    stock_handler,
)

pytestmark = pytest.mark.slow

UPLOADS = PHOTOS | ODD
Expected = dict[str, dict[str, float]]
CPU = torch.device("cpu")


class Confident(nn.Module):
    """A classifier whose logits stand far apart whatever the image (its head's bias): bf16
    keeps their order, so it keeps the top 5."""

    def __init__(self) -> None:
        super().__init__()
        self.body = nn.Sequential(nn.Conv2d(3, 8, 3, stride=4), nn.ReLU())
        self.fc = nn.Linear(8, 10)
        with torch.no_grad():
            self.fc.weight.mul_(0.01)
            self.fc.bias.copy_(torch.arange(10.0) * 4)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        logits: torch.Tensor = self.fc(self.body(x).mean(dim=(2, 3)))
        return logits


@pytest.fixture(scope="module")
def expected(lite0_repository: Path) -> Expected:
    """The stock handler's answer to every upload, on the archive's own TorchScript model."""
    scripted = lite0_repository.parent / LITE0 / f"{LITE0}.pt"
    model = torch.jit.load(str(scripted)).eval()  # type: ignore[no-untyped-call]
    classes = imagenet_classes()
    return {name: stock_handler(model, classes, upload) for name, upload in UPLOADS.items()}


def answers(base_url: str) -> dict[str, dict[str, float]]:
    """``POST /predictions/lite0`` for every upload (the image as the body, as ``curl -T``)."""
    got = {}
    with httpx.Client(base_url=base_url, timeout=60) as client:
        for name, upload in UPLOADS.items():
            answer = client.post(f"/predictions/{LITE0}", content=upload)
            assert answer.status_code == 200, (name, answer.text)
            got[name] = answer.json()
    return got


def served_model(base_url: str) -> dict[str, Any]:
    """What /info says of the worker's model: its precision, and the trials that chose it."""
    workers = httpx.get(f"{base_url}/info").json()["workers"]
    model: dict[str, Any] = workers[0]["models"][0]
    return model


def test_fp32_answers_are_the_stock_handlers_top5_in_order(
    lite0_repository: Path, expected: Expected
) -> None:
    with ServerProcess(MODEL_REPOSITORY=str(lite0_repository), MB_DTYPE="float32") as server:
        got = answers(server.base_url)
        tagged = httpx.post(
            f"{server.base_url}/predict/tag?k=5", files={"image": ("p", PHOTOS["rocket.jpg"])}
        ).json()
    for name, reference in expected.items():
        assert list(got[name]) == list(reference), name  # the same top 5, in order
        for label, probability in reference.items():
            assert got[name][label] == pytest.approx(probability, abs=TOLERANCE), (name, label)
    assert [tag["name"] for tag in tagged] == list(expected["rocket.jpg"])
    manifest = read_manifest(lite0_repository / LITE0 / "1", verify=False)
    assert manifest.input.resize == "pil-resize-then-crop"


@pytest.mark.parametrize(
    "hooks",
    [{}, {"MB_TEST_FASTEST_DTYPE": "bfloat16", "MB_TEST_CPU_BF16": "1"}],
    ids=["auto", "auto-bf16-fastest"],
)
def test_default_settings_give_the_stock_handlers_top1(
    lite0_repository: Path, expected: Expected, hooks: dict[str, str]
) -> None:
    env = {"MODEL_REPOSITORY": str(lite0_repository), "MB_DTYPE": "auto", "MB_STATE_DIR": ""}
    with ServerProcess(**env, **hooks) as server:
        got = answers(server.base_url)
        model = served_model(server.base_url)
    for name, reference in expected.items():
        assert next(iter(got[name])) == next(iter(reference)), name
    bf16 = [trial for trial in model["trials"] if trial["label"].endswith("+bf16")]
    if model["dtype"] == "bfloat16":
        assert model["served_id"].endswith("+bf16")
        assert any(trial["passed"] for trial in bf16)
    elif bf16:  # tried and refused: /info says why
        refused = {label: reason for label, reason in model["skipped"] if "+bf16" in label}
        assert refused and any("top 5" in reason for reason in refused.values()), refused
    if hooks:  # bf16 was tried; it serves only if it kept the top 5
        assert bf16


def test_auto_chooses_bf16_for_an_archive_only_where_it_keeps_the_top5(
    lite0_repository: Path, tmp_path: Path
) -> None:
    """The choice itself, in-process, bf16 timed a thousand times faster (what the
    MB_TEST_FASTEST_DTYPE hook does) on a CPU taken to have bf16 units: an archive whose top 5
    bf16 keeps on the golden photos serves in bf16; the trained one, whose top 5 bf16 changes
    there (on a CPU that computes bf16), serves fp32, and its trial says why."""

    def choose(store: Path) -> RuntimeChoice:
        return choose_runtime(
            store,
            CPU,
            LoadOptions(threads=1),
            "auto",
            dtypes=[torch.float32, torch.bfloat16],
            bf16_units=True,
            favoured=torch.bfloat16,
        )

    mar = archive(tmp_path, "confident", Confident(), {str(i): f"class {i}" for i in range(10)})
    import_mar(mar, tmp_path / "store", runtimes=("openvino",))
    confident = choose(tmp_path / "store")
    assert confident.dtype == torch.bfloat16, confident.describe()
    trained = choose(lite0_repository / LITE0 / "1")
    refused = {label: why for label, why in trained.skipped.items() if "+bf16" in label}
    if trained.dtype == torch.float32:
        assert any("golden photos" in why for why in refused.values()), trained.skipped
    else:  # this CPU computed bf16 as fp32 (no bf16 units): nothing changed, nothing refused
        assert not any("top 5" in why for why in refused.values())
