"""The fleet: kvcm's KV events on the wire and the router that reads them (SPEC sec. 16).

One module per role:

* :mod:`kvcm.fleet.wire`: the wire format (vLLM's ``KVEventBatch`` msgpack encoding);
* :mod:`kvcm.fleet.wire_state`: the translation of manager events to wire events;
* :mod:`kvcm.fleet.publisher`: :class:`~kvcm.fleet.publisher.EventPublisher` (ZeroMQ
  PUB + replay ROUTER, bounded in bytes);
* :mod:`kvcm.fleet.router_index`: :class:`~kvcm.fleet.router_index.RouterIndex`, the
  router's index (whole batches or nothing) and :class:`~kvcm.fleet.router_index.RouterModel`;
* :mod:`kvcm.fleet.subscriber`: :class:`~kvcm.fleet.subscriber.FleetSubscriber`, the
  router's ZeroMQ side (malformed input dropped, resynced per instance);
* :mod:`kvcm.fleet.loopback`: :class:`~kvcm.fleet.loopback.LoopbackLink`, a manager
  wired to a router index in process (no sockets).

The routing replay that drives these (``python -m kvcm route``) is :mod:`kvcm.tools.routing`.
"""
