"""Helm for the chart tests: the pinned binary (``make helm``), ``render(profile)`` and the
profiles in the chart's ``ci/`` folder.

These tests never skip: ``make check-k8s`` installs helm first, and a missing helm, chart or
profile fails them with a message that says what to do.
"""

from __future__ import annotations

import functools
import os
import shutil
import subprocess
from pathlib import Path
from typing import Any

import pytest
import yaml

REPO = Path(__file__).resolve().parents[2]
CHART = REPO / "deploy" / "helm" / "microbatch-server"
PROFILE_DIR = CHART / "ci"
TOOLS = REPO / ".tools"
# The profiles the spec names (each renders alone); any other ci/*.yaml is checked too.
REQUIRED_PROFILES = ("cpu-single", "cpu-broker", "gpu-broker", "keda", "kserve")
RELEASE = "rel"
NAMESPACE = "k8s-check"
# Custom resource APIs, so that a template guarded by .Capabilities.APIVersions.Has renders.
CRD_API_VERSIONS = ("keda.sh/v1alpha1", "monitoring.coreos.com/v1", "serving.kserve.io/v1alpha1")


def _discovered_profiles() -> list[str]:
    found = {path.stem for path in PROFILE_DIR.glob("*.yaml")} if PROFILE_DIR.is_dir() else set()
    # A required profile that is missing still gets its tests, which then fail by name.
    return sorted(found | set(REQUIRED_PROFILES))


PROFILES = _discovered_profiles()


@functools.cache
def find_helm() -> Path:
    """The helm that ``make helm`` installs, else a helm 4 on PATH; fails (never skips) without
    one. (Helm 3 words its schema errors differently.)"""
    pinned = TOOLS / "bin" / "helm"
    found = pinned if pinned.is_file() and os.access(pinned, os.X_OK) else shutil.which("helm")
    if found is None:
        pytest.fail(f"helm not found in {pinned} or on PATH: run `make helm` (or `make check-k8s`)")
    version = subprocess.run(
        [str(found), "version", "--short"],
        capture_output=True,
        text=True,
        env=helm_env(),
        check=False,
    ).stdout.strip()
    if not version.startswith("v4."):
        pytest.fail(f"{found} is helm {version or '(unknown)'}, not 4.x: run `make helm`")
    return Path(found)


def helm_env() -> dict[str, str]:
    """The environment for helm: its cache, config and data under .tools/, never in $HOME."""
    env = dict(os.environ)
    for name, sub in (
        ("HELM_CACHE_HOME", "cache"),
        ("HELM_CONFIG_HOME", "config"),
        ("HELM_DATA_HOME", "data"),
    ):
        env.setdefault(name, str(TOOLS / "helm" / sub))
    return env


def run_helm(*args: str) -> subprocess.CompletedProcess[str]:
    """``helm ARGS`` with stdout and stderr captured as text; never raises on failure."""
    return subprocess.run(
        [str(find_helm()), *args],
        capture_output=True,
        text=True,
        env=helm_env(),
        timeout=120,
        check=False,
    )


def profile_path(profile: str) -> Path:
    path = PROFILE_DIR / f"{profile}.yaml"
    assert path.is_file(), f"profile {profile}: {path.relative_to(REPO)} does not exist"
    return path


@functools.cache
def _rendered_text(profile: str, kube_version: str | None, sets: tuple[str, ...]) -> str:
    args = [
        "template",
        RELEASE,
        str(CHART),
        "--namespace",
        NAMESPACE,
        "-f",
        str(profile_path(profile)),
    ]
    if kube_version is not None:
        args += ["--kube-version", kube_version]
    for api_version in CRD_API_VERSIONS:
        args += ["--api-versions", api_version]
    for setting in sets:
        args += ["--set", setting]
    result = run_helm(*args)
    assert result.returncode == 0, f"helm template with {profile}.yaml failed:\n{result.stderr}"
    return result.stdout


def render(
    profile: str, kube_version: str | None = None, sets: tuple[str, ...] = ()
) -> list[dict[str, Any]]:
    """The chart rendered with ``ci/<profile>.yaml`` (and ``--set`` each of ``sets``): one dict
    per document, empty ones dropped.

    Each call parses afresh, so a caller may change what it gets.
    """
    text = _rendered_text(profile, kube_version, sets)
    docs = [doc for doc in yaml.safe_load_all(text) if doc is not None]
    for doc in docs:
        assert isinstance(doc, dict), f"{profile}: a rendered document is not a mapping: {doc!r}"
    return docs


@pytest.fixture(scope="session")
def helm() -> Path:
    return find_helm()


@pytest.fixture(scope="session")
def chart(helm: Path) -> Path:
    """The chart's folder, once helm is known to be there."""
    assert (CHART / "Chart.yaml").is_file(), f"no chart at {CHART.relative_to(REPO)}"
    return CHART
