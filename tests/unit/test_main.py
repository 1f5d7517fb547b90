"""The app's start-up helpers that need no workers."""

from __future__ import annotations

import gc

from app.main import _freeze_startup_objects


def test_freezing_start_up_objects_is_undone_at_shutdown() -> None:
    undo = _freeze_startup_objects()
    try:
        assert gc.get_freeze_count() > 0
    finally:
        undo()
    assert gc.get_freeze_count() == 0
