"""What leaves the manager: copy ops, events and stats (SPEC sec. 8, 9, 15).

C++ twin: ``cpp/core/outbox.{h,cpp}``.  The ``Outbox`` records; it decides nothing about
pages or blocks.  What it reports of them it is handed (a page, a block and its rows, the
live pages by serial, the pools' figures), so it knows no other part of the pool.
"""

from __future__ import annotations

from collections import deque
from collections.abc import Callable, Mapping, Sequence

from kvcm.api import (
    SHARED,
    ClearedEvent,
    CopyOp,
    Event,
    KVCacheManagerConfig,
    RemovedEvent,
    StoredBlock,
    StoredEvent,
    TierChangedEvent,
    warn_pending_copy_ops,
)
from kvcm.checks import NOTHING_TO_SETTLE, not_in_oldest_drain_error, not_issued_error
from kvcm.python_backend.layout import Layout
from kvcm.python_backend.pools import Page
from kvcm.python_backend.tree import Node

_LC_COUNTERS = ("reused_blocks", "missed_blocks", "reused_tokens", "allocated_blocks", "offloads", "offload_bytes",
                "onboards", "onboard_bytes", "drops", "drop_bytes", "cows", "snapshots_taken", "snapshots_skipped",
                "lost_pages", "shared_stores", "shared_store_bytes", "shared_hit_blocks", "relocations")

# the counter each copy op between pages counts (Outbox.copy)
_COPY_COUNTERS = {"cow": "cows", "snapshot": "snapshots_taken"}

# An event is buffered as a plain tuple of its fields at emission, ``(kind, event_id,
# ...)``: ints, bytes and tuples of them, which the cyclic GC stops tracking (a buffer of
# frozen Event objects would make every collection walk it), built into its Event when read.
STORED, REMOVED, TIER_CHANGED, CLEARED = range(4)
EventRecord = tuple


def built_event(e: EventRecord) -> Event:
    """The :class:`kvcm.api.Event` of a buffered record (see ``Outbox.emit``)."""
    kind = e[0]
    if kind == STORED:  # (kind, id, parent key, key, tokens, rows (lc, tier, priority, coverage), partial)
        _, eid, parent, key, tokens, rows, partial = e
        toks = tuple(tokens)
        return StoredEvent(eid, parent, tuple(StoredBlock(key, len(toks), toks, *row) for row in rows), partial)
    if kind == REMOVED:  # (kind, id, key, lc)
        return RemovedEvent(e[1], (e[2],), e[3])
    if kind == TIER_CHANGED:  # (kind, id, key, lc, old tier, new tier)
        return TierChangedEvent(*e[1:])
    return ClearedEvent(e[1])  # (kind, id)


