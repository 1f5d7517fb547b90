"""``app.repository``: the layout on disk, names, versions, pins, and publishing a version in
one rename."""

from __future__ import annotations

import json
import threading
from pathlib import Path

import pytest

from app.errors import InvalidRequest, ModelNotFound, ModelStoreError
from app.manifest import MANIFEST_NAME
from app.repository import Repository, check_name, name_of_export, publish, staging_folder
from app.settings import Settings, load_settings
from app.settings_values import parse_model_dtypes, parse_pins


def _store(folder: Path, arch: str = "tiny") -> Path:
    """A folder that counts as a version (its manifest is what makes it one)."""
    folder.mkdir(parents=True, exist_ok=True)
    manifest = {
        "arch": arch,
        "weights": "random",
        "input": {"crop_size": 8, "resize_size": 8, "mean": [0, 0, 0], "std": [1, 1, 1]},
        "embedding_dim": 4,
        "num_classes": 0,
        "files": {"embedding": {"path": "embedding.pt", "sha256": "0" * 64}},
    }
    (folder / MANIFEST_NAME).write_text(json.dumps(manifest))
    return folder


def test_versions_are_numbered_folders_holding_a_manifest(tmp_path: Path) -> None:
    _store(tmp_path / "tagger" / "1")
    _store(tmp_path / "tagger" / "3")
    (tmp_path / "tagger" / "2").mkdir()  # no manifest yet: half-copied, not a version
    (tmp_path / "tagger" / "007").mkdir()  # not a version number
    _store(tmp_path / "tagger" / ".incoming-abc")  # an export still being written
    _store(tmp_path / "embedder")  # a store placed directly in the name's folder
    (tmp_path / "empty").mkdir()
    repository = Repository(tmp_path)
    assert repository.names() == ["embedder", "tagger"]
    assert list(repository.versions("tagger")) == [1, 3]
    assert repository.versions("embedder") == {1: tmp_path / "embedder"}
    assert repository.chosen("tagger") == 3
    assert repository.path("tagger", 1) == tmp_path / "tagger" / "1"


def test_a_pin_chooses_the_version_and_must_exist(tmp_path: Path) -> None:
    _store(tmp_path / "tagger" / "1")
    _store(tmp_path / "tagger" / "2")
    assert Repository(tmp_path, pins={"tagger": 1}).chosen("tagger") == 1
    with pytest.raises(ModelNotFound, match="pins tagger=5, but it has versions 1, 2"):
        Repository(tmp_path, pins={"tagger": 5}).chosen("tagger")


@pytest.mark.parametrize("name", ["..", ".", "../etc", "a/b", "a\\b", "", "x" * 65, "bad name"])
def test_a_name_that_could_leave_the_repository_is_refused(tmp_path: Path, name: str) -> None:
    _store(tmp_path.parent / "outside" / "1")
    repository = Repository(tmp_path)
    with pytest.raises(InvalidRequest, match="a model name is 1 to 64"):
        repository.versions(name)
    with pytest.raises(InvalidRequest):
        check_name(name)


def test_a_link_out_of_the_repository_is_not_a_model(tmp_path: Path) -> None:
    root = tmp_path / "repo"
    root.mkdir()
    _store(tmp_path / "elsewhere" / "1")
    (root / "escape").symlink_to(tmp_path / "elsewhere")
    _store(root / "inside" / "1")
    (root / "inside" / "2").symlink_to(tmp_path / "elsewhere" / "1")
    repository = Repository(root)
    assert repository.names() == ["inside"]
    assert list(repository.versions("inside")) == [1]


def test_a_lone_store_is_a_repository_of_one_model_named_after_its_export(tmp_path: Path) -> None:
    store = _store(tmp_path / "store", arch="timm:convnext_tiny")
    repository = Repository.of_store(store)
    assert repository.names() == ["timm-convnext_tiny"]
    assert repository.versions("timm-convnext_tiny") == {1: store}
    assert repository.versions("other") == {}
    with pytest.raises(ModelStoreError, match=r"manifest\.json is missing"):
        Repository.of_store(tmp_path / "nothing")


def test_names_of_exports_are_made_valid() -> None:
    assert name_of_export("efficientnet_lite0") == "efficientnet_lite0"
    assert name_of_export("timm:vit/b") == "timm-vit-b"
    assert name_of_export("..") == "model"


def test_publish_renames_a_whole_store_into_the_next_version(tmp_path: Path) -> None:
    folder = tmp_path / "tagger"
    _store(folder)  # version 1, placed directly
    staging = staging_folder(folder)
    assert staging.name.startswith(".") and Repository(tmp_path).versions("tagger") == {1: folder}
    _store(staging)
    assert publish(staging, folder) == 2
    assert not staging.exists() and list(Repository(tmp_path).versions("tagger")) == [1, 2]


def test_two_exports_at_once_get_two_numbers(tmp_path: Path) -> None:
    folder = tmp_path / "tagger"
    stagings = [_store(staging_folder(folder)) for _ in range(8)]
    numbers: list[int] = []
    threads = [
        threading.Thread(target=lambda s=s: numbers.append(publish(s, folder))) for s in stagings
    ]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    assert sorted(numbers) == list(range(1, 9))
    assert list(Repository(tmp_path).versions("tagger")) == list(range(1, 9))


def test_the_version_pins_setting_is_checked_at_start() -> None:
    assert parse_pins("a=1,b.c=20") == {"a": 1, "b.c": 20}
    assert Settings(mb_model_versions="tagger=3").model_pins == {"tagger": 3}
    for bad in ("tagger", "tagger=0", "tagger=x", "../x=1", "a=1,a=2"):
        with pytest.raises(Exception, match="MB_MODEL_VERSIONS"):
            load_settings(mb_model_versions=bad)


def test_a_model_may_have_its_own_precision_setting(tmp_path: Path) -> None:
    assert parse_model_dtypes("a=float32, b.c=auto") == {"a": "float32", "b.c": "auto"}
    assert Settings(mb_model_dtypes="tagger=float32").model_dtypes == {"tagger": "float32"}
    for bad in ("tagger", "tagger=int4", "../x=auto", "a=auto,a=float32"):
        with pytest.raises(Exception, match="MB_MODEL_DTYPES"):
            load_settings(mb_model_dtypes=bad)
    _store(tmp_path / "tagger" / "1")
    _store(tmp_path / "other" / "1")
    repository = Repository(tmp_path, dtypes={"tagger": "float32"})
    assert repository.read("tagger", 1, "bfloat16", verify=False).spec.dtype == "float32"
    other = repository.read("other", 1, "bfloat16", verify=False).spec
    assert other.dtype == "bfloat16" and other.served_id.endswith("+bf16")
    assert not repository.claimed_id("tagger", 1, "bfloat16").endswith("+bf16")
