"""A model-based test of a model version's whole lifecycle, against real servers: hypothesis
drives a deployment through random sequences of steps (publish a version, good or corrupt;
load one by the admin route, by SIGHUP or by the repository poll; unload; roll back; kill a
worker) while clients send requests, and checks after every step that

- every answer is a 200 or a refusal documented for the reason it had (404 for a name that
  serves nothing, 409 for a pin that is not served, 422 for a load that failed, 503 only while
  no version of the name is loaded or a worker just died);
- an answer's ``X-Model-Id`` names what computed it (its embedding is that export's, within
  its precision's tolerance), and is the id the lifecycle says its name serves;
- every protocol agrees (``/predict``, v2 JSON, v2 binary and gRPC with Triton's clients,
  TorchServe's ``/predictions``), and pins by served id (with and without the precision
  suffix) are served or refused as documented;
- ``/readyz`` and the repository index tell the truth, and no worker process is orphaned.

It runs in-process with one and two workers and in broker mode (a real Redis, two workers;
and behind Sentinel, its primary killed between steps), under each outcome of the precision choice (``MB_DTYPE=auto`` picking fp32, picking bf16,
and int8 exports beside their fp32 sources). ``make test`` runs one fixed sequence per
deployment (``derandomize``); ``make chaos`` runs many random ones (``LIFECYCLE_EXAMPLES``,
``LIFECYCLE_STEPS``). A failing sequence is shrunk to a short reproduction, which becomes a
plain test in ``test_lifecycle_found.py``.
"""

from __future__ import annotations

import os
import shutil
import tempfile
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import httpx
import pytest
from hypothesis import HealthCheck, Phase, settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, invariant, precondition, rule

from app.broker.wire.keys import Keys
from app.jobs import Task
from app.manifest import split_served_id
from tests.answers import metric
from tests.broker import PREFIX
from tests.lifecycle import (
    ADMIN,
    IMAGES,
    NAME,
    PRIORITY,
    Answer,
    Catalog,
    Config,
    Deployment,
    Export,
    Mode,
    Outcome,
    Traffic,
    computed_by,
    http_embedding,
    http_tag,
    predictions,
    publish,
    statuses,
    triton_binary,
    triton_grpc,
    until,
    v2_json,
)

pytestmark = pytest.mark.slow

UNLOADED = "unloaded"
FAILING_OVER = frozenset({"worker_died", "broker_unavailable"})  # 503s while Redis fails over
EXAMPLES = int(os.environ.get("LIFECYCLE_EXAMPLES", "2"))
STEPS = int(os.environ.get("LIFECYCLE_STEPS", "8"))
EXPLORE = "LIFECYCLE_EXAMPLES" in os.environ  # make chaos: random sequences, not one fixed
SHRINK = os.environ.get("LIFECYCLE_SHRINK", "1") != "0"  # 0: report the sequence as found

# make test: each mode, each precision outcome, each loading trigger at least once.
CONFIGS = [
    Config("inprocess", 1, "bf16"),
    Config("inprocess", 2, "fp32", poll=True),
    Config("inprocess", 2, "int8"),
    Config("broker", 2, "fp32"),
    Config("broker", 2, "bf16", poll=True),
    Config("broker", 2, "int8"),
    Config("broker", 2, "bf16", sentinel=True),
]
# make test: one deployment explored by hypothesis, in a fixed (derandomized) way; its first
# sequence is the simplest there is, its second a random one.
EXPLORED = [Config("inprocess", 2, "bf16")]
if EXPLORE:  # make chaos: every mode under every outcome (bf16 with the poll on)
    DEPLOYMENTS: list[tuple[Mode, int]] = [("inprocess", 1), ("inprocess", 2), ("broker", 2)]
    OUTCOMES: list[Outcome] = ["fp32", "bf16", "int8"]
    CONFIGS = EXPLORED = [
        Config(mode, workers, outcome, poll=outcome == "bf16")
        for mode, workers in DEPLOYMENTS
        for outcome in OUTCOMES
    ]


