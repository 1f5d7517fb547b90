"""The chart's pods, run for real (``tests/k8s/pods.py`` says how, and what is substituted):
every probe answers as the kubelet reads it (readiness over gRPC), a request through the
Service's http port and one through its grpc port (Triton's own client) are answered, a
worker pod terminated under load loses nothing, and the autoscaler's trigger follows the real
lag of the queue, across a model update too."""

from __future__ import annotations

import asyncio
import shutil
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import numpy as np
import pytest
import redis
import tritonclient.grpc as triton
from tritonclient.utils import InferenceServerException

from app.manifest import read_manifest
from tests.k8s.conftest import NAMESPACE, RELEASE, render
from tests.k8s.pods import Kubelet, Pod
from tests.models import export_scaled, export_tiny

API_KEY = "check-k8s-api-key"
REDIS_PASSWORD = "check-k8s-redis-password"
CLAIM = "models"
PHOTO = Path(__file__).resolve().parents[2] / "docs" / "cat.jpg"
QUEUED = 8  # requests queued while there are no workers
MODEL = "tiny-test"  # the name the test model serves under
# Each test starts real processes; the first also pays for the module's pods.
pytestmark = pytest.mark.timeout(300)


def rendered(profile: str, *overrides: str) -> list[dict[str, Any]]:
    """``ci/<profile>.yaml`` rendered with Secrets set to test values, and ``overrides``."""
    secrets = (f"auth.apiKey={API_KEY}", f"redis.auth.password={REDIS_PASSWORD}")
    return render(profile, sets=(*secrets, *overrides))


def post(base: str, image: bytes = b"", key: str | None = API_KEY) -> httpx.Response:
    headers = {"Authorization": f"Bearer {key}"} if key else {}
    files = {"image": ("cat.jpg", image or PHOTO.read_bytes())}
    return httpx.post(f"{base}/predict/embedding", files=files, headers=headers, timeout=90)


def grpc_embedding(kubelet: Kubelet, key: str | None = API_KEY) -> np.ndarray:
    """The embedding of the photo, asked through the Service's grpc port with Triton's gRPC
    client (``ModelInfer``, the JPEG's bytes as a BYTES tensor)."""
    client = triton.InferenceServerClient(f"127.0.0.1:{kubelet.services[GRPC_SERVICE]}")
    try:
        assert client.is_server_ready()
        image = triton.InferInput("image", [1, 1], "BYTES")
        image.set_data_from_numpy(np.array([[PHOTO.read_bytes()]], dtype=np.object_))
        headers = {"authorization": f"Bearer {key}"} if key else {}
        outputs = [triton.InferRequestedOutput("embedding")]
        result = client.infer(MODEL, [image], outputs=outputs, headers=headers)
        embedding: np.ndarray = result.as_numpy("embedding")[0]
        return embedding
    finally:
        client.close()


def assert_grpc_answers_as_http(kubelet: Kubelet, base: str) -> None:
    """gRPC through the Service gives HTTP's answer, and wants the API key as HTTP does."""
    np.testing.assert_allclose(grpc_embedding(kubelet), post(base).json(), atol=1e-5)
    with pytest.raises(InferenceServerException, match="UNAUTHENTICATED"):
        grpc_embedding(kubelet, key=None)


def assert_probes_pass(kubelet: Kubelet, pod: Pod) -> None:
    """Every probe a container has passes; readiness and liveness everywhere, and a startup
    probe on every app container (Redis starts at once)."""
    for container in pod.containers:
        kinds = ["readinessProbe", "livenessProbe"]
        if container.name != "redis":
            kinds.append("startupProbe")
        for kind in kinds:
            assert kind in container.spec, f"{pod.name}/{container.name} has no {kind}"
            assert kubelet.probe(container, kind), f"{pod.name}/{container.name}: {kind} fails"


def assert_terminated_cleanly(kubelet: Kubelet, pod: Pod) -> None:
    for name, status, seconds in kubelet.terminate(pod):
        assert status == 0, f"{pod.name}/{name} ended with {status} after {seconds:.1f} s"
        assert seconds < pod.grace_s


