"""The memory of a running server, process by process: which role each process plays, what
it holds (RSS; its anonymous part, RssAnon; USS and PSS from ``/proc/<pid>/smaps_rollup``),
and how much that grew.

A leak or a fragmented heap grows anonymous memory. RSS also counts the pages of the shared
libraries a process maps (torch's are hundreds of MB), which the kernel drops and reads back
as it likes: under memory pressure from other tenants RSS falls with no change in the
process. So the table shows RssAnon's growth beside RSS's.

    >>> classify(["python", "-m", "app.broker.worker"])
    'supervisor'
    >>> growth_pct(1000, 1021)
    2.1

Used by ``python -m bench.soak``; classification, growth and the table are pure.
"""

from __future__ import annotations

import contextlib
import itertools
import os
import time
from collections.abc import Sequence
from dataclasses import dataclass

import psutil

MB = 1 << 20

# The order roles are listed in a table: what serves HTTP, what runs the models, the rest.
ROLE_ORDER = (
    "http",
    "front-end",
    "worker",
    "supervisor",
    "redis",
    "gunicorn-master",
    "launcher",
    "resource-tracker",
    "other",
)


def _module(cmdline: Sequence[str]) -> str | None:
    """The module a ``python -m <module>`` command line runs, if it is one."""
    for flag, value in itertools.pairwise(cmdline):
        if flag == "-m":
            return value
    return None


def classify(cmdline: Sequence[str], parent_role: str | None = None) -> str:
    """The role of a process of this server, from its command line and its parent's role.

    Worker processes are ``multiprocessing`` spawn children (of the HTTP process in-process,
    of the supervisor in broker mode); gunicorn's front ends are forks of its master, with the
    same command line, so only the parent tells them apart.

    >>> classify(["python", "-m", "gunicorn", "app.main:create_app()"], "gunicorn-master")
    'front-end'
    """
    joined = " ".join(cmdline)
    module = _module(cmdline)
    if cmdline and os.path.basename(cmdline[0]).startswith("redis-server"):
        return "redis"
    if "multiprocessing.resource_tracker" in joined:
        return "resource-tracker"
    if "multiprocessing.spawn" in joined or "--multiprocessing-fork" in cmdline:
        return "worker"
    if module == "gunicorn" or "gunicorn" in os.path.basename(cmdline[0] if cmdline else ""):
        return "front-end" if parent_role == "gunicorn-master" else "gunicorn-master"
    return {
        "app": "http",
        "app.broker.worker": "supervisor",
        "app.worker": "supervisor",  # the old name of app.broker.worker
        "app.broker.cluster": "launcher",
    }.get(module or "", "other")


@dataclass(frozen=True)
class Usage:
    """One process's memory at one moment, in bytes (0 for what could not be read)."""

    pid: int
    role: str
    rss: int
    anon: int = 0
    uss: int = 0
    pss: int = 0


def rss_anon(pid: int) -> int:
    """RssAnon of ``pid`` in bytes (0 where the kernel does not say)."""
    with contextlib.suppress(OSError), open(f"/proc/{pid}/status") as status:
        for line in status:
            if line.startswith("RssAnon:"):
                return int(line.split()[1]) * 1024
    return 0


def process_tree(root_pid: int) -> list[tuple[psutil.Process, str]]:
    """``root_pid`` and every process under it, each with its role, parents before children."""
    root = psutil.Process(root_pid)
    roles: dict[int, str] = {root.pid: classify(root.cmdline())}
    out = [(root, roles[root.pid])]
    for child in root.children(recursive=True):  # breadth first: a parent comes first
        with contextlib.suppress(psutil.NoSuchProcess):
            role = classify(child.cmdline(), roles.get(child.ppid()))
            roles[child.pid] = role
            out.append((child, role))
    return out


def sample(root_pid: int) -> list[Usage]:
    """The memory of every process of the server started as ``root_pid``."""
    usages = []
    for process, role in process_tree(root_pid):
        with contextlib.suppress(psutil.NoSuchProcess):
            try:
                full = process.memory_full_info()  # reads smaps_rollup: a few ms
                anon = rss_anon(process.pid)
                usages.append(Usage(process.pid, role, full.rss, anon, full.uss, full.pss))
            except psutil.AccessDenied:
                usages.append(Usage(process.pid, role, process.memory_info().rss))
    return usages


def growth_pct(before: int, after: int) -> float:
    """How much ``after`` exceeds ``before``, in percent of ``before``, to 0.1."""
    if before <= 0:
        raise ValueError(f"no baseline to grow from: {before}")
    return round(100 * (after - before) / before, 1)


