"""The Redis keys front ends and workers share, all under one prefix (``MB_BROKER_PREFIX``),
so a Redis ACL user can be limited to ``~<prefix>:*``, and the timings both sides rely on."""

from __future__ import annotations

from dataclasses import dataclass

from app.jobs import Task

GROUP = "workers"  # the consumer group every worker joins, on every task's stream
# Workers heartbeat every HEARTBEAT_S; one silent for STALE_S counts as gone.
HEARTBEAT_S = 1.0
STALE_S = 3.0
# A reply list nobody reads (its front end died) expires this long after its last reply.
REPLY_TTL_S = 60


@dataclass(frozen=True)
class Keys:
    """Key names under one prefix, the streams also under the served export's digest.

    >>> keys = Keys("mb", "89e9be0d4f64")
    >>> keys.stream(Task.TAG), keys.replies("fe1")
    ('mb:{q}:89e9be0d4f64:tag', 'mb:replies:fe1')
    """

    prefix: str
    model: str  # the served export's version (``Manifest.version``)

    def stream(self, task: Task) -> str:
        """One stream per task, so a batch never mixes endpoints, and per export, so front
        ends and workers of two exports never meet (their vectors never mix). The ``{q}``
        hash tag keeps the streams in one slot (the admission script reads them together)."""
        return f"{self.prefix}:{{q}}:{self.model}:{task.value}"

    @property
    def streams(self) -> tuple[str, ...]:
        return tuple(self.stream(task) for task in Task)

    def replies(self, frontend: str) -> str:
        """The list one front-end process reads its replies from."""
        return f"{self.prefix}:replies:{frontend}"

    @property
    def heartbeats(self) -> str:
        """Sorted set: worker name -> Redis time (ms) of its last heartbeat. (One hash tag
        with ``worker_info``: the heartbeat script writes both.)"""
        return f"{self.prefix}:{{w}}:workers"

    @property
    def worker_info(self) -> str:
        """Hash: worker name -> JSON of what it is and what it has run."""
        return f"{self.prefix}:{{w}}:worker-info"
