"""A response cache (issue #51): an image's answer, keyed by its bytes and everything else
it depends on (``cache_key``), kept in this process (``MB_CACHE_BYTES``) and optionally in a
Redis every front end shares (``MB_CACHE_REDIS``); identical requests in flight at once are
computed once (``ResponseCache``). The Redis tier is ``app.cache.shared``, imported only
when asked for. No entry needs invalidating: the key holds the served id,
which every rollout and rollback changes."""

from app.answers import cache_key
from app.cache.flight import CacheUse, Outcome, ResponseCache

__all__ = ["CacheUse", "Outcome", "ResponseCache", "cache_key"]
