"""The life of one model version: the states it passes through, the moves allowed between
them, and the words every process uses for a version (``ModelSpec``, ``Route``).

::

    ON_DISK --load--> LOADING --loaded--> READY --switch--> SERVING --moved on--> DRAINING
                         |                  |  ^               ^                    |
                         +--fail--> FAILED  |  +---wanted again+-----rollback-------+
                                      |     +--given up--> DRAINING                 |
                                      +--retry--> LOADING    UNLOADED <--unloaded---+

- ON_DISK: a published version nobody loaded (the index says ``unavailable``, as Triton).
- LOADING: verified, loaded, self-tested and warmed up somewhere; nothing is routed to it.
- READY: loaded everywhere it must be; not serving yet (or no longer the name's choice).
- SERVING: what its name answers with. One version per name, switched in one assignment
  (by whoever admits requests: the registry of an HTTP process; a broker worker's versions
  are READY or DRAINING, and the routing rule says which of them serves).
- DRAINING: no new request goes to it; those admitted finish on it, then it is unloaded.
  A rollback to it before it is unloaded makes it serve again, with no load (or, on a
  worker, ready again: which version serves is the routing rule's, not one worker's).
- UNLOADED: its models are gone and its memory given back; a later load starts afresh.
- FAILED: a load that failed (at ``step``, with ``reason``); what served before serves on.

Every process keeps its versions as ``VersionLife`` records and moves them with ``move``,
which refuses a move the diagram does not have: the in-process registry
(``app.services.registry``), a broker worker's versions (``app.broker.versions``) and what a
broker front end follows. Which move to make when is ``app.lifecycle.rules``.
"""

from __future__ import annotations

import contextlib
import os
import time
from collections.abc import Mapping
from dataclasses import dataclass, field, replace
from enum import StrEnum
from typing import NamedTuple


class VersionState(StrEnum):
    """Where one version is in its life (the diagram above)."""

    ON_DISK = "unavailable"
    LOADING = "loading"
    READY = "ready"
    SERVING = "serving"
    DRAINING = "draining"
    UNLOADED = "unloaded"
    FAILED = "failed"

    @property
    def shown(self) -> str:
        """The state as the index, ``/info`` and heartbeats say it: a serving version is
        ``ready`` there (with ``serving: true`` beside it in the index), as Triton says."""
        return VersionState.READY.value if self is VersionState.SERVING else self.value

    @property
    def holds_models(self) -> bool:
        """Whether a version in this state holds (or is taking) memory on a worker."""
        return self in HOLDING


HOLDING = frozenset(
    {VersionState.LOADING, VersionState.READY, VersionState.SERVING, VersionState.DRAINING}
)
# Every move there is: from a state, the states it may go to.
MOVES: Mapping[VersionState, frozenset[VersionState]] = {
    VersionState.ON_DISK: frozenset({VersionState.LOADING}),
    VersionState.LOADING: frozenset({VersionState.READY, VersionState.FAILED}),
    VersionState.READY: frozenset(
        {VersionState.SERVING, VersionState.DRAINING, VersionState.UNLOADED}
    ),
    VersionState.SERVING: frozenset({VersionState.DRAINING}),
    VersionState.DRAINING: frozenset(
        {VersionState.SERVING, VersionState.READY, VersionState.UNLOADED}
    ),
    VersionState.UNLOADED: frozenset({VersionState.LOADING}),
    VersionState.FAILED: frozenset({VersionState.LOADING}),
}


class IllegalMove(RuntimeError):
    """A move the lifecycle does not have (a bug in the caller, never a user's error)."""


@dataclass(eq=False)
class VersionLife:
    """One version of one model and where it is in its life.

    >>> life = VersionLife("tagger", 2, "t@2")
    >>> life.move(VersionState.LOADING); life.move(VersionState.FAILED, "self-test", "cosine 0.2")
    >>> life.state.value, life.step, life.reason
    ('failed', 'self-test', 'cosine 0.2')
    >>> life.move(VersionState.SERVING)
    Traceback (most recent call last):
    app.lifecycle.states.IllegalMove: tagger version 2 (t@2) is failed: it cannot become serving
    """

    name: str
    version: int
    served_id: str
    state: VersionState = VersionState.ON_DISK
    step: str = ""  # FAILED: the step it failed at (verify, load, self-test, budget, timeout...)
    reason: str = ""  # FAILED: why; DRAINING: why it was given up, if it never served
    since: float = field(default_factory=time.monotonic)  # when it entered its state

    @property
    def label(self) -> str:
        return f"{self.name} version {self.version} ({self.served_id})"

    def move(self, to: VersionState, step: str = "", reason: str = "") -> None:
        """Enter ``to`` (``IllegalMove`` if the diagram has no such move); ``step`` and
        ``reason`` say why, for a failure or a version given up."""
        if to not in MOVES[self.state]:
            raise IllegalMove(f"{self.label} is {self.state.value}: it cannot become {to.value}")
        self.state, self.step, self.reason = to, step, reason
        self.since = time.monotonic()

    def age_s(self, now: float | None = None) -> float:
        """Seconds in its present state."""
        return (time.monotonic() if now is None else now) - self.since


def files_of(store: str) -> tuple[tuple[str, int, int], ...]:
    """What a store's folder holds now: each file's path, size and modification time (an
    empty tuple for a folder that is not there). A version that failed is tried again on a
    poll once this changes: a copy into the repository that was not finished when read.

    >>> files_of("/nonexistent")
    ()
    """
    found = []
    for directory, _, names in os.walk(store):
        for name in names:
            path = os.path.join(directory, name)
            with contextlib.suppress(OSError):  # gone meanwhile: it changed, as it shows
                stat = os.stat(path)
                found.append((os.path.relpath(path, store), stat.st_size, stat.st_mtime_ns))
    return tuple(sorted(found))


@dataclass(frozen=True)
class ModelSpec:
    """One version to load, as it travels to the workers (picklable): its name and number,
    its store's folder, the id its answers carry (``Manifest.served_id``), the shape of one
    preprocessed image (height, width, 3) it takes, and the precision to compute it in
    (MB_DTYPE: ``auto`` lets the worker choose by measurement; its id then says which, and
    ``served_id`` here is the fp32 id until a worker decided: ``decided``)."""

    name: str
    version: int
    store: str
    served_id: str
    image_shape: tuple[int, int, int] = (224, 224, 3)
    dtype: str = "float32"  # MB_DTYPE as it applies to this version ("auto": measured)
    # "auto" only: the precision chosen for its export on this class of host before, which
    # the measurement keeps unless another is decisively faster (app.workers.choices).
    incumbent: str | None = None

    def decided(self, dtype: str, served_id: str) -> ModelSpec:
        """This version in the precision a worker chose (``dtype``), under its id."""
        return replace(self, dtype=dtype, served_id=served_id, incumbent=None)

    def with_incumbent(self, dtype: str | None) -> ModelSpec:
        """This version, to be measured keeping ``dtype`` unless another is decisively
        faster (None: measured afresh)."""
        return replace(self, incumbent=dtype)


class Route(NamedTuple):
    """The version a name serves: its number and served id."""

    version: int
    served_id: str
