"""The Redis ACL rules per role (``Keys.acl_rules``): what docs/scaling.md shows is what the
code writes, and each role's keys stay under the prefix."""

from __future__ import annotations

from pathlib import Path

from app.broker.wire.keys import Keys

SCALING = Path(__file__).resolve().parents[2] / "docs" / "scaling.md"


def test_the_documented_rules_are_the_codes() -> None:
    text = SCALING.read_text(encoding="utf-8")
    for role, rules in Keys("mb").acl_rules().items():
        assert f"ACL SETUSER {role} on >secret {rules}\n" in text, role


def test_every_role_is_kept_to_the_prefix_and_only_the_admin_writes_pins() -> None:
    rules = Keys("px").acl_rules()
    assert set(rules) == {"front-end", "worker", "admin"}
    for role, text in rules.items():
        keys = [word for word in text.split() if "~" in word]
        assert keys and all(word.split("~", 1)[1].startswith("px:") for word in keys), role
        assert "resetkeys" in text and "-@dangerous" in text, role
        writes_pins = "~px:{w}:pins" in text.split()
        assert writes_pins is (role == "admin"), role
    assert "-xreadgroup" in rules["front-end"] and "-xreadgroup" not in rules["worker"]
