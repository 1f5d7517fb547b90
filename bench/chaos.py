"""``python -m bench.chaos``: faults in broker mode, one kind of process at a time, under load.

    python -m bench.chaos                      # every fault, 30 s after each
    python -m bench.chaos --faults redis-pause,kill-worker --after-s 20 --json chaos.json

Broker mode on this machine: a Redis, 2 front-end processes (gunicorn with
``app.gunicorn_worker.Worker``), 2 worker supervisors (``python -m app.broker.worker``, hosts
``a`` and ``b``) of 1 model worker each, serving EfficientNet-Lite0 from a model repository.
32 closed-loop clients send distinct photos whose reference vectors are computed here (with
TorchScript), each with a 10 s deadline (``X-Request-Timeout``). Each row injects one fault,
then goes on ``--after-s`` seconds; a process the fault kills is started again by this script
2 s later, as a process manager (systemd, Kubernetes) would.

Each row prints: requests sent and answers by status (``reset``: the connection failed, the
client knows at once); answers whose vector is not the reference of the image sent under the
id they carry (must be 0: never another caller's result); requests with no answer within
their deadline plus 5 s (must be 0); whether every 503 carried ``Retry-After``; the seconds
until throughput was back to 80% of the steady rate before the fault; processes orphaned
(reparented to init) by the fault; shared memory left; and Redis's keys and memory against
the start. After the last row everything is stopped: 5 s later no process of the run may be
left, and Redis (kept up for the check) holds nothing past the reply TTL.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import os
import platform
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time
from collections import Counter
from collections.abc import Awaitable, Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np
import numpy.typing as npt
import psutil
import redis

from app.workers.lineage import stop_child
from bench.loadgen import Connection, multipart_request
from bench.rollout import judged, references

HOST = "127.0.0.1"
PREFIX = "chaos"
DEADLINE_S = 10.0
MARGIN_S = 5.0
RESTART_AFTER_S = 2.0
STEADY_S = 5.0


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind((HOST, 0))
        return int(sock.getsockname()[1])


# -- the cluster -------------------------------------------------------------------------------


class Cluster:
    """Redis, the gunicorn master with 2 front ends, and 2 worker supervisors, each its own
    process group, started and restarted by name."""

    def __init__(self, scratch: Path, repository: Path) -> None:
        self.scratch = scratch
        self.repository = repository
        self.redis_port = free_port()
        self.port = free_port()
        self.processes: dict[str, subprocess.Popen[bytes]] = {}
        self.env = {
            **os.environ,
            "MB_BROKER": f"redis://{HOST}:{self.redis_port}/0",
            "MB_BROKER_PREFIX": PREFIX,
            "MODEL_REPOSITORY": str(repository),
            "CUDA_DEVICES": "cpu",
            "MB_WORKER_NUM": "1",
            "MB_WORKER_THREADS": "1",
            "MB_MAX_QUEUE": "4096",
            "LOG_LEVEL": "warning",
            "PYTHONUNBUFFERED": "1",
        }

    def _spawn(self, name: str, command: list[str], env: dict[str, str]) -> None:
        log = (self.scratch / f"{name}.log").open("ab")
        self.processes[name] = subprocess.Popen(
            command, env=env, stdout=log, stderr=subprocess.STDOUT, start_new_session=True
        )

    def start_redis(self) -> None:
        binary = shutil.which("redis-server")
        if binary is None:
            raise SystemExit("redis-server is not installed (make redis-server)")
        self._spawn(
            "redis",
            [binary, "--port", str(self.redis_port), "--bind", HOST, "--save", "",
             "--appendonly", "no", "--dir", str(self.scratch)],
            dict(os.environ),
        )  # fmt: skip
        deadline = time.monotonic() + 10
        while True:
            with contextlib.suppress(redis.ConnectionError):
                self.redis().ping()
                return
            if time.monotonic() > deadline:
                raise RuntimeError("redis-server did not start")
            time.sleep(0.05)

    def redis(self) -> redis.Redis:
        return redis.Redis(host=HOST, port=self.redis_port, socket_timeout=5)

    def start_front_ends(self) -> None:
        metrics = self.scratch / "metrics"
        shutil.rmtree(metrics, ignore_errors=True)
        metrics.mkdir()
        deadline = time.monotonic() + 30
        while True:  # the port is free once the last front end of before has exited
            with socket.socket() as sock, contextlib.suppress(OSError):
                # As gunicorn binds: connections in TIME_WAIT do not hold the port.
                sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
                sock.bind((HOST, self.port))
                break
            if time.monotonic() > deadline:
                raise RuntimeError(f"port {self.port} stayed taken")
            time.sleep(0.1)
        self._spawn(
            "master",
            [sys.executable, "-m", "gunicorn", "-k", "app.gunicorn_worker.Worker", "-w", "2",
             "-b", f"{HOST}:{self.port}", "--graceful-timeout", "15", "app.main:create_app()"],
            {**self.env, "PROMETHEUS_MULTIPROC_DIR": str(metrics)},
        )  # fmt: skip

    def start_supervisor(self, host: str) -> None:
        self._spawn(
            f"supervisor-{host}",
            [sys.executable, "-m", "app.broker.worker"],
            {**self.env, "MB_WORKER_NAME": host},
        )

    def children(self, name: str) -> list[psutil.Process]:
        with contextlib.suppress(psutil.NoSuchProcess):
            kids = psutil.Process(self.processes[name].pid).children()
            return [p for p in kids if "resource_tracker" not in " ".join(_cmdline(p))]
        return []

    def worker_pid(self, host: str) -> int | None:
        kids = self.children(f"supervisor-{host}")
        return kids[0].pid if kids else None

    def all_pids(self) -> set[int]:
        pids = set()
        for process in self.processes.values():
            with contextlib.suppress(psutil.NoSuchProcess):
                root = psutil.Process(process.pid)
                pids |= {root.pid, *(p.pid for p in root.children(recursive=True))}
        return pids

    def ready(self) -> bool:
        import httpx

        try:
            return httpx.get(f"http://{HOST}:{self.port}/readyz", timeout=2).status_code == 200
        except httpx.TransportError:
            return False

    def stop(self) -> None:
        for name in ("master", "supervisor-a", "supervisor-b", "redis"):
            process = self.processes.get(name)
            if process is not None:
                stop_child(process, timeout_s=90)


def _cmdline(process: psutil.Process) -> list[str]:
    with contextlib.suppress(psutil.Error):
        return list(process.cmdline())
    return []


def ours(redis_port: int) -> set[int]:
    """Every live process of this run, wherever it hangs in the tree (orphans included): the
    ones started with its environment, and its Redis."""
    found = set()
    for process in psutil.process_iter():
        with contextlib.suppress(psutil.Error):
            if process.environ().get(
                "MB_BROKER_PREFIX"
            ) == PREFIX or f"{HOST}:{redis_port}" in " ".join(process.cmdline()):
                found.add(process.pid)
    return found


def orphans(cluster: Cluster) -> list[int]:
    """Processes of this run that nothing of the cluster supervises any more (reparented
    away from the processes this script started)."""
    return sorted(ours(cluster.redis_port) - cluster.all_pids())


def shm_files() -> int:
    shm = Path("/dev/shm")
    return len(list(shm.glob("microbatch-*"))) if shm.is_dir() else 0


# -- load ------------------------------------------------------------------------------------


@dataclass
class Answer:
    sent_at: float
    seconds: float
    status: int  # 0: the connection failed (refused or reset)
    matched: bool = True
    retry_after: bool = True  # a 503 carried Retry-After


@dataclass
class Load:
    answers: list[Answer] = field(default_factory=list)
    sent: list[float] = field(default_factory=list)  # when each request went out
    stop: asyncio.Event = field(default_factory=asyncio.Event)


async def drive(
    port: int,
    images: list[bytes],
    refs: dict[str, npt.NDArray[np.float32]],
    load: Load,
    clients: int,
) -> None:
    headers = [("Accept", "application/octet-stream"), ("X-Request-Timeout", f"{DEADLINE_S:g}")]
    requests = [
        multipart_request(HOST, port, "/predict/embedding", data, headers=headers)
        for data in images
    ]

    async def client(number: int) -> None:
        connection = Connection(HOST, port)
        index = number
        while not load.stop.is_set():
            image = index % len(images)
            index += clients
            sent = time.monotonic()
            load.sent.append(sent)
            try:
                async with asyncio.timeout(DEADLINE_S + MARGIN_S):
                    response = await connection.send(requests[image])
            except TimeoutError:
                await connection.close()
                load.answers.append(Answer(sent, time.monotonic() - sent, -1))  # no answer
                continue
            except (OSError, asyncio.IncompleteReadError):
                await connection.close()
                load.answers.append(Answer(sent, time.monotonic() - sent, 0))
                await asyncio.sleep(0.1)  # a front end restarting: do not spin
                continue
            answer = Answer(sent, time.monotonic() - sent, response.status)
            if response.status == 200:
                served = response.headers.get("x-model-id", "")
                answer.matched = judged(response.body, served, refs, image)[1]
            elif response.status == 503:
                answer.retry_after = response.headers.get("retry-after", "").isdigit()
            load.answers.append(answer)
        await connection.close()

    await asyncio.gather(*(client(i) for i in range(clients)))


# -- the faults ------------------------------------------------------------------------------

Fault = Callable[["Context"], Awaitable[str]]


@dataclass
class Context:
    cluster: Cluster
    args: argparse.Namespace
    images: list[bytes]
    stores: dict[str, Path]

    async def restart_later(self, start: Callable[[], None]) -> None:
        await asyncio.sleep(RESTART_AFTER_S)
        await asyncio.to_thread(start)


async def kill_worker(ctx: Context) -> str:
    pid = ctx.cluster.worker_pid("a")
    assert pid is not None
    os.kill(pid, signal.SIGKILL)
    return f"model worker a:0 (pid {pid}) killed; its supervisor restarts it"


async def kill_supervisor(ctx: Context) -> str:
    cluster = ctx.cluster
    worker = cluster.worker_pid("a")
    cluster.processes["supervisor-a"].kill()
    cluster.processes["supervisor-a"].wait()
    await asyncio.sleep(RESTART_AFTER_S)
    survived = worker is not None and psutil.pid_exists(worker)
    await asyncio.to_thread(cluster.start_supervisor, "a")
    return (
        f"supervisor a killed; its worker {'SURVIVED' if survived else 'died with it'}; restarted"
    )


async def pause_worker(ctx: Context) -> str:
    pid = ctx.cluster.worker_pid("b")
    assert pid is not None
    os.kill(pid, signal.SIGSTOP)
    await asyncio.sleep(10)
    os.kill(pid, signal.SIGCONT)
    return f"model worker b:0 (pid {pid}) stopped 10 s, then continued"


async def kill_front_end(ctx: Context) -> str:
    front = ctx.cluster.children("master")[0]
    front.kill()
    return f"front end {front.pid} killed; gunicorn starts another"


async def kill_master(ctx: Context) -> str:
    cluster = ctx.cluster
    fronts = [p.pid for p in cluster.children("master")]
    cluster.processes["master"].kill()
    cluster.processes["master"].wait()
    await asyncio.sleep(RESTART_AFTER_S)
    left = [pid for pid in fronts if psutil.pid_exists(pid)]
    await asyncio.to_thread(cluster.start_front_ends)
    fate = f"LEFT: {left}" if left else "stopped"
    return f"gunicorn master killed; its front ends {fate}; restarted"


async def restart_redis(ctx: Context) -> str:
    cluster = ctx.cluster
    cluster.processes["redis"].kill()
    cluster.processes["redis"].wait()
    await asyncio.to_thread(cluster.start_redis)
    return "Redis killed and started again, empty"


async def pause_redis(ctx: Context) -> str:
    pid = ctx.cluster.processes["redis"].pid
    os.kill(pid, signal.SIGSTOP)
    await asyncio.sleep(5)
    os.kill(pid, signal.SIGCONT)
    return "Redis stopped 5 s, then continued"


async def redis_full(ctx: Context) -> str:
    client = ctx.cluster.redis()
    used = int(client.info("memory")["used_memory"])
    client.config_set("maxmemory-policy", "noeviction")
    client.config_set("maxmemory", str(used + (1 << 20)))
    await asyncio.sleep(10)
    client.config_set("maxmemory", "0")
    return "Redis at maxmemory (used + 1 MB, noeviction) for 10 s"


async def slow_reader(ctx: Context) -> str:
    """One client reads its answer one byte at a time, 1 ms apart, while the others go on;
    its answer must arrive whole and correct."""
    port = ctx.cluster.port
    request = multipart_request(HOST, port, "/predict/tag", ctx.images[0], fields=[("k", "5")])
    reader, writer = await asyncio.open_connection(HOST, port)
    writer.write(request)
    await writer.drain()
    received, length, started = bytearray(), None, time.monotonic()
    while length is None or len(received) < length:
        byte = await asyncio.wait_for(reader.read(1), 30)
        if not byte:
            break
        received += byte
        if length is None and received.endswith(b"\r\n\r\n"):
            head = bytes(received).lower()
            size = head.split(b"content-length:")[1].split(b"\r\n")[0]
            length = len(received) + int(size)
        await asyncio.sleep(0.001)
    writer.close()
    head, _, body = bytes(received).partition(b"\r\n\r\n")
    whole = head.startswith(b"HTTP/1.1 200") and len(json.loads(body)) == 5
    return (
        f"one client read its answer byte by byte: {len(received)} bytes in "
        f"{time.monotonic() - started:.1f} s, {'whole' if whole else 'NOT WHOLE'}"
    )


async def hang_up_mid_upload(ctx: Context) -> str:
    """Clients that send half an upload, then close the connection, 20 a second for 10 s."""
    port = ctx.cluster.port
    request = multipart_request(HOST, port, "/predict/embedding", ctx.images[1])
    half = request[: len(request) // 2]
    count = 0
    for _ in range(10):
        for _ in range(20):
            with contextlib.suppress(OSError):
                _, writer = await asyncio.open_connection(HOST, port)
                writer.write(half)
                await writer.drain()
                writer.close()
                count += 1
        await asyncio.sleep(1)
    return f"{count} clients hung up halfway through their upload"


async def rolling_update(ctx: Context) -> str:
    """The model's next version published, then SIGHUP to one host's supervisor, then the
    other's once the first holds it."""
    from app.repository import publish, staging_folder

    repository = ctx.cluster.repository
    staging = staging_folder(repository / "main")
    shutil.rmtree(staging)
    shutil.copytree(ctx.stores["v2"], staging)
    version = publish(staging, repository / "main")
    for host in ("a", "b"):
        os.kill(ctx.cluster.processes[f"supervisor-{host}"].pid, signal.SIGHUP)
        await asyncio.sleep(8)
    return f"version {version} rolled out: SIGHUP to host a, then b"


