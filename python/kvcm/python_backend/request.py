"""One request's cache: the life cycle of SPEC sec. 7 and orphan re-attachment (sec. 5).

C++ twin: ``cpp/core/request.{h,cpp}`` (class ``Request``, holding its ``BlockPool&``).  A
``Request`` holds one request's state (its tokens, block references and page tables) and
changes everything else through the ``BlockPool`` surface (``block_pool.py``): it never
touches the manager's registries.  The manager (``manager.py``) creates and registers
requests; the two registry steps a request's own calls need (a fork's id and serial, the
unregistering at close) go through its ``Owner``.  The single calls are ``check_x``
(raises, changes nothing) then ``x_checked`` (the work), so ``batch.py`` can check a whole
batch first.
"""

from __future__ import annotations

import sys
from array import array
from collections.abc import MutableSequence, Sequence
from typing import TYPE_CHECKING, Any, Protocol

from kvcm.api import (
    GPU,
    KVCache,
    ReuseScope,
    Status,
    Token,
    as_int,
)
from kvcm.checks import (
    MAX_REQUEST_BLOCKS,
    check_cache_id,
    check_count,
    check_tokens,
    closed_error,
    fork_history_error,
    fork_room_error,
    input_room_error,
    int32_view,
    status_error,
    stopped_error,
)
from kvcm.keys import block_key, chain_keys, chain_keys_packed, scope_root_key
from kvcm.python_backend.block_pool import NO_NODE, NO_PAGE, BlockPool, Page
from kvcm.python_backend.locking import serialized

if TYPE_CHECKING:
    import threading


def _int_array(packed: bytes) -> array:
    """The int tokens of ``packed`` (4-byte little-endian ints) as an array."""
    out = array("I", packed)
    if sys.byteorder == "big":
        out.byteswap()
    return out


class Owner(Protocol):
    """What a request asks of the manager that registered it: the lock its public calls
    take (SPEC sec. 10) and the registries' part of ``fork`` and ``close`` (ids, serials and
    the open requests are the manager's; pages, tree and clock are the pool's)."""

    lock: threading.RLock

    def fork_request(self, parent: Request, cache_id: int | str | None) -> Request:
        """``parent.fork(cache_id)`` once the id is valid: the id's check, ``check_fork``,
        a new serial, ``fork_checked``, and the child registered."""
        ...

    def forget_request(self, r: Request) -> None:
        """``r`` closed: it leaves the registries."""
        ...


