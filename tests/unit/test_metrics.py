"""``app.metrics``: refusals are counted under the ``reject_reason`` of their error class."""

from __future__ import annotations

import json
from pathlib import Path
from typing import TYPE_CHECKING

import httpx
import pytest
from fastapi import FastAPI
from starlette.exceptions import HTTPException as StarletteHTTPException

from app import errors
from app.jobs import Task
from app.metrics import Metrics
from app.routers.errors import install_error_handlers
from tests.answers import error_of

if TYPE_CHECKING:
    from app.broker.wire.heartbeat import WorkerInfo
    from app.broker.worker.stats import ConsumerStats

# What a worker's heartbeat says beside what it has run (app.broker.worker.consumer).
WORKER = {
    "host": "h", "index": 0, "device": "cpu", "threads": 1, "batch_size": 8, "ready": True,
    "alive": True, "running": 0, "restarts": 0, "batches": 0, "items": 0, "mixed_batches": 0,
    "expired": 0, "malformed": 0, "reclaimed": 0, "given_up": 0,
}  # fmt: skip


def heartbeat(
    stats: ConsumerStats | None, name: str = "h:0", pid: int = 1, life: str = ""
) -> WorkerInfo:
    """The heartbeat of a worker that has run ``stats`` (None: one from before the figures
    a heartbeat carries now), through its JSON, as a front end reads it."""
    from app.broker.wire.heartbeat import decode_worker_info

    figures = {} if stats is None else vars(stats)
    said = {**WORKER, **figures, "name": name, "pid": pid, "life": life}
    return decode_worker_info(json.dumps(said))


REFUSALS = [
    (errors.QueueFull, "queue_full"),
    (errors.NotReady, "not_ready"),
    (errors.DeadlineExceeded, "timeout"),
    (errors.WorkerDied, "worker_died"),
    (errors.DiedRunning, "worker_died"),
    (errors.BrokerUnavailable, "broker_unavailable"),
    (errors.ClientDisconnected, "client_disconnected"),
    (errors.ClientError, "bad_input"),
    (errors.InvalidImage, "bad_input"),
    (errors.UnsupportedImageFormat, "bad_input"),
    (errors.PayloadTooLarge, "bad_input"),
    (errors.InvalidRequest, "bad_input"),
    (errors.InvalidParameter, "bad_input"),
    (errors.Unauthorized, "bad_input"),
    (errors.Forbidden, "bad_input"),
    (errors.QuotaExceeded, "over_quota"),
    (errors.Shed, "shed"),
    (errors.NoClassifier, "bad_input"),
    (errors.NoEmbedding, "bad_input"),
    (errors.ModelNotFound, "bad_input"),
    (errors.ModelVersionUnavailable, "bad_input"),
]


def _rejected_lines(metrics: Metrics) -> list[str]:
    text = metrics.render().decode()
    return [line for line in text.splitlines() if line.startswith("microbatch_rejected_total")]


@pytest.mark.parametrize(("kind", "reason"), REFUSALS)
def test_a_refusal_is_counted_under_its_reason(kind: type[errors.ServerError], reason: str) -> None:
    metrics = Metrics()
    metrics.on_error(kind("x"))
    metrics.on_error(kind)  # a refusal Starlette or FastAPI made, named by its class
    assert _rejected_lines(metrics) == [f'microbatch_rejected_total{{reason="{reason}"}} 2.0']


@pytest.mark.parametrize(
    "kind", [errors.InferenceError, errors.BatchContractError, errors.Unavailable]
)
def test_a_failure_that_is_no_refusal_counts_nothing(kind: type[errors.ServerError]) -> None:
    metrics = Metrics()
    metrics.on_error(kind("x"))
    assert _rejected_lines(metrics) == []


def test_the_table_above_lists_every_counted_class() -> None:
    classes = [c for c in vars(errors).values() if isinstance(c, type)]
    counted = {c for c in classes if issubclass(c, errors.ServerError) and c.reject_reason}
    assert counted == {kind for kind, _ in REFUSALS}


