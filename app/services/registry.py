"""The model registry of one HTTP process: every version it knows, each as a
``app.lifecycle.VersionLife`` moved only by the methods here, which version each name serves,
and the leases of the requests admitted for each.

    LOADING --ready()--> READY --switch()--> SERVING --switch() to another, retire()--> DRAINING
    LOADING --failed()--> FAILED   (what served before serves on; a retry loads it afresh)
    DRAINING --switch()--> SERVING   (a rollback before it was unloaded: no load needed)
    DRAINING --gone()--> UNLOADED    (forgotten: the index shows it on disk again)

A request resolves its model once, when it is admitted (``admit``): by name (``?model=``, or
the default), or pinned to an exact served id (``X-Model-Id``), and holds a lease on that
version until it is answered. A switch is one assignment, with no ``await`` between the check
and the write, so a request sees the old version or the new, never neither. A version that
stops serving drains: it takes no new request, and ``drained`` is set once the last lease on
it is released; only then may its models be unloaded.

Versions are known by name and number: a version that failed its checks is its own row, even
when its manifest claims the served id of another (a corrupted copy).

No asyncio waits, no I/O: ``app.services.models`` moves it as the workers load and drain.
"""

from __future__ import annotations

import asyncio
from collections.abc import Iterable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field

from app.errors import InvalidRequest, ModelNotFound, ModelVersionUnavailable, NotReady
from app.lifecycle import VersionLife, VersionState
from app.manifest import Manifest
from app.repository import check_name
from app.services.predictor import Predictor


@dataclass(eq=False)
class ModelVersion(VersionLife):
    """One version of one model, as the registry knows it: its life, and once ready what
    answers for it and the requests admitted for it."""

    manifest: Manifest | None = None
    predictor: Predictor | None = None  # once READY
    in_flight: int = 0  # requests admitted for it and not yet answered
    drained: asyncio.Event = field(default_factory=asyncio.Event)
    drains: int = 0  # how many times it started draining (a rollback may serve it again)


def numbered(version: ModelVersion, number: str) -> bool:
    """Whether ``number`` names ``version``: its number, or its served id's version part,
    or (a TorchServe archive imported) the archive's own version, as its clients name it
    (``/predictions/densenet161/1.0``), unless that is a whole number, which would be
    another version's repository number."""
    if number in (str(version.version), version.served_id.rsplit("@", 1)[-1]):
        return True
    imported = getattr(version.manifest, "imported", None)  # none yet while it loads
    return imported is not None and number == imported.model_version and not number.isdigit()