FAULTS: dict[str, tuple[str, Fault]] = {
    "kill-worker": ("kill -9 a model worker", kill_worker),
    "kill-supervisor": ("kill -9 a worker supervisor", kill_supervisor),
    "pause-worker": ("SIGSTOP a model worker 10 s", pause_worker),
    "kill-front-end": ("kill -9 a front end", kill_front_end),
    "kill-master": ("kill -9 the gunicorn master", kill_master),
    "restart-redis": ("Redis restarted, data lost", restart_redis),
    "pause-redis": ("SIGSTOP Redis 5 s", pause_redis),
    "redis-full": ("Redis at maxmemory", redis_full),
    "slow-reader": ("a client reading 1 byte at a time", slow_reader),
    "hang-up": ("clients hanging up mid-upload", hang_up_mid_upload),
    "rolling-update": ("a rolling update of the model", rolling_update),
}


# -- a row -----------------------------------------------------------------------------------


def redis_state(cluster: Cluster) -> tuple[int, int]:
    """Redis's keys of this run and its used memory (0, 0 if it cannot be reached)."""
    with contextlib.suppress(redis.RedisError):
        client = cluster.redis()
        keys = sum(1 for _ in client.scan_iter(f"{PREFIX}:*"))
        return keys, int(client.info("memory")["used_memory"])
    return 0, 0