class Request(KVCache):
    """One request's cache (``kvcm.api.KVCache``): its tokens, block references and page
    tables; it changes pages, the tree, copy ops, events and stats through its ``pool``."""

    def __init__(self, pool: BlockPool, owner: Owner, serial: int, cache_id: int | str, tokens: list,
                 packed: bytes | None, scope: ReuseScope, priority: int,
                 hits: set[tuple[bytes, int]] | None = None) -> None:
        B = pool.B
        self.pool = pool  # the pages, tree, clock, copy ops, events and stats it works on
        self.owner = owner  # the manager that registered it (fork, close)
        self.lock = owner.lock  # the manager lock (locking.serialized)
        self.serial = serial  # creation order in the manager
        self._id = cache_id
        self.scope = scope
        self._priority = priority
        self._status = Status.SUSPENDED
        self.stopped = False  # stop_committing() ran: no more commits
        self.root_key = scope_root_key(scope)
        # the root of the scope lives at least as long as this request (sec. 15: released
        # with its last child and its last request)
        self.root = pool.tree.root(self.root_key)
        pool.tree.ref(self.root)
        # the input's (and, sliced from it, the committed) tokens: an array of ints when all
        # are ints, a list otherwise.  An array is no container the cyclic GC walks: a
        # long prompt's token lists would be walked by every collection during its request
        self.input_tokens: MutableSequence[Token] = tokens if packed is None else _int_array(packed)
        # full-block keys of the input, hashed once and reused by commit for the same tokens
        nfull = len(tokens) // B
        if packed is not None:
            self.keys: list[bytes] = chain_keys_packed(self.root_key, packed, B, nfull * B)  # key per full block
        else:
            self.keys = chain_keys(self.root_key, tokens[: nfull * B], B)
        self.pages: dict[int, list[Page | None]] = {}
        self.live: Page | None = None  # the live ssm state
        self.snap: Page | None = None  # matched ssm snapshot, held until the first resume copies it
        self._reused = self.match_and_hold(self.input_tokens, self.keys, hits)
        pool.record_match(len(tokens), self._reused)

    def match_and_hold(self, tokens: MutableSequence[Token], keys: list[bytes],
                       hits: set[tuple[bytes, int]] | None = None) -> int:
        """SPEC sec. 7 create: match ``tokens`` and hold what the match found (the pages of
        the non-stale blocks, the snapshot at the match end), as a fresh SUSPENDED request
        (create, and the roll-back of ``forget_copies``); returns the match length.  With
        the store's ``hits`` the match may extend into the shared tier (DECISIONS.md "The
        shared tier"): taken only when longer, its blocks inserted with shared pages."""
        pool = self.pool
        B = pool.B
        m, _mbs, path, rows = pool.match_with_hits(self.root, tokens, keys, hits)  # (what probes report)
        if rows is not None:
            path = self._insert_shared_blocks(tokens, keys, m, path, rows)
        self.tokens: MutableSequence[Token] = tokens[:m]  # committed tokens (input_tokens' kind)
        self._capacity = m
        self.history = m
        # blocks[i]: tree node this request references for ordinal i (-1: none)
        self.blocks: list[int] = list(path)
        for nid in path:
            pool.tree.ref(nid)
        # pages[lc][i]: page used for block i of attention lc (None: none/stale)
        self.pages = {lc: [None] * len(path) for lc in pool.attn_lcs}
        for lc in pool.attn_lcs:
            lo, hi = pool.stale_range(lc, m)
            for j, nid in enumerate(path):
                if lo <= j < hi:
                    continue
                page = pool.pages[pool.tree.page(nid, lc)]
                pool.use(page, False, self._priority)
                self.pages[lc][j] = page
        self.live = None
        self.snap = None
        if pool.ssm_lc is not None and m > 0:
            nid = path[-1]
            self.snap = pool.pages[pool.tree.page(nid, pool.ssm_lc)]
            pool.use(self.snap, False, self._priority)
        # the block a partial match ends in: copied to private pages on first resume
        self.cow_block = m // B if m % B else -1
        return m

    def _insert_shared_blocks(self, tokens: list, keys: list[bytes], m: int, tree_path: list[int],
                              rows: list[list[int]]) -> list[int]:
        """DECISIONS.md "The shared tier": the extension's blocks below ``ceil(m / B)`` enter
        the tree at once, with a shared page (tier 3, slot -1) for exactly the pages this
        request will hold: attention pages of blocks non-stale at ``m``, and the ssm
        snapshot of the block ``m`` ends in.  Returns the match path (tree path + new blocks)."""
        pool = self.pool
        tree = pool.tree
        B = pool.B
        nb = -(-m // B)
        path = list(tree_path[:nb])
        parent = path[-1] if path else self.root
        for i in range(len(tree_path), nb):
            row = rows[i - len(tree_path)]
            nid = tree.new_block(keys[i], tokens[i * B:(i + 1) * B], i)
            for lc, life in enumerate(pool.lcs):
                if life.kind == "ssm":
                    held = i == nb - 1
                else:
                    lo, hi = life.stale_range(m, B)
                    held = not lo <= i < hi
                if not held:
                    continue
                assert row[lc] == B, "kvcm bug: the fixed point kept a block without its page"
                page = pool.new_shared_page(lc, self._priority, i)
                tree.set_page(nid, lc, page.serial, B)
                page.node = nid
            self._attach(parent, nid)
            path.append(nid)
            parent = nid
        return path

    def rollback_point(self, lost: set[int]) -> int | None:
        """SPEC sec. 15: where this request rolls back to when the pages ``lost`` (serials) are forgotten:
        the start of the first block whose page it uses is lost; its committed length when
        the live ssm state or the matched snapshot is lost (the re-match then finds an
        earlier snapshot).  None: it uses no lost page."""
        B = self.pool.B
        point = None
        for lc in self.pool.attn_lcs:
            for i, p in enumerate(self.pages[lc]):
                if p is not None and p.serial in lost:
                    point = i * B if point is None else min(point, i * B)
                    break
        for p in (self.snap, self.live):
            if p is not None and p.serial in lost:
                point = len(self.tokens) if point is None else point
        return None if point is None else min(point, len(self.tokens))

    def roll_back(self, point: int) -> None:
        """SPEC sec. 15 ``forget_copies``: release everything, then match ``tokens[:point]`` again and
        hold it as a SUSPENDED request (DECISIONS.md "Failed copies")."""
        pool = self.pool
        self._release_all()
        self._status = Status.SUSPENDED
        self.stopped = False
        tokens = self.tokens[:point]
        keys = chain_keys(self.root_key, tokens[: len(tokens) // pool.B * pool.B], pool.B)
        self.match_and_hold(tokens, keys)

    # ------------------------------------------------------------------ properties

    @property
    def id(self) -> int | str:
        return self._id

    @property
    def status(self) -> Status:
        return self._status

    @property
    def capacity(self) -> int:
        return self._capacity

    @property
    def history_length(self) -> int:
        return self.history

    @property
    def num_committed_tokens(self) -> int:
        return len(self.tokens)

    @property
    def committed_tokens(self) -> list[Token]:
        return list(self.tokens)

    @property
    def num_reused_tokens(self) -> int:
        return self._reused

    @property
    def priority(self) -> int:
        return self._priority

    # ------------------------------------------------------------------ life cycle

    @serialized
    def resume(self) -> bool:
        """SPEC sec. 7 resume: every used page LOCKED on gpu, all or nothing."""
        self._require(Status.SUSPENDED, "resume")
        pool = self.pool
        used = self.used_pages()
        cow_sources = self.cow_sources()
        need = dict.fromkeys(range(len(pool.lcs)), 0)  # gpu slots to allocate per lc
        locked_after = {lc: pool.pools[GPU][lc].locked for lc in range(len(pool.lcs))}
        held_gpu = {lc: pool.pools[GPU][lc].held for lc in range(len(pool.lcs))}
        for p in used:
            if p.tier != GPU:
                need[p.lc] += 1
            elif p.locks == 0:
                held_gpu[p.lc] -= 1  # about to be LOCKED: no longer a victim
            if p.locks == 0 and p not in cow_sources:
                locked_after[p.lc] += 1
        if pool.ssm_lc is not None and self.live is None:
            need[pool.ssm_lc] += 1
            locked_after[pool.ssm_lc] += 1
        for p in cow_sources:
            if p.lc != pool.ssm_lc:
                need[p.lc] += 1  # the private copy
                locked_after[p.lc] += 1
        limit = pool.config.max_util_for_resume
        for lc in range(len(pool.lcs)):
            gpu = pool.pools[GPU][lc]
            if locked_after[lc] > limit * gpu.total:
                return False
            if not pool.can_allocate(GPU, lc, need[lc], (gpu.nfree, held_gpu[lc], gpu.droppable)):
                return False

        pool.tick()
        self._status = Status.ACTIVE
        for p in used:
            if p.tier == GPU:
                pool.set_active(p, True)
        for p in used:
            if p.tier != GPU:
                self._ensure_room(GPU, p.lc)
                pool.move(p, GPU, "onboard")
                pool.set_active(p, True)
        if pool.ssm_lc is not None and self.live is None:
            self.live = self._alloc_private(pool.ssm_lc, 0, len(self.tokens) // pool.B)
        if self.cow_block >= 0 or self.snap is not None:
            self._copy_on_write()
        return True

    @serialized
    def suspend(self) -> None:
        """SPEC sec. 7 suspend: LOCKED -> HELD."""
        self._require(Status.ACTIVE, "suspend")
        self.pool.tick()
        for p in self.used_pages():
            self.pool.set_active(p, False)
        self._status = Status.SUSPENDED

    @serialized
    def resize(self, capacity: int, history_length: int | None = None) -> bool:
        return self.resize_checked(*self.check_resize(capacity, history_length))

    def check_resize(self, capacity: Any, history_length: Any) -> tuple[int, int]:
        """SPEC sec. 7 / 10: every check of ``resize`` (changing nothing): the validated (capacity, history).
        Shared with ``resize_batch``, which runs it for the whole batch first."""
        self._require(Status.ACTIVE, "resize")
        capacity = check_count(capacity, "capacity")
        history = self.history if history_length is None else check_count(history_length, "history_length")
        if capacity < len(self.tokens):
            raise ValueError(f"capacity {capacity} is below the {len(self.tokens)} committed tokens")
        if history < self.history:
            raise ValueError(f"history_length {history} is below the current history {self.history}")
        if history > capacity:
            raise ValueError(f"capacity {capacity} is below history_length {history}")
        return capacity, history

    def resize_checked(self, capacity: int, history: int) -> bool:
        """SPEC sec. 7 resize with arguments :meth:`check_resize` accepted (under the manager
        lock): allocate pages for new non-stale blocks, free those beyond the capacity,
        release those that became stale; all or nothing."""
        pool = self.pool
        B = pool.B
        nb = -(-capacity // B)
        # forks (DECISIONS.md "Forks"): room to write into a shared partial page copies it first
        cows = self._shared_tail(history) if capacity > len(self.tokens) else []
        if not cows and pool.full_attention_only and all(len(self.pages[lc]) == nb for lc in pool.attn_lcs):
            # a decode step inside the last block: nothing is stale, nothing to allocate or
            # release, and the pages held already fit (what the general path finds, at once)
            pool.tick()
            self._capacity = capacity
            self.history = history
            return True
        if not self._could_hold(nb, history):
            return False
        releases: list[tuple[int, int]] = []  # (lc, ordinal)
        allocs: list[tuple[int, range]] = []  # (lc, ordinals): a prompt's are one range
        # Only the ordinals whose page changes are visited, so a decode step costs the same
        # on any length: below the table's end ``n`` a block has a page exactly when it is
        # not stale at the current history (observe.py checks it), so pages are released
        # where blocks become stale ([old_hi, hi)) or fall beyond the capacity (>= nb), and
        # allocated past ``n`` outside the new stale range.  Ascending per lc, as a scan.
        for lc in pool.attn_lcs:
            life = pool.lcs[lc]
            lo, hi = life.stale_range(history, B)
            old_hi = life.stale_range(self.history, B)[1]
            pages = self.pages[lc]
            n = len(pages)
            for i in (*range(nb, min(lo, n)), *range(old_hi, min(hi, n)), *range(max(old_hi, nb, min(hi, n)), n)):
                if pages[i] is not None:
                    releases.append((lc, i))
            allocs.extend((lc, r) for r in (range(n, min(lo, nb)), range(max(hi, n), nb)) if r)
        # feasibility from counters, with the releases applied (DECISIONS.md)
        for lc in pool.attn_lcs:
            n = sum(len(r) for a, r in allocs if a == lc) + sum(1 for a, _p in cows if a == lc)
            if not n:
                continue
            gpu = pool.pools[GPU][lc]
            free, held, droppable = gpu.nfree, gpu.held, gpu.droppable
            for rlc, i in releases:
                p = self.pages[rlc][i]
                if rlc != lc or p.locks != 1:
                    continue
                if p.node == NO_NODE or not pool.tree.is_attached(p.node):
                    free += 1 if p.holds == 0 else 0
                    held += 1 if p.holds else 0
                elif p.holds:
                    held += 1
                else:
                    droppable += 1
            if not pool.can_allocate(GPU, lc, n, (free, held, droppable)):
                return False

        pool.tick()
        self._capacity = capacity
        self.history = history
        for lc, i in releases:
            page = self.pages[lc][i]
            self.pages[lc][i] = None
            pool.unuse(page, True)
        for lc in pool.attn_lcs:
            pages = self.pages[lc]
            del pages[nb:]
            pages.extend([None] * (nb - len(pages)))
        self._copy_tail(cows)
        for lc, ordinals in allocs:
            for i in ordinals:
                self.pages[lc][i] = self._alloc_private(lc, 0, i)
        return True

    def _could_hold(self, nb: int, history: int) -> bool:
        """O(1) refusal of a resize the pools could never hold (sec. 7: out of pages ->
        False): per attention lc, the non-stale blocks below ``nb`` need a gpu page each
        (windowed: sink + window blocks; ssm needs none per block), which cannot exceed the
        lc's gpu pool; and the page table is bounded by MAX_REQUEST_BLOCKS.  Exactly the
        cases the full feasibility check would refuse too, except the table bound."""
        pool = self.pool
        if not pool.attn_lcs:
            return True
        if nb > MAX_REQUEST_BLOCKS:
            return False
        for lc in pool.attn_lcs:
            lo, hi = pool.stale_range(lc, history)
            if nb - max(0, min(hi, nb) - min(lo, nb)) > pool.pools[GPU][lc].total:
                return False
        return True

    @serialized
    def commit(self, tokens: Sequence[Token]) -> None:
        """SPEC sec. 7 commit (checks first, sec. 10: a failed call changes nothing)."""
        # the tokens first: any Python code they run (tolist, __iter__) runs before the
        # status is looked at, so it cannot slip a commit past a suspend or close
        toks = check_tokens(tokens)
        self.check_commit(len(toks))
        self.commit_checked(toks)

    @serialized
    def commit_input(self, n: int | None = None) -> None:
        """SPEC sec. 7 commit of the next ``n`` input tokens (all the rest: None), handed over
        at create (DECISIONS.md "commit_input"): ``n`` first, then commit's checks, then the
        input's room; a failed call changes nothing."""
        if n is not None:
            n = check_count(n, "n")
        nc = len(self.tokens) if self._status != Status.CLOSED else 0
        avail = max(0, len(self.input_tokens) - nc)
        k = avail if n is None else n
        self.check_commit(k, "commit_input")
        if k > avail:
            raise input_room_error(k, len(self.input_tokens), nc)
        self.commit_checked(self.input_tokens[nc:nc + k])

    def check_commit(self, n: int, what: str = "commit") -> None:
        """Every check of a ``commit`` of ``n`` tokens, changing nothing (shared with
        ``commit_batch``): the status, then the room (sec. 7: committed + n <= capacity)."""
        self._require(Status.ACTIVE, what)
        if self.stopped:
            raise stopped_error()
        if len(self.tokens) + n > self._capacity:
            raise ValueError(
                f"commit of {n} tokens exceeds capacity {self._capacity} ({len(self.tokens)} committed)")

    def commit_checked(self, toks: list[Token]) -> None:
        """SPEC sec. 7 commit of tokens :meth:`check_commit` accepted (under the manager lock):
        each block that becomes full goes into the tree, a snapshot where the commit ends on
        a block boundary."""
        if not toks:
            return
        pool = self.pool
        B = pool.B
        pool.tick()
        old = len(self.tokens)
        old_history = self.history
        try:
            self.tokens.extend(toks)
        except TypeError:  # a digest token into an int array: the committed tokens become a list
            del self.tokens[old:]  # (what array.extend appended before it failed)
            self.tokens = [*self.tokens, *toks]
        new = len(self.tokens)
        self.history = max(self.history, new)
        full = new // B
        for lc in pool.attn_lcs:  # written tokens cover more of their private pages
            pages = self.pages[lc]
            for i in range(old // B, min(-(-new // B), len(pages))):
                p = pages[i]
                if p is not None and p.node == NO_NODE:
                    p.coverage = B if i < full else new - i * B
        last = new // B - 1
        for i in range(old // B, last + 1):
            snapshot = pool.ssm_lc is not None and i == last and new % B == 0
            self._insert_block(i, self.tokens[i * B:(i + 1) * B], snapshot, defer_prune=i < last)
        self._release_stale(old_history, old // B)

    def _release_stale(self, old_history: int, first_block: int) -> None:
        """SPEC sec. 7: blocks that slid out of a window stop being used at once (they stay in the tree).
        Ordinals stale at ``old_history`` hold no page already, except those this commit
        wrote (from ``first_block`` on): the scan starts there, so a decode step's cost does
        not grow with the request's length."""
        pool = self.pool
        if pool.full_attention_only:  # no block is ever stale
            return
        active = self._status == Status.ACTIVE
        for lc in pool.attn_lcs:
            life = pool.lcs[lc]
            lo, hi = life.stale_range(self.history, pool.B)
            start = max(lo, min(life.stale_range(old_history, pool.B)[1], first_block))
            pages = self.pages[lc]
            for i in range(start, min(hi, len(pages))):
                if pages[i] is not None:
                    page, pages[i] = pages[i], None
                    pool.unuse(page, active)

    @serialized
    def stop_committing(self) -> None:
        """SPEC sec. 7 stop_committing: the partial tail goes into the tree."""
        self._require_open("stop_committing")
        if self.stopped:
            return
        self.pool.tick()
        self._stop()

    @serialized
    def close(self) -> None:
        """SPEC sec. 7 close: stop_committing, then release everything; idempotent."""
        if self._status == Status.CLOSED:
            return
        pool = self.pool
        pool.tick()
        if not self.stopped:
            self._stop()
        self._release_all()
        pool.tree.unref(self.root)  # may release an unused scope root
        self._status = Status.CLOSED
        self.owner.forget_request(self)

    # ------------------------------------------------------------------ forks (issue 22)

    @serialized
    def fork(self, id: int | str | None = None) -> Request:
        """SPEC sec. 18 fork (DECISIONS.md "Forks (issue 22)"): checks first (a failed call
        changes nothing), then a new ACTIVE cache sharing this one's committed pages.  The
        manager checks the id, gives the serial and registers the child (``Owner``)."""
        self._require_open("fork")
        return self.owner.fork_request(self, check_cache_id(id))

    def check_fork(self) -> list[tuple[int, Page]]:
        """Fork's checks past the id's, changing nothing: ACTIVE, history at the committed
        tokens, room for the copies; returns the tail pages the fork copies at once."""
        pool = self.pool
        self._require(Status.ACTIVE, "fork")
        if self.history != len(self.tokens):
            raise fork_history_error(self.history, len(self.tokens))
        # the partial block is copied at once when this cache may already be writing into
        # it (room beyond its committed tokens); else it is shared until a resize
        copies = self._tail_pages() if self._capacity > len(self.tokens) else []
        for lc in range(len(pool.lcs)):
            need = sum(1 for clc, _p in copies if clc == lc) + (1 if lc == pool.ssm_lc else 0)
            if need and not pool.can_allocate(GPU, lc, need):
                raise fork_room_error()
        return copies

    def fork_checked(self, serial: int, cache_id: int | str, copies: list[tuple[int, Page]]) -> Request:
        """Fork's work once :meth:`check_fork` returned ``copies`` (the manager gave
        ``serial`` and ``cache_id``): the child, using this one's pages, with its own live
        ssm state and its copies of the shared tail."""
        pool = self.pool
        child = Request.__new__(Request)
        child._init_fork(self, serial, cache_id)
        if pool.ssm_lc is not None:  # its own live state, a copy of this one's
            child.live = child._alloc_private(pool.ssm_lc, 0, len(child.tokens) // pool.B)
            pool.copy(pool.ssm_lc, self.live, child.live, "cow")
            pool.count(pool.ssm_lc, "cows")
        child._copy_tail(copies)
        return child

    def _init_fork(self, parent: Request, serial: int, cache_id: int | str) -> None:
        """The fork's fields (its ``__init__``): the parent's committed tokens, input and
        keys; ACTIVE, using every page and block the parent uses below ``ceil(c / B)``."""
        pool = parent.pool
        self.pool = pool
        self.owner = parent.owner
        self.lock = parent.lock
        self.serial = serial
        self._id = cache_id
        self.scope = parent.scope
        self._priority = parent._priority
        self._status = Status.ACTIVE
        self.stopped = False
        self.root_key = parent.root_key
        self.root = parent.root
        pool.tree.ref(self.root)
        # never changed after create: shared with the parent
        self.input_tokens = parent.input_tokens
        self.keys = parent.keys
        self.tokens = parent.tokens[:]
        self._capacity = self.history = len(self.tokens)
        self._reused = parent._reused
        nb = -(-len(self.tokens) // pool.B)
        self.blocks = list(parent.blocks[:nb])
        for nid in self.blocks:
            if nid != NO_NODE:
                pool.tree.ref(nid)
        self.pages = {}
        for lc in pool.attn_lcs:
            pages = parent.pages[lc][:nb]
            for p in pages:
                if p is not None:
                    pool.use(p, True, self._priority)
            self.pages[lc] = pages
        self.live = None
        self.snap = None
        self.cow_block = -1

    def _tail_pages(self) -> list[tuple[int, Page]]:
        """(lc, page) of the partial block this cache writes into next (none when its
        committed tokens end on a block boundary)."""
        B = self.pool.B
        j = len(self.tokens) // B
        if len(self.tokens) % B == 0:
            return []
        return [(lc, self.pages[lc][j]) for lc in self.pool.attn_lcs
                if j < len(self.pages[lc]) and self.pages[lc][j] is not None]

    def _shared_tail(self, history: int) -> list[tuple[int, Page]]:
        """DECISIONS.md "Forks": the pages of the partial block this cache is about to
        write into (a resize beyond its committed tokens, to ``history``) that are not its
        own alone: a tree page, or a private page another cache uses too (a fork's).
        None without forks: a cache's partial page is its own after its first resume."""
        if self.stopped:
            return []  # it never writes again
        out = []
        j = len(self.tokens) // self.pool.B
        for lc, p in self._tail_pages():
            lo, hi = self.pool.stale_range(lc, history)
            if not lo <= j < hi and (p.node != NO_NODE or p.locks + p.holds > 1):
                out.append((lc, p))
        return out

    def _copy_tail(self, shared: list[tuple[int, Page]]) -> None:
        """Copy-on-write of the partial block's ``shared`` pages into private ones (a
        ``cow`` op each); this cache stops using the originals and its tree block there."""
        if not shared:
            return
        pool = self.pool
        j = len(self.tokens) // pool.B
        covered = len(self.tokens) - j * pool.B
        for lc, src in shared:
            dst = self._alloc_private(lc, covered, j)
            pool.copy(lc, src, dst, "cow")
            pool.count(lc, "cows")
            pool.unuse(src, self._status == Status.ACTIVE)
            self.pages[lc][j] = dst
        if j < len(self.blocks) and self.blocks[j] != NO_NODE:
            pool.tree.unref(self.blocks[j])
            self.blocks[j] = NO_NODE

    @serialized
    def page_indices(self, lc: int) -> list[int]:
        """SPEC sec. 7: gpu slot per block ordinal, -1 for stale or absent; ssm: the live slot."""
        self._require(Status.ACTIVE, "page_indices")
        lc = self._check_lc(lc)
        if lc == self.pool.ssm_lc:
            return [self.live.slot]
        nb = -(-self._capacity // self.pool.B)
        pages = self.pages[lc]
        return [pages[i].slot if i < len(pages) and pages[i] is not None else -1 for i in range(nb)]

    @serialized
    def page_indices_into(self, lc: int, out: Any) -> int:
        """SPEC sec. 7: the zero-copy variant of page_indices (a caller's int32 buffer)."""
        self._require(Status.ACTIVE, "page_indices_into")
        lc = self._check_lc(lc)
        view = int32_view(out)
        values = self.page_indices(lc)
        if len(values) > len(view):
            raise ValueError(f"buffer holds {len(view)} int32 values, {len(values)} needed")
        for i, v in enumerate(values):
            view[i] = v
        return len(values)

    # ------------------------------------------------------------------ helpers

    def _require_open(self, what: str) -> None:
        if self._status == Status.CLOSED:
            raise closed_error(what)

    def _require(self, status: Status, what: str) -> None:
        self._require_open(what)
        if self._status != status:
            raise status_error(what, status, self._status)

    def _check_lc(self, lc: Any) -> int:
        value = as_int(lc)
        if value is None:
            raise TypeError(f"lc must be an int, got {type(lc).__name__}")
        if not 0 <= value < len(self.pool.lcs):
            raise ValueError(f"unknown life cycle {value}; this model has {len(self.pool.lcs)}")
        return value

    def _release_all(self) -> None:
        """Stop using every page and tree block (close, and the roll-back of forget_copies)."""
        pool = self.pool
        active = self._status == Status.ACTIVE
        for p in self.used_pages():
            pool.unuse(p, active)
        self.live = self.snap = None
        for lc in pool.attn_lcs:
            self.pages[lc] = []
        for nid in self.blocks:
            if nid != NO_NODE:
                pool.tree.unref(nid)
        self.blocks = []

    def used_pages(self) -> list[Page]:
        """Every page this request uses, in the canonical order (lc, ordinal; snap; live)."""
        out = [p for lc in self.pool.attn_lcs for p in self.pages[lc] if p is not None]
        if self.snap is not None:
            out.append(self.snap)
        if self.live is not None:
            out.append(self.live)
        return out

    def cow_sources(self) -> list[Page]:
        """The pages the first resume copies (sec. 7 copy-on-write): the block a match ends
        inside, and the matched ssm snapshot."""
        out: list[Page] = []
        if self.cow_block >= 0:
            for lc in self.pool.attn_lcs:
                pages = self.pages[lc]
                if self.cow_block < len(pages) and pages[self.cow_block] is not None:
                    out.append(pages[self.cow_block])
        if self.snap is not None:
            out.append(self.snap)
        return out

    def _ensure_room(self, tier: int, lc: int) -> None:
        """make_room where a feasibility check already promised the slot."""
        if not self.pool.make_room(tier, lc):
            raise AssertionError("kvcm bug: a feasibility check passed but eviction found no slot")

    def _alloc_private(self, lc: int, coverage: int, ordinal: int) -> Page:
        """A new gpu page private to this request, in its state (LOCKED or HELD)."""
        pool = self.pool
        if not pool.pools[GPU][lc].free_slots:  # (make_room's own first test, without the call)
            self._ensure_room(GPU, lc)
        page = pool.new_page(GPU, lc, coverage, self._priority, ordinal)
        pool.use(page, self._status == Status.ACTIVE, self._priority)
        return page

    def _copy_on_write(self) -> None:
        """SPEC sec. 7: first resume after a match ending inside a block or at a snapshot."""
        pool = self.pool
        j = self.cow_block
        if j >= 0:
            covered = len(self.tokens) - j * pool.B
            for lc in pool.attn_lcs:
                src = self.pages[lc][j] if j < len(self.pages[lc]) else None
                if src is None:
                    continue
                dst = self._alloc_private(lc, covered, j)
                pool.copy(lc, src, dst, "cow")
                pool.count(lc, "cows")
                self.pages[lc][j] = dst
                pool.unuse(src, True)
            pool.tree.unref(self.blocks[j])
            self.blocks[j] = NO_NODE
            self.cow_block = -1
        if self.snap is not None:
            pool.copy(pool.ssm_lc, self.snap, self.live, "cow")
            pool.count(pool.ssm_lc, "cows")
            pool.unuse(self.snap, True)
            self.snap = None

    def _key_for(self, i: int, tokens: list) -> bytes:
        """SPEC sec. 3: key of block ``i`` holding ``tokens`` (input keys are reused when they apply)."""
        B = self.pool.B
        parent = self.pool.tree.key(self.blocks[i - 1]) if i > 0 else self.root_key
        if (len(tokens) == B and i < len(self.keys) and (i == 0 or self.keys[i - 1] == parent)
                and self.input_tokens[i * B:(i + 1) * B] == tokens):
            return self.keys[i]  # same parent key and tokens: the hash done at create
        return block_key(parent, tokens)

    def _parent_for(self, i: int) -> int:
        """The attached node to insert block ``i`` under, re-attaching this request's
        orphaned chain first (sec. 5: the bug this project exists to get right)."""
        if i == 0:
            return self.root
        tree = self.pool.tree
        if tree.is_attached(self.blocks[i - 1]):
            return self.blocks[i - 1]
        k = i - 1
        while k >= 0 and not tree.is_attached(self.blocks[k]):
            k -= 1
        parent = self.root if k < 0 else self.blocks[k]
        for j in range(k + 1, i):
            orphan = self.blocks[j]
            node = tree.nodes[orphan]
            existing = tree.find_existing(parent, node.key, node.tokens)
            if existing != NO_NODE:
                self._switch_block(j, orphan, existing)
            else:
                self._attach(parent, orphan)
            parent = self.blocks[j]
        return parent

    def _switch_block(self, j: int, orphan: int, existing: int) -> None:
        """SPEC sec. 5 re-attachment: another request inserted an equivalent block meanwhile: use it, moving this
        request's pages into it where they cover more."""
        pool = self.pool
        tree = pool.tree
        gained = []
        for lc in pool.attn_lcs:
            p = self.pages[lc][j] if j < len(self.pages[lc]) else None
            if p is None or p.node != orphan or tree.coverage(existing, lc) >= p.coverage:
                continue
            self._install(existing, lc, p, gained)
        tree.ref(existing)
        self.blocks[j] = existing
        tree.unref(orphan)
        pool.emit_stored(existing, gained)

    def _install(self, nid: int, lc: int, p: Page, gained: list[int]) -> None:
        """SPEC sec. 5: make ``p`` the page of block ``nid`` for ``lc`` (a slot keeps only the
        page with the largest coverage).  ``lc`` joins ``gained`` (the caller's ``stored``);
        a replaced page is first announced ``removed`` (DECISIONS.md "Tree and events")."""
        pool = self.pool
        tree = pool.tree
        if p.node != NO_NODE:  # moving from an orphan block
            old_node = p.node
            p.node = NO_NODE
            tree.set_page(old_node, lc, NO_PAGE, 0)
        old = tree.set_page(nid, lc, p.serial, p.coverage)
        if p.locks or p.holds:
            p.node = nid  # a used page: its state does not depend on the node
        else:
            pool.restate(p, node=nid)
        if old == NO_PAGE:
            gained.append(lc)
            return
        q = pool.pages[old]
        pool.restate(q, node=NO_NODE)
        pool.emit_removed(tree.key(nid), lc)  # a coverage upgrade: removed now, stored by the caller
        gained.append(lc)
        if q.locks == 0 and q.holds == 0:
            pool.free_page(q)

    def _attach(self, parent: int, nid: int) -> None:
        """SPEC sec. 5 attach: link block ``nid`` under ``parent`` and announce it: ``removed`` for every lc the
        detached partial siblings had (adopted pages included), then ``stored``."""
        pool = self.pool
        tree = pool.tree
        siblings = tree.attach(parent, nid)
        node = tree.nodes[nid]
        if not siblings:  # the common case: nothing detached, nothing swapped, only ``stored``
            pool.emit_stored(nid, [lc for lc, h in enumerate(node.pages) if h != NO_PAGE])
            return
        had: dict[int, set[int]] = {sid: set() for sid in siblings}
        for sid in siblings:  # page.node still names the owner from before the swap
            for lc, h in enumerate(tree.nodes[sid].pages):
                if h != NO_PAGE and pool.pages[h].node == sid:
                    had[sid].add(lc)
        for lc, h in enumerate(node.pages):
            if h != NO_PAGE and pool.pages[h].node in had:
                had[pool.pages[h].node].add(lc)
        for sid in siblings:
            for lc in sorted(had[sid]):
                pool.emit_removed(tree.nodes[sid].key, lc)
        for lc in range(len(pool.lcs)):
            if node.pages[lc] != NO_PAGE:
                pool.pages[node.pages[lc]].node = nid
            for sid in siblings:
                h = tree.nodes[sid].pages[lc]
                if h != NO_PAGE:
                    pool.pages[h].node = sid
        pool.retire_nodes(siblings, announce=False)
        pool.emit_stored(nid, [lc for lc in range(len(pool.lcs)) if node.pages[lc] != NO_PAGE])

    def _insert_block(self, i: int, tokens: list, want_snapshot: bool, defer_prune: bool = False) -> None:
        """Commit block ``i`` (full, or the partial tail) into the tree (sec. 5 and 7).

        ``defer_prune``: more blocks of this commit follow.  A new block without a page
        stays detached, and pruning its parent chain now would only have the next block
        re-attach the whole chain again (quadratic in the blocks of one pure-ssm commit):
        the chain stays attached until the commit's last block, whose insertion prunes (or
        keeps) it exactly as it would have been (DECISIONS.md)."""
        pool = self.pool
        tree = pool.tree
        ntok = len(tokens)
        key = self._key_for(i, tokens)
        parent = self._parent_for(i)
        existing = tree.find_existing(parent, key, tokens)
        snap: Page | None = None
        ssm = pool.ssm_lc
        # shared_write="commit": a full-coverage page of a full block that becomes a tree
        # page here is written to the shared tier (DECISIONS.md "The shared tier")
        store = pool.store_on_commit and ntok == pool.B
        if want_snapshot and (existing == NO_NODE or tree.coverage(existing, ssm) < ntok):
            if self.live is None or self.live.tier != GPU or not pool.make_room(GPU, ssm):
                pool.count(ssm, "snapshots_skipped")
            else:
                snap = pool.new_page(GPU, ssm, ntok, self._priority, i)
                pool.copy(ssm, self.live, snap, "snapshot")
                pool.count(ssm, "snapshots_taken")
                if store:
                    pool.store(snap, key)
                # eviction may have pruned this request's chain or the existing block
                parent = self._parent_for(i)
                existing = tree.find_existing(parent, key, tokens)
        if existing == NO_NODE:
            nid = tree.new_block(key, tokens, i)
            for lc in pool.attn_lcs:
                p = self.pages[lc][i] if i < len(self.pages[lc]) else None
                if p is not None:
                    if p.node != NO_NODE:
                        # forks: a shared partial page another user's stop_committing put
                        # into a block that was detached since (so not found): it moves here
                        # (DECISIONS.md "Forks", the tail block of a stop)
                        pool.unlink_from_node(p)
                    p.coverage = ntok
                    tree.set_page(nid, lc, p.serial, ntok)
                    p.node = nid  # a used page: its state does not depend on the node
                    if store:
                        pool.store(p, key)
            if snap is not None:
                tree.set_page(nid, ssm, snap.serial, ntok)
                pool.restate(snap, node=nid)
            tree.ref(nid)
            self._set_block(i, nid)
            if tree.nodes[nid].has_page():
                self._attach(parent, nid)
            elif not defer_prune:
                tree.prune_upward(parent)  # a re-attached chain must not stay childless
            return
        gained: list[int] = []
        active = self._status == Status.ACTIVE
        for lc in pool.attn_lcs:
            p = self.pages[lc][i] if i < len(self.pages[lc]) else None
            if p is None:
                continue
            p.coverage = ntok
            q_handle = tree.page(existing, lc)
            if q_handle == NO_PAGE or tree.coverage(existing, lc) < ntok:
                self._install(existing, lc, p, gained)
                if store:
                    pool.store(p, key)
            else:
                q = pool.pages[q_handle]
                if q.tier == GPU:  # switch to the tree's page; its index changes
                    pool.use(q, active, self._priority)
                    self.pages[lc][i] = q
                    pool.unuse(p, active)
                # else: keep our page privately (freed at close)
        if snap is not None:
            self._install(existing, ssm, snap, gained)
        tree.ref(existing)
        self._set_block(i, existing)
        pool.emit_stored(existing, gained)

    def _set_block(self, i: int, nid: int) -> None:
        """This request now references block ``nid`` for ordinal ``i`` (instead of any other)."""
        if i == len(self.blocks):  # the usual case: the next block
            self.blocks.append(nid)
        elif i < len(self.blocks):
            if self.blocks[i] != NO_NODE:
                self.pool.tree.unref(self.blocks[i])
            self.blocks[i] = nid
        else:
            self.blocks.extend([NO_NODE] * (i - len(self.blocks)))
            self.blocks.append(nid)

    def _stop(self) -> None:
        """SPEC sec. 7 stop_committing without the clock tick (close() reuses it)."""
        pool = self.pool
        B = pool.B
        self.stopped = True
        tail = len(self.tokens) % B
        i = len(self.tokens) // B
        if not tail or not pool.config.enable_partial_reuse or self.cow_block == i:
            return
        self._insert_block(i, self.tokens[i * B:], pool.ssm_lc is not None)


PyKVCache = Request  # the name before issue 21 (kvcm.python_backend.PyKVCache)
