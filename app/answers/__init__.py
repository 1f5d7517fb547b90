"""Answers kept by what they depend on: the key (``cache_key``) and a map of read-only
answers bounded in bytes (``BytesLRU``, ``frozen``). The vocabulary the response cache
(``app.cache``, in each front end) and a broker worker that computes identical requests once
(``app.broker.worker.sharing``) share; a leaf, as they are in layers apart."""

from app.answers.key import cache_key
from app.answers.memory import BytesLRU, frozen, size_of

__all__ = ["BytesLRU", "cache_key", "frozen", "size_of"]