def recovery_s(answers: list[Answer], fault_at: float, steady: float) -> float | None:
    """Seconds from the fault until 200s per second were back to 80% of ``steady`` over a
    two-second window (None: never within the row)."""
    done = sorted(a.sent_at + a.seconds for a in answers if a.status == 200)
    if not done or steady <= 0:
        return None
    t = fault_at
    end = done[-1]
    while t + 2 <= end:
        count = sum(1 for d in done if t <= d < t + 2)
        if count / 2 >= 0.8 * steady:
            return max(0.0, t - fault_at)
        t += 0.25
    return None


async def row(key: str, ctx: Context, load: Load, baseline: tuple[int, int]) -> dict[str, Any]:
    title, fault = FAULTS[key]
    cluster = ctx.cluster
    started = time.monotonic()
    await asyncio.sleep(STEADY_S)
    fault_at = time.monotonic()
    said = await fault(ctx)
    await asyncio.sleep(ctx.args.after_s)
    ended = time.monotonic()
    await asyncio.sleep(DEADLINE_S + MARGIN_S)  # every request of the row is answered by now
    answers = [a for a in load.answers if started <= a.sent_at < ended]
    sent = sum(1 for s in load.sent if started <= s < ended)
    before = [a for a in answers if a.sent_at + a.seconds < fault_at and a.status == 200]
    steady = len(before) / STEADY_S
    statuses = Counter(
        "reset" if a.status == 0 else str(a.status) for a in answers if a.status >= 0
    )
    keys, memory = redis_state(cluster)
    result = {
        "fault": key,
        "what": title,
        "said": said,
        "sent": sent,
        "statuses": dict(sorted(statuses.items())),
        "mismatched": sum(1 for a in answers if a.status == 200 and not a.matched),
        "no_answer": sum(1 for a in answers if a.status == -1) + (sent - len(answers)),
        "retry_after_on_every_503": all(a.retry_after for a in answers if a.status == 503),
        "recovery_s": recovery_s(answers, fault_at, steady),
        "orphans": orphans(cluster),
        "shm_files": shm_files(),
        "redis_keys": keys - baseline[0],
        "redis_memory_mb": round((memory - baseline[1]) / (1 << 20), 1),
    }
    print(
        f"  {key:<16} sent {sent:>5} {result['statuses']} mismatched {result['mismatched']} "
        f"no answer {result['no_answer']} Retry-After {result['retry_after_on_every_503']} "
        f"back in {result['recovery_s']} s orphans {result['orphans']}: {said}",
        flush=True,
    )
    # Ready again before the next row: every process of the cluster up.
    deadline = time.monotonic() + 120
    while not (cluster.ready() and cluster.worker_pid("a") and cluster.worker_pid("b")):
        if time.monotonic() > deadline:
            break
        await asyncio.sleep(0.5)
    return result


