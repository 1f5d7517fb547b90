"""Keys, scopes and quotas (``app.tenancy``): the keys file and its errors, who a key is and
what it may do, the token bucket's arithmetic, the 429's headers and a reload on SIGHUP."""

from __future__ import annotations

import asyncio
import io
import logging
from pathlib import Path

import pytest

from app.batching import Ticket
from app.errors import Forbidden, InvalidParameter, QuotaExceeded, SettingsError, Unauthorized
from app.metrics import Metrics
from app.settings import Settings
from app.tenancy import Caller, Keyring, LocalBuckets, Scope, Tenancy, Tenant, key_hash

SHOP, BULK, OPS = "shop-key", "bulk-key", "ops-key"

KEYS_YAML = f"""
tenants:
  shop: {{rate: 10, burst: 20, weight: 4}}
  bulk: {{rate: 2}}
keys:
  - sha256: {key_hash(SHOP)}
    tenant: shop
    scopes: [infer]
    priority: 2
    top_priority: 1
  - sha256: {key_hash(BULK)}
    tenant: bulk
    scopes: [infer]
  - sha256: {key_hash(OPS)}
    tenant: ops
    scopes: [admin, metrics]
anonymous: {{tenant: public, scopes: [metrics]}}
"""

KEYS_TOML = f"""
[tenants.shop]
rate = 10
burst = 20

[[keys]]
sha256 = "{key_hash(SHOP)}"
tenant = "shop"
scopes = ["infer"]
"""


def bearer(key: str) -> str:
    return f"Bearer {key}"


def write(tmp_path: Path, text: str, name: str = "keys.yaml") -> Path:
    path = tmp_path / name
    path.write_text(text)
    return path


def test_a_yaml_keys_file_gives_each_key_its_tenant_scopes_priorities_and_share(
    tmp_path: Path,
) -> None:
    ring = Keyring.read(write(tmp_path, KEYS_YAML))
    shop = ring.caller(SHOP)
    assert shop == Caller("shop", frozenset({Scope.INFER}), priority=2, top_priority=1)
    bulk = ring.caller(BULK)
    assert bulk is not None and (bulk.priority, bulk.top_priority) == (None, None)
    assert ring.tenant("shop") == Tenant("shop", rate=10, burst=20, weight=4)
    assert ring.tenant("bulk") == Tenant("bulk", rate=2, burst=2)  # a second of its rate
    assert ring.tenant("ops") == Tenant("ops")  # not described: no quota
    assert ring.caller("unknown") is None
    assert ring.anonymous == Caller("public", frozenset({Scope.METRICS}))
    assert ring.tenants == ["bulk", "ops", "public", "shop"]


def test_a_toml_keys_file_reads_the_same(tmp_path: Path) -> None:
    ring = Keyring.read(write(tmp_path, KEYS_TOML, "keys.toml"))
    assert ring.caller(SHOP) == Caller("shop", frozenset({Scope.INFER}))
    assert ring.tenant("shop").burst == 20
    assert ring.anonymous is None  # without a key, nothing


def test_the_file_holds_hashes_never_keys(tmp_path: Path) -> None:
    text = write(tmp_path, KEYS_YAML).read_text()
    assert SHOP not in text and key_hash(SHOP) in text