async def test_refusals_starlette_and_fastapi_make_count_as_bad_input() -> None:
    app = FastAPI()
    metrics = Metrics()
    install_error_handlers(app, metrics)

    @app.get("/too-large")
    async def too_large() -> None:
        raise StarletteHTTPException(413, "too large")

    @app.get("/typed")
    async def typed(k: int) -> int:
        return k

    transport = httpx.ASGITransport(app=app)
    async with httpx.AsyncClient(transport=transport, base_url="http://test") as client:
        assert (await client.get("/too-large")).json()["error"]["type"] == "payload_too_large"
        assert (await client.get("/typed?k=abc")).json()["error"]["type"] == "invalid_request"
        assert (await client.get("/nowhere")).status_code == 404  # not a refusal
    assert _rejected_lines(metrics) == ['microbatch_rejected_total{reason="bad_input"} 2.0']


async def test_a_body_refused_from_its_content_length_is_counted() -> None:
    from app.routers.errors import BodySizeLimit

    app = FastAPI()
    metrics = Metrics()
    install_error_handlers(app, metrics)
    app.add_middleware(BodySizeLimit, max_body_bytes=10, metrics=metrics)

    @app.post("/upload")
    async def upload() -> None:
        raise AssertionError("never reached")

    transport = httpx.ASGITransport(app=app)
    async with httpx.AsyncClient(transport=transport, base_url="http://test") as client:
        answer = await client.post("/upload", content=b"x" * 11)
    assert answer.status_code == 413 and error_of(answer)["type"] == "payload_too_large"
    assert _rejected_lines(metrics) == ['microbatch_rejected_total{reason="bad_input"} 1.0']


def test_broker_mode_reports_the_batches_the_workers_ran() -> None:
    """Batches form in the workers: their heartbeats' counts, summed, are the histograms."""
    from app.broker.worker.stats import ConsumerStats

    first, second = ConsumerStats(), ConsumerStats()
    first.record("tagger@1", Task.TAG, 3, 2, 0.02, [0.001, 0.002, 0.2])
    first.record("tagger@1", Task.TAG, 1, 1, 0.01, [0.003])
    second.record("tagger@1", Task.TAG, 3, 1, 0.04, [0.0, 0.0, 0.0])
    second.record("other@9", Task.TAG, 5, 1, 0.5, [0.0] * 5)  # another model: its own labels

    metrics = Metrics(remote_workers=True)
    metrics.labels = {"tagger@1": ("tagger", "1"), "other@9": ("other", "9")}.__getitem__
    metrics.on_workers([heartbeat(first, "h:0"), heartbeat(second, "h:1")])
    text = metrics.render().decode()
    tagger = 'model="tagger",task="tag",version="1"'
    assert f"microbatch_batch_size_count{{{tagger}}} 3.0" in text
    assert f"microbatch_batch_size_sum{{{tagger}}} 7.0" in text
    assert f'microbatch_batch_size_bucket{{le="1.0",{tagger}}} 1.0' in text
    assert f'microbatch_batch_size_bucket{{le="4.0",{tagger}}} 3.0' in text
    assert f"microbatch_queue_wait_seconds_count{{{tagger}}} 7.0" in text
    assert f'microbatch_queue_wait_seconds_bucket{{le="0.001",{tagger}}} 4.0' in text
    assert f"microbatch_model_seconds_sum{{{tagger}}} 0.07" in text
    assert 'microbatch_batch_size_sum{model="other",task="tag",version="9"} 5.0' in text


