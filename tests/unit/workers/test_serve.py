"""``app.workers.serve.WorkerLoop``: what a pool's worker answers a load, without a process."""

from __future__ import annotations

import pickle
import types
from typing import Any

from app.lifecycle import ModelSpec
from app.workers.messages import LoadFailed, LoadModel
from app.workers.serve import WorkerLoop


class Posted:
    """The worker's end of its socket: what it sent."""

    def __init__(self) -> None:
        self.sent: list[Any] = []

    def send_bytes(self, data: bytes) -> None:
        self.sent.append(pickle.loads(data))


def test_a_load_given_up_at_its_deadline_is_not_started_twice_while_it_still_runs() -> None:
    """The pool asks again (SIGHUP, the admin route) while the late load's thread goes on:
    a second load beside it held two copies, past MB_MODEL_MEMORY unseen (a broker worker
    already refused that). It is refused, step timeout, and nothing starts."""
    spec = ModelSpec("t", 2, "/m/t/2", "t@bbb")
    worker: Any = types.SimpleNamespace(models={})
    conn = Posted()
    loop = WorkerLoop(worker, buffer=None, conn=conn)  # type: ignore[arg-type]
    loop._slot._late.append(types.SimpleNamespace(spec=spec, done=False))  # type: ignore[arg-type]
    loop._start_load(LoadModel(7, spec))
    ((answer,),) = [conn.sent]
    assert isinstance(answer, LoadFailed) and answer.step == "timeout"
    assert answer.batch_id == 7 and loop._slot.running is None
