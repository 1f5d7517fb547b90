"""Push a folder of images through the same workers and preprocessing as the server.

    python -m app.bulk photos/ --task tag --out tags.jsonl
    python -m app.bulk photos/ --task embedding --out vectors.jsonl --resume

One reader walks the folder and feeds the Streamer (decoding in a thread pool), the workers on
every configured device do the rest, and each result becomes one JSON line:
``{"path": ..., "result": ...}`` or ``{"path": ..., "error": {"type": ..., "message": ...}}``.
Lines are appended whole and flushed. The job queues at the lowest priority level (in broker
mode it shares the fleet). A file the server could not answer for its own reasons (a worker
died, the queue was full) is tried again, waiting as the error says, up to
``ATTEMPTS`` times; still failing, its line says so and the job exits 1. ``--resume`` first
cuts off a line a crash may have left half-written and drops such lines, then skips every path
still in the file: what the file itself caused (``FINAL_ERRORS``) is not tried again. It
refuses (exit 2) a file written by another export, task or ``k``, as it refuses a task the
model cannot answer, before anything is written. The usual settings apply (``MODEL_STORE``,
``CUDA_DEVICES``, ``MB_WORKER_NUM``, ``MB_BATCH_SIZE``, ...).
"""

from __future__ import annotations

import argparse
import asyncio
import json
import logging
import os
import sys
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

from tqdm import tqdm

from app.batching import Ticket
from app.engine import Engine
from app.errors import (
    IMAGE_ERROR_TYPES,
    InvalidRequest,
    QuotaExceeded,
    ServerError,
    StartupError,
    Unavailable,
)
from app.logs import configure_logging
from app.plan import plan_serving
from app.services.predictor import Predictor
from app.settings import load_settings

log = logging.getLogger("app.bulk")

# The errors a file's own bytes cause: the same every time, so a line with one is final.
UNREADABLE = "unreadable_file"
FINAL_ERRORS = frozenset({UNREADABLE, *(cls.code for cls in IMAGE_ERROR_TYPES)})
ATTEMPTS = 6  # tries of a file the server refused for the time being (503, 429)
WAIT_S = (1.0, 30.0)  # the first wait before another try, and the longest (doubling)


def list_files(root: Path) -> list[Path]:
    """Every regular, non-hidden file under ``root``, in a stable order."""
    found = []
    for directory, subdirs, files in os.walk(root):
        subdirs[:] = sorted(d for d in subdirs if not d.startswith("."))
        found += [Path(directory, f) for f in sorted(files) if not f.startswith(".")]
    return found


def answered(out: Path) -> list[dict[str, Any]]:
    """The lines of ``out`` that stand: a trailing partial line (a crash mid-write) is cut
    off, and lines whose error was the server's (not in ``FINAL_ERRORS``) are dropped from
    the file (rewritten whole, then renamed over it), so their paths are tried again."""
    if not out.exists():
        return []
    with out.open("r+b") as handle:
        data = handle.read()
        end = data.rfind(b"\n") + 1
        if end != len(data):
            log.warning("%s ended with a partial line; removing it", out)
            handle.truncate(end)
    lines = data[:end].splitlines(keepends=True)
    entries = [json.loads(line) for line in lines]
    kept = [i for i, entry in enumerate(entries) if _stands(entry)]
    if len(kept) != len(entries):
        log.warning(
            "%s: %d lines the server failed; trying them again", out, len(entries) - len(kept)
        )
        fresh = out.with_name(out.name + ".resume")
        fresh.write_bytes(b"".join(lines[i] for i in kept))
        os.replace(fresh, out)
    return [entries[i] for i in kept]


def _stands(entry: dict[str, Any]) -> bool:
    return "error" not in entry or entry["error"].get("type") in FINAL_ERRORS