def test_broker_mode_reports_the_loads_the_workers_ended() -> None:
    """Versions load in the workers: their heartbeats' load times and failures (by step),
    summed over the workers, are what an in-process server counts itself; a heartbeat of a
    worker from before them carries neither, and the rest still counts. A heartbeat carries
    the loads of MAX_LOADED names at most."""
    from app.broker.worker.stats import MAX_LOADED, ConsumerStats

    first, second = ConsumerStats(), ConsumerStats()
    first.on_load("tagger", 1, 0.7, None)
    first.on_load("tagger", 2, 0.0, "verify")
    second.on_load("tagger", 1, 12.0, None)
    second.on_load("tagger", 2, 3.0, "self-test")
    second.on_load("tagger", 2, 0.0, "verify")
    second.on_load("other", 4, 2.0, None)
    metrics = Metrics(remote_workers=True)
    metrics.on_workers([heartbeat(first, "h:0"), heartbeat(second, "h:1"), heartbeat(None, "h:2")])
    text = metrics.render().decode()
    assert 'microbatch_model_load_failures_total{model="tagger",step="verify"} 2.0' in text
    assert 'microbatch_model_load_failures_total{model="tagger",step="self-test"} 1.0' in text
    assert text.count("microbatch_model_load_failures_total{") == 2
    assert 'microbatch_model_load_seconds_count{model="tagger"} 2.0' in text
    assert 'microbatch_model_load_seconds_bucket{le="1.0",model="tagger"} 1.0' in text
    assert 'microbatch_model_load_seconds_bucket{le="30.0",model="tagger"} 2.0' in text
    assert 'microbatch_model_load_seconds_sum{model="tagger"} 12.7' in text
    assert 'microbatch_model_load_seconds_count{model="other"} 1.0' in text
    many = ConsumerStats()
    for number in range(MAX_LOADED + 5):
        many.on_load(f"m{number}", 1, 1.0, None if number % 2 else "load")
    assert len(many.load_s.keys() | many.load_failures.keys()) == MAX_LOADED
    assert heartbeat(many).load_failures  # the heartbeat still checks


