"""What can be checked of the container files without a Docker engine."""

from __future__ import annotations

import re
import subprocess
from pathlib import Path
from typing import Any

import yaml

from app.settings import Settings
from tests.unit.test_settings import compose_values

REPO = Path(__file__).resolve().parents[2]
SETTING_NAMES = {name.upper() for name in Settings.model_fields}
OBSERVABILITY = "observability"  # the compose profile of Prometheus, Grafana and Jaeger
SERVING = ("server", "server-gpu", "frontend", "model-worker")  # the app's compose services


def test_compose_services_use_settings_the_app_reads() -> None:
    compose = yaml.safe_load((REPO / "docker" / "docker-compose.yml").read_text())
    services = compose["services"]
    assert {"server", "server-gpu", "locust"} <= set(services)
    for name, service in services.items():
        if name == "locust" or OBSERVABILITY in service.get("profiles", []):
            continue  # not the app
        for key in service.get("environment", {}):
            # OTEL_*: the OpenTelemetry SDK's own variables, which app.tracing hands it.
            assert key in SETTING_NAMES or key.startswith("OTEL_"), (
                f"{name} sets {key}, which the app does not read"
            )
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
    # By default both reach the compose file's Redis (each may be given its own user's URL).
    broker = [compose_values(s["environment"]["MB_BROKER"]) for s in (frontend, worker)]
    assert broker[0] == broker[1] and broker[0][0].startswith("redis://redis:")
    for service in (frontend, worker):  # the certificates a rediss:// URL names
        assert "./redis-tls:/etc/microbatch/redis-tls:ro" in service["volumes"]
    assert "app.gunicorn_worker.Worker" in frontend["command"][-1]
    assert "-w 2" in frontend["command"][-1]
    assert worker["command"] == ["python", "-m", "app.broker.worker"]
    assert worker["deploy"]["replicas"] == 2
    assert "ports" not in worker  # workers only talk to Redis


def test_compose_front_ends_give_admitted_requests_the_request_timeout_at_shutdown() -> None:
    """gunicorn's --graceful-timeout is MB_REQUEST_TIMEOUT + 5 s (its own 30 s cut a request
    allowed longer), worked out by the container's shell, and the default fits within
    compose's stop_grace_period (docker kills the container then)."""
    compose = yaml.safe_load((REPO / "docker" / "docker-compose.yml").read_text())
    frontend = compose["services"]["frontend"]
    found = re.search(r"--graceful-timeout (\S+ \S+ \S+ \S+ \S+)", frontend["command"][-1])
    assert found, frontend["command"]
    said = found.group(1).replace("$$", "$")  # compose's escape: the shell's $
    for timeout, graceful in (("30", 35), ("90.5", 95)):
        shell = subprocess.run(["sh", "-c", f"echo {said}"], capture_output=True, text=True,
                               env={"MB_REQUEST_TIMEOUT": timeout}, check=True)  # fmt: skip
        assert shell.stdout.strip() == str(graceful)
    default = compose_values(frontend["environment"]["MB_REQUEST_TIMEOUT"])[0]
    grace = int(frontend["stop_grace_period"].removesuffix("s"))
    assert int(default) + 5 < grace


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


# -- the compose profile observability: Prometheus, Grafana, Jaeger ---------------------------


def _compose() -> dict[str, Any]:
    loaded = yaml.safe_load((REPO / "docker" / "docker-compose.yml").read_text())
    assert isinstance(loaded, dict)
    return loaded


def _mounts(service: dict[str, Any]) -> dict[str, Path]:
    """A service's bind mounts: container path -> the file or folder on this machine."""
    mounts = {}
    for volume in service.get("volumes", []):
        source, target = str(volume).split(":")[:2]
        assert source.startswith("."), f"{volume}: not a bind mount of the repository"
        mounts[target] = (REPO / "docker" / source).resolve()
    return mounts


def test_compose_images_are_pinned_and_ports_are_loopback_only() -> None:
    for name, service in _compose()["services"].items():
        image = service.get("image", "")
        if "build" not in service:  # pulled, not built here
            tag = image.rpartition(":")[2] if ":" in image.rpartition("/")[2] else ""
            assert re.search(r"\d", tag) and tag != "latest", f"{name}: {image} is not pinned"
        for mapping in service.get("ports", []):
            assert str(mapping).startswith("127.0.0.1:"), f"{name} publishes {mapping}"