# -- the run ---------------------------------------------------------------------------------


def build(root: Path) -> dict[str, Path]:
    from app.export import export

    stores = {"v1": root / "kept" / "v1", "v2": root / "kept" / "v2"}
    print("exporting EfficientNet-Lite0 twice (ImageNet weights, then random ones) ...", flush=True)
    export("efficientnet_lite0", "pretrained", stores["v1"])
    import torch

    torch.manual_seed(7)
    export("efficientnet_lite0", "random", stores["v2"])
    (root / "models" / "main").mkdir(parents=True)
    shutil.copytree(stores["v1"], root / "models" / "main" / "1")
    return stores


async def run(args: argparse.Namespace) -> list[dict[str, Any]]:
    from bench.systems import bench_jpegs

    with tempfile.TemporaryDirectory(prefix="microbatch-chaos-") as name:
        scratch = Path(name)
        stores = build(scratch)
        images = bench_jpegs(args.images)
        refs = references(stores, images)
        cluster = Cluster(scratch, scratch / "models")
        before_pids = {p.pid for p in psutil.process_iter()}
        shm_before = shm_files()
        cluster.start_redis()
        for host in ("a", "b"):
            cluster.start_supervisor(host)
        cluster.start_front_ends()
        deadline = time.monotonic() + 300
        while not (cluster.ready() and cluster.worker_pid("a") and cluster.worker_pid("b")):
            if time.monotonic() > deadline:
                raise RuntimeError(f"the cluster did not start; logs in {scratch}")
            await asyncio.sleep(0.5)
        load = Load()
        ctx = Context(cluster, args, images, stores)
        driving = asyncio.create_task(drive(cluster.port, images, refs, load, args.clients))
        await asyncio.sleep(STEADY_S)  # warm
        baseline = redis_state(cluster)
        cpu = platform.processor() or platform.machine()
        print(
            f"chaos: broker mode, 2 front ends, 2 supervisors x 1 worker, {args.clients} "
            f"clients, {len(images)} distinct photos; {cpu}, {os.cpu_count()} cores",
            flush=True,
        )
        results = []
        try:
            for key in args.faults.split(","):
                results.append(await row(key, ctx, load, baseline))
        finally:
            load.stop.set()
            await asyncio.wait_for(driving, DEADLINE_S + MARGIN_S + 5)
            redis_process = cluster.processes.pop("redis")
            await asyncio.to_thread(cluster.stop)
            # Redis outlives the rest for the last check: nothing left past the reply TTL.
            from app.broker.wire.keys import REPLY_TTL_S

            await asyncio.sleep(REPLY_TTL_S + 5)
            keys, memory = redis_state(cluster)
            cluster.processes["redis"] = redis_process
            await asyncio.to_thread(cluster.stop)
            await asyncio.sleep(5)
            left = sorted(ours(cluster.redis_port) - before_pids)
        final = {
            "fault": "end",
            "processes_left": left,
            "shm_files_left": shm_files() - shm_before,
            "redis_keys_after_ttl": keys - baseline[0],
            "redis_memory_mb_after_ttl": round((memory - baseline[1]) / (1 << 20), 1),
        }
        print(f"  after the run: {final}", flush=True)
        return [*results, final]