def test_broker_mode_counters_do_not_go_down_when_a_worker_leaves(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """A worker that stops sending heartbeats (stopped, scaled down, crashed) keeps its
    figures in the sums: as its own while it may come back, then added to those of the
    workers gone; its next life (a restart under its name) counts from 0 beside them."""
    from app.broker.worker.stats import ConsumerStats
    from app.metrics import reported

    def ran(batches: int, failures: int) -> ConsumerStats:
        stats = ConsumerStats(reclaimed=batches)
        for _ in range(batches):
            stats.record("tagger@1", Task.TAG, 2, 1, 0.01, [0.001, 0.001])
        for _ in range(failures):
            stats.on_load("tagger", 2, 0.0, "verify")
        return stats

    now = [1000.0]
    monkeypatch.setattr(reported, "monotonic", lambda: now[0])
    metrics = Metrics(remote_workers=True)
    metrics.labels = lambda served_id: ("tagger", "1")
    tagger = 'model="tagger",task="tag",version="1"'

    def counted() -> tuple[str, ...]:
        text = metrics.render().decode()  # reclaimed, batches, waits, failed loads
        return tuple(
            line.rsplit(" ", 1)[1]
            for line in text.splitlines()
            if line.startswith(
                (
                    f"microbatch_batch_size_count{{{tagger}}}",
                    f"microbatch_queue_wait_seconds_count{{{tagger}}}",
                    "microbatch_worker_reclaimed_total",
                    'microbatch_model_load_failures_total{model="tagger",step="verify"}',
                )
            )
        )

    metrics.on_workers([heartbeat(ran(3, 1), "h:0", 10), heartbeat(ran(2, 1), "h:1", 11)])
    assert counted() == ("5.0", "5.0", "10.0", "2.0")
    now[0] += 5
    metrics.on_workers([heartbeat(ran(2, 1), "h:1", 11)])  # h:0 stopped
    assert counted() == ("5.0", "5.0", "10.0", "2.0")
    now[0] += 5
    metrics.on_workers([heartbeat(ran(4, 1), "h:0", 10), heartbeat(ran(2, 1), "h:1", 11)])
    assert counted() == ("6.0", "6.0", "12.0", "2.0")  # back, and counted once
    now[0] += reported.KEEP_S + 1
    metrics.on_workers([heartbeat(ran(1, 0), "h:0", 12), heartbeat(ran(2, 1), "h:1", 11)])
    assert counted() == ("7.0", "7.0", "14.0", "2.0")  # its last life's figures stay
    now[0] += reported.KEEP_S + 1
    metrics.on_workers([])  # every one gone, long ago
    now[0] += reported.KEEP_S + 1
    metrics.on_workers([])
    assert counted() == ("7.0", "7.0", "14.0", "2.0")
    # A container restarted under its name, whose worker has the same pid as the last one
    # (its figures overwrote the last life's: 100 batches went down to 3).
    metrics.on_workers([heartbeat(ran(100, 0), "h:9", 7, life="0a")])
    assert counted()[0] == "107.0"
    metrics.on_workers([heartbeat(ran(3, 0), "h:9", 7, life="0b")])
    assert counted()[0] == "110.0"


def test_the_restarts_counter_never_goes_down() -> None:
    """Broker mode sees only the workers with a fresh heartbeat: a worker whose restart takes
    longer than that leaves the sum, and comes back with one more (5, 0, 6 read as a reset:
    6 restarts, and the alert on restarts fired on one). A supervisor started again counts
    from 0: the sum keeps what it had counted."""
    from app.batching import WorkerStatus
    from app.metrics.live import LiveGauges, LiveState

    def worker(restarts: int) -> WorkerStatus:
        return WorkerStatus(index=0, device="cpu", threads=1, pid=9, ready=True, alive=True,
                            batch_size=8, batches=0, items=0, restarts=restarts, name="h:0")  # fmt: skip

    seen: list[list[WorkerStatus]] = [[worker(5)], [], [worker(6)], [worker(0)], [worker(1)]]
    gauges = LiveGauges(lambda: LiveState(workers=seen.pop(0)))
    totals = []
    for _ in range(5):
        (family,) = [f for f in gauges.collect() if f.name == "microbatch_worker_restarts"]
        totals.append(family.samples[0].value)
    assert totals == [5, 5, 6, 6, 7]


def test_broker_mode_keeps_the_figures_of_a_version_a_worker_unloaded() -> None:
    """A worker's heartbeat drops an unloaded version's figures (to stay bounded); the front
    end keeps them, so that version's counters do not go down while its worker lives on,
    under the labels they had once the registry forgets the version too."""
    from app.broker.worker.stats import ConsumerStats

    stats = ConsumerStats()
    stats.record("tagger@1", Task.TAG, 4, 1, 0.02, [0.001] * 4)
    stats.record("tagger@2", Task.TAG, 2, 1, 0.01, [0.001] * 2)
    metrics = Metrics(remote_workers=True)
    known = {"tagger@1": ("tagger", "1"), "tagger@2": ("tagger", "2")}
    metrics.labels = lambda served_id: known.get(served_id, ("", ""))
    metrics.on_workers([heartbeat(stats)])
    assert "microbatch_batch_size_sum" in metrics.render().decode()  # version 1 seen by name
    stats.forget("tagger@1")
    stats.record("tagger@2", Task.TAG, 2, 1, 0.01, [0.001] * 2)
    metrics.on_workers([heartbeat(stats)])
    metrics.on_workers([heartbeat(stats)])  # forgotten once, counted once
    del known["tagger@1"]  # and the registry forgot it: its figures keep their labels
    text = metrics.render().decode()
    assert 'version=""' not in text
    assert 'microbatch_batch_size_sum{model="tagger",task="tag",version="1"} 4.0' in text
    assert 'microbatch_batch_size_sum{model="tagger",task="tag",version="2"} 4.0' in text


def test_broker_mode_statistics_add_what_the_workers_ran() -> None:
    """Triton's statistics of a version in broker mode: the requests this front end answered,
    and what every worker ran of it (images, model calls, waits, worker time by size)."""
    from app.broker.worker.stats import ConsumerStats

    first, second = ConsumerStats(), ConsumerStats()
    first.record("tagger@1", Task.TAG, 4, 1, 0.02, [0.001] * 4)
    first.record("tagger@1", Task.EMBEDDING, 1, 1, 0.005, [0.002])
    second.record("tagger@1", Task.TAG, 4, 1, 0.04, [0.003] * 4)
    metrics = Metrics(remote_workers=True)
    metrics.labels = lambda served_id: ("tagger", "1")
    metrics.on_workers([heartbeat(first, "h:0"), heartbeat(second, "h:1")])
    metrics.on_request("/v2/models/{name}/infer", 200, 0.05, "tagger", "1", inference=True)
    (entry,) = metrics.statistics.report([("tagger", "1")])
    assert (entry["inference_count"], entry["execution_count"]) == (9, 3)
    assert entry["inference_stats"]["success"]["count"] == 1
    assert entry["inference_stats"]["queue"] == {"count": 9, "ns": 18_000_000}
    assert entry["inference_stats"]["compute_infer"] == {"count": 9, "ns": 245_000_000}
    by_size = {b["batch_size"]: b["compute_infer"] for b in entry["batch_stats"]}
    assert by_size == {1: {"count": 1, "ns": 5_000_000}, 4: {"count": 2, "ns": 60_000_000}}


def test_broker_mode_reports_each_tenant_s_queue_wait_from_the_workers_lanes() -> None:
    """Each entry's wait under the tenant its lane names, summed over the workers; entries
    of no tenant (a task's stream, a level's lane) are not counted; a heartbeat carries at
    most MAX_TENANTS tenants."""
    from app.broker.wire.keys import Keys
    from app.broker.worker.stats import MAX_TENANTS, ConsumerStats

    lanes = ["mb:{q}:1:tag:p2:shop", "mb:{q}:1:tag", "mb:{q}:1:tag:p2", "mb:{q}:1:tag:p1:bulk"]
    tenants = [Keys.lane_tenant(lane) for lane in lanes]
    first, second = ConsumerStats(), ConsumerStats()
    first.record("tagger@1", Task.TAG, 4, 1, 0.02, [0.002, 0.0, 0.0, 0.3], tenants)
    second.record("tagger@1", Task.TAG, 1, 1, 0.02, [0.002], ["shop"])
    metrics = Metrics(remote_workers=True)
    metrics.labels = {"tagger@1": ("tagger", "1")}.__getitem__
    metrics.on_workers([heartbeat(first, "h:0"), heartbeat(second, "h:1")])
    text = metrics.render().decode()
    assert 'microbatch_tenant_queue_wait_seconds_count{tenant="shop"} 2.0' in text
    assert 'microbatch_tenant_queue_wait_seconds_bucket{le="0.0025",tenant="shop"} 2.0' in text
    assert 'microbatch_tenant_queue_wait_seconds_count{tenant="bulk"} 1.0' in text
    assert 'microbatch_tenant_queue_wait_seconds_sum{tenant="bulk"} 0.3' in text
    assert text.count("microbatch_tenant_queue_wait_seconds_count") == 2
    many = ConsumerStats()
    names = [f"t{i}" for i in range(MAX_TENANTS + 5)]
    many.record("tagger@1", Task.TAG, len(names), 1, 0.1, [0.0] * len(names), names)
    assert len(many.tenant_wait_s) == MAX_TENANTS


def test_several_processes_are_summed_from_the_multiprocess_directory(tmp_path: Path) -> None:
    """With PROMETHEUS_MULTIPROC_DIR, a scrape reads every process's files there."""
    import subprocess
    import sys

    code = (
        "from app.metrics import Metrics; m = Metrics(); "
        "m.on_request('/predict/tag', 200, 0.01, 'tagger', '2')"
    )
    env = {"PROMETHEUS_MULTIPROC_DIR": str(tmp_path), "PATH": "/usr/bin:/bin"}
    repo = Path(__file__).resolve().parents[2]
    for _ in range(2):  # two processes, one request each
        subprocess.run([sys.executable, "-c", code], cwd=repo, env=env, check=True)
    reader = subprocess.run(
        [
            sys.executable,
            "-c",
            "import sys; from pathlib import Path; from app.metrics import Metrics;"
            "sys.stdout.write(Metrics(multiprocess_dir=Path(sys.argv[1])).render().decode())",
            str(tmp_path),
        ],
        cwd=repo,
        env=env,
        capture_output=True,
        text=True,
        check=True,
    )
    answered = 'model="tagger",route="/predict/tag",status="200",version="2"'
    assert f"microbatch_http_requests_total{{{answered}}} 2.0" in reader.stdout