@dataclass
class Sample:
    """The memory of every process after ``served`` requests (0: just after the warm-up)."""

    served: int
    usages: list[Usage]
    at: float = 0.0  # time.time() when taken

    @classmethod
    def take(cls, root_pid: int, served: int) -> Sample:
        return cls(served, sample(root_pid), time.time())


def labels(baseline: Sample) -> dict[int, str]:
    """A short name for each process of the baseline: its role, numbered where a role has
    several processes (``worker-1``, ``worker-2``, in pid order)."""
    by_role: dict[str, list[int]] = {}
    for usage in baseline.usages:
        by_role.setdefault(usage.role, []).append(usage.pid)
    names = {}
    for role, pids in by_role.items():
        for number, pid in enumerate(sorted(pids), 1):
            names[pid] = role if len(pids) == 1 else f"{role}-{number}"
    return names


@dataclass(frozen=True)
class Row:
    """One process across the run: RSS (bytes) at each sample, and how much it grew; its
    anonymous memory after the warm-up and at the end, and how much that grew."""

    label: str
    role: str
    pid: int
    rss: list[int | None]  # None: the process was gone (or not there yet) at that sample
    anon_first: int
    anon_last: int

    @property
    def rss_growth_pct(self) -> float | None:
        first, last = self.rss[0], self.rss[-1]
        return None if first is None or last is None else growth_pct(first, last)

    @property
    def rss_trend_pct(self) -> float | None:
        """The mean RSS over the last third of the samples against the first third's: the
        growth without the swing of a single sample (buffers held at that instant)."""
        values = [value for value in self.rss if value is not None]
        if self.rss[0] is None or len(values) < 2:  # no baseline, or nothing after it
            return None
        third = max(1, len(values) // 3)
        early, late = sum(values[:third]) / third, sum(values[-third:]) / third
        return growth_pct(round(early), round(late))

    @property
    def anon_growth_pct(self) -> float | None:
        if not self.anon_first or not self.anon_last:
            return None
        return growth_pct(self.anon_first, self.anon_last)


def rows(samples: Sequence[Sample]) -> list[Row]:
    """One row per process seen after the warm-up, in role order. A process that appeared
    later (a restarted worker) gets a row of its own, with no baseline."""
    names = labels(samples[0])
    seen: dict[int, str] = {}
    for s in samples:
        for usage in s.usages:
            seen.setdefault(usage.pid, usage.role)
    out = []
    for pid, role in seen.items():
        at = [{u.pid: u for u in s.usages}.get(pid) for s in samples]
        present = [u for u in at if u is not None]
        out.append(
            Row(
                label=names.get(pid, f"{role} (new)"),
                role=role,
                pid=pid,
                rss=[u.rss if u is not None else None for u in at],
                anon_first=at[0].anon if at[0] is not None else 0,
                anon_last=present[-1].anon if at[-1] is not None else 0,
            )
        )
    order = {role: i for i, role in enumerate(ROLE_ORDER)}
    return sorted(out, key=lambda r: (order.get(r.role, len(order)), r.label, r.pid))


def _mb(value: int | None) -> str:
    return "-" if value is None else f"{value / MB:.0f}"


def _pct(value: float | None) -> str:
    return "-" if value is None else f"{value:+.1f}%"


def table(samples: Sequence[Sample]) -> str:
    """RSS in MB per process after the warm-up and at each later sample, its growth over the
    run (the last sample against the first) and its trend (the last third's mean against
    the first third's), and anonymous memory (RssAnon) after the warm-up and at the end with
    its growth.

    >>> base = Sample(0, [Usage(10, "worker", 500 * MB, 400 * MB)])
    >>> end = Sample(10_000, [Usage(10, "worker", 510 * MB, 404 * MB)])
    >>> print(table([base, end]))
    process  pid  warm-up  10k  RSS growth  RSS trend  anon warm-up  anon end  anon growth
    worker   10   500      510  +2.0%       +2.0%      400           404       +1.0%
    """
    head = ["process", "pid", "warm-up"]
    head += [f"{s.served // 1000}k" if s.served % 1000 == 0 else str(s.served) for s in samples[1:]]
    head += ["RSS growth", "RSS trend", "anon warm-up", "anon end", "anon growth"]
    lines = [head]
    for row in rows(samples):
        lines.append(
            [
                row.label,
                str(row.pid),
                *map(_mb, row.rss),
                _pct(row.rss_growth_pct),
                _pct(row.rss_trend_pct),
                _mb(row.anon_first or None),
                _mb(row.anon_last or None),
                _pct(row.anon_growth_pct),
            ]
        )
    widths = [max(len(line[i]) for line in lines) for i in range(len(head))]
    return "\n".join(
        "  ".join(cell.ljust(width) for cell, width in zip(line, widths, strict=True)).rstrip()
        for line in lines
    )
