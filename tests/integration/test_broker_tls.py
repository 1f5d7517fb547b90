"""Broker mode through a Redis that speaks TLS only and asks every client for a certificate
(issue #49, its TLS part): a ``rediss://`` URL with redis-py's certificate options, given as
``MB_BROKER``, serves for front ends and workers alike; a client without a certificate is
refused by Redis, and the server's answer to that is a typed 503, never a hang."""

from __future__ import annotations

import time
from pathlib import Path

import httpx
import pytest
import redis

from tests.answers import error_of
from tests.broker import RedisServer, Workers, broker_env, make_tls_files
from tests.conftest import distinct_images
from tests.server import ServerProcess

pytestmark = pytest.mark.slow


def test_front_ends_and_workers_serve_through_a_redis_that_speaks_only_tls(
    tiny_store: Path, tmp_path: Path
) -> None:
    tls = make_tls_files(tmp_path)
    with RedisServer(tls=tls) as redis_server, Workers(redis_server, tiny_store, count=1):
        assert redis_server.url.startswith("rediss://")
        with ServerProcess(**broker_env(redis_server.url, tiny_store)) as front:
            deadline = time.monotonic() + 60
            while front.readiness()[0] != 200:
                assert time.monotonic() < deadline, front.readiness()
                time.sleep(0.2)
            for image in distinct_images(3):
                answer = httpx.post(
                    f"{front.base_url}/predict/embedding", files={"image": image}, timeout=30
                )
                assert answer.status_code == 200, answer.text
                assert len(answer.json()) > 0
        # Only TLS with a client certificate gets in: no plain port, no anonymous TLS.
        plain = f"redis://127.0.0.1:{redis_server.port}/0"
        with pytest.raises(redis.ConnectionError):
            redis.Redis.from_url(plain, socket_timeout=2, socket_connect_timeout=2).ping()
        anonymous = f"rediss://127.0.0.1:{redis_server.port}/0?ssl_ca_certs={tls.ca}"
        with pytest.raises(redis.ConnectionError):
            redis.Redis.from_url(anonymous, socket_timeout=2, socket_connect_timeout=2).ping()


def test_a_front_end_without_a_client_certificate_answers_503_broker_unavailable(
    tiny_store: Path, tmp_path: Path
) -> None:
    tls = make_tls_files(tmp_path)
    with RedisServer(tls=tls) as redis_server:
        anonymous = f"rediss://127.0.0.1:{redis_server.port}/0?ssl_ca_certs={tls.ca}"
        front = ServerProcess(**broker_env(anonymous, tiny_store)).start(ready=False)
        try:
            assert front.readiness()[0] == 503
            began = time.monotonic()
            answer = httpx.post(
                f"{front.base_url}/predict/embedding",
                files={"image": distinct_images(1)[0]},
                timeout=30,
            )
            assert time.monotonic() - began < 5
        finally:
            front.stop()
    assert answer.status_code == 503
    assert error_of(answer)["type"] == "broker_unavailable"
    assert "Retry-After" in answer.headers
