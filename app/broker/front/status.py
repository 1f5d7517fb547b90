"""The live workers as a front end reports them (``/readyz``, ``/info``, the metrics): each
heartbeat (``WorkerInfo``) as the ``WorkerStatus`` every transport reports a worker by."""

from __future__ import annotations

from app.batching import HeldModel, Trial, WorkerStatus
from app.broker.wire.heartbeat import WorkerInfo


def worker_status(w: WorkerInfo) -> WorkerStatus:
    """A worker's heartbeat as the transports report a worker (``/readyz``, ``/info``, the
    metrics)."""
    return WorkerStatus(
        index=w.index, device=w.device, threads=w.threads, pid=w.pid, ready=w.ready,
        alive=w.alive, batch_size=w.batch_size, batches=w.batches, items=w.items,
        rss_bytes=w.rss_bytes, cpu_seconds=w.cpu_seconds, restarts=w.restarts,
        name=w.name, host=w.host, runtime=w.runtime,
        models=tuple(
            HeldModel(
                m.served_id, m.state.shown, m.runtime, m.batch_size, m.memory_bytes,
                f"{m.step}: {m.reason}" if m.step else m.reason, m.name, m.version,
                tuple(m.skipped.items()), m.slowdown, m.dtype,
                tuple(Trial(**t.model_dump()) for t in m.trials),
            )
            for m in w.models
        ),
    )  # fmt: skip