class Expected:
    """What the lifecycle must do, as the documentation says: the versions on disk, what the
    admin route chose, and the version ``NAME`` serves."""

    def __init__(self, first: Export) -> None:
        self.on_disk: dict[int, Export] = {1: first}
        self.admin: int | str | None = None
        self.serving: int | None = 1

    def target(self) -> int | None:
        """The version the name should serve (``app.lifecycle.chosen_version``)."""
        if self.admin == UNLOADED:
            return None
        if isinstance(self.admin, int):
            return self.admin
        return max(self.on_disk)

    def reached(self, number: int | None) -> None:
        """A load of ``number`` ran: it serves if it is good; a corrupt one changes
        nothing."""
        if number is not None and self.on_disk[number].good:
            self.serving = number

    def served_id(self) -> str | None:
        return None if self.serving is None else self.on_disk[self.serving].served_id


class Lifecycle(RuleBasedStateMachine):
    """One deployment of ``config`` (set by ``machine``), driven step by step."""

    config: Config
    catalog: Catalog

    def __init__(self) -> None:
        super().__init__()
        self.scratch = Path(tempfile.mkdtemp(prefix="mbtest-lifecycle-"))
        self.root = self.scratch / "repository"
        first = self.catalog.good[0]
        publish(self.root, first)
        self.expected = Expected(first)
        self.deployment = Deployment(self.config, self.root, self.scratch).__enter__()
        self.http = httpx.Client(base_url=self.deployment.base_url, timeout=120)
        self.traffic = Traffic(self.deployment.base_url)
        self.log: list[str] = ["started"]
        self.kills = 0  # each takes a worker's restart: a sequence has at most two
        self._during: tuple[str, str | None, list[Answer], frozenset[str]] | None = None

    def teardown(self) -> None:
        self.http.close()
        try:
            self.deployment.__exit__(None, None, None)
        finally:
            lines = [ln for ln in self.deployment.output().splitlines() if "app.request" not in ln]
            print(f"--- {self.config.name}: {' / '.join(self.log)}", *lines[-80:], sep="\n")
        left = [pid for pid in self.deployment.seen_pids if _alive_after(pid)]
        shutil.rmtree(self.scratch, ignore_errors=True)
        assert not left, f"worker processes left running after the server stopped: {left}"

    # -- steps ---------------------------------------------------------------------------------

    def _step(self, what: str, run: Any, *, may_drop: frozenset[str] = frozenset()) -> Any:
        """Run one step with traffic flowing; the answers given meanwhile are checked once
        the step has said what it expects (``the_traffic_was_answered_as_documented``), and
        a step that fails says what the traffic got too. ``may_drop``: the 503s the step
        may cause (a worker that died, Redis failing over)."""
        before = self.expected.served_id()
        self.log.append(what)
        try:
            with self.traffic:
                result = run()
        except BaseException as exc:
            answers = [answer for _, _, answer in self.traffic.take()]
            exc.add_note(f"traffic during {what!r}: {dict(statuses(answers))}")
            raise
        self._during = (what, before, [answer for _, _, answer in self.traffic.take()], may_drop)
        return result

    @rule(k=st.integers(0, 3))
    def publish_good(self, k: int) -> None:
        """A version of one of the good exports: a new model, or one published before (a
        rollback written as the next version)."""
        export = self.catalog.good[k % len(self.catalog.good)]
        number = publish(self.root, export)
        self.expected.on_disk[number] = export
        self.log.append(f"published {export.key} as version {number}")
        self._polled(number)

    @rule()
    def publish_corrupt(self) -> None:
        """A version whose embedding file does not match its sha256 (it claims the id of
        the first export)."""
        number = publish(self.root, self.catalog.corrupt)
        self.expected.on_disk[number] = self.catalog.corrupt
        self.log.append(f"published a corrupt copy as version {number}")
        self._polled(number)

    def _polled(self, number: int) -> None:
        if self.config.poll and self.expected.target() == number:
            self._step(f"poll loads version {number}", lambda: self._settle(number, slow=True))

    @rule(choice=st.integers(0, 8))
    def load_by_route(self, choice: int) -> None:
        """The admin route's load: of version ``choice`` when it is on disk (a rollback when
        it is older than what serves), else without a version (the newest again)."""
        number = choice if choice in self.expected.on_disk else None
        body = {"parameters": {"version": str(number)}} if number is not None else {}

        def load() -> httpx.Response:
            return self.http.post(f"/v2/repository/models/{NAME}/load", json=body, headers=ADMIN)

        answer = self._step(f"load by the route: version {number}", load)
        self.expected.admin = number
        target = self.expected.target()
        assert target is not None
        export = self.expected.on_disk[target]
        if export.good:
            assert answer.status_code == 200, answer.text
            assert answer.json()["model_id"] == export.served_id, answer.text
            assert answer.json()["version"] == str(target), answer.text
        else:
            assert answer.status_code == 422, answer.text
            assert answer.json()["type"] == "model_load_failed", answer.text
            assert str(self.root) not in answer.text, "a path in the answer"
        self.expected.reached(target)
        self._settle(target)

    @rule()
    def sighup(self) -> None:
        """``kill -HUP``: load what is new, as the repository chooses it."""
        target = self.expected.target()
        # A version that failed already shows its failed row before the retry starts: wait
        # for the retry to end (its failure counted: in broker mode, by a worker's heartbeat
        # a front end read), or a check would read it loading.
        again = target is not None and not self.expected.on_disk[target].good
        failures = self._load_failures() if again else 0

        def hang_up() -> None:
            self.deployment.sighup()
            if again:
                until(lambda: self._load_failures() > failures, "the failed version retried")
            self._settle(target, slow=True)

        self._step("SIGHUP", hang_up)

    @rule()
    def unload(self) -> None:
        def unload() -> httpx.Response:
            return self.http.post(f"/v2/repository/models/{NAME}/unload", headers=ADMIN)

        answer = self._step("unload by the route", unload)
        if self.expected.serving is None:
            assert answer.status_code == 404, answer.text
        else:
            assert answer.status_code == 200, answer.text
        self.expected.admin = UNLOADED
        self.expected.serving = None
        self._settle(None)

    @precondition(lambda self: self.expected.serving is not None and self.kills < 2)
    @rule()
    def kill_worker(self) -> None:
        """``kill -9`` of a model worker: it restarts, and serves what the others serve."""

        self.kills += 1

        def kill() -> None:
            pid = self.deployment.kill_worker()
            until(lambda: pid not in self.deployment.worker_pids(), "the dead worker gone")
            until(
                lambda: len(self.deployment.worker_pids()) == self.config.workers,
                "every worker back",
                timeout_s=120,
            )
            self._settle(self.expected.serving)

        self._step("kill -9 a worker", kill, may_drop=frozenset({"worker_died"}))

    @precondition(lambda self: self.config.sentinel)
    @rule()
    def fail_over_redis(self) -> None:
        """``kill -9`` of Redis's primary, behind Sentinel: the lifecycle goes on as it was
        (what serves, the pins, the fleet's precision), and the requests meanwhile are
        answered or refused 503 as when a worker dies."""

        def fail_over() -> None:
            self._fail_over()
            self._settle(self.expected.serving)

        self._step("kill -9 Redis's primary", fail_over, may_drop=FAILING_OVER)

    @precondition(lambda self: self.config.sentinel)
    @rule(k=st.integers(0, 3))
    def load_as_redis_fails_over(self, k: int) -> None:
        """A good export published and loaded by the admin route, Redis's primary killed as
        soon as the route has asked: the workers load it while Redis fails over, and the
        route answers once it serves (found by CI's failover test: a load slot whose release
        was lost kept the other worker of the host from loading it for 300 s)."""
        export = self.catalog.good[k % len(self.catalog.good)]
        number = publish(self.root, export)
        self.expected.on_disk[number] = export
        pins = Keys(PREFIX).pins_seq
        asked = self.deployment.redis.client().hget(pins, "seq")

        def load() -> httpx.Response:
            body = {"parameters": {"version": str(number)}}
            with ThreadPoolExecutor(1) as pool:
                answer = pool.submit(
                    self.http.post, f"/v2/repository/models/{NAME}/load", json=body, headers=ADMIN
                )
                until(
                    lambda: self.deployment.redis.client().hget(pins, "seq") != asked,
                    "the route's pin written",
                )
                self._fail_over()
                return answer.result()

        answer = self._step(
            f"load version {number} ({export.key}) as Redis fails over", load, may_drop=FAILING_OVER
        )
        assert answer.status_code == 200, answer.text
        assert answer.json()["model_id"] == export.served_id, answer.text
        self.expected.admin = number
        self.expected.reached(number)
        self._settle(number)

    def _fail_over(self) -> None:
        self.deployment.fail_over_redis()  # returns once every worker beats to the new one
        # Until a front end reaches the new primary, a request through it hears it cannot
        # (one past the cache: a hit answers meanwhile, found by this test). Each front
        # end reconnects on its own.
        others = [] if self.deployment.other is None else [self.deployment.other.base_url]
        for base_url in [self.deployment.base_url, *others]:
            with httpx.Client(base_url=base_url, timeout=120) as http:
                until(
                    lambda: http_embedding(http, 0, fresh=True).error != "broker_unavailable",
                    f"the front end at {base_url} reaching Redis again",
                    timeout_s=30,
                )
        # /readyz lists every worker again once the front end has looked since: until
        # then a live worker may be missing from it (found by CI after the unload, where
        # nothing serves and _settle waits for no worker).
        until(
            lambda: len(self.deployment.worker_pids()) == self.config.workers,
            "every worker in /readyz after the failover",
            timeout_s=60,
        )

    # -- waiting for the lifecycle to settle ---------------------------------------------------

    def _settle(self, target: int | None, *, slow: bool = False) -> None:
        """Wait until ``NAME`` serves what the lifecycle says after a load of ``target`` (a
        trigger with nothing to do waits for nothing), nothing of it loads, and every worker
        holds it."""
        if slow:  # SIGHUP and the poll answer nobody: the load happens in the background
            self.expected.reached(target)
        want = self.expected.served_id()

        def settled() -> bool | str:
            rows = self._rows()
            shown = [(r["version"], r["model_id"], r["state"], r["serving"]) for r in rows]
            serving = [r for r in rows if r["serving"]]
            if any(r["state"] == "loading" for r in rows):
                return False
            if want is None:
                done = not serving and not any(r["state"] == "ready" for r in rows)
                return done or f"rows {shown}"
            # The number too: a version published again (the same export) serves under its
            # new number once a front end has heard so (found by make chaos: a probe too early
            # read version 1 in broker mode, where the ids alone were already equal).
            number = str(self.expected.serving)
            if len(serving) != 1 or (serving[0]["model_id"], serving[0]["version"]) != (
                want,
                number,
            ):
                return f"rows {shown}"
            failed = target is not None and not self.expected.on_disk[target].good
            if failed:  # the failure is on its own row, with its reason
                row = next((r for r in rows if r["version"] == str(target)), None)
                if row is None or row["state"] != "failed":
                    return f"no failed row for version {target}: {shown}"
            return serving[0]["workers"] >= self.config.workers or f"workers: {shown}"

        until(
            lambda: settled() is True,
            lambda: f"{NAME} settled on {want} after {self.log[-1]} ({settled()})",
            timeout_s=120,
        )

    def _load_failures(self) -> float:
        """The server's count of failed loads (in broker mode, its live workers')."""
        return metric(self.http.get("/metrics").text, "microbatch_model_load_failures_total")

    def _rows(self) -> list[dict[str, Any]]:
        answer = self.http.get("/v2/repository/index")
        assert answer.status_code == 200, answer.text
        return [row for row in answer.json() if row["name"] == NAME]

    # -- checks ------------------------------------------------------------------------------

    @invariant()
    def the_traffic_was_answered_as_documented(self) -> None:
        """Every answer the clients got during the last step: its own version's result
        (the version before the step or after it), or a refusal documented for what the
        step did."""
        if self._during is None:
            return
        (what, before, answers, may_drop), self._during = self._during, None
        after = self.expected.served_id()
        allowed_ids = {i for i in (before, after) if i is not None}
        gap = before is None or after is None  # no version of the name loaded at some point
        wrong: list[str] = []
        for answer in answers:
            if answer.status == 200:
                assert answer.served_id is not None
                why = computed_by(self.catalog, answer.served_id, answer.image, answer.embedding)
                if why is None and answer.served_id not in allowed_ids:
                    why = f"{answer.served_id} served, though {NAME} went {before} -> {after}"
                if why is not None:
                    wrong.append(why)
            elif not _documented(answer, gap=gap, may_drop=may_drop):
                wrong.append(f"{answer.status} {answer.error}: {answer.message[:200]}")
        assert not wrong, (
            f"during {what!r} ({len(answers)} answers: {dict(statuses(answers))}), after "
            f"{self.log[:-1]}: {wrong[:5]}"
        )

    @invariant()
    def every_protocol_answers_as_the_lifecycle_says(self) -> None:
        want = self.expected.served_id()
        answers = self._probe()
        if want is None:
            for answer in answers:
                assert answer.status == 404, (answer, self.log)
        else:
            for answer in answers:
                assert answer.status == 200, (answer, self.log)
                if answer.served_id is not None:
                    assert answer.served_id == want, (answer.served_id, want, self.log)
                if answer.version is not None:
                    assert answer.version == str(self.expected.serving), (answer, self.log)
                if answer.embedding is not None:
                    why = computed_by(self.catalog, want, answer.image, answer.embedding)
                    assert why is None, (why, answer.protocol, self.log)
            self._check_pins(want)

    def _probe(self) -> list[Answer]:
        url, grpc = self.deployment.base_url, self.deployment.grpc_url
        return [
            http_embedding(self.http, 0),
            http_embedding(self.http, 1, model=None),  # the default model: the only one
            http_tag(self.http, 2),
            v2_json(self.http, 1),
            triton_binary(url, 2),
            triton_grpc(grpc, 0),
            predictions(self.http, 1),
        ]

    def _check_pins(self, want: str) -> None:
        pinned = http_embedding(self.http, 0, pin=want, tenant="shop")  # a tenant's pin
        self._assert_computed_by(want, pinned)
        # The probe asked the same image of the same id: the cache answers, with its answer.
        assert pinned.cache == "hit", (pinned, self.log)
        if self.config.mode == "broker":
            self._check_lanes(want)
            self._check_front_ends(want)
        bare, suffix = split_served_id(want)
        if suffix != "float32":  # the export's id without its precision: not what serves
            refused = http_embedding(self.http, 0, pin=bare)
            assert refused.status == 409, (refused, self.log)
            assert refused.error == "model_version_unavailable", (refused, self.log)
        other = next(e for e in self.catalog.good if e.served_id != want)
        refused = http_embedding(self.http, 0, pin=other.served_id)
        assert refused.status == 409, (refused, self.log)

    def _check_lanes(self, want: str) -> None:
        """Broker mode: a tenant's request at its priority waits in its own lane of the
        version served (docs/tenants.md), and is computed by the export that id names."""
        self._assert_computed_by(want, http_embedding(self.http, 2, tenant="bulk", fresh=True))
        keys = Keys(PREFIX)
        lanes = self.deployment.redis.client().hkeys(keys.lanes(want))
        bulk = keys.lane(want, Task.EMBEDDING, int(PRIORITY["bulk"]) - 1, "bulk")
        assert bulk.encode() in lanes, (lanes, self.log)

    def _check_front_ends(self, want: str) -> None:
        """Broker mode: one image through both front ends at once (each with its own cache,
        the second without the shared Redis: they meet only at the workers, which compute
        identical requests once, docs/cache.md) is answered by the export that id names, once
        the second front end has seen the route the first one took (it looks each second)."""
        assert self.deployment.other is not None
        image = len(IMAGES) - 1  # only this check sends it
        with httpx.Client(base_url=self.deployment.other.base_url, timeout=120) as other:
            until(
                lambda: other.get("/info").json().get("model_id") == want,
                lambda: f"the second front end serving {want} after {self.log}",
                timeout_s=30,
            )
            with ThreadPoolExecutor(2) as pool:
                answers = list(pool.map(lambda c: http_embedding(c, image), (self.http, other)))
        for answer in answers:
            self._assert_computed_by(want, answer)

    def _assert_computed_by(self, want: str, answer: Answer) -> None:
        """A 200 that names ``want`` and carries what that export computes for its image."""
        assert answer.status == 200 and answer.served_id == want, (answer, self.log)
        why = computed_by(self.catalog, want, answer.image, answer.embedding)
        assert why is None, (why, answer.cache, self.log)

    @invariant()
    def readiness_and_the_index_tell_the_truth(self) -> None:
        want = self.expected.served_id()
        status = self.http.get("/readyz").status_code
        assert status == (200 if want is not None else 503), (status, want, self.log)
        rows = self._rows()
        serving = [r for r in rows if r["serving"]]
        if want is None:
            assert not serving, (rows, self.log)
        else:
            assert [(r["version"], r["model_id"], r["state"]) for r in serving] == [
                (str(self.expected.serving), want, "ready")
            ], (rows, self.log)
            shown = [(r["version"], r["state"], r["serving"], r["workers"]) for r in rows]
            workers = [
                (w.get("name"), w["pid"], [(m["version"], m["state"]) for m in w["models"]])
                for w in self.http.get("/readyz").json()["workers"]
            ]
            assert serving[0]["workers"] == self.config.workers, (shown, workers, self.log)
        for row in rows:
            assert str(self.root) not in row["reason"], ("a path in the index", row)
            export = self.expected.on_disk.get(int(row["version"]))
            if export is not None and not export.good and row["state"] != "unavailable":
                assert row["state"] == "failed" and row["reason"], (row, self.log)

    @invariant()
    def no_worker_is_orphaned(self) -> None:
        assert not self.deployment.orphans(), self.log


