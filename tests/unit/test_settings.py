from __future__ import annotations

from pathlib import Path

import pytest

from app.errors import SettingsError
from app.settings import Settings, load_settings


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
        ("MB_DTYPE", "int4"),
        ("MB_MAX_LATENCY", "-1"),
        ("MB_WORKER_NUM", "0"),
        ("MB_MAX_QUEUE", "0"),
        ("CUDA_DEVICES", "zero"),
        ("MB_REQUEST_TIMEOUT", "0"),
        ("LOG_LEVEL", "loud"),
        ("MB_PRIORITY_LEVELS", "three"),  # neither a count nor JSON (was a traceback)
        ("MB_BROKER", "redis://:pw@redis:notaport/0"),  # (was a traceback at first use)
        ("MB_CACHE_REDIS", "rediss://cache:63790000/0"),
    ],
)
def test_bad_value_fails_naming_the_setting(
    monkeypatch: pytest.MonkeyPatch, tmp_path: Path, name: str, value: str
) -> None:
    monkeypatch.chdir(tmp_path)
    monkeypatch.setenv(name, value)
    with pytest.raises(SettingsError, match=name):
        load_settings()


def compose_values(expression: str) -> list[str]:
    """The values a compose ``environment`` entry can take when its variables are unset or
    empty: ``${NAME:-default}`` gives its default (``${A:-${B:-x}}``: x), ``${NAME:-}`` the
    empty string."""
    import re

    while match := re.fullmatch(r"\$\{(\w+):-(.*)\}", expression):
        expression = match.group(2)
    return [expression]


def test_settings_accept_every_value_the_compose_file_can_pass(
    monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    import yaml

    compose = yaml.safe_load(
        (Path(__file__).resolve().parents[2] / "docker" / "docker-compose.yml").read_text()
    )
    monkeypatch.chdir(tmp_path)  # no .env file here
    checked = 0
    for name, service in compose["services"].items():
        environment = {k: str(v) for k, v in service.get("environment", {}).items()}
        if name == "locust" or "observability" in service.get("profiles", []) or not environment:
            continue  # not the app
        for key in environment:
            monkeypatch.delenv(key, raising=False)
        for key, expression in environment.items():
            (value,) = compose_values(expression)
            if key == "PROMETHEUS_MULTIPROC_DIR":  # the command makes it before it starts
                value = str(tmp_path / value.strip("/").replace("/", "-"))
                Path(value).mkdir(exist_ok=True)
            monkeypatch.setenv(key, value)
        settings = load_settings()  # raises SettingsError naming the setting otherwise
        if "MB_WORKER_NUM" in environment and environment["MB_WORKER_NUM"].endswith(":-}"):
            assert settings.mb_worker_num is None  # empty: one worker per device
        checked += 1
    assert checked >= 4


@pytest.mark.parametrize(
    "name", ["MB_WORKER_NUM", "MB_WORKER_THREADS", "MB_DECODE_THREADS", "PORT"]
)
def test_an_empty_value_means_the_default(monkeypatch: pytest.MonkeyPatch, name: str) -> None:
    monkeypatch.setenv(name, "")
    default = Settings.model_fields[name.lower()].default
    assert getattr(load_settings(), name.lower()) == default


def test_an_empty_cuda_devices_still_means_the_cpu(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("CUDA_DEVICES", "")
    assert load_settings().cuda_device_ids == []


def test_an_empty_state_dir_keeps_the_precisions_in_memory(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """As documented (it meant the home directory's: a test that asked for memory only read
    an earlier run's choice there)."""
    monkeypatch.setenv("MB_STATE_DIR", "")
    assert load_settings().mb_state_dir is None


def test_a_bad_broker_url_is_refused_without_echoing_it(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("MB_BROKER", "http://:s3cret@redis:6379/0")
    with pytest.raises(SettingsError) as refused:
        load_settings()
    assert "MB_BROKER" in str(refused.value) and "s3cret" not in str(refused.value)


def test_a_bad_secret_setting_is_named_but_its_value_never_shown(
    monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    monkeypatch.chdir(tmp_path)
    monkeypatch.setenv("MB_BROKER", "http://user:hunter2@10.0.0.5:6379/0")
    monkeypatch.setenv("MB_BATCH_SIZE", "lots")
    with pytest.raises(SettingsError) as caught:
        load_settings()
    message = str(caught.value)
    assert "MB_BROKER" in message and "hunter2" not in message
    assert "'lots'" in message  # other settings still show what they got


def test_a_metrics_directory_must_exist_and_be_in_the_environment(
    monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    """prometheus-client reads PROMETHEUS_MULTIPROC_DIR from the environment as it is
    imported: one given in .env alone left every counter out of /metrics, and a missing
    directory failed the first request counted."""
    monkeypatch.chdir(tmp_path)
    monkeypatch.setenv("PROMETHEUS_MULTIPROC_DIR", str(tmp_path / "missing"))
    with pytest.raises(SettingsError, match=r"PROMETHEUS_MULTIPROC_DIR: .*existing directory"):
        load_settings()
    monkeypatch.setenv("PROMETHEUS_MULTIPROC_DIR", str(tmp_path))
    assert load_settings().prometheus_multiproc_dir == tmp_path
    monkeypatch.delenv("PROMETHEUS_MULTIPROC_DIR")
    (tmp_path / ".env").write_text(f"PROMETHEUS_MULTIPROC_DIR={tmp_path}\n")
    with pytest.raises(SettingsError, match=r"PROMETHEUS_MULTIPROC_DIR: .*in the environment"):
        load_settings()
