"""Broker mode: many front ends and many model workers sharing one queue in Redis Streams.

``transport.BrokerTransport`` is the front ends' side (a ``Transport``, asyncio, no torch);
``consumer`` is the model workers' side (``python -m app.broker.worker``); ``wire`` is the format
between them and ``keys`` the names they share.
"""
