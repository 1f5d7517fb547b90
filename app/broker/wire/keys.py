"""The Redis keys front ends and workers share, all under one prefix (``MB_BROKER_PREFIX``),
so a Redis ACL user can be limited to ``~<prefix>:*``, and the timings both sides rely on."""

from __future__ import annotations

import re
from collections.abc import Iterable
from dataclasses import dataclass

from app.jobs import Task
from app.manifest import model_version

GROUP = "workers"  # the consumer group every worker joins, on every task's stream
# Workers heartbeat every HEARTBEAT_S; one silent for STALE_S counts as gone.
HEARTBEAT_S = 1.0
STALE_S = 3.0
# A reply list nobody reads (its front end died) expires this long after its last reply.
REPLY_TTL_S = 60
# What a lane adds to its task's stream name: its priority (1 is the highest) and tenant.
_LANE_SUFFIX = re.compile(r":p([1-9][0-9]{0,2})(?::([A-Za-z0-9_.-]{1,64}))?$")


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

    def lane(
        self, served_id: str, task: Task, level: int, tenant: str | None, *, own: bool = False
    ) -> str:
        """The stream a request of priority ``level`` (0: the highest) and ``tenant`` waits
        in (``app.broker.wire.lanes``): its task's stream for the highest level and no
        tenant (so a server without keys or levels has one stream per task, as before)
        unless ``own`` (that level has a policy the workers must read), else a stream of
        its own beside it, so workers can take the levels in order and the tenants in turn.

        >>> keys, served = Keys("mb"), "m@89e9be0d4f64"
        >>> keys.lane(served, Task.TAG, 1, "shop"), keys.lane(served, Task.TAG, 0, None)
        ('mb:{q}:89e9be0d4f64:tag:p2:shop', 'mb:{q}:89e9be0d4f64:tag')
        >>> keys.lane(served, Task.TAG, 0, None, own=True)
        'mb:{q}:89e9be0d4f64:tag:p1'
        """
        stream = self.stream(served_id, task)
        if level == 0 and tenant is None and not own:
            return stream
        return f"{stream}:p{level + 1}" + ("" if tenant is None else f":{tenant}")

    @staticmethod
    def base(stream: str) -> str:
        """The task's stream a lane belongs to (a task's stream is its own).

        >>> Keys.base("mb:{q}:89e9be0d4f64:tag:p2:shop"), Keys.base("mb:{q}:89e9be0d4f64:tag")
        ('mb:{q}:89e9be0d4f64:tag', 'mb:{q}:89e9be0d4f64:tag')
        """
        return _LANE_SUFFIX.sub("", stream)

    @staticmethod
    def lane_level(stream: str) -> int:
        """The priority level (0: the highest) of a lane's requests; a task's stream's: 0.

        >>> Keys.lane_level("mb:{q}:89e9be0d4f64:tag:p2:shop"), Keys.lane_level("mb:{q}:8:tag")
        (1, 0)
        """
        suffix = _LANE_SUFFIX.search(stream)
        return 0 if suffix is None else int(suffix.group(1)) - 1

    @staticmethod
    def lane_tenant(stream: str) -> str | None:
        """The tenant of a lane's requests (None: a task's stream, or a level's lane).

        >>> Keys.lane_tenant("mb:{q}:89e9be0d4f64:tag:p2:shop"), Keys.lane_tenant("mb:{q}:8:tag")
        ('shop', None)
        """
        suffix = _LANE_SUFFIX.search(stream)
        return None if suffix is None else suffix.group(2)

    def lanes_of(self, served_id: str, names: Iterable[str]) -> tuple[str, ...]:
        """Of ``names`` (a lanes hash's fields), the lanes of ``served_id``, sorted: a
        forged name (another key, another version's stream) is never read or counted."""
        own = self.streams(served_id)
        return tuple(sorted({n for n in names if n not in own and self.base(n) in own}))

    def lanes(self, served_id: str) -> str:
        """Hash: a version's lanes (stream name -> what it holds: ``app.broker.wire.lanes``),
        written by the front ends as they add to a lane, read by the workers."""
        return f"{self.prefix}:{{q}}:{model_version(served_id)}:lanes"

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

    def quota(self, tenant: str) -> str:
        """Hash: a tenant's token bucket (tokens, when), shared by every front end
        (``app.tenancy.quota``)."""
        return f"{self.prefix}:quota:{tenant}"

    def acl_rules(self) -> dict[str, str]:
        """The fewest rights each role needs, as ``ACL SETUSER <user> on >password <rules>``
        takes them (docs/scaling.md): a front end (its streams' entries in, its replies,
        the routes, the tenants' quotas; reads the workers' keys, writes no pin, reads no
        stream as a consumer),
        a worker (the streams as a consumer, the replies, its own keys; reads the pins and
        the routes) and an admin (a front end that also writes the pins:
        ``MB_BROKER_ADMIN``). No role may run the dangerous commands (FLUSHALL, KEYS,
        CONFIG...) or touch a key outside the prefix."""
        p = self.prefix
        commands = (
            "resetchannels -@all +@read +@write +@stream +@list +@hash +@sortedset +@string "
            "+@scripting +@connection +@transaction -@dangerous +info +time"
        )
        consumer = "-xreadgroup -xack -xclaim -xautoclaim -xgroup"
        # The live workers' keys are read by a script (EVAL, whose declared keys need
        # write rights too); the rest of the workers' keys, the pins among them, read-only.
        front = (
            f"resetkeys ~{p}:{{q}}:* ~{p}:replies:* ~{p}:routes ~{p}:{{w}}:workers "
            f"~{p}:{{w}}:worker-info %R~{p}:{{w}}:* ~{p}:quota:*"
        )
        worker = (
            f"resetkeys ~{p}:{{q}}:* ~{p}:replies:* %R~{p}:routes %R~{p}:{{w}}:pins "
            f"%R~{p}:{{w}}:pins-seq ~{p}:{{w}}:workers ~{p}:{{w}}:worker-info "
            f"~{p}:{{w}}:precisions ~{p}:{{w}}:loading:*"
        )
        pins = f"~{p}:{{w}}:pins ~{p}:{{w}}:pins-seq"
        return {
            "front-end": f"{front} {commands} {consumer}",
            "worker": f"{worker} {commands}",
            "admin": f"{front} {pins} {commands} {consumer}",
        }
