"""An in-process wire link: manager events -> vLLM wire bytes -> router index, no sockets.

The routing simulation (``kvcm.tools.routing``) runs thousands of steps; going through ZeroMQ
would only add thread scheduling to its timing, never change its result.  ``LoopbackLink``
uses exactly the publisher's translation (``WireState``) and encoding (``wire.Encoder``)
and the router client's decoding (``wire.Decoder``), so what the router index sees is what
it would receive from an ``EventPublisher``.
"""

from __future__ import annotations

from typing import Any

from kvcm.api import KVCacheManager, ReuseScope
from kvcm.fleet.router_index import RouterIndex
from kvcm.fleet.wire import Decoder, Encoder, Layout
from kvcm.fleet.wire_state import WireState


class LoopbackLink:
    """Feeds one manager's events to one instance of a ``RouterIndex``, step by step."""

    def __init__(self, manager: KVCacheManager, router: RouterIndex, name: Any, layout: Layout = "map",
                 scopes: tuple[ReuseScope, ...] = ()) -> None:
        self.manager = manager
        self.router = router
        self.name = name
        self._state = WireState(manager.life_cycles, manager.config.tokens_per_block, scopes)
        self._state.load_snapshot(manager.snapshot())
        self._enc = Encoder(layout)
        self._dec = Decoder()
        self.step_no = 0
        self.bytes_sent = 0
        self.batches = 0
        router.reset(name, self._dec.decode(self._enc.encode(0.0, self._state.restatement())))

    def step(self) -> None:
        """Publish this step's ``take_events()`` and apply the batch to the router."""
        wire = self._state.translate(self.manager.take_events())
        self.step_no += 1
        if not wire:
            return
        payload = self._enc.encode(float(self.step_no - 1), wire)
        self.bytes_sent += len(payload)
        self.batches += 1
        self.router.apply(self.name, self._dec.decode(payload))


__all__ = ["LoopbackLink"]
