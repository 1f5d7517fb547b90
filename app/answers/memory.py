"""Answers kept in a process: a least-recently-used map bounded in bytes (a front end's
cache, a broker worker's recent answers)."""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Callable

import numpy as np

from app.jobs import EmbeddingAndTopK, TopK

ENTRY_OVERHEAD = 240  # bytes an entry costs besides its arrays: the key, the dict slot, objects


def frozen(answer: object) -> object:
    """An answer as the cache keeps it: its arrays copied out of the batch they came in
    (a row of a batch's output would keep the whole batch alive, or a view of a buffer that
    is reused) and read-only, since every hit hands out the same objects."""
    if isinstance(answer, np.ndarray):
        kept = np.array(answer, copy=True)
        kept.flags.writeable = False
        return kept
    if isinstance(answer, TopK):
        return TopK(frozen(answer.indices), frozen(answer.probs))  # type: ignore[arg-type]
    if isinstance(answer, EmbeddingAndTopK):
        return EmbeddingAndTopK(frozen(answer.embedding), frozen(answer.top_k))  # type: ignore[arg-type]
    raise TypeError(f"not an answer the cache keeps: {type(answer).__name__}")


def size_of(answer: object) -> int:
    """What an entry of ``answer`` costs, in bytes (its arrays and ``ENTRY_OVERHEAD``)."""
    if isinstance(answer, np.ndarray):
        return answer.nbytes + ENTRY_OVERHEAD
    if isinstance(answer, TopK):
        return answer.indices.nbytes + answer.probs.nbytes + ENTRY_OVERHEAD
    if isinstance(answer, EmbeddingAndTopK):
        return size_of(answer.embedding) + size_of(answer.top_k)
    raise TypeError(f"not an answer the cache keeps: {type(answer).__name__}")


class BytesLRU:
    """Answers by key, the least recently used evicted first once they take more than
    ``max_bytes`` (``on_evict`` hears of each); ``bytes`` and ``evictions`` say how full it
    is and how much it let go.

    >>> lru = BytesLRU(max_bytes=2 * size_of(np.zeros(4, np.float32)))
    >>> for key in (b"a", b"b", b"c"):
    ...     lru.put(key, np.zeros(4, np.float32))
    >>> lru.get(b"a") is None, lru.get(b"c") is not None, lru.evictions, len(lru)
    (True, True, 1, 2)
    """

    def __init__(self, max_bytes: int, on_evict: Callable[[], None] = lambda: None) -> None:
        self.max_bytes = max_bytes
        self._on_evict = on_evict
        self.bytes = 0
        self.evictions = 0
        self._entries: OrderedDict[bytes, tuple[object, int]] = OrderedDict()

    def __len__(self) -> int:
        return len(self._entries)

    def get(self, key: bytes) -> object | None:
        entry = self._entries.get(key)
        if entry is None:
            return None
        self._entries.move_to_end(key)
        return entry[0]

    def put(self, key: bytes, answer: object) -> None:
        """Keep ``answer`` (already ``frozen``) under ``key``; one larger than the whole
        cache is not kept."""
        size = size_of(answer)
        if size > self.max_bytes:
            return
        old = self._entries.pop(key, None)
        if old is not None:
            self.bytes -= old[1]
        self._entries[key] = (answer, size)
        self.bytes += size
        while self.bytes > self.max_bytes:
            _, (_, dropped) = self._entries.popitem(last=False)
            self.bytes -= dropped
            self.evictions += 1
            self._on_evict()
