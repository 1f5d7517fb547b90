"""Broker mode when Redis fails over (issue #49): a primary, two replicas and three Sentinels
(``tests.sentinel``), two front ends and two workers following the primary through
``redis+sentinel://``, 16 clients sending photos, and the three faults: ``SENTINEL
FAILOVER``, ``kill -9`` of the primary, ``SIGSTOP`` of it past Sentinel's down-after (then
``SIGCONT``: it comes back as a replica). A rollout is asked just before one of them.

Invariants: every request gets one answer, 200 or a typed 503, before its deadline plus
``GRACE_S``; no answer carries another request's result; serving resumes within 5 s of the
Sentinels' electing a new primary (down-after + 5 s of the fault, when the election takes
no longer than down-after: on a busy host it may); no entry stays pending; no process is
lost; the rollout completes. ``make test`` runs each fault once; ``make chaos`` three times
each, then again over TLS with one ACL user per role, and prints the figures per fault
(``FAILOVER_ROUNDS``, ``FAILOVER_TLS``)."""

from __future__ import annotations

import asyncio
import itertools
import os
import signal
import time
from collections import Counter
from dataclasses import dataclass, field
from pathlib import Path

import httpx
import numpy as np
import pytest

from app.broker.wire.keys import Keys
from tests.answers import metric
from tests.broker import PREFIX, Workers, broker_env, make_tls_files, stream_state
from tests.conftest import distinct_images, expected_for
from tests.integration.test_broker_rollout import served_id
from tests.integration.test_repository import add_version
from tests.models import export_scaled, export_tiny
from tests.sentinel import SentinelSet
from tests.server import ServerProcess
from tests.waiting import wait_for

pytestmark = pytest.mark.slow

ROUNDS = int(os.environ.get("FAILOVER_ROUNDS", "1"))
FAULTS = tuple(os.environ.get("FAILOVER_FAULTS", "failover,kill,stop").split(","))
DEADLINE_S = 10.0  # MB_REQUEST_TIMEOUT: each request's deadline
GRACE_S = 5.0  # an answer later than its deadline by more than this counts as none
RESUMED_S = 5.0  # the longest the load may go without a 200 once a new primary is elected
CLIENTS = 16
IMAGES = distinct_images(32)
REFUSALS = {"broker_unavailable", "worker_died", "queue_full", "not_ready"}
ADMIN = {"Authorization": "Bearer admin-secret"}


@dataclass
class Answer:
    sent: float
    done: float
    status: int | None  # None: no answer before the deadline plus the grace
    kind: str  # "ok", the refusal's type, or what the client saw


@dataclass
class Figures:
    """One fault's figures, from the answers to the requests sent during it."""

    fault: str
    ok: int = 0
    refused: Counter[str] = field(default_factory=Counter)
    unanswered: int = 0
    without_200_s: float = 0.0  # the longest the load went without a 200, election included
    elected_s: float = 0.0  # from the fault until the Sentinels named a new primary
    after_election_s: float = 0.0  # the longest without a 200 from then on
    resent: float = 0.0  # the front ends' counters (microbatch_broker_events)
    lost: float = 0.0
    redelivered: int = 0
    primary_s: float = 0.0  # until the Sentinels agreed on a new primary, replicas in sync


class Load:
    """``CLIENTS`` clients, each sending photo after photo to the front ends in turn, every
    answer checked against the vector its version computes."""

    def __init__(self, bases: list[str], scales: dict[str, float], store: Path) -> None:
        self.bases, self.scales = bases, scales
        self.expected = [expected_for(image, store) for image in IMAGES]
        self.answers: list[Answer] = []
        self.mixed: list[str] = []
        self.messages: Counter[str] = Counter()  # what the refusals said
        self.stop = asyncio.Event()

    async def run(self) -> None:
        await asyncio.gather(*(self._client(i) for i in range(CLIENTS)))

    async def _client(self, offset: int) -> None:
        async with httpx.AsyncClient(timeout=DEADLINE_S + GRACE_S) as http:
            sent = offset
            while not self.stop.is_set():
                index, base = sent % len(IMAGES), self.bases[sent % len(self.bases)]
                sent += 1
                started = time.monotonic()
                try:
                    answer = await http.post(
                        f"{base}/predict/embedding", files={"image": ("x.png", IMAGES[index])}
                    )
                except httpx.TimeoutException:
                    self.answers.append(Answer(started, time.monotonic(), None, "timeout"))
                    continue
                except httpx.TransportError as exc:  # a front end must never drop a socket
                    self.answers.append(Answer(started, time.monotonic(), None, repr(exc)))
                    continue
                self.answers.append(Answer(started, time.monotonic(), *self._judged(index, answer)))

    def _judged(self, index: int, answer: httpx.Response) -> tuple[int, str]:
        if answer.status_code != 200:
            try:
                kind = answer.json()["error"]["type"]
                self.messages[f"{kind}: {answer.json()['error']['message'][:90]}"] += 1
            except Exception:
                kind = f"untyped: {answer.text[:100]}"
            if answer.status_code == 503 and "Retry-After" not in answer.headers:
                kind = f"{kind} without Retry-After"
            return answer.status_code, kind
        scale = self.scales.get(answer.headers["X-Model-Id"])
        if scale is None or not np.allclose(answer.json(), scale * self.expected[index], atol=1e-4):
            self.mixed.append(f"image {index} from {answer.headers['X-Model-Id']}")
        return 200, "ok"

    def figures(self, fault: str, start: float, elected: float, end: float) -> Figures:
        """The figures of the requests sent in [start, end); a new primary was elected at
        ``elected``."""
        during = [a for a in self.answers if start <= a.sent < end]
        figures = Figures(fault)
        for answer in during:
            if answer.status == 200:
                figures.ok += 1
            elif answer.status is None:
                figures.unanswered += 1
            else:
                figures.refused[answer.kind] += 1
        oks = sorted(a.done for a in self.answers if a.status == 200 and start <= a.done < end)
        figures.without_200_s = max(b - a for a, b in itertools.pairwise([start, *oks, end]))
        later = [done for done in oks if done > elected]
        figures.after_election_s = max(b - a for a, b in itertools.pairwise([elected, *later, end]))
        figures.elected_s = elected - start
        return figures


