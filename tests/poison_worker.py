"""``python tests/poison_worker.py``: ``python -m app.broker.worker`` whose model kills its process
whenever a batch holds a pure magenta image (a poison input that crashes the worker, not one
that merely raises); ``python tests/poison_worker.py --server``: ``python -m app`` whose pool
workers do the same. Fault injection lives in tests, never in the app.

The worker processes are spawned: each imports this script again (as ``__mp_main__``), so
the patch below applies in every one of them.
"""

from __future__ import annotations

import os
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import numpy as np

from app.workers import runner

_run = runner.BatchRunner.run


def _run_or_die(self: runner.BatchRunner, task: object, pixels: object, top_k: int) -> object:
    batch = np.asarray(pixels)
    magenta = (batch[..., 0] > 250) & (batch[..., 1] < 5) & (batch[..., 2] > 250)
    if magenta.reshape(len(batch), -1).all(axis=1).any():
        os._exit(13)  # as a segfault in a native library would
    return _run(self, task, pixels, top_k)  # type: ignore[arg-type]


runner.BatchRunner.run = _run_or_die  # type: ignore[method-assign,assignment]

if __name__ == "__main__":
    if sys.argv[1:2] == ["--server"]:
        del sys.argv[1]
        from app.__main__ import main
    else:
        from app.broker.worker.__main__ import main
    sys.exit(main())
