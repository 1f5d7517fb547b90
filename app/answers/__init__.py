"""Answers kept by what they depend on: the key (``cache_key``) and a map of read-only
answers bounded in bytes (``BytesLRU``, ``frozen``). The vocabulary the response cache
(``app.cache``, in each front end) and a broker worker that computes identical requests once
(``app.broker.worker.sharing``) share; a leaf, as they are in layers apart."""

from dataclasses import dataclass

from app.answers.key import cache_key
from app.answers.memory import BytesLRU, frozen, size_of


@dataclass(frozen=True, slots=True)
class SharedAnswer:
    """An answer a broker worker gave a request from an identical request's computation
    (``app.broker.worker.sharing``): the response cache tells it ``coalesced``, not ``miss``."""

    answer: object


__all__ = ["BytesLRU", "SharedAnswer", "cache_key", "frozen", "size_of"]
