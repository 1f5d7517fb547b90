"""Redis as production runs it, for real on 127.0.0.1: a primary, two replicas and three
Sentinels (Debian's redis-server; ``--sentinel`` needs nothing else), with TLS and ACL users
when asked, and the faults a failover test makes: ``SENTINEL FAILOVER``, ``kill -9`` of the
primary, ``SIGSTOP`` past Sentinel's down-after then ``SIGCONT``."""

from __future__ import annotations

import os
import shutil
import signal
import subprocess
import tempfile
import time
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import redis

from tests.broker import TlsFiles, require_redis_server
from tests.children import start
from tests.server import free_port

SERVICE = "mb-primary"
DOWN_AFTER_MS = 1000  # Sentinel's down-after: a primary silent this long is down
FAILOVER_TIMEOUT_MS = 2000  # and another failover of it may start 2x this later
OPS_USER, OPS_PASSWORD = "ops", "ops-pw"  # replication and Sentinel's own user


class RedisNode:
    """One redis-server (no persistence) or Sentinel of the set."""

    def __init__(self, binary: str, folder: Path, name: str, lines: list[str]) -> None:
        self.binary, self.name = binary, name
        self.port = free_port()
        self.dir = folder / name
        self.dir.mkdir()
        self.conf = self.dir / "redis.conf"
        self.lines = lines
        self.process: subprocess.Popen[bytes] | None = None

    def start(self, extra: list[str] | None = None) -> None:
        self.conf.write_text("\n".join([*self.lines, *(extra or [])]) + "\n")
        command = [self.binary, str(self.conf)]
        if self.name.startswith("sentinel"):
            command.append("--sentinel")
        self.process = start(command, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)

    @property
    def alive(self) -> bool:
        return self.process is not None and self.process.poll() is None

    def signal(self, signum: int) -> None:
        assert self.process is not None
        os.kill(self.process.pid, signum)
        if signum == signal.SIGKILL:
            self.process.wait(timeout=10)

    def stop(self) -> None:
        if self.process is not None and self.process.poll() is None:
            os.kill(self.process.pid, signal.SIGCONT)  # a stopped one must hear SIGTERM
            self.process.terminate()
            try:
                self.process.wait(timeout=10)
            except subprocess.TimeoutExpired:
                self.process.kill()
                self.process.wait(timeout=10)