class ModelRegistry:
    """The versions known, by name and served id, and each name's serving version.

    >>> # registry = ModelRegistry(default_name="tagger")
    >>> # entry = registry.loading("tagger", 2, "resnet50@1a2b3c4d5e6f")
    >>> # registry.ready(entry, manifest, predictor); old = registry.switch(entry)
    >>> # with registry.admit(None, None) as version: ...   # the default name's version
    """

    def __init__(self, default_name: str | None = None) -> None:
        self.default_name = default_name
        self._versions: dict[tuple[str, int], ModelVersion] = {}  # (name, number)
        self._serving: dict[str, ModelVersion] = {}  # name -> its SERVING version
        self._known: set[str] = set()  # every name ever asked to load (for 404 vs 503)

    # -- what is there -----------------------------------------------------------------------

    def versions(self) -> list[ModelVersion]:
        """Every version known, by name then version number."""
        return sorted(self._versions.values(), key=lambda v: (v.name, v.version))

    def names(self) -> list[str]:
        """The names that serve a version now."""
        return sorted(self._serving)

    def serving(self, name: str) -> ModelVersion | None:
        return self._serving.get(name)

    def get(self, name: str, number: int) -> ModelVersion | None:
        return self._versions.get((name, number))

    def holders(self, served_id: str) -> list[ModelVersion]:
        """The versions, under any name, that are this export and still hold its models
        (loading, ready, serving or draining)."""
        return [
            v for v in self._versions.values() if v.served_id == served_id and v.state.holds_models
        ]

    def in_use(self, served_id: str) -> bool:
        """Whether requests here may still use ``served_id`` (a version of it serves, or
        drains): its workers must not unload it yet."""
        return bool(self.holders(served_id))

    def of_export(self, name: str, served_id: str) -> ModelVersion | None:
        """``name``'s version that is this export and holds its models, if any (under
        whatever number it was published as)."""
        return next((v for v in self.holders(served_id) if v.name == name), None)

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
        served: never a substitute; ``NotReady`` (503) while a name that will serve serves
        nothing yet, pinned or not."""
        if name is not None:
            check_name(name)
        if pinned is not None:  # any name's, unless the request names one
            version = self._pinned(name, pinned)
            if number is not None and not numbered(version, number):
                raise ModelVersionUnavailable(
                    f"{pinned[:200]!r} is {version.label}, not version {number[:20]!r}"
                )
            return version
        if name is None:
            name = self._default_name()
            if name is None and not self._known:
                raise ModelNotFound("no model is served here (the admin route unloaded it)")
            if name is None:
                raise InvalidRequest(
                    f"this server serves several models ({', '.join(self.names())}): name one "
                    "with ?model=NAME"
                )
        serving = self._serving.get(name)
        if serving is not None:
            if number is not None and not numbered(serving, number):
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
        if not ready and self._known:  # nothing serves yet (a start, a replace): as unpinned
            said = f"model {name!r}" if name else "this server"
            raise NotReady(f"{said} has no version ready now", retry_after_s=2)
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
            if version.in_flight == 0 and version.state is VersionState.DRAINING:
                version.drained.set()

    def expect(self, names: Iterable[str]) -> None:
        """Names that will serve (a broker front end, before the workers say so): a request
        for one gets 503 until then, not 404."""
        self._known.update(names)

    # -- moves -------------------------------------------------------------------------------

    def loading(self, name: str, number: int, served_id: str) -> ModelVersion:
        """A load of ``name``'s version ``number`` begins: a new row, or one that failed or
        was unloaded before loads afresh. A version already loading, ready, serving or
        draining is returned as it is (under another id: ``reexported`` says which)."""
        self._known.add(name)
        key = (name, number)
        entry = self._versions.get(key)
        if entry is not None and entry.state.holds_models:
            return entry
        if entry is None or entry.served_id != served_id:
            entry = self._versions[key] = ModelVersion(name, number, served_id)
        entry.move(VersionState.LOADING)
        return entry

    def ready(self, version: ModelVersion, manifest: Manifest, predictor: Predictor) -> None:
        """LOADING -> READY: loaded everywhere it must be; not serving until ``switch``."""
        version.move(VersionState.READY)
        version.manifest, version.predictor = manifest, predictor

    def reexported(
        self, version: ModelVersion, served_id: str, manifest: Manifest, predictor: Predictor
    ) -> None:
        """``version`` (serving or draining) as the workers hold it now: another export or
        precision under its number (a mixed fleet's other precision, a front end's own
        reading replaced by the workers'). Its id, manifest and predictor change in one
        step, its state does not: requests admitted before finish on the predictor they
        hold, and a pin of the id it had gets 409 from now on."""
        version.served_id, version.manifest, version.predictor = served_id, manifest, predictor

    def failed(self, version: ModelVersion, step: str, reason: str) -> None:
        """LOADING -> FAILED, at ``step``, with the reason (``/info``, the index)."""
        version.move(VersionState.FAILED, step, reason)

    def gave_up(self, name: str) -> None:
        """The workers gave a load of ``name`` up: unless a version of it serves or is on
        its way (loading, ready), the name is unknown again (404), not coming (503 with
        Retry-After, which would have a client retry for nothing)."""
        coming = any(
            v.name == name and v.state in (VersionState.LOADING, VersionState.READY)
            for v in self._versions.values()
        )
        if name not in self._serving and not coming:
            self._known.discard(name)

    def switch(self, version: ModelVersion) -> ModelVersion | None:
        """Make ``version`` (READY, or DRAINING: a rollback before it was unloaded) the one
        its name serves, in one step; the version it replaces starts draining and is
        returned (None if there was none). Failures of the name's older versions are
        forgotten: what failed before the one serving now no longer matters."""
        old = self._serving.get(version.name)
        if old is version:
            return None
        if version.state is VersionState.DRAINING:
            version.drained.clear()
        version.move(VersionState.SERVING)
        self._serving[version.name] = version  # the switch: one assignment
        for key, entry in list(self._versions.items()):
            failed = entry.state is VersionState.FAILED
            if failed and entry.name == version.name and entry.version < version.version:
                del self._versions[key]
        if old is None:
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
        if version.version == number:
            return
        self._versions.pop((version.name, version.version), None)
        version.version = number
        self._versions[(version.name, number)] = version

    def _drain(self, version: ModelVersion) -> None:
        version.move(VersionState.DRAINING)
        version.drains += 1
        if version.in_flight == 0:
            version.drained.set()

    def gone(self, version: ModelVersion) -> None:
        """DRAINING (or READY, never served) -> UNLOADED: its models are unloaded; it is
        forgotten (the index shows it on disk again)."""
        version.move(VersionState.UNLOADED)
        if self._versions.get((version.name, version.version)) is version:
            del self._versions[(version.name, version.version)]