def _check_resumed(entries: list[dict[str, Any]], model_id: str, task: str, k: int) -> None:
    """``InvalidRequest`` unless every answer in the file is what this run would write: the
    same export (and precision), task and number of labels."""
    for entry in entries:
        if entry.get("model_id") != model_id:
            raise InvalidRequest(
                f"{entry['path']} was answered by {entry.get('model_id')}, and {model_id} "
                "serves now: resuming would mix two exports in one file (use --overwrite, "
                "or a new --out)"
            )
        result = entry.get("result")
        if result is None:
            continue
        was = "tag" if result and isinstance(result[0], dict) else "embedding"
        if was != task or (task == "tag" and len(result) != k):
            said = f"{was} with k={len(result)}" if was == "tag" else was
            asked = f"tag with k={k}" if task == "tag" else task
            raise InvalidRequest(
                f"{entry['path']} was answered as {said}, and this run asks {asked}: resume "
                "with the same --task and -k (or use --overwrite, or a new --out)"
            )


def _plan(
    root: Path, out: Path, resume: bool, expected: tuple[str, str, int]
) -> tuple[list[Path], list[Path]]:
    """All files under ``root``, and those still to do (all of them unless resuming);
    ``expected``: the export, task and k this run answers with."""
    files = list_files(root)
    skip: set[str] = set()
    if resume:
        entries = answered(out)
        _check_resumed(entries, *expected)
        skip = {entry["path"] for entry in entries}
    else:
        out.write_bytes(b"")
    return files, [f for f in files if str(f.relative_to(root)) not in skip]


class ResultWriter:
    """Appends whole JSON lines, each with one write() and a flush."""

    def __init__(self, out: Path) -> None:
        self._handle = out.open("ab", buffering=0)

    def write(self, entry: dict[str, Any]) -> None:
        self._handle.write((json.dumps(entry) + "\n").encode())

    def close(self) -> None:
        os.fsync(self._handle.fileno())
        self._handle.close()


async def run(
    root: Path,
    task: str,
    out: Path,
    *,
    top_k: int | None,
    resume: bool,
    progress: bool = True,
    model: str | None = None,
) -> dict[str, int]:
    plan = plan_serving(load_settings(mb_request_timeout=3600.0))
    started = time.perf_counter()
    async with Engine(plan) as engine:
        predictor = engine.registry.resolve(model).predictor  # one version for every file
        assert predictor is not None
        # What the model cannot answer fails here, before anything is written.
        k = predictor.labels_to_return(top_k) if task == "tag" else 0
        if task == "embedding":
            predictor.require_embedding()
        expected = (predictor.model_id, task, k)
        files, todo = await asyncio.to_thread(_plan, root, out, resume, expected)
        counts = {"ok": 0, "error": 0, "failed": 0, "skipped": len(files) - len(todo)}
        writer = ResultWriter(out)
        bar = tqdm(total=len(todo), unit="img", disable=not progress, smoothing=0.1)
        try:
            await _feed(engine, predictor, root, task, todo, k, writer, bar, counts)
        finally:
            bar.close()
            writer.close()
        # Which runtime computed the results (each worker chose at its start).
        runtimes = sorted({w.runtime for w in engine.transport.worker_status() if w.runtime})
        counts["runtimes"] = runtimes  # type: ignore[assignment]
    elapsed = time.perf_counter() - started
    counts["seconds"] = round(elapsed, 2)  # type: ignore[assignment]
    counts["images_per_s"] = round(len(todo) / elapsed, 1) if elapsed else 0  # type: ignore[assignment]
    return counts


