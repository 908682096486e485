"""The data plane's copy counters (reporting only): completed copy ops and their bytes by
reason, ops by route (``"gpu->host"``), batched runs and kernel calls.  The copy-run
executor (:mod:`kvcm.dataplane.copy_runs`) and the shared-tier I/O
(:mod:`kvcm.dataplane.shared_io`) count into one :class:`CopyStats`, given to each."""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

from kvcm.api import SHARED, CopyOp, CopyRun

COPY_REASONS = ("offload", "onboard", "cow", "snapshot", "store", "relocate")


class CopyStats:
    """Counters of one data plane.  ``slot_bytes``: the bytes of one slot per life cycle;
    ``tier_kind``: the kind (``"gpu"``, ``"host"``, ``"disk"``) of a pool tier by SPEC's
    number (the shared tier is ``"shared"``)."""

    def __init__(self, slot_bytes: Sequence[int], tier_kind: Callable[[int], str]) -> None:
        self._slot_bytes = list(slot_bytes)
        self._tier_kind = tier_kind
        self.copies = dict.fromkeys(COPY_REASONS, 0)  # ops executed, by reason
        self.copy_bytes = dict.fromkeys(COPY_REASONS, 0)
        self.routes: dict[str, int] = {}  # ops executed by route, e.g. "gpu->host"
        self.route_bytes: dict[str, int] = {}  # bytes copied by route
        self.route_seconds: dict[str, float] = {}  # seconds spent copying by route (reporting only)
        self.runs = 0  # batched runs executed
        self.kernel_calls = 0  # gather+scatter pairs issued (one per (src tier, dst tier, lc) per run)

    def count(self, op: CopyOp | CopyRun, n: int = 1) -> None:
        """Count ``n`` completed ops of ``op``'s lc, tiers and reason."""
        if not n:
            return
        self.copies[op.reason] += n
        self.copy_bytes[op.reason] += n * self._slot_bytes[op.lc]
        route = self.route(op)
        self.routes[route] = self.routes.get(route, 0) + n
        self.route_bytes[route] = self.route_bytes.get(route, 0) + n * self._slot_bytes[op.lc]

    def route(self, op: CopyOp | CopyRun) -> str:
        """``op``'s route, e.g. ``"disk->gpu"``."""
        return f"{self._kind(op.src_tier)}->{self._kind(op.dst_tier)}"

    def timed(self, op: CopyOp | CopyRun, seconds: float) -> None:
        """Add ``seconds`` spent executing a batch of ``op``'s route."""
        route = self.route(op)
        self.route_seconds[route] = self.route_seconds.get(route, 0.0) + seconds

    def _kind(self, tier: int) -> str:
        return "shared" if tier == SHARED else self._tier_kind(tier)

    def as_dict(self) -> dict[str, Any]:
        """Copies of the counters: ``copies``, ``copy_bytes``, ``routes``, ``runs``, ``kernel_calls``
        (``route_bytes`` and ``route_seconds`` are read as attributes: the seconds are not
        deterministic)."""
        return {"copies": dict(self.copies), "copy_bytes": dict(self.copy_bytes), "routes": dict(self.routes),
                "runs": self.runs, "kernel_calls": self.kernel_calls}
