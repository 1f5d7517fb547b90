"""``python -m app.worker``: the same as ``python -m app.broker.worker`` (the broker-mode model
workers), kept so deployments that run the old name go on working."""

from __future__ import annotations

import sys

from app.broker.worker.__main__ import main

if __name__ == "__main__":
    sys.exit(main())