def _documented(answer: Answer, *, gap: bool, may_drop: frozenset[str]) -> bool:
    """Whether a refusal is one the documentation gives for what was happening."""
    if gap and answer.status == 404 and answer.error == "model_not_found":
        return True  # the name was unloaded
    if gap and answer.status == 503 and answer.error == "not_ready":
        return True  # loading again after an unload
    return answer.status == 503 and answer.error in may_drop


def _alive_after(pid: int, wait_s: float = 10) -> bool:
    from tests.server import alive

    deadline = time.monotonic() + wait_s
    while alive(pid):
        if time.monotonic() > deadline:
            return True
        time.sleep(0.1)
    return False


# Every step, in an order that takes each path that broke before: a new version under the
# default precision (by SIGHUP, the poll and the route), a worker killed, a corrupt version by
# SIGHUP and then by the route (a retried load), a rollback by the route, an unload and a
# load after it, and a rollback written as the next version (served with no load). In the
# int8 catalog, version 2 is the int8 quantization of version 1.
PROGRAM: list[tuple[str, dict[str, int]]] = [
    ("publish_good", {"k": 1}),
    ("sighup", {}),
    ("publish_good", {"k": 2}),
    ("load_by_route", {"choice": 0}),
    ("kill_worker", {}),
    ("publish_corrupt", {}),
    ("sighup", {}),
    ("load_by_route", {"choice": 4}),
    ("load_by_route", {"choice": 1}),
    ("unload", {}),
    ("load_by_route", {"choice": 3}),
    ("publish_good", {"k": 2}),
    ("load_by_route", {"choice": 5}),
    ("load_by_route", {"choice": 0}),
]