@pytest.mark.parametrize(
    ("text", "says"),
    [
        ("keys: [{sha256: abc, tenant: t, scopes: [infer]}]", "sha256"),
        (f"keys: [{{sha256: {key_hash('k')}, tenant: t, scopes: [fly]}}]", "scopes"),
        (f"keys: [{{sha256: {key_hash('k')}, tenant: 'a b', scopes: [infer]}}]", "tenant"),
        (f"keys: [{{sha256: {key_hash('k')}, tenant: t, scopes: []}}]", "scopes"),
        (
            f"keys: [{{sha256: {key_hash('k')}, tenant: t, scopes: [infer], priority: 1, "
            "top_priority: 3}]",
            "top_priority 3 is below",
        ),
        (
            f"keys: [{{sha256: {key_hash('k')}, tenant: t, scopes: [infer]}},"
            f" {{sha256: {key_hash('k')}, tenant: u, scopes: [infer]}}]",
            "twice",
        ),
        ("tenants: {t: {rate: -1}}", "rate"),
        ("tenants: {'a b': {rate: 1}}", "tenant names"),
        ("tenant: {}", "tenant"),  # a misspelt section is an error, not ignored
        ("keys: [", "not valid yaml"),
        # Found by a review: an empty file (one caught half written by a SIGHUP) revoked
        # every key; a weight past what the broker's lanes carry left a tenant unserved.
        ("", "grants nothing"),
        ("tenants: {t: {weight: 2000000}}", "weight"),
    ],
)
def test_a_bad_keys_file_is_refused_with_what_is_wrong(
    tmp_path: Path, text: str, says: str
) -> None:
    with pytest.raises(SettingsError, match="MB_KEYS_FILE") as refused:
        Keyring.read(write(tmp_path, text))
    assert says in str(refused.value)


def test_a_keys_file_that_is_not_utf8_is_refused_in_one_line(tmp_path: Path) -> None:
    """Found by a review: a traceback at start, and on SIGHUP an exception that also
    skipped the reload of the models."""
    path = tmp_path / "keys.yaml"
    path.write_bytes(b"keys: [\xff]")
    with pytest.raises(SettingsError, match="not UTF-8"):
        Keyring.read(path)


def test_a_keys_file_of_another_kind_or_missing_is_refused(tmp_path: Path) -> None:
    with pytest.raises(SettingsError, match=r"name a \.yaml"):
        Keyring.read(write(tmp_path, "{}", "keys.json"))
    with pytest.raises(SettingsError, match="cannot read"):
        Keyring.read(tmp_path / "absent.yaml")


def test_api_key_and_admin_api_key_are_a_one_line_keyring() -> None:
    ring = Keyring.of_settings("user", "admin")
    assert ring.caller("user") == Caller("default", frozenset({Scope.INFER}), None, 1)
    assert ring.caller("admin") == Caller("admin", frozenset({Scope.ADMIN}))
    assert ring.anonymous == Caller("anonymous", frozenset({Scope.METRICS}), None, 1)
    open_ring = Keyring.of_settings(None, None)
    assert open_ring.anonymous is not None and open_ring.anonymous.allows(Scope.INFER)
    assert not open_ring.any_allows(Scope.ADMIN)


def test_a_keys_file_and_api_key_together_are_refused(tmp_path: Path) -> None:
    settings = Settings(mb_keys_file=write(tmp_path, KEYS_YAML), api_key="x")
    with pytest.raises(SettingsError, match="replaces API_KEY"):
        Tenancy.of_settings(settings)


def test_who_calls_401_for_no_or_unknown_key_403_for_a_key_without_the_scope(
    tmp_path: Path,
) -> None:
    gate = Tenancy(Keyring.read(write(tmp_path, KEYS_YAML)), tmp_path / "keys.yaml", levels=2)
    assert gate.caller(bearer(SHOP), Scope.INFER).tenant == "shop"
    assert gate.caller(None, Scope.METRICS).tenant == "public"  # the file allows it
    assert gate.caller(bearer(OPS), Scope.METRICS).tenant == "ops"
    # a scope open without a key is open with any key (found by the API fuzz: API_KEY's
    # key, which lacks the metrics scope, was refused /metrics, open to everyone before)
    assert gate.caller(bearer(SHOP), Scope.METRICS).tenant == "public"
    assert gate.caller(bearer("unknown"), Scope.METRICS).tenant == "public"
    settings_gate = Tenancy(Keyring.of_settings("user", None))
    assert settings_gate.caller(bearer("user"), Scope.METRICS).tenant == "anonymous"
    for sent in (None, bearer("unknown"), "Basic eDp5", SHOP):
        with pytest.raises(Unauthorized, match="a key with the infer scope"):
            gate.caller(sent, Scope.INFER)
    with pytest.raises(Forbidden, match=r"tenant shop.*admin scope"):
        gate.caller(bearer(SHOP), Scope.ADMIN)
    with pytest.raises(Unauthorized, match="metadata 'authorization"):
        gate.caller(None, Scope.INFER, where="metadata")


