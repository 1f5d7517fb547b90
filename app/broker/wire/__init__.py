"""What both sides of broker mode share in Redis, and nothing else: the key names under one
prefix and the timings both rely on (``keys``); the formats of what crosses, checked on
arrival, no pickle anywhere (``request``, ``reply``, ``heartbeat``, read with ``parsing``);
what the fleet decided, which both sides read (``control``: the admin route's pins, the
precision of each export); and the one view of the live workers, from their heartbeats
(``live``); and where Redis is, plain or behind Sentinel, and how every process connects to
it (``connect``)."""