def _metric(base: str, name: str, label: str) -> float:
    return metric(httpx.get(f"{base}/metrics", timeout=10).text, f"{name}_total", event=label)


def _reclaimed(workers: Workers) -> int:
    return sum(int(beat["reclaimed"]) for beat in workers.live().values())


async def _fault(redis_set: SentinelSet, fault: str) -> tuple[float, float]:
    """Make ``fault`` happen, and wait until the set has healed: when the Sentinels named a
    new primary (``time.monotonic()``, seen within 0.1 s), and the seconds until they agreed
    on it with both replicas in sync."""
    await asyncio.to_thread(redis_set.settled)
    old = redis_set.primary_port()
    assert old is not None
    if fault == "failover":
        redis_set.failover()
        healed_s = await asyncio.to_thread(redis_set.after_fault, old)
        return redis_set.elected_at, healed_s
    if fault == "kill":
        victim = redis_set.kill_primary()
        started = time.monotonic()
        await asyncio.to_thread(redis_set.restart, victim)
        await asyncio.to_thread(redis_set.after_fault, old)
        return redis_set.elected_at, time.monotonic() - started
    stopped = redis_set.primary()
    stopped.signal(signal.SIGSTOP)
    started = time.monotonic()
    try:
        await asyncio.to_thread(
            redis_set.wait, lambda: redis_set.primary_port() not in (None, old), "a primary", 30
        )
        elected = time.monotonic()
    finally:
        stopped.signal(signal.SIGCONT)  # it comes back, and is made a replica
    await asyncio.to_thread(redis_set.after_fault, old)
    return elected, time.monotonic() - started


def _users() -> dict[str, str]:
    """One ACL user per role, with the rules docs/scaling.md gives (``Keys.acl_rules``)."""
    return {role: f">{role}-pw {rules}" for role, rules in Keys(PREFIX).acl_rules().items()}


