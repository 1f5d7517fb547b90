"""The benchmark's figures as JSON (what ``docs/bench.json`` holds)."""

from __future__ import annotations

import json
from dataclasses import asdict
from pathlib import Path

from bench.results import ModelReport, ProtocolReport


def write_json(
    reports: list[ModelReport],
    mach: dict[str, float],
    path: Path,
    protocols: ProtocolReport | None = None,
) -> None:
    """Write the machinery step, per model the raw pipeline, every point and the idle
    latencies, and the protocols step where it ran, to ``path``."""
    path.write_text(
        json.dumps(
            {
                "machinery": mach,
                "models": [
                    {
                        "model": r.model,
                        "raw": {str(k): v for k, v in r.raw.items()},
                        "raw_runtimes": {
                            runtime: {str(k): v for k, v in rows.items()}
                            for runtime, rows in r.raw_runtimes.items()
                        },
                        "accuracy": r.accuracy,
                        "startup_s_and_worker_rss_mb": r.startup,
                        "points": [asdict(p) for p in r.points],
                        "idle_p50_ms": {
                            label: {"server": served, "raw": alone}
                            for label, (served, alone) in r.idle.items()
                        },
                    }
                    for r in reports
                ],
                **({"protocols": asdict(protocols)} if protocols is not None else {}),
            },
            indent=2,
        )
    )
