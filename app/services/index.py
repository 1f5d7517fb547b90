"""The repository index (``/v2/repository/index``, ``/info``'s ``models``): one row per model
and version number, on disk or known, saying where it is in its life and why.

A row's state comes from the registry of this process where it knows the version (what it
serves, what drains, a load that failed here), else from what the workers say of it (a
broker front end learns of a version loading, ready or failed on the workers from their
heartbeats), else ``unavailable`` (on disk, not loaded). A failure is on the failed
version's own row, never on the row of the version serving.
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Mapping, Sequence
from typing import Any

from app.batching import HeldModel, WorkerStatus
from app.lifecycle import VersionState
from app.repository import Repository
from app.services.registry import ModelRegistry

# How the workers' states of one version sum up, most telling first.
_ORDER = (VersionState.READY, VersionState.LOADING, VersionState.DRAINING, VersionState.FAILED)


def _held(workers: Sequence[WorkerStatus]) -> dict[tuple[str, int], list[HeldModel]]:
    held: dict[tuple[str, int], list[HeldModel]] = {}
    for worker in workers:
        for model in worker.models:
            held.setdefault((model.name, model.version), []).append(model)
    return held


def _runtime_fields(held: Sequence[HeldModel]) -> dict[str, Any]:
    """What runs the version on its workers (the runtime most of them chose), the runtimes
    that failed their self-test or their load there, with the reason, and how much slower
    than the one its export asked for it serves, if it does."""
    runtimes = Counter(m.runtime for m in held if m.runtime)
    skipped: dict[str, str] = {}
    slowdowns = [m.slowdown for m in held if m.slowdown is not None]
    for model in held:
        for runtime, reason in model.skipped:
            skipped.setdefault(runtime, reason)
    return {
        "runtime": runtimes.most_common(1)[0][0] if runtimes else None,
        "runtimes_failed": skipped,
        "slowdown": max(slowdowns) if slowdowns else None,
    }


def _from_workers(held: Sequence[HeldModel]) -> tuple[str, str]:
    """The state and reason a version has on the workers that advertise it."""
    states = {VersionState(m.state) for m in held}
    state = next((s for s in _ORDER if s in states), VersionState.FAILED)
    reasons = sorted({m.reason for m in held if m.state == VersionState.FAILED and m.reason})
    return state.shown, "; ".join(reasons) if state is VersionState.FAILED else ""


def index_rows(
    repository: Repository,
    registry: ModelRegistry,
    workers: Sequence[WorkerStatus],
    given_up: Mapping[tuple[str, int], str] | None = None,
) -> list[dict[str, Any]]:
    """Every version on disk or known, by name and number: its served id, state, the reason
    it failed or was given up, whether it serves, requests in flight, the workers holding
    it ready, what it costs one of them, and what runs it (``_runtime_fields``).
    ``given_up``: versions whose rollout the workers gave up (broker mode,
    ``app.lifecycle.given_up``)."""
    held = _held(workers)
    given_up = given_up or {}
    rows: dict[tuple[str, int], dict[str, Any]] = {}

    def row(name: str, number: int, model_id: str | None) -> dict[str, Any]:
        models = held.get((name, number), [])
        memory = [m.memory_bytes for m in models if m.memory_bytes is not None]
        ready = (VersionState.READY.value, VersionState.SERVING.value)
        return {
            "name": name,
            "version": str(number),
            "model_id": model_id,
            "state": VersionState.ON_DISK.value,
            "serving": False,
            "reason": "",
            "in_flight": 0,
            "workers": sum(m.state in ready for m in models),
            "memory_bytes": max(memory) if memory else None,
            **_runtime_fields(models),
        }

    for name in repository.names():
        for number in repository.versions(name):
            rows[(name, number)] = row(name, number, None)
    for (name, number), models in held.items():
        entry = rows.setdefault((name, number), row(name, number, models[0].served_id))
        entry["model_id"] = models[0].served_id
        entry["state"], entry["reason"] = _from_workers(models)
    for (name, number), reason in given_up.items():
        entry = rows.setdefault((name, number), row(name, number, None))
        entry["state"], entry["reason"] = VersionState.FAILED.value, reason
    for version in registry.versions():
        entry = rows.setdefault(
            (version.name, version.version), row(version.name, version.version, None)
        )
        serving = registry.serving(version.name) is version
        entry.update(
            model_id=version.served_id,
            state=version.state.shown,
            serving=serving,
            reason=f"{version.step}: {version.reason}" if version.step else version.reason,
            in_flight=version.in_flight,
        )
    return [rows[key] for key in sorted(rows)]
