"""``snapshot()`` and ``check_invariants()`` of the python backend (SPEC sec. 11).

C++ twin: ``cpp/core/observe.cpp``.  The snapshot is written section by section, one
function per key group; the invariant checks go rule group by rule group (slot accounting,
requests, pages, tree links and pruning), in that order.
"""

from __future__ import annotations

from typing import Any

from kvcm.api import GPU, InvariantError, Status
from kvcm.python_backend.block_pool import BlockPool
from kvcm.python_backend.pools import DROPPABLE, HELD, LOCKED, NO_NODE, Page, Pool
from kvcm.python_backend.request import Request
from kvcm.python_backend.tree import NO_PAGE, Node, RadixTree


def _tok(t: Any) -> Any:
    return t if isinstance(t, int) else {"digest": t.hex()}


# ---------------------------------------------------------------------------------- snapshot


def snapshot(pool: BlockPool, requests: dict[int, Request], next_request: int, shutdown: bool) -> dict:
    """SPEC sec. 11: everything observable, in a canonical order (node ids, page serials,
    request serials): the pool's state, the open ``requests`` by serial, the manager's
    next request serial and whether it is shut down."""
    return {
        "clock": pool.clock.now,
        "tree": _snapshot_tree(pool.tree),
        "pages": _snapshot_pages(pool),
        "pools": _snapshot_pools(pool),
        "requests": _snapshot_requests(pool, requests),
        "stats": pool.stats_view(pool.outbox.totals),
        "iteration_stats": pool.stats_view(pool.outbox.iteration),
        "copy_ops": _snapshot_copy_ops(pool),
        "issued_copy_ops": _snapshot_issued(pool),
        "events": _snapshot_events(pool),
        "events_dropped": pool.outbox.events_dropped,
        "next": {"event": pool.outbox.next_event, "page": pool.pages.next_page, "request": next_request,
                 "node": pool.tree.next_id},
        "shutdown": shutdown,
    }


def _snapshot_tree(tree: RadixTree) -> list[dict]:
    """``tree``: every live node by id."""
    out = []
    for nid in sorted(tree.nodes):
        n = tree.nodes[nid]
        out.append({
            "id": n.id,
            "key": n.key.hex(),
            "parent": n.parent.id if n.parent is not None else None,
            "attached": n.attached,
            "root": n.is_root,
            "ordinal": n.ordinal,
            "tokens": [_tok(t) for t in n.tokens],
            "children": sorted(c.id for c in n.children.values()),
            "refs": n.refs,
            "pages": [None if h == NO_PAGE else {"page": h, "coverage": n.coverage[lc]} for lc, h in enumerate(n.pages)],
        })
    return out


def _snapshot_pages(pool: BlockPool) -> list[dict]:
    """``pages``: every live page by serial."""
    return [_page_entry(pool, p) for p in pool.pages.live_pages()]


def _page_entry(pool: BlockPool, p: Page) -> dict:
    """One entry of ``pages``."""
    return {
        "serial": p.serial, "lc": p.lc, "tier": pool.layout.tier_ids[p.tier], "slot": p.slot, "coverage": p.coverage,
        "state": p.state, "priority": p.priority, "last_used": p.last_used, "ordinal": p.ordinal,
        "node": p.node if p.node != NO_NODE else None, "locks": p.locks, "holds": p.holds,
    }


def _snapshot_pools(pool: BlockPool) -> list[dict]:
    """``pools``: per tier, per life cycle, the free slots."""
    return [{"tier": pool.layout.tier_ids[t], "kind": pool.layout.tier_kinds[t], "quota_bytes": pool.pages.quotas[t],
             "lc": [{"total": p.total, "free": p.nfree, "free_slots": sorted(p.free_slots)} for p in tier]}
            for t, tier in enumerate(pool.pages.pools)]


def _snapshot_requests(pool: BlockPool, requests: dict[int, Request]) -> list[dict]:
    """``requests``: the open requests by creation serial."""
    return [_request_entry(pool, serial, requests[serial]) for serial in sorted(requests)]


def _snapshot_copy_ops(pool: BlockPool) -> list[list]:
    """``copy_ops``: the pending (undrained) ops in issue order."""
    return [op.to_json() for op in pool.outbox.copy_ops]


def _snapshot_issued(pool: BlockPool) -> list[list]:
    """``issued_copy_ops``: the last drain's unreported ops, each ``[*op.to_json(), page
    serial]``; with explicit settlement the unsettled drains, oldest first, each a list
    of such entries (DECISIONS.md "Asynchronous copies: settle_copies")."""
    if pool.outbox.explicit:
        return [[[*op.to_json(), serial] for op, serial in zip(ops, pages)] for ops, pages in pool.outbox.unsettled]
    return [[*op.to_json(), serial] for op, serial in zip(pool.outbox.issued, pool.outbox.issued_pages)]


def _snapshot_events(pool: BlockPool) -> list[dict]:
    """``events``: the buffered events, oldest first."""
    return [e.to_json() for e in pool.outbox.built_events()]


