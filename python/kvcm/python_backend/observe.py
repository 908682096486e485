"""``snapshot()`` and ``check_invariants()`` of the python backend (SPEC sec. 11).

C++ twin: ``cpp/core/observe.cpp``.  The snapshot is written section by section, one
function per key group; the invariant checks go rule group by rule group (slot accounting,
requests, pages, tree links and pruning), in that order.
"""

from __future__ import annotations

from typing import Any

from kvcm.api import GPU, Status
from kvcm.python_backend.pools import DROPPABLE, HELD, LOCKED, NO_NODE, Page, Pool
from kvcm.python_backend.request import PyKVCache
from kvcm.python_backend.tree import NO_PAGE, Node, RadixTree


def _tok(t: Any) -> Any:
    return t if isinstance(t, int) else {"digest": t.hex()}


# ---------------------------------------------------------------------------------- snapshot


def snapshot(mgr: Any) -> dict:
    """SPEC sec. 11: everything observable, in a canonical order (node ids, page serials,
    request serials)."""
    return {
        "clock": mgr.clock,
        "tree": _snapshot_tree(mgr.tree),
        "pages": _snapshot_pages(mgr),
        "pools": _snapshot_pools(mgr),
        "requests": _snapshot_requests(mgr),
        "stats": mgr.stats(),
        "iteration_stats": mgr.stats_view(mgr.iteration),
        "copy_ops": _snapshot_copy_ops(mgr),
        "issued_copy_ops": [[*op.to_json(), serial] for op, serial in zip(mgr.issued, mgr.issued_pages)],
        "events": _snapshot_events(mgr),
        "events_dropped": mgr.events_dropped,
        "next": {"event": mgr.next_event, "page": mgr.next_page, "request": mgr.next_request,
                 "node": mgr.tree.next_id},
        "shutdown": mgr.is_shutdown,
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


def _snapshot_pages(mgr: Any) -> list[dict]:
    """``pages``: every live page by serial."""
    return [_page_entry(mgr, mgr.pages[serial]) for serial in sorted(mgr.pages)]


def _page_entry(mgr: Any, p: Page) -> dict:
    """One entry of ``pages``."""
    return {
        "serial": p.serial, "lc": p.lc, "tier": mgr.tier_ids[p.tier], "slot": p.slot, "coverage": p.coverage,
        "state": p.state, "priority": p.priority, "last_used": p.last_used, "ordinal": p.ordinal,
        "node": p.node if p.node != NO_NODE else None, "locks": p.locks, "holds": p.holds,
    }


def _snapshot_pools(mgr: Any) -> list[dict]:
    """``pools``: per tier, per life cycle, the free slots."""
    return [{"tier": mgr.tier_ids[t], "kind": mgr._rc.tier_kinds[t], "quota_bytes": mgr.quotas[t],
             "lc": [{"total": p.total, "free": p.nfree, "free_slots": sorted(p.free_slots)} for p in tier]}
            for t, tier in enumerate(mgr.pools)]


def _snapshot_requests(mgr: Any) -> list[dict]:
    """``requests``: the open requests by creation serial."""
    return [_request_entry(mgr, serial, mgr.requests[serial]) for serial in sorted(mgr.requests)]


def _snapshot_copy_ops(mgr: Any) -> list[list]:
    """``copy_ops``: the pending (undrained) ops in issue order."""
    return [op.to_json() for op in mgr.copy_ops]


def _snapshot_events(mgr: Any) -> list[dict]:
    """``events``: the buffered events, oldest first."""
    return [e.to_json() for e in mgr.built_events()]


def _request_entry(mgr: Any, serial: int, r: PyKVCache) -> dict:
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
        "pages": {str(lc): [p.serial if p is not None else None for p in r.pages[lc]] for lc in mgr.attn_lcs},
        "live": r.live.serial if r.live is not None else None,
        "snap": r.snap.serial if r.snap is not None else None,
        "cow_block": r.cow_block,
    }


# ---------------------------------------------------------------------------------- invariants


def check_invariants(mgr: Any) -> None:
    """SPEC sec. 11: recompute every derived fact from scratch and compare (raises
    InvariantError), rule group by rule group."""
    for t, tier in enumerate(mgr.pools):
        for lc, pool in enumerate(tier):
            _check_pool(mgr, t, lc, pool)
    locks: dict[int, int] = {}
    holds: dict[int, int] = {}
    refs: dict[int, int] = {}
    for r in mgr.requests.values():
        _check_request(mgr, r, locks, holds, refs)
    for p in mgr.pages.values():
        _check_page_users(mgr, p, locks, holds)
    for nid, n in mgr.tree.nodes.items():
        _check_tree_links(mgr, nid, n, refs)


def _check_pool(mgr: Any, t: int, lc: int, pool: Pool) -> None:
    """Slot accounting (sec. 4): each slot used by at most one page, free + used == total,
    the state counters."""
    check = mgr.check
    free = set(pool.free_slots)
    check(len(free) == len(pool.free_slots), f"pool({t},{lc}): duplicate free slot")
    used = [p for p in mgr.pages.values() if p.tier == t and p.lc == lc]
    slots = [p.slot for p in used]
    check(len(set(slots)) == len(slots), f"pool({t},{lc}): two pages share a slot")
    check(not free & set(slots), f"pool({t},{lc}): a used slot is also free")
    check(len(free) + len(used) == pool.total, f"pool({t},{lc}): {len(free)} free + {len(used)} used != {pool.total}")
    check(all(0 <= s < pool.total for s in slots) and all(0 <= s < pool.total for s in free),
          f"pool({t},{lc}): slot out of range")
    for state, have in ((LOCKED, pool.locked), (HELD, pool.held), (DROPPABLE, pool.droppable)):
        n = sum(1 for p in used if p.state == state)
        check(n == have, f"pool({t},{lc}): {have} {state} counted, {n} found")


