"""The routes front ends keep in Redis (``Keys.routes``, ``MB_SCALE_FROM_ZERO``): for each
model name, the version the live workers' heartbeats gave it last, as one JSON field of a
hash; what a front end routes to while no worker is live (``app.broker.front.monitor``)."""

from __future__ import annotations

import json
from collections.abc import Mapping
from typing import Any

from app.broker.wire.parsing import text
from app.lifecycle import Route


def encode_route(route: Route) -> str:
    """One field of the routes hash.

    >>> encode_route(Route(2, "tagger@1a2b3c4d5e6f"))
    '{"version": 2, "served_id": "tagger@1a2b3c4d5e6f"}'
    """
    return json.dumps({"version": route.version, "served_id": route.served_id})


def decode_routes(raw: Mapping[Any, Any]) -> dict[str, Route]:
    """The routes hash as routes; a field that does not parse is left out.

    >>> decode_routes({b"tagger": encode_route(Route(2, "tagger@1a2b3c4d5e6f")), b"odd": b"{"})
    {'tagger': Route(version=2, served_id='tagger@1a2b3c4d5e6f')}
    """
    decoded = {}
    for name, value in raw.items():
        try:
            fields = json.loads(value)
            decoded[text(name)] = Route(int(fields["version"]), str(fields["served_id"]))
        except (ValueError, TypeError, KeyError):
            continue
    return decoded