def _request_entry(pool: BlockPool, serial: int, r: Request) -> dict:
    """One entry of ``requests``."""
    return {
        "serial": serial,
        "id": r.id,
        "status": r.status.value,
        "scope": [r.scope.lora_id, r.scope.salt],
        "priority": r.priority,
        "capacity": r.capacity,
        "history_length": r.history_length,
        "committed_tokens": [_tok(t) for t in r.tokens],
        "reused_tokens": r.num_reused_tokens,
        "stopped": r.stopped,
        "blocks": [b if b != NO_NODE else None for b in r.blocks],
        "pages": {str(lc): [p.serial if p is not None else None for p in r.pages[lc]] for lc in pool.layout.attn_lcs},
        "live": r.live.serial if r.live is not None else None,
        "snap": r.snap.serial if r.snap is not None else None,
        "cow_block": r.cow_block,
    }


# ---------------------------------------------------------------------------------- invariants


def _check(cond: bool, message: str) -> None:
    if not cond:
        raise InvariantError(message)


def check_invariants(pool: BlockPool, requests: dict[int, Request]) -> None:
    """SPEC sec. 11: recompute every derived fact from scratch and compare (raises
    InvariantError), rule group by rule group."""
    for t, tier in enumerate(pool.pages.pools):
        for lc, slots in enumerate(tier):
            _check_pool(pool, t, lc, slots)
    locks: dict[int, int] = {}
    holds: dict[int, int] = {}
    refs: dict[int, int] = {}
    for r in requests.values():
        _check_request(pool, r, locks, holds, refs)
    for p in pool.pages.live.values():
        _check_page_users(pool, p, locks, holds)
    for nid, n in pool.tree.nodes.items():
        _check_tree_links(pool, nid, n, refs)
    _check_issued(pool)


def _check_pool(pool: BlockPool, t: int, lc: int, slot_pool: Pool) -> None:
    """Slot accounting (sec. 4): each slot used by at most one page, free + used == total,
    the state counters."""
    check = _check
    free = set(slot_pool.free_slots)
    check(len(free) == len(slot_pool.free_slots), f"pool({t},{lc}): duplicate free slot")
    used = [p for p in pool.pages.live.values() if p.tier == t and p.lc == lc]
    slots = [p.slot for p in used]
    check(len(set(slots)) == len(slots), f"pool({t},{lc}): two pages share a slot")
    check(not free & set(slots), f"pool({t},{lc}): a used slot is also free")
    check(len(free) + len(used) == slot_pool.total, f"pool({t},{lc}): {len(free)} free + {len(used)} used != {slot_pool.total}")
    check(all(0 <= s < slot_pool.total for s in slots) and all(0 <= s < slot_pool.total for s in free),
          f"pool({t},{lc}): slot out of range")
    for state, have in ((LOCKED, slot_pool.locked), (HELD, slot_pool.held), (DROPPABLE, slot_pool.droppable)):
        n = sum(1 for p in used if p.state == state)
        check(n == have, f"pool({t},{lc}): {have} {state} counted, {n} found")


