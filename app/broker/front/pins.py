"""What a front end knows the fleet's admin route chose (``app.broker.wire.control``): the
pins as its last look at Redis read them, and its own writes since, each as Redis stamped
it. When another Redis answers (a failover that lost the last writes, or a restart that
lost them all), the front end writes this back (``restore_pins``): each name takes the
later of what Redis has and what the front end knew, whoever wrote it. Every front end
restores the fleet's pins as it last saw them, not only its own, so the order in which
they come back does not matter, and a pin written on the new primary is never undone.
"""

from __future__ import annotations

import time
from collections.abc import Mapping
from typing import Any

from app.broker.wire.control import later
from app.broker.wire.parsing import text

# After another Redis answers, the restore is asked again at each look for this long: a
# write the old primary answered late (it was paused, not dead) is then written back too.
RESTORE_S = 10.0


class KnownPins:
    """The pins' fields as last seen or written, and the highest sequence number known.

    >>> known = KnownPins()
    >>> known.seen({b"tagger": b'{"version": 2, "at": 5}'}, seq=4)
    >>> known.wrote("tagger", '{"cleared": true, "at": 9}', seq=5)
    >>> known.fields(), known.seq
    ({'tagger': '{"cleared": true, "at": 9}'}, 5)
    """

    def __init__(self) -> None:
        self._seen: dict[str, str] = {}  # the pins hash at the last look before any loss
        self._written: dict[str, str] = {}  # this front end's own writes, as Redis stamped them
        self.seq = 0  # the highest sequence number seen or written
        self.due = False  # another Redis answers: a restore is to be asked for
        self._until = 0.0  # monotonic time until which a restore is asked at each look

    def seen(self, fields: Mapping[Any, Any], seq: int) -> None:
        """A look's read of the pins (not once another Redis answers, until restored)."""
        if not self.due:
            self._seen = {text(name): text(raw) for name, raw in fields.items()}
            self.seq = max(self.seq, seq)

    def wrote(self, name: str, raw: str, seq: int) -> None:
        self._written[name] = raw
        self.seq = max(self.seq, seq)

    def asked(self, seq: int) -> None:
        """A reload asked of every worker (the sequence bumped): redone if lost."""
        self.seq = max(self.seq, seq)

    def lost(self) -> None:
        """Another Redis answers: what it lacks is written back, from now and for a while."""
        self.due = True
        self._until = time.monotonic() + RESTORE_S

    @property
    def restoring(self) -> bool:
        """Whether a restore is to be asked at this look."""
        return self.due or time.monotonic() < self._until

    def restored(self, seq: int) -> None:
        self.due = False
        self.seq = max(self.seq, seq)

    def fields(self) -> dict[str, str]:
        """For each name, the later of the field seen and the one written."""
        return later(self._seen, self._written)