@pytest.fixture(scope="module")
def repository(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The PersistentVolumeClaim's folder: a repository holding one model, version 1."""
    root = tmp_path_factory.mktemp("claim")
    export_tiny(root / "tiny-test" / "1")
    return root


def test_the_single_server_pod_passes_its_probes_and_serves(
    repository: Path, tmp_path: Path
) -> None:
    """ci/cpu-single.yaml: one pod of ``python -m app``, the model from the image's store."""
    store = export_tiny(tmp_path / "image-store")
    kubelet = Kubelet(rendered("cpu-single"), {}, store, NAMESPACE)
    try:
        pod = kubelet.start("server")
        kubelet.wait_started(pod)
        assert_probes_pass(kubelet, pod)
        base = f"http://127.0.0.1:{kubelet.services[f'{RELEASE}-microbatch-server:8000']}"
        assert post(base).status_code == 200
        assert post(base, key=None).status_code == 401
        assert_grpc_answers_as_http(kubelet, base)
        assert_terminated_cleanly(kubelet, pod)
    finally:
        kubelet.close()


@pytest.fixture(scope="module")
def broker(repository: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Kubelet]:
    """ci/keda.yaml's pods (the model repository on a claim, polled every second): Redis,
    a worker pod and a front-end pod, each started once its dependencies pass their probes."""
    docs = rendered(
        "keda",
        "models.source=pvc",
        f"models.pvc.claimName={CLAIM}",
        "config.repositoryPollSeconds=1",
        "frontend.processes=1",
    )
    store = export_tiny(tmp_path_factory.mktemp("image") / "store")
    kubelet = Kubelet(docs, {CLAIM: repository}, store, NAMESPACE)
    try:
        for component in ("redis", "worker", "frontend"):
            pod = kubelet.start(component)
            kubelet.wait_started(pod)
            assert_probes_pass(kubelet, pod)
        yield kubelet
    finally:
        kubelet.close()


SERVICE = f"{RELEASE}-microbatch-server:8000"  # the front ends' (or the server's) Service
GRPC_SERVICE = f"{RELEASE}-microbatch-server:8001"  # the same Service's grpc port


def front(kubelet: Kubelet) -> str:
    return f"http://127.0.0.1:{kubelet.services[SERVICE]}"


def redis_client(kubelet: Kubelet) -> redis.Redis:
    port = kubelet.services[f"{RELEASE}-microbatch-server-redis:6379"]
    password = kubelet.secrets[f"{RELEASE}-microbatch-server-redis"]["password"]
    return redis.Redis(port=port, password=password)


def test_a_request_through_the_front_end_service_is_answered(broker: Kubelet) -> None:
    answer = post(front(broker))
    assert answer.status_code == 200, answer.text
    assert len(answer.json()) == 48
    assert post(front(broker), key=None).status_code == 401  # API_KEY came from the Secret


def test_a_grpc_request_through_the_front_end_service_is_answered(broker: Kubelet) -> None:
    """The front end serves the Open Inference Protocol over gRPC too (MB_GRPC_PORT), on the
    port its readiness probe asks and the Service's grpc port reaches."""
    assert_grpc_answers_as_http(broker, front(broker))


def test_the_redis_password_from_the_secret_is_required(broker: Kubelet) -> None:
    port = broker.services[f"{RELEASE}-microbatch-server-redis:6379"]
    with pytest.raises(redis.AuthenticationError):
        redis.Redis(port=port).ping()
    assert redis_client(broker).ping()


async def _load(kubelet: Kubelet, seconds: float, clients: int = 4) -> list[int]:
    """``clients`` callers sending one request after another for ``seconds``, each to the
    front-end Service as it is at that moment."""
    statuses: list[int] = []

    async def caller(index: int) -> None:
        async with httpx.AsyncClient(timeout=90) as client:
            ends = time.monotonic() + seconds
            while time.monotonic() < ends:
                answer = await client.post(
                    f"{front(kubelet)}/predict/embedding",
                    files={"image": ("cat.jpg", PHOTO.read_bytes())},
                    headers={"Authorization": f"Bearer {API_KEY}"},
                )
                statuses.append(answer.status_code)

    await asyncio.gather(*(caller(i) for i in range(clients)))
    return statuses


def terminated_under_load(kubelet: Kubelet, pod: Pod) -> None:
    """8 s of load from 4 clients; 2 s in, ``pod`` is terminated as the kubelet does it: it
    exits 0 within its grace period, and every request is answered 200."""

    async def run() -> list[int]:
        load = asyncio.create_task(_load(kubelet, 8))
        await asyncio.sleep(2)
        await asyncio.to_thread(assert_terminated_cleanly, kubelet, pod)
        return await load

    statuses = asyncio.run(run())
    assert len(statuses) > 20
    assert set(statuses) == {200}, sorted(set(statuses))


def test_a_worker_pod_terminated_under_load_loses_nothing(broker: Kubelet) -> None:
    """Two worker pods under load; one goes through the kubelet's termination (its preStop,
    if any, then SIGTERM, SIGKILL at the grace period): it exits 0 in time, and every request
    sent meanwhile is answered 200."""
    second = broker.start("worker")
    broker.wait_started(second)
    first = next(p for p in broker.pods if p.labels["app.kubernetes.io/component"] == "worker")

    terminated_under_load(broker, first)


def test_a_front_end_pod_terminated_under_load_loses_nothing(broker: Kubelet) -> None:
    """Two front-end pods under load; one is terminated: it leaves the Service's endpoints,
    its preStop sleep lets requests already sent to it finish, SIGTERM ends it (exit 0 in
    its grace period), and every request is answered 200."""
    serving = broker.behind(SERVICE)
    broker.wait_started(broker.start("frontend"))
    if broker.behind(SERVICE) is not serving:  # the Service sends to the new one: swap back
        broker.serve(serving)
    assert broker.behind(SERVICE) is serving

    terminated_under_load(broker, serving)
    assert broker.behind(SERVICE) is not serving


def trigger(kubelet: Kubelet) -> dict[str, Any]:
    """The ScaledObject's metrics-api trigger, as rendered."""
    (scaled,) = kubelet.objects("ScaledObject")
    (found,) = scaled["spec"]["triggers"]
    assert found["type"] == "metrics-api"
    metadata: dict[str, Any] = found["metadata"]
    return metadata


def trigger_value(kubelet: Kubelet) -> tuple[int, dict[str, Any]]:
    """What KEDA would read: GET the trigger's url (the front-end Service), the number at
    ``valueLocation``; and the whole answer."""
    metadata = trigger(kubelet)
    url = kubelet.route(metadata["url"])
    body = httpx.get(url, timeout=5).json()
    value: Any = body
    for part in metadata["valueLocation"].split("."):
        value = value[part]
    return int(value), body


def lag_in_redis(client: redis.Redis, streams: list[str]) -> int:
    """What XINFO GROUPS says of ``streams``: lag + pending of the workers' group."""
    total = 0
    for stream in streams:
        assert client.exists(stream), f"{stream} does not exist"
        (group,) = [g for g in client.xinfo_groups(stream) if g["name"] == b"workers"]
        total += int(group["lag"]) + int(group["pending"])
    return total


def _queue_and_drain(kubelet: Kubelet, served_id: str) -> None:
    """No worker pods; requests queued; the trigger's figure and XINFO GROUPS agree and grow
    with them; a worker pod started answers every one, and the figure falls to 0."""
    for pod in [p for p in kubelet.pods if p.labels["app.kubernetes.io/component"] == "worker"]:
        assert_terminated_cleanly(kubelet, pod)
    client = redis_client(kubelet)
    value, _ = trigger_value(kubelet)
    assert value == 0

    async def run() -> list[httpx.Response]:
        async with httpx.AsyncClient(timeout=120) as http:
            sent = []
            seen = []
            for index in range(QUEUED):
                sent.append(
                    asyncio.create_task(
                        http.post(
                            f"{front(kubelet)}/predict/embedding",
                            files={"image": ("cat.jpg", PHOTO.read_bytes())},
                            headers={"Authorization": f"Bearer {API_KEY}"},
                        )
                    )
                )
                queued = index + 1
                await _until(
                    lambda n=queued: trigger_value(kubelet)[0] == n,
                    lambda n=queued: (
                        f"the trigger to read {n} (answered meanwhile: "
                        f"{[t.result().status_code for t in sent if t.done()]})"
                    ),
                )
                value, body = trigger_value(kubelet)
                streams = [s["stream"] for s in body["streams"] if s["lag"] or s["pending"]]
                assert all(served_id.split("@")[1].split("+")[0] in s for s in streams)
                seen.append((value, lag_in_redis(client, streams)))
            assert seen == [(n, n) for n in range(1, QUEUED + 1)], seen
            assert not any(task.done() for task in sent)
            worker = await asyncio.to_thread(kubelet.start, "worker")
            await asyncio.to_thread(kubelet.wait_started, worker)
            answers = await asyncio.gather(*sent)
            await _until(lambda: trigger_value(kubelet)[0] == 0, lambda: "the trigger to read 0")
            return answers

    answers = asyncio.run(run())
    assert [a.status_code for a in answers] == [200] * QUEUED
    assert {a.headers["X-Model-Id"] for a in answers} == {served_id}


async def _until(condition: Any, what: Any, timeout_s: float = 30) -> None:
    """Until ``condition()``; ``what()`` says what was waited for, when it never came."""
    deadline = time.monotonic() + timeout_s
    while not await asyncio.to_thread(condition):
        assert time.monotonic() < deadline, f"timed out waiting for {what()}"
        await asyncio.sleep(0.1)


def test_the_autoscalers_trigger_follows_the_real_lag(broker: Kubelet) -> None:
    url = trigger(broker)["url"]
    assert url == f"http://{RELEASE}-microbatch-server.{NAMESPACE}.svc.cluster.local:8000/backlog"
    served = post(front(broker)).headers["X-Model-Id"]
    _queue_and_drain(broker, served)


def test_the_trigger_follows_the_lag_across_a_model_update(
    broker: Kubelet, repository: Path, tmp_path: Path
) -> None:
    """A new version written into the claim: the worker pods (polling the repository) load
    it and the name switches, with no change to the chart; the trigger then counts the new
    version's streams."""
    before = post(front(broker)).headers["X-Model-Id"]
    staged = export_scaled(tmp_path / "v2", 2.0)
    shutil.copytree(staged, repository / "tiny-test" / ".2.tmp")
    (repository / "tiny-test" / ".2.tmp").rename(repository / "tiny-test" / "2")
    after = f"tiny-test@{read_manifest(staged).version}"
    deadline = time.monotonic() + 60
    while (served := post(front(broker)).headers["X-Model-Id"]) == before:
        assert time.monotonic() < deadline, "the new version never served"
        time.sleep(0.5)
    assert served.split("+")[0] == after
    _queue_and_drain(broker, served)
