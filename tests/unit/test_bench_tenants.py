"""bench/tenants.py's pieces that need no server: the keys file it serves with, the headers
each stream sends, and how it reads a run."""

from __future__ import annotations

from pathlib import Path

import pytest

from app.tenancy import Keyring, Scope, Tenancy
from bench import tenants
from bench.tenants import KEYS, Stream, keys_file, stream


def test_its_keys_file_is_one_the_server_takes(tmp_path: Path) -> None:
    gate = Tenancy(Keyring.read(keys_file(tmp_path, capacity=200.0)), levels=2)
    assert gate.keyring.tenant("A").rate == pytest.approx(100.0)
    assert gate.keyring.tenant("B").rate == pytest.approx(40.0)
    ticket = gate.ticket(gate.caller(f"Bearer {KEYS['L']}", Scope.INFER), "1")
    assert ticket.level == 1  # L may not raise itself to priority 1
    assert gate.ticket(gate.caller(f"Bearer {KEYS['H']}", Scope.INFER), "1").level == 0


def test_a_stream_sends_its_key_and_priority_only_with_the_features_on() -> None:
    on = dict(stream("H", 10.0, on=True, priority="1").headers)
    off = dict(stream("H", 10.0, on=False, priority="1").headers)
    assert on["Authorization"] == f"Bearer {KEYS['H']}" and on["X-Priority"] == "1"
    assert set(off) == {"X-Request-Timeout"}


def test_a_streams_p99_and_refusals() -> None:
    run = Stream("B", 1.0, ())
    run.latencies_s = [0.001 * i for i in range(1, 101)]
    run.statuses.update({200: 100, 429: 2, 0: 1})
    assert run.p99_ms() == pytest.approx(100.0) and run.refused == 3


def test_a_run_sends_each_tenant_its_share_of_the_capacity(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    sent: list[Stream] = []

    def run(port: int, jpegs: list[bytes], streams: list[Stream], seconds: float) -> list[Stream]:
        sent.extend(streams)
        return streams

    monkeypatch.setattr(tenants, "run", run)
    got = tenants.runs(8000, [b"x"], 200.0, 1.0, True, ("H", 0.3, "1"), ("L", 1.7, "2"))
    assert [(s.name, s.rate) for s in got] == [("H", pytest.approx(60.0)), ("L", 340.0)]
    assert dict(sent[1].headers)["X-Priority"] == "2"


def test_the_quota_verdict_compares_the_admitted_with_burst_and_rate() -> None:
    # C 200: A's rate 100/s, its burst 10; in 30 s its quota lets 3,010 images through.
    assert tenants.quota_verdict("m", 3_010, 200.0, 30.0)["pass"] is True
    assert tenants.quota_verdict("m", 3_300, 200.0, 30.0)["pass"] is True  # 9.6% over
    far = tenants.quota_verdict("m", 6_000, 200.0, 30.0)  # two front ends, a bucket each
    assert far["pass"] is False and far["value"] == pytest.approx(2990 / 3010)