def program_for(config: Config) -> list[tuple[str, dict[str, int]]]:
    """``PROGRAM``; behind Sentinel, with Redis's primary killed after a version is loaded by
    the route (its pin written, then perhaps lost), as a version loads, and after the
    unload."""
    if not config.sentinel:
        return PROGRAM
    program = list(PROGRAM)
    at = program.index(("kill_worker", {}))
    program[at:at] = [("fail_over_redis", {}), ("load_as_redis_fails_over", {"k": 3})]
    program.insert(program.index(("unload", {})) + 1, ("fail_over_redis", {}))
    return program


def machine(config: Config, catalog: Catalog) -> type[Lifecycle]:
    return type(
        f"Lifecycle_{config.name.replace('-', '_')}",
        (Lifecycle,),
        {"config": config, "catalog": catalog},
    )


def run_program(machine_class: type[Lifecycle], program: list[tuple[str, dict[str, int]]]) -> None:
    """Run ``program``'s steps on one deployment, checking every invariant after each, as
    hypothesis would."""
    state = machine_class()
    checks = [
        getattr(state, name)
        for name in (
            "the_traffic_was_answered_as_documented",
            "every_protocol_answers_as_the_lifecycle_says",
            "readiness_and_the_index_tell_the_truth",
            "no_worker_is_orphaned",
        )
    ]
    try:
        for check in checks:
            check()
        for step, arguments in program:
            getattr(state, step)(**arguments)
            for check in checks:
                check()
    finally:
        state.teardown()


