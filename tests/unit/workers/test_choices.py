"""The fleet's precision of an export (``PrecisionChoice``) when its record cannot be written
at the moment a load chose it (Redis away, in broker mode): it is written at a later round,
so the next worker to load the export loads that precision rather than measuring again and
perhaps serving it under another id (found by a review of what a failover loses)."""

from __future__ import annotations

import pytest

from app.lifecycle import ModelSpec
from app.workers.choices import HostChoices, PoolRecord, PrecisionChoice

SPEC = ModelSpec("t", 1, "/m/t/1", "tiny@abc", dtype="auto")
CHOSEN = SPEC.decided("bfloat16", "tiny@abc+bf16")


class Away(PoolRecord):
    """A fleet's record whose writes fail while ``away``."""

    def __init__(self) -> None:
        super().__init__()
        self.away = True

    def record(self, model_id: str, dtype: str) -> str:
        if self.away:
            raise ConnectionError("Redis is failing over")
        return super().record(model_id, dtype)


def test_a_choice_the_record_could_not_take_is_recorded_at_a_later_round() -> None:
    fleet = Away()
    choice = PrecisionChoice(fleet, HostChoices(None, host="h"))
    with pytest.raises(ConnectionError):
        choice.record(SPEC, CHOSEN)
    with pytest.raises(ConnectionError):
        choice.settle()  # still away: kept for the next round
    assert fleet.read("tiny@abc") is None
    fleet.away = False
    choice.settle()
    assert fleet.read("tiny@abc") == "bfloat16"
    assert not choice.unrecorded
    other = PrecisionChoice(fleet, HostChoices(None, host="h"))  # the next worker
    assert other.decided(SPEC).served_id == "tiny@abc+bf16"


def test_a_choice_recorded_late_never_overwrites_another_worker_s() -> None:
    fleet = Away()
    choice = PrecisionChoice(fleet, HostChoices(None, host="h"))
    with pytest.raises(ConnectionError):
        choice.record(SPEC, CHOSEN)
    fleet.away = False
    fleet.record("tiny@abc", "float32")  # another worker recorded first
    choice.settle()
    assert fleet.read("tiny@abc") == "float32"
    assert choice.known == {"tiny@abc": "float32"}
    assert choice.decided(SPEC).served_id == "tiny@abc"  # the fleet's, from its next load