def test_without_an_admin_key_loading_is_off_whatever_is_sent() -> None:
    gate = Tenancy(Keyring.of_settings("user", None))
    with pytest.raises(Unauthorized, match="ADMIN_API_KEY is not set"):
        gate.caller(bearer("user"), Scope.ADMIN)
    with pytest.raises(Unauthorized, match="Bearer <API_KEY>"):
        gate.caller(bearer("wrong"), Scope.INFER)


def test_a_bucket_refills_at_its_rate_up_to_its_burst() -> None:
    now = [0.0]
    buckets = LocalBuckets(clock=lambda: now[0])
    share = Tenant("t", rate=4.0, burst=8.0)
    assert buckets.take(share, 8).allowed  # a full burst at once
    refused = buckets.take(share, 2)
    assert not refused.allowed and refused.retry_after_s == pytest.approx(0.5)
    now[0] = 0.5
    assert buckets.take(share, 2).allowed  # refilled exactly that
    now[0] = 100.0
    full = buckets.take(share, 1)
    assert full.allowed and full.remaining == pytest.approx(7.0)  # capped at the burst
    other = Tenant("u", rate=1.0, burst=1.0)
    assert buckets.take(other, 1).allowed  # each tenant its own bucket


def test_a_tenant_over_its_quota_gets_429_with_retry_after_and_ratelimit_fields(
    tmp_path: Path,
) -> None:
    metrics = Metrics()
    gate = Tenancy(Keyring.read(write(tmp_path, KEYS_YAML)), metrics=metrics, levels=2)
    bulk = gate.caller(bearer(BULK), Scope.INFER)
    shop = gate.caller(bearer(SHOP), Scope.INFER)

    async def run() -> QuotaExceeded:
        await gate.charge(gate.ticket(bulk), 2)  # its whole burst
        with pytest.raises(QuotaExceeded) as refused:
            await gate.charge(gate.ticket(bulk), 1)
        await gate.charge(gate.ticket(shop), 20)  # another tenant's bucket is its own
        return refused.value

    refused = asyncio.run(run())
    assert 0.3 < refused.retry_after_s <= 0.5  # one image at 2/s
    assert refused.headers == {
        "RateLimit-Policy": '"bulk";q=2;w=1',
        "RateLimit": '"bulk";r=0;t=1',
    }
    assert "bulk is over its quota of 2 images/s" in refused.message
    text = metrics.render().decode()
    assert 'microbatch_tenant_requests_total{outcome="over_quota",tenant="bulk"} 1.0' in text
    assert 'microbatch_tenant_images_total{outcome="admitted",tenant="shop"} 20.0' in text
    assert 'tenant="ops"' not in text  # a tenant's series start when it asks (so do panels)


def test_a_request_larger_than_its_burst_is_422_not_an_endless_429(tmp_path: Path) -> None:
    gate = Tenancy(Keyring.read(write(tmp_path, KEYS_YAML)), levels=2)
    bulk = gate.caller(bearer(BULK), Scope.INFER)
    with pytest.raises(InvalidParameter, match=r"3 images in one request.*burst of 2"):
        asyncio.run(gate.charge(gate.ticket(bulk), 3))


def test_a_tenant_without_a_rate_is_never_refused(tmp_path: Path) -> None:
    gate = Tenancy(Keyring.read(write(tmp_path, KEYS_YAML)), levels=2)
    ops = Caller("ops", frozenset({Scope.INFER}))

    async def run() -> None:
        for _ in range(1000):
            await gate.charge(gate.ticket(ops), 64)

    asyncio.run(run())


