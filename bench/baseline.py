"""The source tree of an earlier commit, to serve beside this one in the same run: figures
taken minutes apart on a shared machine differ by more than most changes, so a before/after
ratio is only worth something when both sides run in one benchmark, in turns."""

from __future__ import annotations

import io
import subprocess
import tarfile
from pathlib import Path

from bench.systems import REPO


def source_tree(ref: str, dest: Path) -> Path:
    """``ref``'s tracked files, unpacked into ``dest`` (from this clone's history: no network).
    SystemExit naming the ref when git cannot give it."""
    try:
        archive = subprocess.run(
            ["git", "-C", str(REPO), "archive", "--format=tar", ref],
            capture_output=True,
            check=True,
        ).stdout
    except (OSError, subprocess.CalledProcessError) as exc:
        detail = getattr(exc, "stderr", b"") or str(exc).encode()
        raise SystemExit(
            f"bench: cannot read commit {ref!r} from this clone's history: "
            f"{detail.decode(errors='replace').strip()}"
        ) from None
    dest.mkdir(parents=True, exist_ok=True)
    with tarfile.open(fileobj=io.BytesIO(archive)) as tar:
        tar.extractall(dest, filter="data")
    return dest
