"""One request's cache: the life cycle of SPEC sec. 7 and orphan re-attachment (sec. 5).

C++ twin: ``cpp/core/request.{h,cpp}`` (class ``Request``, holding its ``BlockPool&``).  A
``Request`` holds one request's state (its tokens, block references and page tables) and
changes everything else through the ``BlockPool`` and its parts (``block_pool.py``): it never
touches the manager's registries.  The manager (``manager.py``) creates and registers
requests; the two registry steps a request's own calls need (a fork's id and serial, the
unregistering at close) go through its ``Owner``.  The single calls are ``check_x``
(raises, changes nothing) then ``x_checked`` (the work), so ``batch.py`` can check a whole
batch first.
"""

from __future__ import annotations

import itertools
import sys
from array import array
from collections.abc import Iterable, MutableSequence, Sequence
from typing import TYPE_CHECKING, Any, Protocol

from kvcm.api import (
    GPU,
    KVCache,
    ReuseScope,
    Status,
    Token,
)
from kvcm.checks import (
    MAX_REQUEST_BLOCKS,
    check_block_range,
    check_cache_id,
    check_count,
    check_lc,
    check_tokens,
    closed_error,
    fork_history_error,
    fork_room_error,
    input_room_error,
    int32_view,
    status_error,
    stopped_error,
)
from kvcm.keys import chain_keys, chain_keys_packed, scope_root_key
from kvcm.python_backend.block_pool import NO_NODE, BlockPool, Chain, Page
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
    tables; it changes pages, the tree, copy ops, events and stats through its ``pool``.

    The seam (issue 30): a request reads the configuration's facts as one value
    (``pool.layout``) and changes shared state through a dozen members of the ``BlockPool``
    and its parts (``pool.tree_index.release``, ``pool.pages.budget``, ...); a page's fields
    are written by ``Pages`` alone (tests/house/test_seam.py)."""

    def __init__(self, pool: BlockPool, owner: Owner, serial: int, cache_id: int | str, tokens: list,
                 packed: bytes | None, scope: ReuseScope, priority: int,
                 hits: set[tuple[bytes, int]] | None = None) -> None:
        B = pool.layout.B
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
        self.root = pool.tree_index.open_scope(self.root_key)
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

    def match_and_hold(self, tokens: MutableSequence[Token], keys: list[bytes],
                       hits: set[tuple[bytes, int]] | None = None) -> int:
        """SPEC sec. 7 create: match ``tokens`` and hold what the match found (the pages of
        the non-stale blocks, the snapshot at the match end), as a fresh SUSPENDED request
        (create, and the roll-back of ``forget_copies``); returns the match length.  With
        the store's ``hits`` the match may extend into the shared tier (DECISIONS.md "The
        shared tier"): taken only when longer, its blocks inserted with shared pages."""
        held = self.pool.tree_index.hold_match(self.root, tokens, keys, hits, self._priority)
        m = held.m
        self.tokens: MutableSequence[Token] = tokens[:m]  # committed tokens (input_tokens' kind)
        self._capacity = m
        self.history = m
        self.blocks: list[int] = held.blocks  # blocks[i]: tree node referenced for ordinal i (-1: none)
        self.pages = held.pages  # pages[lc][i]: page used for block i of attention lc (None: none/stale)
        self.live = None
        self.snap = held.snap
        # the block a partial match ends in: copied to private pages on first resume
        B = self.pool.layout.B
        self.cow_block = m // B if m % B else -1
        return m

    def rollback_point(self, lost: set[int]) -> int | None:
        """SPEC sec. 15: where this request rolls back to when the pages ``lost`` (serials) are forgotten:
        the start of the first block whose page it uses is lost; its committed length when
        the live ssm state or the matched snapshot is lost (the re-match then finds an
        earlier snapshot).  None: it uses no lost page."""
        layout = self.pool.layout
        B = layout.B
        point = None
        for lc in layout.attn_lcs:
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
        B = self.pool.layout.B
        self._release_all()
        self._status = Status.SUSPENDED
        self.stopped = False
        tokens = self.tokens[:point]
        keys = chain_keys(self.root_key, tokens[: len(tokens) // B * B], B)
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
        layout = pool.layout
        nlc = len(layout.lcs)
        used = self.used_pages()
        cow_sources = self.cow_sources()
        budgets = [pool.pages.budget(lc) for lc in range(nlc)]
        need = dict.fromkeys(range(nlc), 0)  # gpu slots to allocate per lc
        locked_after = {lc: budgets[lc].locked for lc in range(nlc)}
        held_gpu = {lc: budgets[lc].held for lc in range(nlc)}
        for p in used:
            if p.tier != GPU:
                need[p.lc] += 1
            elif p.locks == 0:
                held_gpu[p.lc] -= 1  # about to be LOCKED: no longer a victim
            if p.locks == 0 and p not in cow_sources:
                locked_after[p.lc] += 1
        if layout.ssm_lc is not None and self.live is None:
            need[layout.ssm_lc] += 1
            locked_after[layout.ssm_lc] += 1
        for p in cow_sources:
            if p.lc != layout.ssm_lc:
                need[p.lc] += 1  # the private copy
                locked_after[p.lc] += 1
        for lc in range(nlc):
            b = budgets[lc]
            if locked_after[lc] > layout.max_util_for_resume * b.total:
                return False
            if not b._replace(held=held_gpu[lc]).fits(need[lc]):
                return False

        pool.tick()
        self._status = Status.ACTIVE
        for p in used:
            if p.tier == GPU:
                pool.set_active(p, True)
        for p in used:
            if p.tier != GPU:
                pool.set_active(p, True)  # onboarded first
        if layout.ssm_lc is not None and self.live is None:
            self.live = self._alloc_private(layout.ssm_lc, 0, len(self.tokens) // layout.B)
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
        layout = pool.layout
        B = layout.B
        nb = -(-capacity // B)
        # forks (DECISIONS.md "Forks"): room to write into a shared partial page copies it first
        cows = self._shared_tail(history) if capacity > len(self.tokens) else []
        if not cows and layout.full_attention_only and all(len(self.pages[lc]) == nb for lc in layout.attn_lcs):
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
        for lc in layout.attn_lcs:
            lo, hi = layout.stale_range(lc, history)
            old_hi = layout.stale_range(lc, self.history)[1]
            pages = self.pages[lc]
            n = len(pages)
            for i in (*range(nb, min(lo, n)), *range(old_hi, min(hi, n)), *range(max(old_hi, nb, min(hi, n)), n)):
                if pages[i] is not None:
                    releases.append((lc, i))
            allocs.extend((lc, r) for r in (range(n, min(lo, nb)), range(max(hi, n), nb)) if r)
        # feasibility from counters, with the releases applied (DECISIONS.md)
        released = [self.pages[lc][i] for lc, i in releases]
        for lc in layout.attn_lcs:
            n = sum(len(r) for a, r in allocs if a == lc) + sum(1 for a, _p in cows if a == lc)
            if n and not pool.pages.budget(lc, released).fits(n):
                return False

        pool.tick()
        self._capacity = capacity
        self.history = history
        for lc, i in releases:
            page = self.pages[lc][i]
            self.pages[lc][i] = None
            pool.tree_index.release(page, True)
        for lc in layout.attn_lcs:
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
        layout = pool.layout
        if not layout.attn_lcs:
            return True
        if nb > MAX_REQUEST_BLOCKS:
            return False
        for lc in layout.attn_lcs:
            lo, hi = layout.stale_range(lc, history)
            if nb - max(0, min(hi, nb) - min(lo, nb)) > pool.pages.budget(lc).total:
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
        layout = pool.layout
        B = layout.B
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
        for lc in layout.attn_lcs:  # written tokens cover more of their private pages
            pages = self.pages[lc]
            for i in range(old // B, min(-(-new // B), len(pages))):
                p = pages[i]
                if p is not None and p.node == NO_NODE:
                    pool.pages.set_coverage(p, B if i < full else new - i * B)
        last = new // B - 1
        for i in range(old // B, last + 1):
            snapshot = layout.ssm_lc is not None and i == last and new % B == 0
            self._insert_block(i, self.tokens[i * B:(i + 1) * B], snapshot, defer_prune=i < last)
        self._release_stale(old_history, old // B)

    def _release_stale(self, old_history: int, first_block: int) -> None:
        """SPEC sec. 7: blocks that slid out of a window stop being used at once (they stay in the tree).
        Ordinals stale at ``old_history`` hold no page already, except those this commit
        wrote (``[first_block, written)``): only those and the newly stale ones
        (``[old_hi, hi)``) are visited, ascending, so a commit's cost does not grow with
        the request's history (a long history behind a short commit: a window's decode)."""
        pool = self.pool
        layout = pool.layout
        if layout.full_attention_only:  # no block is ever stale
            return
        active = self._status == Status.ACTIVE
        written = -(-len(self.tokens) // layout.B)
        for lc in layout.attn_lcs:
            lo, hi = layout.stale_range(lc, self.history)
            pages = self.pages[lc]
            end = min(hi, len(pages))
            for i in _union(max(lo, first_block), min(written, end), max(lo, layout.stale_range(lc, old_history)[1]), end):
                if pages[i] is not None:
                    page, pages[i] = pages[i], None
                    pool.tree_index.release(page, active)

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
        pool.tree_index.unref(self.root)  # may release an unused scope root
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
        layout = pool.layout
        self._require(Status.ACTIVE, "fork")
        if self.history != len(self.tokens):
            raise fork_history_error(self.history, len(self.tokens))
        # the partial block is copied at once when this cache may already be writing into
        # it (room beyond its committed tokens); else it is shared until a resize
        copies = self._tail_pages() if self._capacity > len(self.tokens) else []
        for lc in range(len(layout.lcs)):
            need = sum(1 for clc, _p in copies if clc == lc) + (1 if lc == layout.ssm_lc else 0)
            if need and not pool.pages.budget(lc).fits(need):
                raise fork_room_error()
        return copies

    def fork_checked(self, serial: int, cache_id: int | str, copies: list[tuple[int, Page]]) -> Request:
        """Fork's work once :meth:`check_fork` returned ``copies`` (the manager gave
        ``serial`` and ``cache_id``): the child, using this one's pages, with its own live
        ssm state and its copies of the shared tail."""
        pool = self.pool
        ssm = pool.layout.ssm_lc
        child = Request.__new__(Request)
        child._init_fork(self, serial, cache_id)
        if ssm is not None:  # its own live state, a copy of this one's
            child.live = child._alloc_private(ssm, 0, len(child.tokens) // pool.layout.B)
            pool.outbox.copy(ssm, self.live, child.live, "cow")
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
        self.root = pool.tree_index.open_scope(self.root_key)  # (the parent's root: it holds it)
        # never changed after create: shared with the parent
        self.input_tokens = parent.input_tokens
        self.keys = parent.keys
        self.tokens = parent.tokens[:]
        self._capacity = self.history = len(self.tokens)
        self._reused = parent._reused
        nb = -(-len(self.tokens) // pool.layout.B)
        self.blocks = list(parent.blocks[:nb])
        self.pages = {lc: parent.pages[lc][:nb] for lc in pool.layout.attn_lcs}
        pool.tree_index.hold(self.blocks, self.pages, self._priority)
        self.live = None
        self.snap = None
        self.cow_block = -1

    def _tail_pages(self) -> list[tuple[int, Page]]:
        """(lc, page) of the partial block this cache writes into next (none when its
        committed tokens end on a block boundary)."""
        layout = self.pool.layout
        j = len(self.tokens) // layout.B
        if len(self.tokens) % layout.B == 0:
            return []
        return [(lc, self.pages[lc][j]) for lc in layout.attn_lcs
                if j < len(self.pages[lc]) and self.pages[lc][j] is not None]

    def _shared_tail(self, history: int) -> list[tuple[int, Page]]:
        """DECISIONS.md "Forks": the pages of the partial block this cache is about to
        write into (a resize beyond its committed tokens, to ``history``) that are not its
        own alone: a tree page, or a private page another cache uses too (a fork's).
        None without forks: a cache's partial page is its own after its first resume."""
        if self.stopped:
            return []  # it never writes again
        out = []
        layout = self.pool.layout
        j = len(self.tokens) // layout.B
        for lc, p in self._tail_pages():
            lo, hi = layout.stale_range(lc, history)
            if not lo <= j < hi and (p.node != NO_NODE or p.locks + p.holds > 1):
                out.append((lc, p))
        return out

    def _copy_tail(self, shared: list[tuple[int, Page]]) -> None:
        """Copy-on-write of the partial block's ``shared`` pages into private ones (a
        ``cow`` op each); this cache stops using the originals and its tree block there."""
        if not shared:
            return
        pool = self.pool
        B = pool.layout.B
        j = len(self.tokens) // B
        covered = len(self.tokens) - j * B
        for lc, src in shared:
            dst = self._alloc_private(lc, covered, j)
            pool.outbox.copy(lc, src, dst, "cow")
            pool.tree_index.release(src, self._status == Status.ACTIVE)
            self.pages[lc][j] = dst
        if j < len(self.blocks) and self.blocks[j] != NO_NODE:
            pool.tree_index.unref(self.blocks[j])
            self.blocks[j] = NO_NODE

    @serialized
    def page_indices(self, lc: int, start: int = 0, stop: int | None = None) -> list[int]:
        """SPEC sec. 7: gpu slot per block ordinal in ``[start, stop)``, -1 for stale or
        absent; ssm: the live slot (ordinal 0)."""
        self._require(Status.ACTIVE, "page_indices")
        lc = self._check_lc(lc)
        layout = self.pool.layout
        ssm = lc == layout.ssm_lc
        start, stop = check_block_range(start, stop, 1 if ssm else -(-self._capacity // layout.B))
        if ssm:
            return [self.live.slot][start:stop]
        pages = self.pages[lc]
        return [pages[i].slot if i < len(pages) and pages[i] is not None else -1 for i in range(start, stop)]

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
        return check_lc(lc, len(self.pool.layout.lcs))

    def _release_all(self) -> None:
        """Stop using every page and tree block (close, and the roll-back of forget_copies)."""
        pool = self.pool
        active = self._status == Status.ACTIVE
        for p in self.used_pages():
            pool.tree_index.release(p, active)
        self.live = self.snap = None
        for lc in pool.layout.attn_lcs:
            self.pages[lc] = []
        for nid in self.blocks:
            if nid != NO_NODE:
                pool.tree_index.unref(nid)
        self.blocks = []

    def used_pages(self) -> list[Page]:
        """Every page this request uses, in the canonical order (lc, ordinal; snap; live)."""
        out = [p for lc in self.pool.layout.attn_lcs for p in self.pages[lc] if p is not None]
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
            for lc in self.pool.layout.attn_lcs:
                pages = self.pages[lc]
                if self.cow_block < len(pages) and pages[self.cow_block] is not None:
                    out.append(pages[self.cow_block])
        if self.snap is not None:
            out.append(self.snap)
        return out

    def _alloc_private(self, lc: int, coverage: int, ordinal: int) -> Page:
        """A new gpu page private to this request, in its state (LOCKED or HELD)."""
        return self.pool.alloc(lc, coverage, ordinal, self._priority, self._status == Status.ACTIVE)

    def _copy_on_write(self) -> None:
        """SPEC sec. 7: first resume after a match ending inside a block or at a snapshot."""
        pool = self.pool
        layout = pool.layout
        j = self.cow_block
        if j >= 0:
            covered = len(self.tokens) - j * layout.B
            for lc in layout.attn_lcs:
                src = self.pages[lc][j] if j < len(self.pages[lc]) else None
                if src is None:
                    continue
                dst = self._alloc_private(lc, covered, j)
                pool.outbox.copy(lc, src, dst, "cow")
                self.pages[lc][j] = dst
                pool.tree_index.release(src, True)
            pool.tree_index.unref(self.blocks[j])
            self.blocks[j] = NO_NODE
            self.cow_block = -1
        if self.snap is not None:
            pool.outbox.copy(layout.ssm_lc, self.snap, self.live, "cow")
            pool.tree_index.release(self.snap, True)
            self.snap = None

    def _key_hint(self, i: int, tokens: Sequence[Token]) -> tuple[bytes | None, bytes] | None:
        """SPEC sec. 3: the key of block ``i`` hashed at create, when ``tokens`` are the input's
        tokens there, with the key it was chained from (None: the scope's root); the pool
        takes it when block ``i - 1`` still has that key (``BlockPool.insert_block``)."""
        B = self.pool.layout.B
        if len(tokens) == B and i < len(self.keys) and self.input_tokens[i * B:(i + 1) * B] == tokens:
            return (self.keys[i - 1] if i > 0 else None), self.keys[i]
        return None

    def _insert_block(self, i: int, tokens: Sequence[Token], want_snapshot: bool, defer_prune: bool = False) -> None:
        """Commit block ``i`` (full, or the partial tail) into the tree (sec. 5 and 7): the
        pool inserts it (``BlockPool.insert_block``: the orphaned chain re-attached, a
        snapshot where wanted, the pages moved in or switched); this request then
        references what the insertion gave it."""
        chain = Chain(self.root, self.blocks, self.pages, self.live, self._priority, self._status == Status.ACTIVE)
        done = self.pool.insert_block(chain, i, tokens, self._key_hint(i, tokens), want_snapshot, defer_prune)
        for j, nid in done.switched.items():
            self.blocks[j] = nid
        for lc, q in done.replaced:
            self.pages[lc][i] = q
        self._set_block(i, done.node)

    def _set_block(self, i: int, nid: int) -> None:
        """This request now references block ``nid`` for ordinal ``i`` (the pool moved the
        reference: ``Inserted``)."""
        if i == len(self.blocks):  # the usual case: the next block
            self.blocks.append(nid)
        elif i < len(self.blocks):
            self.blocks[i] = nid
        else:
            self.blocks.extend([NO_NODE] * (i - len(self.blocks)))
            self.blocks.append(nid)

    def _stop(self) -> None:
        """SPEC sec. 7 stop_committing without the clock tick (close() reuses it)."""
        layout = self.pool.layout
        B = layout.B
        self.stopped = True
        tail = len(self.tokens) % B
        i = len(self.tokens) // B
        if not tail or not layout.partial_reuse or self.cow_block == i:
            return
        self._insert_block(i, self.tokens[i * B:], layout.ssm_lc is not None)


def _union(a1: int, b1: int, a2: int, b2: int) -> Iterable[int]:
    """The integers of ``[a1, b1)`` and ``[a2, b2)``, ascending, each once."""
    if a1 >= b1:
        return range(a2, b2)
    if a2 >= b2:
        return range(a1, b1)
    if a1 > a2:
        a1, b1, a2, b2 = a2, b2, a1, b1
    if a2 <= b1:
        return range(a1, max(b1, b2))
    return itertools.chain(range(a1, b1), range(a2, b2))


PyKVCache = Request  # the name before issue 21 (kvcm.python_backend.PyKVCache)