class SentinelSet:
    """A primary, two replicas and three Sentinels watching it (quorum 2), with ``url`` the
    ``redis+sentinel://`` URL of the set (``rediss+sentinel://`` with ``tls``). With
    ``acl``, every data node has the same users (``ACL SETUSER`` on each: ACLs are not
    replicated) and the default user is off; replication and Sentinel go as ``ops``."""

    def __init__(self, tls: TlsFiles | None = None, acl: Mapping[str, str] | None = None) -> None:
        self.binary = require_redis_server()
        self.folder = Path(tempfile.mkdtemp(prefix="mbtest-sentinel-"))
        self.tls, self.acl = tls, dict(acl or {})
        self.nodes = [self._node(f"redis-{i}", self._data_lines()) for i in range(3)]
        self.sentinels = [self._node(f"sentinel-{i}", []) for i in range(3)]
        self.url = self.url_as(OPS_USER, OPS_PASSWORD) if acl else self.url_as(None, None)
        self.elected_at = 0.0  # when ``after_fault`` last saw a new primary

    def url_as(self, user: str | None, password: str | None) -> str:
        """The set's ``redis+sentinel://`` URL (``rediss+sentinel://`` with TLS), as
        ``user`` (one of the ACL users) where given."""
        hosts = ",".join(f"127.0.0.1:{s.port}" for s in self.sentinels)
        scheme = "rediss+sentinel" if self.tls else "redis+sentinel"
        query = f"?{self.tls.url_options()}" if self.tls else ""
        auth = f"{user}:{password}@" if user else ""
        return f"{scheme}://{auth}{hosts}/{SERVICE}/0{query}"

    def _node(self, name: str, lines: list[str]) -> RedisNode:
        node = RedisNode(self.binary, self.folder, name, lines)
        node.lines = [*self._listen(node.port), "bind 127.0.0.1", f"dir {node.dir}", *lines]
        return node

    def _listen(self, port: int) -> list[str]:
        if self.tls is None:
            return [f"port {port}"]
        t = self.tls
        return ["port 0", f"tls-port {port}", f"tls-cert-file {t.server_cert}",
                f"tls-key-file {t.server_key}", f"tls-ca-cert-file {t.ca}",
                "tls-replication yes"]  # fmt: skip

    def _data_lines(self) -> list[str]:
        lines = ['save ""', "appendonly no", "repl-diskless-sync yes",
                 "repl-diskless-sync-delay 0"]  # fmt: skip
        if self.acl:
            lines += [f"user {OPS_USER} on >{OPS_PASSWORD} ~* &* +@all", "user default off",
                      f"masteruser {OPS_USER}", f"masterauth {OPS_PASSWORD}"]  # fmt: skip
            lines += [f"user {name} on {rules}" for name, rules in self.acl.items()]
        return lines

    def _sentinel_lines(self, primary_port: int) -> list[str]:
        lines = [
            f"sentinel monitor {SERVICE} 127.0.0.1 {primary_port} 2",
            f"sentinel down-after-milliseconds {SERVICE} {DOWN_AFTER_MS}",
            f"sentinel failover-timeout {SERVICE} {FAILOVER_TIMEOUT_MS}",
            f"sentinel parallel-syncs {SERVICE} 2",
        ]
        if self.acl:
            lines += [f"sentinel auth-user {SERVICE} {OPS_USER}",
                      f"sentinel auth-pass {SERVICE} {OPS_PASSWORD}"]  # fmt: skip
        return lines

    # -- life ------------------------------------------------------------------------------

    def start(self) -> SentinelSet:
        primary = self.nodes[0]
        primary.start()
        for node in self.nodes[1:]:
            node.start([f"replicaof 127.0.0.1 {primary.port}"])
        for sentinel in self.sentinels:
            sentinel.start(self._sentinel_lines(primary.port))
        self.wait(lambda: len(self.replicas_synced()) == 2, "two replicas in sync", 20)
        self.wait(lambda: self.sentinels_agree(primary.port), "the Sentinels watching", 40)
        return self

    def stop(self) -> None:
        for node in [*self.sentinels, *self.nodes]:
            node.stop()
        shutil.rmtree(self.folder, ignore_errors=True)

    def __enter__(self) -> SentinelSet:
        return self.start()

    def __exit__(self, *exc_info: object) -> None:
        self.stop()

    # -- asking ------------------------------------------------------------------------------

    def _client(self, port: int, timeout_s: float = 2) -> redis.Redis:
        options: dict[str, object] = {"socket_timeout": timeout_s, "socket_connect_timeout": 1}
        if self.tls is not None:
            options |= self.tls.client_options()
        if self.acl:
            options |= {"username": OPS_USER, "password": OPS_PASSWORD}
        return redis.Redis(host="127.0.0.1", port=port, **options)  # type: ignore[arg-type]

    def _sentinel_client(self, sentinel: RedisNode) -> redis.Redis:
        options: dict[str, object] = {"socket_timeout": 2, "socket_connect_timeout": 1}
        if self.tls is not None:
            options |= self.tls.client_options()
        return redis.Redis(host="127.0.0.1", port=sentinel.port, **options)  # type: ignore[arg-type]

    def primary_port(self) -> int | None:
        """The primary's port as a majority of the live Sentinels says it."""
        said: dict[int, int] = {}
        for sentinel in self.sentinels:
            if not sentinel.alive:
                continue
            try:
                address: Any = self._sentinel_client(sentinel).sentinel_get_master_addr_by_name(
                    SERVICE
                )
                port = address[1]
            except (redis.RedisError, OSError, TypeError):
                continue
            said[int(port)] = said.get(int(port), 0) + 1
        best = max(said.items(), key=lambda kv: kv[1], default=None)
        return best[0] if best and best[1] >= 2 else None

    def primary(self) -> RedisNode:
        port = self.primary_port()
        node = next((n for n in self.nodes if n.port == port), None)
        assert node is not None, f"no primary agreed on (said: {port})"
        return node

    def sentinels_agree(self, port: int) -> bool:
        """Every Sentinel names ``port`` the primary, knows its two replicas up and the
        two other Sentinels: a failover can be asked and can succeed."""
        for sentinel in self.sentinels:
            try:
                client = self._sentinel_client(sentinel)
                address: Any = client.sentinel_get_master_addr_by_name(SERVICE)
                said = address[1]
                replicas: Any = client.sentinel_slaves(SERVICE)
                others: Any = client.sentinel_sentinels(SERVICE)
            except (redis.RedisError, OSError, TypeError):
                return False
            up = [
                r
                for r in replicas
                if not (
                    {"s_down", "o_down", "disconnected"}
                    & set(r["flags"].split(",") if isinstance(r["flags"], str) else r["flags"])
                )
            ]
            if int(said) != port or len(up) < 2 or len(others) < 2:
                return False
        return True

    def replicas_synced(self) -> list[RedisNode]:
        """The data nodes that replicate the current primary, link up."""
        port = self.primary_port()
        synced = []
        for node in self.nodes:
            if not node.alive or node.port == port:
                continue
            try:
                info = self._client(node.port).info("replication")
            except (redis.RedisError, OSError):
                continue
            if info.get("master_port") == port and info.get("master_link_status") == "up":
                synced.append(node)
        return synced

    def client(self) -> redis.Redis:
        """A client of the primary, following it through Sentinel (as ``ops``)."""
        from app.broker.wire.connect import connect

        return connect(self.url, socket_timeout=5, socket_connect_timeout=1)

    @staticmethod
    def wait(check: object, what: str, timeout_s: float) -> None:
        deadline = time.monotonic() + timeout_s
        while not check():  # type: ignore[operator]
            if time.monotonic() > deadline:
                raise AssertionError(f"timed out waiting for {what}")
            time.sleep(0.1)

    # -- faults ------------------------------------------------------------------------------

    def failover(self) -> None:
        """A graceful failover, as an operator asks it."""
        sentinel = self._sentinel_client(self.sentinels[0])
        sentinel.execute_command("SENTINEL", "FAILOVER", SERVICE)  # type: ignore[no-untyped-call]

    def kill_primary(self) -> RedisNode:
        """``kill -9`` of the primary; ``restart`` brings it back, empty, as a replica."""
        victim = self.primary()
        victim.signal(signal.SIGKILL)
        return victim

    def restart(self, node: RedisNode) -> None:
        self.wait(lambda: self.primary_port() not in (None, node.port), "a new primary", 30)
        node.start([f"replicaof 127.0.0.1 {self.primary_port()}"])

    def after_fault(self, old_port: int, timeout_s: float = 30) -> float:
        """Wait until the Sentinels agree on a new primary (``elected_at``: when this saw
        it, by ``time.monotonic()``) and both replicas follow it; returns the seconds it took."""
        started = time.monotonic()
        self.wait(lambda: self.primary_port() not in (None, old_port), "a new primary", timeout_s)
        self.elected_at = time.monotonic()
        self.wait(lambda: len(self.replicas_synced()) == 2, "two replicas in sync", timeout_s)
        return time.monotonic() - started

    def settled(self, timeout_s: float = 40) -> None:
        """Wait until a next failover can be asked and succeed: every Sentinel agrees on the
        primary, and sees both replicas up and the other Sentinels."""

        def agreed() -> bool:
            port = self.primary_port()
            return port is not None and self.sentinels_agree(port)

        self.wait(agreed, "the Sentinels to settle", timeout_s)