def test_a_reload_takes_the_new_keys_and_a_bad_file_keeps_the_old(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    path = write(tmp_path, KEYS_YAML)
    gate = Tenancy(Keyring.read(path), path, levels=2)
    revoked = KEYS_YAML.replace(key_hash(BULK), key_hash("new-bulk-key"))
    path.write_text(revoked)
    assert gate.reload()
    with pytest.raises(Unauthorized):
        gate.caller(bearer(BULK), Scope.INFER)  # revoked on the next reload
    assert gate.caller(bearer("new-bulk-key"), Scope.INFER).tenant == "bulk"
    path.write_text("keys: [")
    with caplog.at_level(logging.ERROR, logger="app"):
        assert not gate.reload()
    assert "previous keys stay in force" in caplog.text and "not valid yaml" in caplog.text
    assert gate.caller(bearer("new-bulk-key"), Scope.INFER).tenant == "bulk"
    assert not Tenancy(Keyring.of_settings(None, None)).reload()  # no file: nothing to read


def test_the_command_line_makes_hashes_and_checks_a_file(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    from app.tenancy.__main__ import main

    assert main(["new"]) == 0
    key_line, hash_line = capsys.readouterr().out.splitlines()
    assert key_hash(key_line.split()[-1]) == hash_line.split()[-1]
    monkeypatch.setattr("sys.stdin", io.StringIO(f"{SHOP}\n"))
    assert main(["hash"]) == 0
    assert capsys.readouterr().out.strip() == key_hash(SHOP)
    assert main(["check", str(write(tmp_path, KEYS_YAML))]) == 0
    out = capsys.readouterr().out
    assert "tenant shop: 10 images/s, burst 20, weight 4" in out
    assert "without a key: metrics" in out
    assert main(["check", str(write(tmp_path, "keys: ["))]) == 2
    assert "not valid yaml" in capsys.readouterr().err


def test_a_ticket_takes_the_asked_priority_capped_by_the_key_else_its_default(
    tmp_path: Path,
) -> None:
    gate = Tenancy(Keyring.read(write(tmp_path, KEYS_YAML)), levels=3)
    shop = gate.caller(bearer(SHOP), Scope.INFER)  # priority 2, top 1
    bulk = gate.caller(bearer(BULK), Scope.INFER)  # neither: the server's default
    assert gate.ticket(shop) == Ticket("shop", level=1, weight=4.0)
    assert gate.ticket(shop, "1").level == 0  # within its allowance
    assert gate.ticket(shop, "3").level == 2  # lower is always allowed
    assert gate.ticket(bulk).level == 2  # default: the lowest of 3
    assert gate.ticket(bulk, 1).level == 2  # capped: it may not raise itself
    assert gate.ticket(bulk, 0).level == 2  # 0, as Triton's clients send it: the default
    for bad in ("high", "4", -1, 1.5, True):
        with pytest.raises(InvalidParameter, match="X-Priority must be an integer from 1 to 3"):
            gate.ticket(shop, bad)
    with pytest.raises(InvalidParameter, match=r"parameters\.priority must be"):
        gate.ticket(shop, "x", "parameters.priority")
    middle = Tenancy(Keyring.of_settings("user", None), levels=3, default_priority=2)
    user = middle.caller(bearer("user"), Scope.INFER)
    assert middle.ticket(user).level == 1 and middle.ticket(user, "1").level == 0  # free choice


def test_a_key_s_top_priority_caps_the_server_s_default_too(tmp_path: Path) -> None:
    """Found by a review: a key allowed priority 3 at best, asking nothing, got
    ``MB_DEFAULT_PRIORITY`` 1, above what it may ask for."""
    text = f"keys: [{{sha256: {key_hash('k')}, tenant: t, scopes: [infer], top_priority: 3}}]"
    gate = Tenancy(Keyring.read(write(tmp_path, text)), levels=3, default_priority=1)
    caller = gate.caller(bearer("k"), Scope.INFER)
    assert gate.ticket(caller).level == 2
    assert gate.ticket(caller, "1").level == 2


def test_a_key_priority_beyond_the_levels_is_refused_at_start_and_on_reload(
    tmp_path: Path,
) -> None:
    path = write(tmp_path, KEYS_YAML)
    with pytest.raises(SettingsError, match="has priority 2, but MB_PRIORITY_LEVELS has 1"):
        Tenancy(Keyring.read(path), path)
    gate = Tenancy(Keyring.read(path), path, levels=2)
    path.write_text(KEYS_YAML.replace("priority: 2", "priority: 3"))
    assert not gate.reload()