def _check_request(pool: BlockPool, r: Request, locks: dict[int, int], holds: dict[int, int],
                   refs: dict[int, int]) -> None:
    """Request invariants (sec. 7), counting the page users and block references it has
    into ``locks`` / ``holds`` / ``refs`` for the page and tree checks."""
    check = _check
    tree = pool.tree
    B = pool.layout.B
    check(r.num_committed_tokens <= r.history_length <= r.capacity,
          f"request {r.id}: committed {r.num_committed_tokens} <= history {r.history_length} <= capacity {r.capacity}")
    target = locks if r.status == Status.ACTIVE else holds
    used = r.used_pages()
    check(len({p.serial for p in used}) == len(used), f"request {r.id}: uses a page twice")
    for p in used:
        check(p.serial in pool.pages.live, f"request {r.id}: uses freed page {p.serial}")
        target[p.serial] = target.get(p.serial, 0) + 1
        if r.status == Status.ACTIVE:
            check(p.tier == GPU, f"request {r.id} is ACTIVE but page {p.serial} is on tier {p.tier}")
    nb = -(-r.capacity // B)
    for lc in pool.layout.attn_lcs:
        check(len(r.pages[lc]) <= max(nb, len(r.blocks)), f"request {r.id}: pages beyond capacity")
        lo, hi = pool.layout.lcs[lc].stale_range(r.history_length, B)
        for i, p in enumerate(r.pages[lc]):
            check(p is None or not lo <= i < hi, f"request {r.id}: stale block {i} of lc {lc} keeps a page")
            check(p is not None or lo <= i < hi, f"request {r.id}: block {i} of lc {lc} has no page")
    if r.status == Status.ACTIVE and pool.layout.ssm_lc is not None:
        check(r.live is not None, f"request {r.id}: ACTIVE without a live ssm state")
    for nid in r.blocks:
        if nid != NO_NODE:
            check(nid in tree.nodes, f"request {r.id}: references deleted block {nid}")
            refs[nid] = refs.get(nid, 0) + 1
    check(r.root in tree.nodes and tree.nodes[r.root].is_root, f"request {r.id}: its scope root is gone")
    refs[r.root] = refs.get(r.root, 0) + 1


def _check_page_users(pool: BlockPool, p: Page, locks: dict[int, int], holds: dict[int, int]) -> None:
    """Pages (sec. 4): users as the requests count them, LOCKED only on gpu, a private page
    has a user, a committed one is held by its block."""
    check = _check
    tree = pool.tree
    check(p.locks == locks.get(p.serial, 0), f"page {p.serial}: {p.locks} locks, {locks.get(p.serial, 0)} users ACTIVE")
    check(p.holds == holds.get(p.serial, 0), f"page {p.serial}: {p.holds} holds, {holds.get(p.serial, 0)} users SUSPENDED")
    check(p.state != LOCKED or p.tier == GPU, f"page {p.serial}: LOCKED on tier {p.tier}")
    if p.tier == pool.layout.shared_pos:  # DECISIONS.md "The shared tier": HELD, linked, full, no slot
        check(p.slot == -1 and p.locks == 0 and p.holds > 0, f"page {p.serial}: a shared page must be HELD, "
              f"slot -1 ({p.locks} locks, {p.holds} holds, slot {p.slot})")
        check(p.node != NO_NODE and p.coverage == pool.layout.B, f"page {p.serial}: a shared page outside a full block")
    if p.node == NO_NODE:
        check(p.locks + p.holds > 0, f"page {p.serial}: private page without a user")
    else:
        check(p.node in tree.nodes, f"page {p.serial}: block {p.node} does not exist")
        n = tree.nodes[p.node]
        check(n.pages[p.lc] == p.serial, f"page {p.serial}: block {p.node} does not hold it")
        if not n.attached:
            check(p.locks + p.holds > 0, f"page {p.serial}: orphan block {p.node} page without a user")


def _check_tree_links(pool: BlockPool, nid: int, n: Node, refs: dict[int, int]) -> None:
    """Tree links and pruning (sec. 5): references, pages linked back, children and their
    index, roots, and no prunable block left attached."""
    check = _check
    tree = pool.tree
    check(n.refs == refs.get(nid, 0), f"block {nid}: {n.refs} refs, {refs.get(nid, 0)} requests")
    for lc, h in enumerate(n.pages):
        if h != NO_PAGE:
            check(h in pool.pages.live and pool.pages.live[h].node == nid, f"block {nid}: page {h} of lc {lc} not linked back")
            check(n.coverage[lc] > 0, f"block {nid}: page with zero coverage")
        else:
            check(n.coverage[lc] == 0, f"block {nid}: coverage without a page")
    for k, c in n.children.items():
        check(k == c.key and c.parent is n, f"block {nid}: child {c.id} link broken")
        check(len(n.tokens) == pool.layout.B or n.is_root, f"block {nid}: a partial block has children")
    check(tree.index_leaves(nid) == sorted(c.id for c in n.children.values() if c.tokens),
          f"block {nid}: children index out of sync")
    if n.is_root:
        check(tree.roots.get(n.key) is n, f"root {nid}: not the root of its scope")
        check(bool(n.children) or n.refs > 0, f"root {nid}: unused (no child, no request) but not released")
        return
    expect_attached = n.parent is not None and n.parent.attached and n.parent.children.get(n.key) is n
    check(n.attached == expect_attached, f"block {nid}: attached flag {n.attached} but links say {expect_attached}")
    if n.attached:
        check(bool(n.children) or n.has_page(), f"block {nid}: attached with neither a child nor a page (prunable)")
        check(n.ordinal == (n.parent.ordinal + 1), f"block {nid}: ordinal {n.ordinal} under {n.parent.ordinal}")
    else:
        check(n.parent is None, f"block {nid}: detached but has a parent")
        check(n.refs > 0 or n.has_page(), f"block {nid}: dead orphan not deleted")


def _check_issued(pool: BlockPool) -> None:
    """Issued copy ops (sec. 15): each names the page it fills (a serial already made;
    -1 exactly for a store, which fills none); explicit settlement keeps no empty drain,
    counts the unsettled ops right and reports nothing through the last drain."""
    check = _check
    drains = list(pool.outbox.unsettled) if pool.outbox.explicit else [(pool.outbox.issued, pool.outbox.issued_pages)]
    for d, (ops, pages) in enumerate(drains):
        check(len(ops) == len(pages), f"issued drain {d}: {len(ops)} ops, {len(pages)} pages")
        check(bool(ops) or not pool.outbox.explicit, f"unsettled drain {d} is empty")
        for op, serial in zip(ops, pages):
            check((serial == -1) == (op.reason == "store") and -1 <= serial < pool.pages.next_page,
                  f"issued drain {d}: op {op.to_json()} fills page {serial}")
    if pool.outbox.explicit:
        n = sum(len(ops) for ops, _ in pool.outbox.unsettled)
        check(n == pool.outbox.unsettled_ops, f"{pool.outbox.unsettled_ops} unsettled copy ops counted, {n} found")
        check(not pool.outbox.issued and not pool.outbox.issued_pages, "explicit settlement with a last drain to report")
