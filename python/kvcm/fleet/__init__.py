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

Compatibility (to be removed in the next release): ``kvcm.fleet`` used to be the module of
the fleet replay over a shared tier, now :mod:`kvcm.tools.fleet_replay`.  Its public names
(``run_fleet``, ``main_fleet``, ...) are still reachable here through a lazy module
``__getattr__`` that imports :mod:`kvcm.tools.fleet_replay` on first use, so that
importing the fleet layer never imports the tools.
"""

from __future__ import annotations

from typing import Any

# the public names of the former module kvcm/fleet.py (the fleet replay)
_REPLAY_NAMES = frozenset({
    "NUM_LAYERS", "FleetResult", "fleet_config", "fleet_table", "format_header", "main_fleet", "plot",
    "raw_throughput", "resolve_shared", "run_fleet",
})


def __getattr__(name: str) -> Any:
    """The fleet replay's former names, on demand (compatibility re-export, to be removed in
    the next release); any other missing name is an AttributeError, importing nothing."""
    if name in _REPLAY_NAMES:
        from kvcm.tools import fleet_replay  # only when an old name is asked for

        return getattr(fleet_replay, name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


def __dir__() -> list[str]:
    return sorted(set(globals()) | _REPLAY_NAMES)
