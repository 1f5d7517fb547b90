"""Broker mode: which version each model name serves, decided from the workers' heartbeats.
Front ends switch a name by it; workers unload an old version only once it no longer serves
by it (and its streams are empty).

The rule, per name, over the live workers that are not draining and hold some version of
the name (loading or ready): the newest version that is ready on enough of them (every one by
default, ``MB_SWITCH_MIN_WORKERS`` to ask for fewer). A version still loading somewhere is
not yet on every worker, so a name moves only once the new version is ready where it must
be; a version that fails to load anywhere never takes the name.

When no version is ready on enough workers (a rolling restart, one host on the old version
and one on the new), the rule says nothing for that name: a front end keeps what it serves
(``sticky``), and no worker unloads anything of it.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence

from app.broker.wire import WorkerInfo
from app.repository import ModelState, Route

# A worker unloads a version only after the rule has routed its name elsewhere this long (so
# every front end, which looks once a second, has switched) and its streams are empty.
SWITCH_GRACE_S = 3.0


def routes(
    workers: Sequence[WorkerInfo],
    min_workers: int | None = None,
    sticky: Mapping[str, Route] | None = None,
) -> dict[str, Route]:
    """name -> the version it serves, by the rule above. With ``sticky`` (a front end's
    current routes), a name the rule says nothing of keeps its route while that version is
    still ready on a live worker, else takes the version ready on the most workers (a front
    end must route somewhere); without it (a worker deciding what to unload), such a name is
    left out.

    Tested in ``tests/unit/test_routing.py``.
    """
    serving = [w for w in workers if w.alive and not w.draining]
    holding: dict[str, set[str]] = {}  # name -> workers holding a version of it
    ready: dict[str, dict[Route, set[str]]] = {}  # name -> version -> workers it is ready on
    for worker in serving:
        for model in worker.models:
            if model.state in (ModelState.LOADING, ModelState.READY):
                holding.setdefault(model.name, set()).add(worker.name)
            if model.state is ModelState.READY:
                on = ready.setdefault(model.name, {}).setdefault(
                    Route(model.version, model.served_id), set()
                )
                on.add(worker.name)
    chosen: dict[str, Route] = {}
    for name, versions in ready.items():
        needed = len(holding[name])
        if min_workers is not None:
            needed = min(needed, min_workers)
        enough = [route for route, on in versions.items() if len(on) >= needed]
        if enough:
            chosen[name] = max(enough)
        elif sticky is not None:
            kept = sticky.get(name)
            if kept is None or kept not in versions:
                kept = max(versions, key=lambda route: (len(versions[route]), route))
            chosen[name] = kept
    return chosen
