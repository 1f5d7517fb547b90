"""What a broker worker makes of the entries it read: which run, which are dropped unrun
(a malformed entry, one past its deadline) or refused unrun (past its priority level's queue
timeout), and the model calls a batch of them becomes."""

from __future__ import annotations

import logging
import traceback
from collections.abc import Callable, Collection, Sequence
from typing import Any

import numpy as np

from app.broker.wire.lanes import Lane
from app.broker.wire.parsing import MalformedMessage, text
from app.broker.wire.reply import encode_answer
from app.broker.wire.request import Request, decode_request, entry_time_ms
from app.broker.worker.replies import Answered, Entry, EntryId
from app.broker.worker.stats import ConsumerStats
from app.errors import InferenceError, InvalidImage, Shed
from app.jobs import Task
from app.workers.compute import run_batch
from app.workers.process import PreparedModel, PreparedWorker
from app.workers.transfer import results

log = logging.getLogger("app.worker")

Tagged = tuple[str, Entry]  # an entry and the stream (or lane) it came from
Done = tuple[list[Answered], list[EntryId]]  # a stream's replies, and its entries dropped


def fields_of(entries: Any) -> list[Entry]:
    """Entries as a read gives them: from a script, each one's fields as a flat list."""
    return [
        (
            entry_id,
            fields
            if isinstance(fields, dict)
            else dict(zip(fields[::2], fields[1::2], strict=False)),
        )
        for entry_id, fields in entries
    ]


def triage(
    entries: Sequence[Tagged],
    task: Task,
    now_ms: int,
    max_image_bytes: int,
    lane_of: Callable[[str], Lane | None],
    stats: ConsumerStats,
    on_error: Callable[[str], None],
) -> tuple[list[tuple[EntryId, Request]], list[str], dict[str, Done]]:
    """The entries to run (with each one's stream), and per stream what is answered or
    dropped without running: malformed entries, entries past their deadline (their callers
    have had their 504), and ``Shed`` for those past their level's queue timeout."""
    runnable: list[tuple[EntryId, Request]] = []
    streams: list[str] = []
    done: dict[str, Done] = {}
    for stream, (entry_id, fields) in entries:
        answered = done.setdefault(stream, ([], []))
        try:
            request = decode_request(fields, max_image_bytes)
            if request.task is not task:
                raise MalformedMessage(f"a {request.task} request in the {task} stream")
            expired = entry_time_ms(entry_id) + request.ttl_ms <= now_ms
        except Exception as exc:  # MalformedMessage, or anything a forged entry causes
            on_error(f"dropped malformed entry {text(entry_id)[:40]}: {str(exc)[:200]}")
            stats.malformed += 1
            answered[1].append(entry_id)
            continue
        if expired:
            stats.expired += 1
            answered[1].append(entry_id)
            continue
        shed = past_level_wait(lane_of(stream), entry_id, now_ms)
        if shed is not None:
            stats.shed += 1
            answered[0].append((entry_id, request, encode_answer(request.id, 1, shed)))
            continue
        runnable.append((entry_id, request))
        streams.append(stream)
    return runnable, streams, done


def past_level_wait(lane: Lane | None, entry_id: EntryId, now_ms: int) -> Shed | None:
    """``Shed`` for an entry of a lane whose level refuses what waited past its queue
    timeout (``delay``: it waits on in its level, and runs within its deadline)."""
    if lane is None or lane.timeout_ms is None or not lane.reject:
        return None
    if now_ms - entry_time_ms(entry_id) <= lane.timeout_ms:
        return None
    limit = lane.timeout_ms / 1000
    return Shed(f"priority {lane.level + 1} waits at most {limit:g} s in the queue")


def compute(
    worker: PreparedWorker,
    name: str,
    model: PreparedModel,
    task: Task,
    requests: Sequence[Request],
) -> tuple[list[object], int]:
    """Run ``requests`` as one batch (``app.workers.compute.run_batch``): each one's answer
    (or its error), and the size of the batch they ran in. If the model call fails for the
    batch, each is run alone, so only the guilty one gets the 500."""
    size = len(requests)
    try:
        answered: dict[int, object] = {}
        for positions, images in by_kind(requests, model.runner.image_shape, answered):
            top_ks = [requests[position].top_k for position in positions]
            done = run_batch(worker, model.spec.served_id, task, images, max(top_ks))
            answered |= results(task, top_ks, positions, done.outputs, done.errors)
        return [answered[position] for position in range(size)], size
    except Exception:
        if size > 1:
            log.warning("worker %s: a batch of %d failed; running each alone", name, size)
            alone = [compute(worker, name, model, task, [one])[0][0] for one in requests]
            return alone, 1
        log.error("worker %s: a model call failed:\n%s", name, traceback.format_exc())
        return [InferenceError("model call failed")], 1


def replies(
    runnable: Sequence[tuple[EntryId, Request]],
    answers: Sequence[object],
    size: int,
    shared: Collection[int] = (),
) -> list[Answered]:
    """Each entry's reply: its answer, from a batch of ``size``; the positions in ``shared``
    were answered by an identical request's computation."""
    return [
        (entry_id, request, encode_answer(request.id, size, answer, position in shared))
        for position, ((entry_id, request), answer) in enumerate(
            zip(runnable, answers, strict=True)
        )
    ]


def by_kind(
    requests: Sequence[Request], image_shape: tuple[int, ...], refused: dict[int, object]
) -> list[tuple[list[int], Any]]:
    """A batch's requests as model calls: the encoded uploads (decoded here) in one, the
    preprocessed pixels (a v2 client's FP32 input, rare) in another. Pixels not of the
    model's input size get ``InvalidImage`` in ``refused`` (a front end checks them first)."""
    encoded = [p for p, request in enumerate(requests) if request.pixels is None]
    pixels = []
    for position, request in enumerate(requests):
        if request.pixels is None:
            continue
        if (*request.pixels, 3) != tuple(image_shape):
            refused[position] = InvalidImage(f"pixels of {request.pixels}, not {image_shape[:2]}")
        else:
            pixels.append(position)
    calls: list[tuple[list[int], Any]] = []
    if encoded:
        calls.append((encoded, [requests[p].image for p in encoded]))
    if pixels:
        calls.append((pixels, np.stack([requests[p].as_input() for p in pixels])))
    return calls