def _check_request(mgr: Any, r: PyKVCache, locks: dict[int, int], holds: dict[int, int],
                   refs: dict[int, int]) -> None:
    """Request invariants (sec. 7), counting the page users and block references it has
    into ``locks`` / ``holds`` / ``refs`` for the page and tree checks."""
    check = mgr.check
    tree = mgr.tree
    B = mgr.B
    check(r.num_committed_tokens <= r.history_length <= r.capacity,
          f"request {r.id}: committed {r.num_committed_tokens} <= history {r.history_length} <= capacity {r.capacity}")
    target = locks if r.status == Status.ACTIVE else holds
    used = r.used_pages()
    check(len({p.serial for p in used}) == len(used), f"request {r.id}: uses a page twice")
    for p in used:
        check(p.serial in mgr.pages, f"request {r.id}: uses freed page {p.serial}")
        target[p.serial] = target.get(p.serial, 0) + 1
        if r.status == Status.ACTIVE:
            check(p.tier == GPU, f"request {r.id} is ACTIVE but page {p.serial} is on tier {p.tier}")
    nb = -(-r.capacity // B)
    for lc in mgr.attn_lcs:
        check(len(r.pages[lc]) <= max(nb, len(r.blocks)), f"request {r.id}: pages beyond capacity")
        lo, hi = mgr.lcs[lc].stale_range(r.history_length, B)
        for i, p in enumerate(r.pages[lc]):
            check(p is None or not lo <= i < hi, f"request {r.id}: stale block {i} of lc {lc} keeps a page")
            check(p is not None or lo <= i < hi, f"request {r.id}: block {i} of lc {lc} has no page")
    if r.status == Status.ACTIVE and mgr.ssm_lc is not None:
        check(r.live is not None, f"request {r.id}: ACTIVE without a live ssm state")
    for nid in r.blocks:
        if nid != NO_NODE:
            check(nid in tree.nodes, f"request {r.id}: references deleted block {nid}")
            refs[nid] = refs.get(nid, 0) + 1
    check(r.root in tree.nodes and tree.nodes[r.root].is_root, f"request {r.id}: its scope root is gone")
    refs[r.root] = refs.get(r.root, 0) + 1


def _check_page_users(mgr: Any, p: Page, locks: dict[int, int], holds: dict[int, int]) -> None:
    """Pages (sec. 4): users as the requests count them, LOCKED only on gpu, a private page
    has a user, a committed one is held by its block."""
    check = mgr.check
    tree = mgr.tree
    check(p.locks == locks.get(p.serial, 0), f"page {p.serial}: {p.locks} locks, {locks.get(p.serial, 0)} users ACTIVE")
    check(p.holds == holds.get(p.serial, 0), f"page {p.serial}: {p.holds} holds, {holds.get(p.serial, 0)} users SUSPENDED")
    check(p.state != LOCKED or p.tier == GPU, f"page {p.serial}: LOCKED on tier {p.tier}")
    if p.tier == mgr.shared_pos:  # DECISIONS.md "The shared tier": HELD, linked, full, no slot
        check(p.slot == -1 and p.locks == 0 and p.holds > 0, f"page {p.serial}: a shared page must be HELD, "
              f"slot -1 ({p.locks} locks, {p.holds} holds, slot {p.slot})")
        check(p.node != NO_NODE and p.coverage == mgr.B, f"page {p.serial}: a shared page outside a full block")
    if p.node == NO_NODE:
        check(p.locks + p.holds > 0, f"page {p.serial}: private page without a user")
    else:
        check(p.node in tree.nodes, f"page {p.serial}: block {p.node} does not exist")
        n = tree.nodes[p.node]
        check(n.pages[p.lc] == p.serial, f"page {p.serial}: block {p.node} does not hold it")
        if not n.attached:
            check(p.locks + p.holds > 0, f"page {p.serial}: orphan block {p.node} page without a user")


def _check_tree_links(mgr: Any, nid: int, n: Node, refs: dict[int, int]) -> None:
    """Tree links and pruning (sec. 5): references, pages linked back, children and their
    index, roots, and no prunable block left attached."""
    check = mgr.check
    tree = mgr.tree
    check(n.refs == refs.get(nid, 0), f"block {nid}: {n.refs} refs, {refs.get(nid, 0)} requests")
    for lc, h in enumerate(n.pages):
        if h != NO_PAGE:
            check(h in mgr.pages and mgr.pages[h].node == nid, f"block {nid}: page {h} of lc {lc} not linked back")
            check(n.coverage[lc] > 0, f"block {nid}: page with zero coverage")
        else:
            check(n.coverage[lc] == 0, f"block {nid}: coverage without a page")
    for k, c in n.children.items():
        check(k == c.key and c.parent is n, f"block {nid}: child {c.id} link broken")
        check(len(n.tokens) == mgr.B or n.is_root, f"block {nid}: a partial block has children")
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
