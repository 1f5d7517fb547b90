"""The Redis keys front ends and workers share, all under one prefix (``MB_BROKER_PREFIX``),
so a Redis ACL user can be limited to ``~<prefix>:*``, and the timings both sides rely on."""

from __future__ import annotations

from dataclasses import dataclass

from app.jobs import Task
from app.manifest import model_version

GROUP = "workers"  # the consumer group every worker joins, on every task's stream
# Workers heartbeat every HEARTBEAT_S; one silent for STALE_S counts as gone.
HEARTBEAT_S = 1.0
STALE_S = 3.0
# A reply list nobody reads (its front end died) expires this long after its last reply.
REPLY_TTL_S = 60


@dataclass(frozen=True)
class Keys:
    """Key names under one prefix; a model version's streams also under its served id's
    version part (the export's digest, and precision).

    >>> keys = Keys("mb")
    >>> keys.stream("efficientnet_lite0@89e9be0d4f64", Task.TAG), keys.replies("fe1")
    ('mb:{q}:89e9be0d4f64:tag', 'mb:replies:fe1')
    """

    prefix: str

    def stream(self, served_id: str, task: Task) -> str:
        """One stream per task, so a batch never mixes endpoints, and per served id, so two
        models, versions or precisions never share a batch (their vectors never mix). The
        ``{q}`` hash tag keeps every stream in one slot (the admission script reads them
        together)."""
        return f"{self.prefix}:{{q}}:{model_version(served_id)}:{task.value}"

    def streams(self, served_id: str) -> tuple[str, ...]:
        """The served id's streams, one per task."""
        return tuple(self.stream(served_id, task) for task in Task)

    @property
    def routes(self) -> str:
        """Hash: model name -> the version it served last (JSON), as front ends saw the
        workers' heartbeats: what a front end routes to while no worker is live
        (``MB_SCALE_FROM_ZERO``)."""
        return f"{self.prefix}:routes"

    @property
    def pins(self) -> str:
        """Hash: model name -> what the admin route chose for it (``app.broker.wire.control``)."""
        return f"{self.prefix}:{{w}}:pins"

    @property
    def pins_seq(self) -> str:
        """Hash: ``seq`` -> a number every change of ``pins`` bumps."""
        return f"{self.prefix}:{{w}}:pins-seq"

    @property
    def precisions(self) -> str:
        """Hash: export (model id) -> the precision the fleet serves it in
        (``app.broker.wire.control.Precisions``)."""
        return f"{self.prefix}:{{w}}:precisions"

    def loading(self, host: str) -> str:
        """The prefix of the slots a host's workers hold while they load a model (at most
        ``app.lifecycle.LOADERS_PER_HOST`` at a time), so its other workers serve meanwhile."""
        return f"{self.prefix}:{{w}}:loading:{host}"

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