class Outbox:
    """The pending copy ops (and the drains not reported / settled yet), the event buffer
    and the stats counters of one manager."""

    def __init__(self, layout: Layout, config: KVCacheManagerConfig, explicit: bool) -> None:
        self.layout = layout
        self.copy_ops: list[CopyOp] = []
        self.copy_pages: list[int] = []  # serial of the page each pending op fills
        # the ops of the last drain not reported yet, with the page each fills (forget_copies)
        self.issued: list[CopyOp] = []
        self.issued_pages: list[int] = []
        # copy_settlement="explicit" (DECISIONS.md "Asynchronous copies: settle_copies"): the
        # drains not settled yet, oldest first, each (its ops, the page each fills); `issued`
        # stays empty.  unsettled_ops: their ops in all (the warning below counts them)
        self.explicit = explicit
        self.unsettled: deque[tuple[list[CopyOp], list[int]]] = deque()
        self.unsettled_ops = 0
        # sec. 15: undrained (and, explicit, unsettled) copy ops are a visible bound:
        # stats()["pending_copy_ops"], unsettled_drains, and one PendingCopyOpsWarning when
        # they reach the configured figure (DECISIONS.md)
        self.copy_ops_warn_at = config.pending_copy_ops_warning
        self.copy_ops_warned = False
        self.copy_ops_warn_due = False
        # a full buffer drops its oldest on append by itself (maxlen), counted in emit
        self.max_events = config.max_events
        self.events: deque[EventRecord] = deque(maxlen=config.max_events)
        self.events_dropped = 0
        self.next_event = 0
        self.totals = self._zero_counters()
        self.iteration = self._zero_counters()

    # --- copy ops

    def copy(self, lc: int, src: Page, dst: Page, reason: str) -> None:
        """SPEC sec. 7, 8: a copy op from ``src`` to ``dst`` (``cow`` or ``snapshot``), counted."""
        tid = self.layout.tier_ids
        self.add_copy_op(CopyOp(lc, tid[src.tier], src.slot, tid[dst.tier], dst.slot, reason), dst.serial)
        self.count(lc, _COPY_COUNTERS[reason])

    def add_copy_op(self, op: CopyOp, fills: int) -> None:
        """SPEC sec. 8 copy ops (``fills``: the serial of the page the op fills, -1: none),
        and sec. 15's one warning when the pending ones reach the figure."""
        self.copy_ops.append(op)
        self.copy_pages.append(fills)
        # (the figure grows only here, one op at a time: == catches the crossing)
        if len(self.copy_ops) + self.unsettled_ops == self.copy_ops_warn_at and not self.copy_ops_warned:
            self.copy_ops_warned = self.copy_ops_warn_due = True  # warned once, at the call's end

    def store(self, page: Page, key: bytes) -> None:
        """A ``store`` op (DECISIONS.md "The shared tier"): ``page`` (a full-coverage page of
        the full block ``key``) is written to the shared tier.  It fills no page here
        (forget_copies forgets nothing)."""
        self.add_copy_op(CopyOp(page.lc, self.layout.tier_ids[page.tier], page.slot, SHARED, -1, "store", key), -1)
        self.count_bytes(page.lc, "shared_stores", "shared_store_bytes", self.layout.lcs[page.lc].slot_bytes)

    def warn_copy_ops(self) -> None:
        """SPEC sec. 15: the one PendingCopyOpsWarning, issued at the end of the public call
        whose op reached the figure (the warning never changes the call's work)."""
        if self.copy_ops_warn_due:
            self.copy_ops_warn_due = False
            warn_pending_copy_ops(self.copy_ops_warn_at, self.explicit)

    def take_copy_ops(self) -> list[CopyOp]:
        """drain_copy_ops: the pending ops; they become the last drain (forget_copies), or,
        with explicit settlement and at least one op, the newest unsettled drain."""
        ops, self.copy_ops = self.copy_ops, []
        pages, self.copy_pages = self.copy_pages, []
        # (copies: the caller owns ``ops``)
        if not self.explicit:
            self.issued, self.issued_pages = list(ops), pages
        elif ops:
            self.unsettled.append((list(ops), pages))
            self.unsettled_ops += len(ops)
        return ops

    def match_issued(self, issued: list[CopyOp], ops: Sequence[CopyOp],
                     refuse: Callable[[int, CopyOp], ValueError]) -> set[int]:
        """SPEC sec. 15: the ops of one drain (``issued``) that ``ops`` name, matched by value
        in order, one issued op per listed op: their indices.  An op with no unmatched equal
        left raises ``refuse(i, op)`` (nothing changed)."""
        pending: dict[CopyOp, list[int]] = {}  # op -> its indices in issued, in order
        for k, iop in enumerate(issued):
            pending.setdefault(iop, []).append(k)
        taken: set[int] = set()
        for i, op in enumerate(ops):
            ks = pending.get(op)
            if not ks:
                raise refuse(i, op)
            taken.add(ks.pop(0))
        return taken

    def live_fills(self, issued_pages: list[int], taken: set[int], live: Mapping[int, Page]) -> list[Page]:
        """The live pages (``live``: the pages by serial) the ``taken`` ops of a drain were to
        fill, once each, in drain order (a page that died meanwhile is skipped)."""
        lost: list[Page] = []
        for k in sorted(taken):
            page = live.get(issued_pages[k])
            if page is not None and page not in lost:
                lost.append(page)
        return lost

    def take_issued(self, ops: Sequence[CopyOp], live: Mapping[int, Page]) -> list[Page]:
        """SPEC sec. 15 forget_copies, the outbox's part: ``ops`` (each an unreported op of the
        last drain, else ValueError and nothing changed) are reported; returns the live
        pages they were to fill, once each, in drain order."""
        taken = self.match_issued(self.issued, ops, not_issued_error)
        lost = self.live_fills(self.issued_pages, taken, live)
        self.issued = [e for k, e in enumerate(self.issued) if k not in taken]
        self.issued_pages = [e for k, e in enumerate(self.issued_pages) if k not in taken]
        return lost

    def settle_oldest(self, failed: Sequence[CopyOp], live: Mapping[int, Page]) -> list[Page]:
        """SPEC sec. 15 settle_copies, the outbox's part: the oldest unsettled drain is settled
        with ``failed`` (each an op of that drain, else ValueError and nothing changed; no
        drain: ValueError); returns the live pages the failed ops were to fill, once each,
        in drain order."""
        if not self.unsettled:
            raise ValueError(NOTHING_TO_SETTLE)
        ops, pages = self.unsettled[0]
        lost = self.live_fills(pages, self.match_issued(ops, failed, not_in_oldest_drain_error), live)
        self.unsettled.popleft()
        self.unsettled_ops -= len(ops)
        return lost

    def unsettled_drains(self) -> int:
        """DECISIONS.md "Asynchronous copies: settle_copies": the drains not settled yet."""
        return len(self.unsettled)

    # --- events (sec. 9)

    def emit(self, kind: int, *fields: object) -> None:
        """SPEC sec. 9 / 15: buffer an event of ``kind`` with the next event id and
        ``fields`` (its record ``(kind, id, *fields)``, see ``built_event``); the oldest is
        dropped (and counted) when full, and with ``max_events == 0`` the event itself."""
        eid = self.next_event  # (event_id's step, inline: one event per changed block)
        self.next_event += 1
        if len(self.events) == self.max_events:  # full (0: always): one is dropped
            self.events_dropped += 1
            if not self.max_events:
                return
        self.events.append((kind, eid, *fields))  # (the oldest leaves by the deque's maxlen)

    def event_id(self) -> int:
        """The next event id (ids count every event, the dropped ones too)."""
        self.next_event += 1
        return self.next_event - 1

    def emit_removed(self, key: bytes, lc: int) -> None:
        """SPEC sec. 9: ``removed`` for a block that lost its last page of ``lc`` or was detached."""
        self.emit(REMOVED, key, lc)

    def emit_stored(self, node: Node, rows: list[tuple[int, int, int, int]]) -> None:
        """SPEC sec. 9: ``stored`` for block ``node``, which just gained (or regained) pages,
        one row ``(lc, tier number, priority, coverage)`` each (none: no event)."""
        if not rows:
            return
        parent = None if node.parent is None else node.parent.key
        # the block's key and tokens (never changed) are shared with the node, not copied
        self.emit(STORED, parent, node.key, node.tokens, tuple(rows), len(node.tokens) < self.layout.B)

    def emit_tier_changed(self, key: bytes, lc: int, old_tier: int, new_tier: int) -> None:
        """SPEC sec. 9: ``tier_changed`` for an attached block's page of ``lc`` that moved."""
        self.emit(TIER_CHANGED, key, lc, old_tier, new_tier)

    def emit_cleared(self) -> None:
        """SPEC sec. 9: ``cleared`` (clear_reusable)."""
        self.emit(CLEARED)

    def built_events(self) -> list[Event]:
        """The buffered events, oldest first."""
        return [built_event(e) for e in self.events]

    def take_events(self) -> list[Event]:
        out = self.built_events()
        self.events.clear()
        return out

    # --- stats (sec. 9)

    def _zero_counters(self) -> dict:
        return {"requests": 0, "query_tokens": 0, "reused_tokens": 0,
                "lc": [dict.fromkeys(_LC_COUNTERS, 0) for _ in self.layout.lcs]}

    def count(self, lc: int, name: str, n: int = 1) -> None:
        self.totals["lc"][lc][name] += n
        self.iteration["lc"][lc][name] += n

    def count_bytes(self, lc: int, name: str, bytes_name: str, nbytes: int) -> None:
        """``count(lc, name)`` and ``count(lc, bytes_name, nbytes)`` in one call (per evicted page)."""
        t, i = self.totals["lc"][lc], self.iteration["lc"][lc]
        t[name] += 1
        t[bytes_name] += nbytes
        i[name] += 1
        i[bytes_name] += nbytes

    def record_match(self, n_query: int, m: int) -> None:
        """Hit-rate stats count attention life cycles only (sec. 9)."""
        B = self.layout.B
        for c in (self.totals, self.iteration):
            c["requests"] += 1
            c["query_tokens"] += n_query
            c["reused_tokens"] += m
            for lc in self.layout.attn_lcs:
                d = c["lc"][lc]
                d["reused_tokens"] += m
                d["reused_blocks"] += -(-m // B)
                d["missed_blocks"] += -(-n_query // B) - -(-m // B)

    def take_iteration_stats(self, tiers: list[dict]) -> dict:
        """The stats of this iteration (``tiers``: the pools' figures now); the iteration's
        counters start again from zero."""
        view = self.stats_view(self.iteration, tiers)
        self.iteration = self._zero_counters()
        return view

    def stats_view(self, counters: dict, tiers: list[dict]) -> dict:
        """SPEC sec. 9: the stats dict of ``counters`` (cumulative or this iteration's), with
        ``tiers`` the pools' figures (``Pages.tier_stats``)."""
        return {
            "requests": counters["requests"],
            "query_tokens": counters["query_tokens"],
            "reused_tokens": counters["reused_tokens"],
            "lc": [dict(c) for c in counters["lc"]],
            "tiers": tiers,
            "events_dropped": self.events_dropped,
            "pending_copy_ops": len(self.copy_ops),
        }