def table(results: list[dict[str, Any]]) -> str:
    lines = [
        "| fault | sent | answers by status | mismatched | no answer | 503s with Retry-After "
        "| back to steady (s) | orphans | Redis keys / MB vs start |",
        "|---|---|---|---|---|---|---|---|---|",
    ]
    for r in results:
        if r["fault"] == "end":
            continue
        statuses = ", ".join(f"{k}: {v}" for k, v in r["statuses"].items())
        back = "-" if r["recovery_s"] is None else f"{r['recovery_s']:.1f}"
        lines.append(
            f"| {r['what']} | {r['sent']} | {statuses} | {r['mismatched']} | {r['no_answer']} | "
            f"{'all' if r['retry_after_on_every_503'] else 'NOT ALL'} | {back} | "
            f"{len(r['orphans'])} | {r['redis_keys']:+d} / {r['redis_memory_mb']:+.1f} |"
        )
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="python -m bench.chaos",
        description=__doc__,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    parser.add_argument("--faults", default=",".join(FAULTS))
    parser.add_argument("--after-s", type=float, default=30.0, help="load after each fault")
    parser.add_argument("--clients", type=int, default=32)
    parser.add_argument("--images", type=int, default=64, help="distinct photos")
    parser.add_argument("--json", type=Path)
    args = parser.parse_args(argv)
    unknown = set(args.faults.split(",")) - set(FAULTS)
    if unknown:
        parser.error(f"unknown faults: {', '.join(sorted(unknown))} (known: {', '.join(FAULTS)})")
    results = asyncio.run(run(args))
    print("\n" + table(results))
    end = results[-1]
    rows = results[:-1]
    checks = [
        ("no answer mismatched its image", all(r["mismatched"] == 0 for r in rows)),
        ("every request answered by its deadline + 5 s", all(r["no_answer"] == 0 for r in rows)),
        ("every 503 carried Retry-After", all(r["retry_after_on_every_503"] for r in rows)),
        ("no process orphaned", all(not r["orphans"] for r in rows)),
        ("no process left 5 s after the run", not end["processes_left"]),
        ("no shared memory left", end["shm_files_left"] <= 0),
        ("Redis holds nothing past the reply TTL", end["redis_keys_after_ttl"] <= 0),
    ]  # fmt: skip
    print()
    for what, ok in checks:
        print(f"{'PASS' if ok else 'FAIL'}: {what}")
    if args.json:
        args.json.write_text(json.dumps(results, indent=2, default=str))
    return 0 if all(ok for _, ok in checks) else 1


if __name__ == "__main__":
    sys.exit(main())
