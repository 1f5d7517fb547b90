"""Broker mode with one Redis ACL user per role (issue #49, its ACL part): the rules of
``Keys.acl_rules`` (docs/scaling.md) on a real redis-server; workers, a front end and the
admin routes (``MB_BROKER_ADMIN``) serve and roll a version under them, and each user is
refused what its role does not do."""

from __future__ import annotations

import json
import time
from pathlib import Path

import httpx
import pytest
import redis
from redis.exceptions import NoPermissionError

from app.broker.wire.control import decode_pins
from app.broker.wire.keys import Keys
from app.jobs import Task
from tests.answers import error_of
from tests.broker import PREFIX, RedisServer, Workers, broker_env
from tests.integration.test_broker_rollout import IMAGES, served_id
from tests.integration.test_repository import add_version
from tests.models import export_scaled, export_tiny
from tests.server import ServerProcess

pytestmark = pytest.mark.slow

ADMIN = {"Authorization": "Bearer admin-secret"}
IMAGE = {"image": ("x.png", IMAGES[0])}


def role_urls(redis_server: RedisServer) -> dict[str, str]:
    """One user per role, with the documented rules; the URL of each."""
    client = redis_server.client()
    urls = {}
    for role, rules in Keys(PREFIX).acl_rules().items():
        client.execute_command("ACL", "SETUSER", role, "on", f">{role}-pw", *rules.split())  # type: ignore[no-untyped-call]
        urls[role] = f"redis://{role}:{role}-pw@127.0.0.1:{redis_server.port}/0"
    return urls


def front(redis_url: str, repository: Path, store: Path, **env: str) -> ServerProcess:
    return ServerProcess(
        **broker_env(
            redis_url, store, MODEL_REPOSITORY=str(repository), ADMIN_API_KEY="admin-secret",
            **env,
        )
    )  # fmt: skip


def test_every_role_serves_under_its_own_user_and_is_refused_the_rest(tmp_path: Path) -> None:
    repository = tmp_path / "models"
    v1 = export_tiny(repository / "tiny" / "1")
    with RedisServer() as redis_server:
        urls = role_urls(redis_server)
        workers = Workers(
            redis_server, repository, count=1, MODEL_REPOSITORY=str(repository),
            MB_BROKER=urls["worker"],
        )  # fmt: skip
        with (
            workers,
            front(urls["front-end"], repository, v1, MB_BROKER_ADMIN=urls["admin"]) as admin,
            front(urls["front-end"], repository, v1) as plain,
            httpx.Client(timeout=120) as client,
        ):
            for server in (admin, plain):
                answer = client.post(f"{server.base_url}/predict/embedding", files=IMAGE)
                assert answer.status_code == 200, answer.text
                assert answer.headers["X-Model-Id"] == served_id(v1)
            # The admin routes write the pins through the admin user: a rollout completes.
            v2 = add_version(repository, "tiny", lambda out: export_scaled(out, 2.0))
            loaded = client.post(f"{admin.base_url}/v2/repository/models/tiny/load", headers=ADMIN)
            assert loaded.status_code == 200, loaded.text
            assert loaded.json()["model_id"] == served_id(v2)
            deadline = time.monotonic() + 10  # the other front end follows at its next look
            while True:
                answer = client.post(f"{plain.base_url}/predict/embedding", files=IMAGE)
                assert answer.status_code == 200, answer.text
                if answer.headers["X-Model-Id"] == served_id(v2):
                    break
                assert time.monotonic() < deadline, "the other front end never followed"
                time.sleep(0.2)
            # A front end whose only user may not write pins says so, and serves on.
            refused = client.post(f"{plain.base_url}/v2/repository/models/tiny/load", headers=ADMIN)
            assert refused.status_code == 503, refused.text
            assert "MB_BROKER_ADMIN" in error_of(refused)["message"]
            answer = client.post(f"{plain.base_url}/predict/embedding", files=IMAGE)
            assert answer.status_code == 200, answer.text
        stream = Keys(PREFIX).stream(served_id(v2), Task.EMBEDDING)
        as_front = redis.Redis.from_url(urls["front-end"], socket_timeout=5)
        as_worker = redis.Redis.from_url(urls["worker"], socket_timeout=5)
        pins = Keys(PREFIX).pins
        for refused_call in (
            lambda: as_front.xreadgroup("workers", "intruder", {stream: ">"}, count=1),
            lambda: as_front.hset(pins, "tiny", "{}"),
            lambda: as_front.flushall(),
            lambda: as_front.set("elsewhere", "1"),
            lambda: as_worker.hset(pins, "tiny", "{}"),
            lambda: as_worker.keys("*"),
        ):
            with pytest.raises(NoPermissionError):
                refused_call()
        # Reading them is allowed (the load of the newest left no pin in force: the cleared
        # pin's tombstone, with when Redis wrote it, written through the admin user alone).
        assert decode_pins(as_front.hgetall(pins)) == decode_pins(as_worker.hgetall(pins)) == {}
        (tombstone,) = as_worker.hgetall(pins).values()
        assert json.loads(tombstone)["cleared"] is True
