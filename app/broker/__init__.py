"""Broker mode: many front ends and many model workers sharing one queue in Redis Streams, in
three rooms, one for each side and one for what crosses between them:

- ``front``: a front end's side (asyncio, no torch): ``front.transport.BrokerTransport``, the
  ``Transport`` the HTTP process serves through, with its look at Redis, the requests it waits
  the replies of and the backlog it reports;
- ``worker``: a model worker's side (``python -m app.broker.worker``): the supervisor of a
  host's worker processes and its probes, and in each process the consumer of its streams,
  with its versions and loads, its replies, its claims on dead workers' entries and its
  heartbeat;
- ``wire``: what both sides share, and nothing else: the Redis keys, the request, reply and
  heartbeat formats, the fleet's decisions both read, the one view of the live workers.

``front`` and ``worker`` import ``wire``, never each other. ``cluster`` (``python -m
app.broker.cluster``) runs Redis, the workers and the front ends on one machine.
"""
