"""Which threads a CPU worker's batch runs on: its own, plus those of CPU workers that have
sat idle for a while.

A lone request then gets every core. Under load, workers are idle only between two batches,
and a borrowed thread would soon fight its own worker's next batch for a core (OpenMP waits
at every barrier for its slowest thread), so each worker keeps its own share.
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import Protocol

# A CPU worker lends its threads only once it has sat idle this long.
LEND_AFTER_IDLE_S = 0.05


class Lender(Protocol):
    """What the rule needs to know of a worker."""

    @property
    def device(self) -> str: ...

    @property
    def threads(self) -> int: ...

    @property
    def serving(self) -> bool:
        """Alive, ready and not running a batch."""
        ...

    @property
    def idle_since(self) -> float:
        """When it last became idle (``time.monotonic``)."""
        ...


def batch_threads(runner: Lender, others: Iterable[Lender], now: float) -> int:
    """Torch threads for the batch ``runner`` starts at ``now``: 0 (unchanged) on a GPU,
    else its own threads plus those of every other CPU worker idle since
    ``LEND_AFTER_IDLE_S`` or longer.

    >>> from types import SimpleNamespace as W
    >>> me = W(device="cpu", threads=1, serving=True, idle_since=0.0)
    >>> batch_threads(me, [W(device="cpu", threads=1, serving=True, idle_since=0.0)], 1.0)
    2
    >>> batch_threads(me, [W(device="cpu", threads=1, serving=True, idle_since=0.99)], 1.0)
    1
    """
    if runner.device != "cpu":
        return 0
    idle_before = now - LEND_AFTER_IDLE_S
    lent = sum(
        other.threads
        for other in others
        if other is not runner
        and other.device == "cpu"
        and other.serving
        and other.idle_since <= idle_before
    )
    return runner.threads + lent
