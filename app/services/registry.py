"""The model registry: every version the server knows, its state, and which version each
name serves. The one state machine of model versions (states: ``app.repository.ModelState``);
every move is a method here, and nothing else changes a version's state.

    LOADING --ready()--> READY --switch() to another, or retire()--> DRAINING --gone()--> GONE
    LOADING --failed()--> FAILED                (what served before serves on)
    DRAINING --revive()--> READY                (a rollback before it was unloaded)

A request resolves its model once, when it is admitted (``admit``): by name (``?model=``, or
the default), or pinned to an exact served id (``X-Model-Id``), and holds a lease on that
version until it is answered. A switch is one assignment, with no ``await`` between the check
and the write, so a request sees the old version or the new, never neither. A version that
stops serving drains: it takes no new request, and ``drained`` is set once the last lease on
it is released; only then may its models be unloaded.

No asyncio waits, no I/O: the manager (``app.services.models``) does the loading.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Iterable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field

from app.errors import InvalidRequest, ModelNotFound, ModelVersionUnavailable, NotReady
from app.manifest import Manifest
from app.repository import ModelState, check_name
from app.services.predictor import Predictor


@dataclass(eq=False)
class ModelVersion:
    """One version of one model, as the registry knows it."""

    name: str
    version: int
    served_id: str
    state: ModelState = ModelState.LOADING
    manifest: Manifest | None = None
    predictor: Predictor | None = None  # once READY
    reason: str | None = None  # FAILED: why
    in_flight: int = 0  # requests admitted for it and not yet answered
    since: float = field(default_factory=time.monotonic)  # when it entered its state
    drained: asyncio.Event = field(default_factory=asyncio.Event)

    @property
    def label(self) -> str:
        return f"{self.name} version {self.version} ({self.served_id})"


def _numbered(version: ModelVersion, number: str) -> bool:
    """Whether ``number`` names ``version``: its number, or its served id's version part."""
    return number in (str(version.version), version.served_id.rsplit("@", 1)[-1])