@pytest.mark.timeout(240 + 150 * ROUNDS)
@pytest.mark.parametrize(
    "secured",
    [False, *([True] if os.environ.get("FAILOVER_TLS") else [])],
    ids=lambda secured: "tls-acl" if secured else "plain",
)
async def test_every_request_is_answered_once_across_failovers(
    secured: bool, tmp_path: Path
) -> None:
    repository = tmp_path / "models"
    v1 = export_tiny(repository / "tiny" / "1")
    tls = make_tls_files(tmp_path) if secured else None
    with SentinelSet(tls=tls, acl=_users() if secured else None) as redis_set:
        urls = {role: redis_set.url for role in ("worker", "front-end", "admin")}
        if secured:
            urls = {role: redis_set.url_as(role, f"{role}-pw") for role in urls}
        workers = Workers(redis_set, repository, count=2, MODEL_REPOSITORY=str(repository),  # type: ignore[arg-type]
                          MB_BROKER=urls["worker"])  # fmt: skip
        env = broker_env(urls["front-end"], v1, MODEL_REPOSITORY=str(repository),
                         ADMIN_API_KEY="admin-secret", MB_REQUEST_TIMEOUT=str(DEADLINE_S),
                         MB_BROKER_ADMIN=urls["admin"])  # fmt: skip
        with workers, ServerProcess(**env) as first, ServerProcess(**env) as second:
            pids = {beat["pid"] for beat in workers.live().values()}
            bases = [first.base_url, second.base_url]
            load = Load(bases, {served_id(v1): 1.0}, v1)
            running = asyncio.create_task(load.run())
            table: list[Figures] = []
            rollout: asyncio.Task[httpx.Response] | None = None
            v2: Path | None = None
            try:
                await asyncio.sleep(2)
                for round_ in range(ROUNDS):
                    for fault in FAULTS:
                        if round_ == 0 and fault == "kill":  # a rollout asked just before
                            v2 = add_version(repository, "tiny", lambda o: export_scaled(o, 2.0))
                            load.scales[served_id(v2)] = 2.0
                            seq = await asyncio.to_thread(_pins_seq, redis_set)
                            rollout = asyncio.create_task(_roll_out(first.base_url))
                            await wait_for(lambda seq=seq: _pins_seq(redis_set) != seq,
                                           what="the rollout asked")  # the fault meets it  # fmt: skip
                        before = [sum(_metric(b, "microbatch_broker_events", e) for b in bases)
                                  for e in ("resent", "lost")]  # fmt: skip
                        reclaimed = _reclaimed(workers)
                        start = time.monotonic()
                        elected, healed_s = await _fault(redis_set, fault)
                        await asyncio.sleep(RESUMED_S + 1)  # the load goes on after it healed
                        figures = load.figures(fault, start, elected, time.monotonic())
                        figures.primary_s = healed_s
                        figures.resent, figures.lost = (
                            sum(_metric(b, "microbatch_broker_events", e) for b in bases) - was
                            for e, was in zip(("resent", "lost"), before, strict=True)
                        )
                        figures.redelivered = _reclaimed(workers) - reclaimed
                        table.append(figures)
            finally:
                load.stop.set()
                await running
            rolled: httpx.Response | httpx.HTTPError | None = None
            if rollout is not None:
                try:
                    rolled = await rollout
                except httpx.HTTPError as exc:  # judged below, once the logs are at hand
                    rolled = exc
            # Nothing left pending, nobody lost: the same two workers, both front ends up.
            deadline = time.monotonic() + 20
            while any(state != (0, 0) for state in stream_state(redis_set).values()):  # type: ignore[arg-type]
                assert time.monotonic() < deadline, stream_state(redis_set)  # type: ignore[arg-type]
                await asyncio.sleep(0.2)
            # Both heartbeat on the last primary (the same two pids, unless one was restarted).
            while len(workers.live()) < 2 and time.monotonic() < deadline:
                await asyncio.sleep(0.2)
            pids_after = {beat["pid"] for beat in workers.live().values()}
            alive = [p.process is not None and p.process.poll() is None
                     for p in (workers, first, second)]  # fmt: skip
    _print(table, secured)
    logs = "\n".join(
        f"--- {name}:\n" + "\n".join(process.output.splitlines()[-300:])
        for name, process in (("front end 1", first), ("front end 2", second), ("workers", workers))
    )
    held = [
        f.unanswered == 0
        and set(f.refused) <= REFUSALS
        and f.after_election_s <= RESUMED_S
        and f.ok
        for f in table
    ]
    rolled_out = rollout is None or (
        isinstance(rolled, httpx.Response) and rolled.status_code == 200
    )
    if not all(held) or not rolled_out or pids_after != pids or not all(alive):
        print(logs)  # pytest shows it with the failure
    if rollout is not None:
        assert isinstance(rolled, httpx.Response), f"the rollout got no answer: {rolled!r}"
        assert rolled.status_code == 200, rolled.text
        assert v2 is not None and rolled.json()["model_id"] == served_id(v2)
    assert pids_after == pids, "a worker died, and was restarted"
    assert all(alive), "a process of the test's deployment ended"
    assert not load.mixed, load.mixed[:5]
    for figures in table:
        assert figures.unanswered == 0, figures
        assert set(figures.refused) <= REFUSALS, figures
        assert figures.after_election_s <= RESUMED_S, figures
        assert figures.ok > 0, figures


def _pins_seq(redis_set: SentinelSet) -> int:
    """The number the admin route bumps when it asks the workers to look again."""
    return int(redis_set.client().hget(Keys(PREFIX).pins_seq, "seq") or 0)


async def _roll_out(base: str) -> httpx.Response:
    async with httpx.AsyncClient(timeout=180) as http:
        return await http.post(f"{base}/v2/repository/models/tiny/load", headers=ADMIN)


def _print(table: list[Figures], secured: bool) -> None:
    print(f"\nRedis failovers ({'TLS, ACL users' if secured else 'plain'}), {CLIENTS} clients:")
    print(f"{'fault':<10}{'200':>7}{'refused':>9}{'none':>6}{'no 200 s':>10}{'elected s':>11}"
          f"{'then':>6}{'healed s':>10}{'resent':>8}{'lost':>6}{'redeliv.':>10}  refusals")  # fmt: skip
    for f in table:
        refused = sum(f.refused.values())
        kinds = ", ".join(f"{k} {n}" for k, n in f.refused.most_common())
        print(f"{f.fault:<10}{f.ok:>7}{refused:>9}{f.unanswered:>6}{f.without_200_s:>10.1f}"
              f"{f.elected_s:>11.1f}{f.after_election_s:>6.1f}{f.primary_s:>10.1f}"
              f"{f.resent:>8.0f}{f.lost:>6.0f}{f.redelivered:>10}  {kinds}")  # fmt: skip