async def _feed(
    engine: Engine,
    predictor: Predictor,
    root: Path,
    task: str,
    todo: list[Path],
    top_k: int,
    writer: ResultWriter,
    bar: Any,  # tqdm
    counts: dict[str, int],
) -> None:
    """Submit every file, a bounded window at a time, and write each answer as it comes.
    Raises (and leaves nothing running) if writing fails."""
    limits = engine.plan.limits
    model_id = predictor.model_id  # on every line: never mix two exports (or precisions)
    # Enough in flight to keep every worker busy with full batches, not so much that the
    # queue bound or memory is at risk.
    transport = engine.transport
    window = asyncio.Semaphore(min(limits.max_queue, 4 * transport.batch_size * transport.capacity))

    # Background work: it queues at the lowest priority level, behind whatever callers share
    # the workers (in broker mode, the fleet's), and within that level's policy.
    ticket = Ticket(level=len(limits.levels) - 1)

    async def answer(data: bytes) -> Any:
        deadline = time.monotonic() + limits.request_timeout_s
        if task == "tag":
            (tags,) = await predictor.tags([data], top_k, deadline, ticket=ticket)
            return [{"name": t.name, "prob": t.prob} for t in tags]
        return (await predictor.embeddings([data], deadline, ticket=ticket))[0].tolist()

    async def one(path: Path) -> None:
        entry: dict[str, Any] = {"path": str(path.relative_to(root)), "model_id": model_id}
        try:
            data = await asyncio.to_thread(path.read_bytes)
            for attempt in range(ATTEMPTS):
                try:
                    entry["result"] = await answer(data)
                    break
                except (Unavailable, QuotaExceeded) as exc:  # a worker restarting, a full
                    # queue, its level's wait passed: wait as the error says
                    if attempt == ATTEMPTS - 1:
                        raise
                    wait = min(WAIT_S[1], max(WAIT_S[0] * 2**attempt, exc.retry_after_s))
                    log.info("%s: %s; trying again in %.0f s", entry["path"], exc.code, wait)
                    await asyncio.sleep(wait)
            counts["ok"] += 1
        except (ServerError, OSError) as exc:
            code = getattr(exc, "code", UNREADABLE)
            entry["error"] = {"type": code, "message": getattr(exc, "message", str(exc))}
            counts["error" if code in FINAL_ERRORS else "failed"] += 1
        finally:
            window.release()
        writer.write(entry)
        bar.update(1)

    async with asyncio.TaskGroup() as group:  # a failing writer cancels the rest
        for path in todo:
            await window.acquire()
            group.create_task(one(path))


def _parse(argv: list[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(
        prog="python -m app.bulk",
        description=__doc__,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    parser.add_argument("input_dir", type=Path)
    parser.add_argument("--task", choices=["tag", "embedding"], required=True)
    parser.add_argument("--out", type=Path, required=True, help="JSON lines file to write")
    parser.add_argument(
        "-k", "--top-k", type=int, help="labels per image (tag; default 5, or every class if fewer)"
    )
    parser.add_argument(
        "--model", help="the model's name (default: the only one, or MB_DEFAULT_MODEL)"
    )
    parser.add_argument("--resume", action="store_true", help="skip paths already in --out")
    parser.add_argument("--overwrite", action="store_true", help="replace an existing --out")
    parser.add_argument("--no-progress", action="store_true")
    return parser.parse_args(argv)


def main(argv: list[str] | None = None) -> int:
    args = _parse(argv)
    try:
        settings = load_settings()
    except StartupError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    configure_logging(settings.log_level, settings.log_format)  # LOG_FORMAT=json too
    if not args.input_dir.is_dir():
        print(f"error: {args.input_dir} is not a directory", file=sys.stderr)
        return 2
    if args.out.exists() and not (args.resume or args.overwrite):
        print(
            f"error: {args.out} exists; pass --resume to continue it or --overwrite",
            file=sys.stderr,
        )
        return 2
    try:
        counts = asyncio.run(
            run(
                args.input_dir,
                args.task,
                args.out,
                top_k=args.top_k,
                model=args.model,
                resume=args.resume,
                progress=not args.no_progress,
            )
        )
    except StartupError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    except ServerError as exc:  # --model names no model served, or it cannot answer
        print(f"error: {exc.message}", file=sys.stderr)
        return 2
    print(json.dumps(counts))
    if counts["failed"]:
        print(
            f"error: {counts['failed']} files were not answered for the server's reasons "
            "(their lines say which): run again with --resume to try them again",
            file=sys.stderr,
        )
        return 1
    return 0


def iter_results(out: Path) -> Iterator[dict[str, Any]]:
    """Read a results file back, one dict per line."""
    with out.open() as handle:
        for line in handle:
            yield json.loads(line)


if __name__ == "__main__":
    sys.exit(main())
