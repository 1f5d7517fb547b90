"""Identical requests computed once by a broker worker, whichever front ends they came
through (single-flight across front ends, issue #51). A request whose front end keeps answers
(its response cache is on, and the caller did not ask afresh: ``Request.shared``) takes the
answer of an identical request in the same batch, or of one this worker computed moments
before (the last ``RECENT_BYTES`` of answers, least recently used first): a repeat sent
through another front end while the first was in flight does not run the model again.
Identical means the key the front ends' cache uses (``app.answers.cache_key``), computed here
from the entry's own bytes, never taken from a front end's word."""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass, field

import numpy as np

from app.answers import BytesLRU, cache_key, frozen
from app.broker.wire.request import Request
from app.errors import IMAGE_ERROR_TYPES, ServerError
from app.jobs import EmbeddingAndTopK, Task, TopK

RECENT_BYTES = 8 << 20  # answers kept for repeats that reach the worker a batch later
KEPT = (np.ndarray, TopK, EmbeddingAndTopK)  # the answers kept (an error is not)


@dataclass
class Split:
    """What a batch's requests need: ``run`` (positions the model computes), ``same_as``
    (position -> the running position whose answer it takes) and ``kept`` (position -> an
    answer computed before); ``keys``: each position's key (None: not shared)."""

    keys: list[bytes | None]
    run: list[int] = field(default_factory=list)
    same_as: dict[int, int] = field(default_factory=dict)
    kept: dict[int, object] = field(default_factory=dict)

    @property
    def shared(self) -> int:
        """Requests answered without a model run of their own."""
        return len(self.same_as) + len(self.kept)

    @property
    def positions_shared(self) -> set[int]:
        return self.same_as.keys() | self.kept.keys()


def _shared_error(answer: object) -> bool:
    """Whether an answer may go to an identical request: a result, or the image's own error
    (the same bytes fail the same way)."""
    return not isinstance(answer, ServerError) or isinstance(answer, IMAGE_ERROR_TYPES)


class Sharing:
    """``split`` a batch's requests into those to run and those answered by another's
    computation; ``answers`` puts the computed answers back in the batch's order, keeping
    each success for the repeats to come.

    >>> # answers, size, split = sharing.run(served_id, task, requests, compute)
    """

    def __init__(self, max_bytes: int = RECENT_BYTES) -> None:
        self.recent = BytesLRU(max_bytes)

    def run(
        self,
        served_id: str,
        task: Task,
        requests: Sequence[Request],
        compute: Callable[[list[Request]], tuple[list[object], int]],
    ) -> tuple[list[object], int, Split]:
        """Every request's answer, ``compute`` (answers and the size of the batch they ran
        in) called for those that need the model, if any; the size; how they were split."""
        split = self.split(served_id, task, requests)
        computed: list[object] = []
        size = 1
        if split.run:
            computed, size = compute([requests[position] for position in split.run])
        answers = self.answers(split, computed)
        # An error not of the image's own (a failed model call) is not shared: the requests
        # that were to take it run for themselves, as a front end's waiting ones do.
        retry = [p for p, leader in split.same_as.items() if not _shared_error(answers[leader])]
        if retry:
            again, _ = compute([requests[position] for position in retry])
            for position, answer in zip(retry, again, strict=True):
                answers[position] = answer
                del split.same_as[position]
                split.run.append(position)
        return answers, size, split

    def split(self, served_id: str, task: Task, requests: Sequence[Request]) -> Split:
        keys = [
            cache_key(served_id, task, r.top_k, r.as_input()) if r.shared else None
            for r in requests
        ]
        split = Split(keys)
        first: dict[bytes, int] = {}
        for position, key in enumerate(keys):
            if key is None:
                split.run.append(position)
            elif (answer := self.recent.get(key)) is not None:
                split.kept[position] = answer
            elif key in first:
                split.same_as[position] = first[key]
            else:
                first[key] = position
                split.run.append(position)
        return split

    def answers(self, split: Split, computed: Sequence[object]) -> list[object]:
        """Every position's answer, from ``computed`` (``split.run``'s, in order)."""
        ran = dict(zip(split.run, computed, strict=True))
        for position, answer in ran.items():
            key = split.keys[position]
            if key is not None and isinstance(answer, KEPT):  # errors never kept
                self.recent.put(key, frozen(answer))
        return [
            split.kept[p] if p in split.kept else ran[split.same_as.get(p, p)]
            for p in range(len(split.keys))
        ]