@pytest.fixture(scope="module")
def catalogs(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Catalog]:
    from bench.systems import photo_views

    photos = photo_views(tmp_path_factory.mktemp("photos"), 100)
    root = tmp_path_factory.mktemp("catalog")
    outcomes: list[Outcome] = ["fp32", "bf16", "int8"]
    return {outcome: Catalog(root / outcome, outcome, photos) for outcome in outcomes}


@pytest.mark.timeout(600)
@pytest.mark.parametrize("config", CONFIGS, ids=[c.name for c in CONFIGS])
def test_every_step_in_every_mode_and_precision(
    config: Config, catalogs: dict[str, Catalog]
) -> None:
    """The covering program: every step, in every mode, under every precision outcome."""
    run_program(machine(config, catalogs[config.outcome]), program_for(config))


@pytest.mark.timeout(900 * EXAMPLES)  # a failing sequence is shrunk, with real servers
@pytest.mark.parametrize("config", EXPLORED, ids=[c.name for c in EXPLORED])
def test_random_sequences_keep_the_lifecycle_true(
    config: Config, catalogs: dict[str, Catalog]
) -> None:
    """hypothesis's sequences, shrunk to a short reproduction when one fails."""
    state_machine = machine(config, catalogs[config.outcome])
    state_machine.TestCase.settings = settings(
        max_examples=EXAMPLES,
        stateful_step_count=STEPS,
        derandomize=not EXPLORE,
        deadline=None,
        database=None,
        phases=[Phase.explicit, Phase.generate, *([Phase.shrink] if SHRINK else [])],
        suppress_health_check=list(HealthCheck),
        print_blob=True,
    )
    state_machine.TestCase().runTest()
