"""What can be checked of the container files without a Docker engine."""

from __future__ import annotations

import re
from pathlib import Path

import yaml

from app.settings import Settings

REPO = Path(__file__).resolve().parents[2]
SETTING_NAMES = {name.upper() for name in Settings.model_fields}


def test_compose_services_use_settings_the_app_reads() -> None:
    compose = yaml.safe_load((REPO / "docker" / "docker-compose.yml").read_text())
    services = compose["services"]
    assert {"server", "server-gpu", "locust"} <= set(services)
    for name, service in services.items():
        if name == "locust":
            continue
        for key in service.get("environment", {}):
            assert key in SETTING_NAMES, f"{name} sets {key}, which the app does not read"
    assert services["server"]["ports"] == [
        "127.0.0.1:${PORT:-8000}:8000",
        "127.0.0.1:${GRPC_PORT:-8011}:8001",  # MB_GRPC_PORT in the container
    ]
    assert services["server"]["environment"]["MB_GRPC_PORT"] == "8001"
    gpu = services["server-gpu"]["deploy"]["resources"]["reservations"]["devices"][0]
    assert gpu["driver"] == "nvidia" and "gpu" in gpu["capabilities"]


def test_dockerfile_copies_files_that_exist_and_runs_real_modules() -> None:
    dockerfile = (REPO / "Dockerfile").read_text()
    for line in re.findall(r"^COPY (.+)$", dockerfile, flags=re.M):
        for source in line.split()[:-1]:
            assert (REPO / source).exists(), f"Dockerfile copies missing {source}"
    for module in re.findall(r"python -m ([\w.]+)", dockerfile):
        assert (REPO / (module.replace(".", "/") + ".py")).is_file() or (
            REPO / module.replace(".", "/") / "__main__.py"
        ).is_file(), module
    assert "USER app" in dockerfile and "HEALTHCHECK" in dockerfile and "/readyz" in dockerfile
    env = dict(re.findall(r"^\s+(\w+)=(\S+)", dockerfile, flags=re.M))
    assert {"HOST", "PORT", "MODEL_STORE"} <= SETTING_NAMES & set(env)


def test_compose_locust_service_runs_the_repo_locustfile() -> None:
    compose = yaml.safe_load((REPO / "docker" / "docker-compose.yml").read_text())
    locust = compose["services"]["locust"]
    assert locust["profiles"] == ["loadtest"]
    assert locust["command"][:5] == [
        "locust",
        "-f",
        "tests/load/locustfile.py",
        "--host",
        "http://server:8000",
    ]
    # Offline: locust comes with the image, built from the Dockerfile's loadtest stage.
    assert locust["build"]["target"] == "loadtest" and "entrypoint" not in locust
    dockerfile = (REPO / "Dockerfile").read_text()
    assert "AS loadtest" in dockerfile and "pip install locust" in dockerfile
    assert dockerfile.rstrip().splitlines()[-1] == "FROM server"  # the default target
    mounted = {v.split(":")[0] for v in locust["volumes"]}
    for source in mounted:
        assert (REPO / "docker" / source).resolve().exists(), source
    assert (REPO / "tests" / "load" / "locustfile.py").is_file()


def test_compose_passes_the_operator_settings_through() -> None:
    compose = yaml.safe_load((REPO / "docker" / "docker-compose.yml").read_text())
    for name in ("server", "server-gpu"):
        environment = compose["services"][name]["environment"]
        assert {"API_KEY", "LOG_FORMAT", "MB_DECODE"} <= set(environment), name
    text = (REPO / "docker" / "docker-compose.yml").read_text()
    assert ":/srv/app/model_store" in text  # how to mount your own model store


def test_root_compose_file_includes_the_docker_one() -> None:
    root = yaml.safe_load((REPO / "compose.yaml").read_text())
    assert root["include"] == ["docker/docker-compose.yml"]
    assert (REPO / root["include"][0]).is_file()


def test_readme_documents_every_setting() -> None:
    readme = (REPO / "README.md").read_text()
    missing = [name for name in sorted(SETTING_NAMES) if f"`{name}`" not in readme]
    assert missing == []


def test_dockerfile_healthcheck_is_valid_python_probing_readyz() -> None:
    import shlex

    dockerfile = (REPO / "Dockerfile").read_text()
    command = dockerfile.split("HEALTHCHECK", 1)[1].split("CMD", 1)[1].split("\n")[0]
    argv = shlex.split(command)
    assert argv[:2] == ["python", "-c"]
    compile(argv[2], "healthcheck", "exec")
    assert "/readyz" in argv[2] and 'os.environ["PORT"]' in argv[2]


def test_image_leaves_the_benchmark_out() -> None:
    dockerfile = (REPO / "Dockerfile").read_text()
    # The first path component of every COPY source ("." for the whole build context).
    copied = [
        source.strip("./").split("/")[0] or "."
        for line in re.findall(r"^COPY (.+)$", dockerfile, flags=re.M)
        for source in line.split()[:-1]
        if not source.startswith("--")
    ]
    assert "app" in copied and "bench" not in copied and "." not in copied
    ignored = (REPO / ".dockerignore").read_text().split()
    assert "bench" in ignored or "bench/" in ignored
    assert (REPO / "bench" / "__main__.py").is_file()


def test_compose_cluster_profile_runs_broker_mode() -> None:
    compose = yaml.safe_load((REPO / "docker" / "docker-compose.yml").read_text())
    services = compose["services"]
    cluster = {name for name, s in services.items() if "cluster" in s.get("profiles", [])}
    assert cluster == {"redis", "frontend", "model-worker"}
    frontend, worker = services["frontend"], services["model-worker"]
    assert frontend["environment"]["MB_BROKER"] == worker["environment"]["MB_BROKER"]
    assert frontend["environment"]["MB_BROKER"].startswith("redis://redis:")
    assert "app.gunicorn_worker.Worker" in frontend["command"][-1]
    assert "-w 2" in frontend["command"][-1]
    assert worker["command"] == ["python", "-m", "app.broker.worker"]
    assert worker["deploy"]["replicas"] == 2
    assert "ports" not in worker  # workers only talk to Redis


def test_no_two_compose_services_publish_the_same_host_port() -> None:
    compose = yaml.safe_load((REPO / "docker" / "docker-compose.yml").read_text())
    published: dict[str, str] = {}
    for name, service in compose["services"].items():
        assert "extends" not in service  # its ports would be its base's too
        for mapping in service.get("ports", []):
            host = mapping.rsplit(":", 1)[0]
            assert host not in published, f"{name} and {published[host]} both publish {host}"
            published[host] = name


def test_the_image_and_make_install_give_workers_the_same_allocator() -> None:
    """The workers look for jemalloc (app/workers/allocator.py); the image installs it in
    the stage the server runs from, and ``make install`` installs the same package."""
    dockerfile = (REPO / "Dockerfile").read_text()
    server_stage = dockerfile.split(" AS server", 1)[1].split("\nFROM ", 1)[0]
    assert re.search(r"^RUN apt-get update && apt-get install .*libjemalloc2", server_stage, re.M)
    makefile = (REPO / "Makefile").read_text()
    assert re.search(r"^install: .*\bjemalloc\b", makefile, re.M)
    assert "apt-get install -y -qq libjemalloc2" in makefile
