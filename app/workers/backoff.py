"""How long to wait before restarting a worker that died: capped exponential delays, used by
the in-process pool and by the broker workers' supervisor (``python -m app.broker.worker``).

They differ in when a worker has shown that it works (``reset``): the pool resets a slot as
soon as its worker answers a batch; the supervisor, which sees no batches, resets a slot whose
worker ran at least ``STABLE_S`` (a minute) before it died."""

from __future__ import annotations


class RestartBackoff:
    """Capped exponential delays per worker index, reset once a worker has shown it works.

    >>> backoff = RestartBackoff(first_s=0.5, cap_s=30.0)
    >>> [backoff.next_delay(0) for _ in range(4)], backoff.next_delay(1)
    ([0.5, 1.0, 2.0, 4.0], 0.5)
    >>> backoff.reset(0)
    >>> backoff.next_delay(0), [backoff.next_delay(2) for _ in range(8)][-1]
    (0.5, 30.0)
    """

    def __init__(self, first_s: float = 0.5, cap_s: float = 30.0) -> None:
        self.first_s = first_s
        self.cap_s = cap_s
        self._failures: dict[int, int] = {}

    def next_delay(self, index: int) -> float:
        """The wait before restarting worker ``index`` now; each call counts one more failure."""
        failures = self._failures.get(index, 0)
        self._failures[index] = failures + 1
        return min(self.cap_s, self.first_s * 2.0**failures)

    def reset(self, index: int) -> None:
        """Worker ``index`` works (it answered, or it ran a good while): start afresh."""
        self._failures.pop(index, None)
