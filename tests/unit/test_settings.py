from __future__ import annotations

from pathlib import Path

import pytest

from app.errors import SettingsError
from app.settings import load_settings


def test_defaults(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    monkeypatch.chdir(tmp_path)  # no stray .env
    settings = load_settings()
    assert settings.mb_batch_size == 32
    assert settings.mb_worker_num is None
    assert settings.cuda_device_ids is None
    assert settings.model_store == Path("model_store")


def test_environment_names_from_the_article(
    monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    monkeypatch.chdir(tmp_path)
    monkeypatch.setenv("MB_BATCH_SIZE", "64")
    monkeypatch.setenv("MB_MAX_LATENCY", "0.1")
    monkeypatch.setenv("MB_WORKER_NUM", "4")
    monkeypatch.setenv("CUDA_DEVICES", "0,1")
    monkeypatch.setenv("MODEL_STORE", "/srv/models")
    monkeypatch.setenv("MB_MAX_QUEUE", "10")
    settings = load_settings()
    assert (settings.mb_batch_size, settings.mb_max_latency, settings.mb_worker_num) == (64, 0.1, 4)
    assert settings.cuda_device_ids == [0, 1]
    assert settings.model_store == Path("/srv/models")
    assert settings.mb_max_queue == 10


def test_batch_size_auto(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    monkeypatch.chdir(tmp_path)
    monkeypatch.setenv("MB_BATCH_SIZE", "auto")
    monkeypatch.setenv("MB_AUTO_BATCH_MAX", "16")
    settings = load_settings()
    assert settings.mb_batch_size == "auto" and settings.max_batch_size == 16
    monkeypatch.setenv("MB_BATCH_SIZE", "8")
    assert load_settings().max_batch_size == 8


def test_dotenv_file_is_read(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    monkeypatch.chdir(tmp_path)
    (tmp_path / ".env").write_text("MB_BATCH_SIZE=7\nCUDA_DEVICES=cpu\n")
    settings = load_settings()
    assert settings.mb_batch_size == 7
    assert settings.cuda_device_ids == []


@pytest.mark.parametrize(
    ("name", "value"),
    [
        ("MB_BATCH_SIZE", "0"),
        ("MB_BATCH_SIZE", "lots"),
        ("MB_BATCH_SIZE", "5000"),
        ("MB_DTYPE", "int8"),
        ("MB_MAX_LATENCY", "-1"),
        ("MB_WORKER_NUM", "0"),
        ("MB_MAX_QUEUE", "0"),
        ("CUDA_DEVICES", "zero"),
        ("MB_REQUEST_TIMEOUT", "0"),
        ("LOG_LEVEL", "loud"),
    ],
)
def test_bad_value_fails_naming_the_setting(
    monkeypatch: pytest.MonkeyPatch, tmp_path: Path, name: str, value: str
) -> None:
    monkeypatch.chdir(tmp_path)
    monkeypatch.setenv(name, value)
    with pytest.raises(SettingsError, match=name):
        load_settings()