def test_compose_mounts_files_that_exist() -> None:
    for name, service in _compose()["services"].items():
        for target, source in _mounts(service).items():
            assert source.exists(), f"{name} mounts {source} (at {target}), which is missing"


def test_the_observability_profile_runs_prometheus_grafana_and_jaeger() -> None:
    services = _compose()["services"]
    profile = {name for name, s in services.items() if OBSERVABILITY in s.get("profiles", [])}
    assert profile == {"prometheus", "grafana", "jaeger"}
    assert services["prometheus"]["image"].startswith("prom/prometheus:")
    assert services["grafana"]["image"].startswith("grafana/grafana:")
    assert services["jaeger"]["image"].startswith("jaegertracing/all-in-one:")
    published = {str(p).rsplit(":", 1)[1] for p in services["jaeger"]["ports"]}
    assert published == {"16686", "4317", "4318"}  # the UI, OTLP over gRPC and HTTP
    assert services["jaeger"]["environment"]["COLLECTOR_OTLP_ENABLED"] == "true"
    for name in SERVING:  # tracing off unless the operator sets the endpoint
        environment = services[name]["environment"]
        assert environment["OTEL_EXPORTER_OTLP_ENDPOINT"] == "${OTEL_EXPORTER_OTLP_ENDPOINT:-}"
    text = (REPO / "docker" / "docker-compose.yml").read_text()
    assert "OTEL_EXPORTER_OTLP_ENDPOINT=http://jaeger:4318" in text  # how to turn it on


def test_compose_prometheus_scrapes_the_servers_with_the_rules_of_deploy() -> None:
    services = _compose()["services"]
    prometheus = services["prometheus"]
    mounts = _mounts(prometheus)
    config_path = next(a.split("=", 1)[1] for a in prometheus["command"] if "--config.file" in a)
    config = yaml.safe_load(mounts[config_path].read_text())
    rules = REPO / "deploy" / "prometheus" / "rules.yaml"
    assert [mounts[path] for path in config["rule_files"]] == [rules.resolve()]
    scraped = {
        (name, sd["port"])
        for job in config["scrape_configs"]
        for sd in job["dns_sd_configs"]
        for name in sd["names"]
    }
    assert scraped == {("server", 8000), ("server-gpu", 8000), ("frontend", 8000)}
    assert "ports" not in services["model-worker"]  # its batches reach /metrics by heartbeat


def test_compose_prometheus_config_passes_promtool(tmp_path: Path) -> None:
    """docker/prometheus.yml as the container reads it: its rule file at the path the
    compose file mounts deploy/prometheus/rules.yaml."""
    from tests.prometheus import require_tool

    prometheus = _compose()["services"]["prometheus"]
    mounts = _mounts(prometheus)
    config_path = next(a.split("=", 1)[1] for a in prometheus["command"] if "--config.file" in a)
    config = yaml.safe_load(mounts[config_path].read_text())
    config["rule_files"] = [str(mounts[path]) for path in config["rule_files"]]
    (tmp_path / "prometheus.yml").write_text(yaml.safe_dump(config))
    checked = subprocess.run(
        [require_tool("promtool"), "check", "config", str(tmp_path / "prometheus.yml")],
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert checked.returncode == 0, checked.stdout + checked.stderr


def test_compose_grafana_provisions_prometheus_and_the_dashboard_of_deploy() -> None:
    grafana = _compose()["services"]["grafana"]
    mounts = _mounts(grafana)
    provisioning = mounts["/etc/grafana/provisioning"]
    sources = yaml.safe_load((provisioning / "datasources" / "prometheus.yaml").read_text())
    (source,) = sources["datasources"]
    assert source["type"] == "prometheus" and source["url"] == "http://prometheus:9090"
    assert source["isDefault"] is True
    providers = yaml.safe_load((provisioning / "dashboards" / "microbatch.yaml").read_text())
    (provider,) = providers["providers"]
    assert mounts[provider["options"]["path"]] == (REPO / "deploy" / "grafana").resolve()
    home = Path(grafana["environment"]["GF_DASHBOARDS_DEFAULT_HOME_DASHBOARD_PATH"])
    assert (mounts[str(home.parent)] / home.name).is_file()