class ModelRegistry:
    """The versions known, by name and served id, and each name's serving version.

    >>> # registry = ModelRegistry(default_name="tagger")
    >>> # entry = registry.loading("tagger", 2, "resnet50@1a2b3c4d5e6f")
    >>> # registry.ready(entry, manifest, predictor); old = registry.switch(entry)
    >>> # with registry.admit(None, None) as version: ...   # the default name's version
    """

    def __init__(self, default_name: str | None = None) -> None:
        self.default_name = default_name
        self._versions: dict[tuple[str, str], ModelVersion] = {}  # (name, served id)
        self._serving: dict[str, ModelVersion] = {}  # name -> its READY version
        self._known: set[str] = set()  # every name ever asked to load (for 404 vs 503)

    # -- what is there -----------------------------------------------------------------------

    def versions(self) -> list[ModelVersion]:
        """Every version known, by name then version number."""
        return sorted(self._versions.values(), key=lambda v: (v.name, v.version, v.since))

    def names(self) -> list[str]:
        """The names that serve a version now."""
        return sorted(self._serving)

    def serving(self, name: str) -> ModelVersion | None:
        return self._serving.get(name)

    def holders(self, served_id: str) -> list[ModelVersion]:
        """The versions, under any name, that are this export and still hold its models
        (loading, serving or draining)."""
        live = (ModelState.LOADING, ModelState.READY, ModelState.DRAINING)
        return [v for v in self._versions.values() if v.served_id == served_id and v.state in live]

    @property
    def default(self) -> ModelVersion | None:
        """The version a request without ``?model=`` gets, if any."""
        name = self._default_name()
        return self._serving.get(name) if name is not None else None

    def _default_name(self) -> str | None:
        if self.default_name is not None:
            return self.default_name
        if len(self._known) == 1:
            return next(iter(self._known))
        return None

    # -- admission ---------------------------------------------------------------------------

    def resolve(
        self, name: str | None, pinned: str | None = None, number: str | None = None
    ) -> ModelVersion:
        """The version a request gets: ``name``'s serving one (the default without a name),
        or exactly the one ``pinned`` names (a served id), or ``name``'s version ``number``
        (its number, or the version part of its served id). ``ModelNotFound`` (404) for a
        name not served, ``ModelVersionUnavailable`` (409) for a pin or a version not
        served: never a substitute."""
        if name is not None:
            check_name(name)
        if pinned is not None:  # any name's, unless the request names one
            version = self._pinned(name, pinned)
            if number is not None and not _numbered(version, number):
                raise ModelVersionUnavailable(
                    f"{pinned[:200]!r} is {version.label}, not version {number[:20]!r}"
                )
            return version
        if name is None:
            name = self._default_name()
            if name is None:
                raise InvalidRequest(
                    f"this server serves several models ({', '.join(self.names())}): name one "
                    "with ?model=NAME"
                )
        serving = self._serving.get(name)
        if serving is not None:
            if number is not None and not _numbered(serving, number):
                raise ModelVersionUnavailable(
                    f"version {number[:20]!r} of {name!r} is not served; served: "
                    f"version {serving.version} ({serving.served_id})"
                )
            return serving
        if name in self._known:
            raise NotReady(f"model {name!r} has no version ready now", retry_after_s=2)
        raise ModelNotFound(
            f"no model named {name!r} is served here (served: {', '.join(self.names()) or 'none'})"
        )

    def _pinned(self, name: str | None, pinned: str) -> ModelVersion:
        ready = [
            v
            for v in self._serving.values()
            if name is None or v.name == name  # a pin is served only while its name serves it
        ]
        for version in ready:
            if version.served_id == pinned:
                return version
        if name is not None and name not in self._known:
            raise ModelNotFound(f"no model named {name!r} is served here")
        served = ", ".join(sorted(v.served_id for v in ready)) or "none"
        raise ModelVersionUnavailable(
            f"{pinned[:200]!r} is not served{f' as {name!r}' if name else ''}; served: {served}"
        )

    @contextmanager
    def admit(
        self, name: str | None, pinned: str | None = None, number: str | None = None
    ) -> Iterator[ModelVersion]:
        """Resolve (``resolve``) and hold a lease on the version until the block ends: it
        will not be unloaded while a request admitted for it is unanswered."""
        version = self.resolve(name, pinned, number)
        version.in_flight += 1
        try:
            yield version
        finally:
            version.in_flight -= 1
            if version.in_flight == 0 and version.state is ModelState.DRAINING:
                version.drained.set()

    def expect(self, names: Iterable[str]) -> None:
        """Names that will serve (a broker front end, before the workers say so): a request
        for one gets 503 until then, not 404."""
        self._known.update(names)

    # -- moves -------------------------------------------------------------------------------

    def _move(self, version: ModelVersion, state: ModelState) -> None:
        version.state = state
        version.since = time.monotonic()

    def loading(self, name: str, version: int, served_id: str) -> ModelVersion:
        """A load begins (a failed try of the same export before is forgotten)."""
        self._known.add(name)
        key = (name, served_id)
        existing = self._versions.get(key)
        if existing is not None and existing.state is not ModelState.FAILED:
            return existing  # loading, serving or draining already
        entry = self._versions[key] = ModelVersion(name, version, served_id)
        return entry

    def ready(self, version: ModelVersion, manifest: Manifest, predictor: Predictor) -> None:
        """LOADING -> READY: loaded everywhere it must be; not serving until ``switch``."""
        if version.state is not ModelState.LOADING:
            raise RuntimeError(f"{version.label} is {version.state}, not loading")
        version.manifest, version.predictor = manifest, predictor
        self._move(version, ModelState.READY)

    def failed(self, version: ModelVersion, reason: str) -> None:
        """LOADING -> FAILED, with the reason (``/info``, the repository index)."""
        version.reason = reason
        self._move(version, ModelState.FAILED)

    def switch(self, version: ModelVersion) -> ModelVersion | None:
        """Make ``version`` (READY) the one its name serves, in one step; the version it
        replaces starts draining and is returned (None if there was none, or it was this)."""
        if version.state is not ModelState.READY:
            raise RuntimeError(f"{version.label} is {version.state}, not ready")
        old = self._serving.get(version.name)
        self._serving[version.name] = version  # the switch: one assignment
        self._forget_failures(version.name)
        if old is None or old is version:
            return None
        self._drain(old)
        return old

    def retire(self, name: str, *, coming_back: bool = False) -> ModelVersion | None:
        """The name serves nothing any more: its version drains, and is returned. Unloaded,
        the name is then unknown (404); ``coming_back`` (a replacement in place) keeps it
        known, answered 503 until its next version serves."""
        old = self._serving.pop(name, None)
        if old is not None:
            self._drain(old)
        if not coming_back:
            self._known.discard(name)
        return old

    def renumber(self, version: ModelVersion, number: int) -> None:
        """The same export published again as another version (a rollback written as the
        next version): it serves under that number, with no load."""
        version.version = number

    def revive(self, version: ModelVersion) -> None:
        """DRAINING -> READY, before its models are unloaded: a rollback to it needs no load
        (``switch`` then makes it serve)."""
        if version.state is not ModelState.DRAINING:
            raise RuntimeError(f"{version.label} is {version.state}, not draining")
        version.drained.clear()
        self._move(version, ModelState.READY)

    def _drain(self, version: ModelVersion) -> None:
        self._move(version, ModelState.DRAINING)
        if version.in_flight == 0:
            version.drained.set()

    def gone(self, version: ModelVersion) -> None:
        """DRAINING (or FAILED) -> GONE: its models are unloaded; it is forgotten."""
        if version.state is ModelState.READY and self._serving.get(version.name) is version:
            raise RuntimeError(f"{version.label} still serves")
        self._move(version, ModelState.GONE)
        self._versions.pop((version.name, version.served_id), None)

    def _forget_failures(self, name: str) -> None:
        for key, entry in list(self._versions.items()):
            if entry.name == name and entry.state is ModelState.FAILED:
                del self._versions[key]
