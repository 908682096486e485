// The block pool (SPEC sec. 4, 5, 8, 9): everything the requests share.  The pages (a slab
// addressed by handle), the pools [tier][lc] with their free slots, counters and eviction
// indexes, the radix tree with its token interning, the clock, the pending copy ops, the
// event buffer and the stats counters, with the config-derived facts they need.  Python
// twin: kvcm/python_backend/block_pool.py (BlockPool).
//
// A Request (request.h) works the shared state only through this class's public surface;
// the Manager (manager.h) owns one BlockPool and hands it to each Request.  The snapshot's
// and the invariant checks' views of the pool are BlockPool members defined in observe.cpp.
#pragma once

#include <algorithm>
#include <cstdint>
#include <deque>
#include <memory>
#include <memory_resource>
#include <span>
#include <string>
#include <type_traits>
#include <unordered_map>
#include <utility>
#include <vector>

#include "core/block_keys.h"
#include "core/fifo.h"
#include "core/layout.h"
#include "core/lifecycle.h"
#include "core/pools.h"
#include "core/tokens.h"
#include "core/tree.h"
#include "core/types.h"

namespace kvcm {

// ------------------------------------------------------------------ events
struct StoredBlockC {  // key and tokens are the event's (one block, several life cycles)
  std::int32_t lc = 0, tier = 0;
  std::int64_t priority = 0;
  std::int32_t coverage = 0;  // tokens of the block the page covers
};

enum class EventKind { stored, removed, tier_changed, cleared };

// One buffered event.  Trivially destructible on purpose: when the buffer is full the
// oldest event is dropped without touching its (cold) memory.  A stored event's variable
// parts — its block's tokens and its per-life-cycle blocks — sit in the pool's side
// queues, in event order.
struct EventC {
  EventKind kind = EventKind::cleared;
  bool has_parent = false;    // stored
  bool partial = false;       // stored
  std::uint32_t ntokens = 0;  // stored: tokens of the block
  std::uint32_t nblocks = 0;  // stored: life cycles announced
  std::int64_t id = 0;
  std::int64_t lc = 0, old_tier = 0, new_tier = 0;  // removed / tier_changed
  Digest key{};                                     // stored / removed / tier_changed
  Digest parent_key{};                              // stored
};
static_assert(std::is_trivially_destructible_v<EventC>);

// What take_events() hands out: the events, and the stored events' tokens and blocks,
// each concatenated in event order (event i's follow those of the stored events before it).
struct TakenEvents {
  std::vector<EventC> events;
  std::vector<TokenOut> tokens;
  std::vector<StoredBlockC> blocks;
};

// An op of the last drain_copy_ops not reported yet (forget_copies), or of an unsettled
// drain (settle_copies), with the page it was meant to fill.
struct IssuedOp {
  CopyOpC op;
  std::int64_t handle, serial;  // the page's handle and serial (-1, -1: a shared-tier store)
};

// The shared tier's extension of a create's match (DECISIONS.md "The shared tier"): computed
// by BlockPool::match_shared from the store's hits, installed by Request::match_and_hold.
struct SharedMatch {
  std::int64_t m = -1;                          // the extended match length (-1: no run)
  std::int64_t m_before_ssm = -1;               // the same fixed point without the ssm rule
  std::vector<NodeId> path;                     // the tree path [0, P)
  std::vector<std::vector<std::int64_t>> rows;  // coverage per lc of blocks P, P+1, ...
};

// The match a request created now takes (SPEC sec. 6, DECISIONS.md "The shared tier"):
// computed by BlockPool::match_with_hits, held by Request::match_and_hold, reported by
// Manager::probe.  Python twin: RequestMatch in block_pool.py.
struct RequestMatch {
  std::int64_t m = 0;
  std::int64_t m_before_ssm = 0;
  // the tree blocks of the match: the ceil(m / B) blocks of the ordinary match, or,
  // extended, the whole tree path [0, P) (the blocks past it are the extension's)
  std::vector<NodeId> path;
  std::vector<std::vector<std::int64_t>> rows;  // extended: coverage per lc of blocks P, P+1, ...
  bool extended = false;
};

// The store's answer to shared_candidates: (block key, lc) pairs, sorted and unique.
using SharedHits = std::vector<std::pair<Digest, std::int64_t>>;

// The gpu pool of one life cycle as a request's feasibility checks read it (SPEC sec. 8,
// DECISIONS.md "All-or-nothing resume / resize"; BlockPool::budget).  Python twin: Budget.
struct Budget {
  std::int64_t total = 0, free = 0, locked = 0, held = 0, droppable = 0;
  std::int64_t colder = 0;  // what the colder tiers could take of its HELD pages (0: no colder tier)
  // whether n new pages fit after eviction: free slots, DROPPABLE pages, and HELD pages a
  // colder tier can take
  bool fits(std::int64_t n) const noexcept { return free + droppable + std::min(held, colder) >= n; }
};

// What a request holds after BlockPool::hold_match (Python twin: HeldMatch): the match
// length, the blocks it references (ordinal order), its page handles per lc (attention
// lcs; -1: stale) and the ssm snapshot at the match end (-1: none).
struct HeldMatch {
  std::int64_t m = 0;
  std::vector<NodeId> blocks;
  std::vector<std::vector<std::int64_t>> pages;
  std::int64_t snap = -1;
};

// What BlockPool::insert_block reads of the request whose block it inserts; it changes
// none of it (the request applies the result, Inserted).  Python twin: Chain.
struct Chain {
  NodeId root;                                          // its scope's root
  const std::vector<NodeId>& blocks;                    // the tree block per ordinal (kNoNode: none)
  const std::vector<std::vector<std::int64_t>>& pages;  // its page handles per lc (-1: none)
  std::int64_t live;                                    // its live ssm state (-1: none)
  std::int64_t priority;
  bool active;  // ACTIVE (its pages LOCKED), else SUSPENDED (HELD)
};

// The key of a block hashed at create, with the key it was chained from (prev nullptr:
// the scope's root); BlockPool::insert_block takes it when the parent still has that key.
struct KeyHint {
  const Digest* prev = nullptr;
  const Digest* key = nullptr;  // nullptr: no hint
};

// BlockPool::insert_block's result (Python twin: Inserted): the block the request now
// references for the inserted ordinal, the ordinals of its orphaned chain re-attachment
// moved to an equivalent block, and its pages the insertion replaced by the tree's.
struct Inserted {
  NodeId node = kNoNode;
  std::unordered_map<std::int64_t, NodeId> switched;  // ordinal -> block
  std::vector<std::pair<std::int64_t, std::int64_t>> replaced;  // (lc, page handle)
};

class BlockPool {
 public:
  explicit BlockPool(ManagerConfig cfg);
  BlockPool(const BlockPool&) = delete;
  BlockPool& operator=(const BlockPool&) = delete;

  // ---------------------------------------------------------------- the layout, the tokens
  const Layout& layout() const noexcept { return layout_; }
  TokenTable& tokens() noexcept { return tokens_; }
  const TokenTable& tokens() const noexcept { return tokens_; }
  void set_quota_bytes(std::int64_t tier, std::int64_t bytes) { layout_.set_quota_bytes(tier, bytes); }
  void set_pending_copy_ops_warning(std::int64_t n) noexcept { layout_.set_pending_copy_ops_warning(n); }

  // ---------------------------------------------------------------- the clock
  std::int64_t tick() { return ++clock_; }

  // ---------------------------------------------------------------- tree and tokens
  // Read-only: the tree changes only through the pool's methods.
  const RadixTree& tree() const noexcept { return tree_; }
  NodeId new_block(const Digest& key, std::span<const Tok> tokens, std::int64_t ordinal);
  // The match extended by the store's hits (DECISIONS.md "The shared tier"; m -1: no run;
  // root kNoNode: a scope with no root, no tree path).
  SharedMatch match_shared(NodeId root, std::span<const Digest> keys, const SharedHits& hits) const;
  // The match a request created now takes: the ordinary one (none under root kNoNode), or
  // the extension by `hits` (nullptr: none) when longer.  Pure.
  RequestMatch match_with_hits(NodeId root, std::span<const Tok> query, std::span<const Digest> keys,
                               const SharedHits* hits) const;
  // ReuseProbe.block_tiers (SPEC sec. 6): per full block of a match of length m over the
  // tree blocks `path` (past its end: the shared extension's), the coldest tier number of
  // the pages a request created with it holds for the block, -1 when none.  O(m / B).
  std::vector<std::int64_t> block_tiers(const std::vector<NodeId>& path, std::int64_t m) const;
  // The creation number snapshots show for a node handle (kNoNode stays kNoNode).
  std::int64_t node_uid(NodeId id) const { return id == kNoNode ? kNoNode : tree_.uid(id); }

  // ---------------------------------------------------------------- a request's references
  // The root of the scope root_key, made on first use, with one more reference (each open
  // request holds one, a fork its own).
  NodeId open_scope(const Digest& root_key);
  // create's match (match_with_hits; hits nullptr: none), held as a SUSPENDED request holds
  // it: blocks referenced, the pages of blocks not stale at the match end and the ssm
  // snapshot there used (HELD, priority raised); a shared extension's blocks enter the tree.
  HeldMatch hold_match(NodeId root, std::span<const Tok> query, std::span<const Digest> keys,
                       const SharedHits* hits, std::int64_t priority);
  // A fork takes its own references of `blocks` (kNoNode skipped) and uses `pages` (per
  // attention lc; -1 skipped), LOCKED.
  void hold(const std::vector<NodeId>& blocks, const std::vector<std::vector<std::int64_t>>& pages,
            std::int64_t priority);
  // A request stops referencing tree block (or scope root) `node`.
  void unref(NodeId node) { tree_.unref(node); }
  // SPEC sec. 5, 7: block i of `chain` (full, or its partial tail) into the tree (see
  // block_pool.cpp); defer_prune: more blocks of this commit follow.
  Inserted insert_block(const Chain& chain, std::int64_t i, std::span<const Tok> block, KeyHint hint,
                        bool want_snapshot, bool defer_prune = false);

  // ---------------------------------------------------------------- pools
  const Pool& pool(std::int64_t tier, std::int64_t lc) const {
    return pools_[static_cast<std::size_t>(tier)][static_cast<std::size_t>(lc)];
  }

  // ---------------------------------------------------------------- pages
  // Pages are addressed by handle (a slot of the page slab, reused after the page is
  // freed); snapshots show the page's serial instead.
  const Page& page(std::int64_t handle) const {
    if (!page_alive(handle)) [[unlikely]] no_page(handle);
    return slab(handle);
  }
  bool page_alive(std::int64_t handle) const noexcept {
    if (handle < 0 || handle >= page_slots_) return false;
    const auto h = static_cast<std::size_t>(handle);
    return page_chunks_[h / kPageChunk][h % kPageChunk].handle == handle;
  }
  std::int64_t page_serial(std::int64_t handle) const { return handle < 0 ? -1 : page(handle).serial; }
  // (const: a page's fields change only through the pool's methods)
  Page* new_page(std::int64_t tier, std::int64_t lc, std::int64_t coverage, std::int64_t priority,
                 std::int64_t ordinal);
  Page* new_shared_page(std::int64_t lc, std::int64_t priority, std::int64_t ordinal);
  // use / unuse / set_active: one call of restate each (page users, SPEC sec. 4)
  void use(Page* p, bool active, std::int64_t priority);
  void unuse(const Page* p, bool active);
  void set_active(const Page* p, bool active);
  // A new gpu page private to one request, in its state (LOCKED when active, else HELD);
  // room is made first (the caller's check promised it).
  const Page* alloc(std::int64_t lc, std::int64_t coverage, std::int64_t ordinal, std::int64_t priority, bool active);
  // The tokens a request wrote into its private page `p` (no part of its state or key).
  void set_coverage(const Page* p, std::int64_t coverage) { own(p)->coverage = static_cast<std::int16_t>(coverage); }
  // Unindex `p`, apply `change` (its users, node, priority or last_used), index it again:
  // the only way a pooled page's eviction key or state changes.
  template <typename F>
  void restate(Page& p, F change) {
    if (p.tier == layout_.shared_pos()) {  // a shared page is in no pool
      change();
      return;
    }
    unindex(p);
    change();
    index(p);
  }
  void free_page(Page* p);
  // `p` leaves its block's slot (no event, no pruning); may delete a dead orphan block
  void unlink_from_node(Page* p);
  // The gpu pool of `lc` as a feasibility check reads it (changing nothing); `releasing`:
  // page handles about to lose one ACTIVE user (a resize's releases), counted in the state
  // they will be in.
  Budget budget(std::int64_t lc, std::span<const std::int64_t> releasing = {}) const;
  std::int64_t capacity_of(std::int64_t tier, std::int64_t lc) const;
  bool make_room(std::int64_t tier, std::int64_t lc);
  // make_room where a feasibility check already promised the slot
  void ensure_room(std::int64_t tier, std::int64_t lc);
  void resize_pool(std::int64_t tier, std::int64_t lc, std::int64_t n);
  void move(Page* p, std::int64_t dst, const char* reason);
  void retire_nodes(const std::vector<NodeId>& ids, bool announce);
  void drop_all_droppable();

  // ---------------------------------------------------------------- copy ops
  // A copy op from src to dst ("cow" or "snapshot"), counted.
  void copy(std::int64_t lc, const Page* src, const Page* dst, const char* reason);
  // The shared tier's write (DECISIONS.md): a store op for `p`, a full-coverage page of the
  // full block `key` (shared_write="commit").
  void store(const Page* p, const Digest& key);
  // The pending ops, handed out; they become the issued ops of this drain.
  std::vector<CopyOpC> drain_copy_ops();
  // forget_copies' first half: take the given ops (each an unreported op of the last drain)
  // out of the issued ops and return the live pages they were meant to fill,
  // as (handle, serial) in issue order.  ValueErr (nothing changed) naming the first op
  // that is not one.
  std::vector<std::pair<std::int64_t, std::int64_t>> take_issued(std::span<const CopyOpC> ops);
  // settle_copies' first half (explicit settlement): settle the oldest unsettled drain,
  // whose ops in `failed` did not complete; returns the live pages they were meant to fill,
  // as (handle, serial) in issue order.  ValueErr (nothing changed) when there is no
  // unsettled drain, or naming the first op that is not one of that drain.
  std::vector<std::pair<std::int64_t, std::int64_t>> settle_oldest(std::span<const CopyOpC> failed);
  std::int64_t unsettled_drains() const noexcept { return static_cast<std::int64_t>(unsettled_.size()); }
  // ... and its second: unlink the lost pages still alive (SPEC sec. 5 pruning, removed
  // events) and free the unused ones.
  void forget_pages(const std::vector<std::pair<std::int64_t, std::int64_t>>& lost);
  std::int64_t take_copy_ops_warning() noexcept {
    const std::int64_t due = copy_ops_warn_due_ ? layout_.cfg().pending_copy_ops_warning : 0;
    copy_ops_warn_due_ = false;
    return due;
  }

  // ---------------------------------------------------------------- events
  // A new buffered event with the next id (a stored event also buffers its block's
  // `tokens`), the oldest dropped when full; nullptr when no events are kept (max_events 0).
  // tokens_have_digest: whether `tokens` hold a digest code (the node's has_digest).
  EventC* new_event(EventKind kind, std::span<const Tok> tokens = {}, bool tokens_have_digest = false);
  void emit_removed(const Digest& key, std::int64_t lc);
  void emit_stored(NodeId nid, std::span<const std::int64_t> lcs);
  TakenEvents take_events();

  // ---------------------------------------------------------------- stats
  void count(std::int64_t lc, int counter, std::int64_t n = 1);
  void record_match(std::int64_t n_query, std::int64_t m);
  // stats() (or take_iteration_stats(): the iteration counters, then zeroed) as JSON
  void stats_json(std::string& out, bool take_iteration);

  // ---------------------------------------------------------------- observe.cpp
  // The snapshot's sections of the pool's state (one per key of observe.snapshot) and the
  // invariant checks' rule groups over it; the requests' parts stay with the Manager.
  void snapshot_head(std::string& o) const;         // "clock" .. "pools"
  void snapshot_tail(std::string& o) const;         // "stats" .. "events_dropped"
  void snapshot_next(std::string& o) const;         // "event", "page" of "next"
  // Page users and block references, recomputed from the requests.
  struct InvariantUsers {
    std::unordered_map<std::int64_t, std::int64_t> locks, holds, refs;
  };
  void check_pools() const;
  void check_pages_and_tree(InvariantUsers& users) const;
  void check_issued() const;  // the issued (unreported / unsettled) copy ops
  // Sizes of the internal tables (tests of SPEC sec. 15), as (name, count) pairs, the
  // manager's request count among them.
  std::vector<std::pair<std::string, std::int64_t>> internal_sizes(std::int64_t num_requests) const;

  // ---------------------------------------------------------------- scratch
  // Buffers the request operations reuse, so a decode step does not allocate.
  struct Scratch {
    std::vector<std::pair<std::int64_t, std::int64_t>> releases, allocs;  // Request::resize_checked
    std::vector<std::int64_t> lcs;                                         // Request::attach
  };
  Scratch& scratch() noexcept { return scratch_; }

 private:
  [[noreturn]] static void no_page(std::int64_t handle);
  std::int64_t tier_id(std::int64_t t) const { return layout_.tier_id(t); }
  // The pool's own write access to a page it handed out as const: every page is a
  // (non-const) object of the slab this class owns, so the cast is the owner's view.
  static Page* own(const Page* p) noexcept { return const_cast<Page*>(p); }
  Page& mut(std::int64_t handle) {
    if (!page_alive(handle)) [[unlikely]] no_page(handle);
    return slab(handle);
  }
  Page* page_ptr(std::int64_t handle) { return handle < 0 ? nullptr : &mut(handle); }
  std::vector<std::int64_t> live_pages() const;  // handles, by serial
  // insert_block's parts (block_pool.cpp)
  std::vector<NodeId> insert_shared_blocks(NodeId root, std::span<const Tok> query, std::span<const Digest> keys,
                                           std::int64_t m, const RequestMatch& sm, std::int64_t priority);
  Digest key_for(const Chain& chain, std::int64_t i, std::span<const Tok> block, KeyHint hint) const;
  NodeId parent_for(const Chain& chain, std::int64_t i, Inserted& done);
  void switch_block(const Chain& chain, std::int64_t j, NodeId orphan, NodeId existing, Inserted& done);
  void install(NodeId nid, std::int64_t lc, Page* p, std::vector<std::int64_t>& gained);
  void attach(NodeId parent, NodeId nid);
  void move_reference(NodeId old, NodeId nid);
  // One more free slot by evicting the pool's first victim (make_room, resize_pool).
  bool evict_one(std::int64_t tier, std::int64_t lc);
  void drop(Page* p);
  void unlink_committed(Page* p);
  void free_orphan_page(Page* p);
  // The write-back of a page eviction is about to drop (shared_write="evict").
  void store_evicted(const Page* p);
  // Unchecked: for handles the pool's own links hold (the eviction list), always live.
  Page& slab(std::int64_t handle) noexcept {
    const auto h = static_cast<std::size_t>(handle);
    return page_chunks_[h / kPageChunk][h % kPageChunk];
  }
  const Page& slab(std::int64_t handle) const noexcept {
    const auto h = static_cast<std::size_t>(handle);
    return page_chunks_[h / kPageChunk][h % kPageChunk];
  }
  Pool& pool_at(std::int64_t tier, std::int64_t lc) {
    return pools_[static_cast<std::size_t>(tier)][static_cast<std::size_t>(lc)];
  }
  std::int64_t take_page_handle();
  // A page with the next serial in a handle of the slab, last used now (new_page, new_shared_page).
  Page* make_page(std::int64_t tier, std::int64_t lc, std::int64_t slot, std::int64_t coverage,
                  std::int64_t priority, std::int64_t ordinal);
  void unindex(Page& p);
  // Link `p` into `ix`'s list just before page `before` (-1: at the tail).
  void list_insert(EvictIndex& ix, Page& p, std::int64_t before);
  void index(Page& p);
  Page* peek(Pool& pool, int state);
  Page* victim(Pool& pool, bool can_offload);
  void relocate(Page* p);
  void add_copy_op(const CopyOpC& op);
  // One drain's ops that `ops` name, matched by value in order (one per listed op): a flag
  // per op of `drain`.  ValueErr (settle: settle_copies' message, else forget_copies')
  // naming the first op with no unmatched equal left.
  static std::vector<bool> match_issued(std::span<const IssuedOp> drain, std::span<const CopyOpC> ops, bool settle);
  // The live pages the flagged ops of `drain` were meant to fill, once each, in issue order.
  std::vector<std::pair<std::int64_t, std::int64_t>> live_fills(std::span<const IssuedOp> drain,
                                                                const std::vector<bool>& taken) const;
  std::int64_t event_id() { return next_event_++; }
  void stats_view(std::string& out, const std::vector<std::int64_t>& counters) const;
  // stats()["tiers"] (snapshot false) or snapshot()["pools"] (true): the one writer of both
  void pools_json(std::string& o, bool snapshot) const;
  // observe.cpp: the snapshot's sections and the invariant checks' rule groups
  void snapshot_tree(std::string& o) const;
  void snapshot_pages(std::string& o) const;
  void snapshot_copy_ops(std::string& o) const;
  void snapshot_events(std::string& o) const;
  using NodeIndex = std::unordered_map<NodeId, const NodeDump*>;
  void check_pool(std::size_t t, std::size_t lc, const std::vector<std::int64_t>& all) const;
  void check_pool_index(const Pool& pool, const std::string& where, const std::vector<const Page*>& used) const;
  void check_page_users(const std::vector<std::int64_t>& all, InvariantUsers& users, NodeIndex& nodes) const;
  void check_tree_links(const std::vector<NodeDump>& dump, NodeIndex& nodes, InvariantUsers& users) const;

  // --- configuration
  Layout layout_;  // the config-derived facts (parts and requests hold it const)
  bool evicting_ = false;  // shared_write="evict": an eviction drop is running (retire_nodes writes too)

  // --- pools, tree, pages
  // eviction-index nodes: recycled here instead of a malloc per index change
  std::pmr::unsynchronized_pool_resource evict_nodes_;
  std::vector<std::vector<Pool>> pools_;  // [tier][lc]: free slots, state counters, eviction indexes
  RadixTree tree_;  // the committed blocks, their pages per lc, and the interned digest tokens
  TokenTable tokens_;  // the door to the tree's digest table for everything else
  // The page slab: fixed-size chunks, so a Page* stays valid while pages are added.
  static constexpr std::size_t kPageChunk = 4096;
  std::vector<std::unique_ptr<Page[]>> page_chunks_;
  std::int64_t page_slots_ = 0;           // slots handed out so far (live or free)
  std::vector<std::int64_t> free_pages_;  // freed slots (LIFO)
  std::int64_t clock_ = 0;      // advanced once per mutating call (pages' last_used)
  std::int64_t next_page_ = 0;  // the next page serial
  std::int64_t next_event_ = 0;  // the next event id

  // --- copy ops
  std::vector<CopyOpC> copy_ops_;  // pending, in issue order
  // (handle, serial) of the page each pending op fills ((-1, -1): a store)
  std::vector<std::pair<std::int64_t, std::int64_t>> copy_pages_;
  std::vector<IssuedOp> issued_;  // the ops of the last drain not reported yet (forget_copies)
  // explicit settlement: the drains not settled yet, oldest first (issued_ stays empty), and
  // their ops in all (the pending-ops warning counts them)
  std::deque<std::vector<IssuedOp>> unsettled_;
  std::int64_t unsettled_ops_ = 0;
  bool copy_ops_warned_ = false;    // the pending-ops warning was raised (once per manager)
  bool copy_ops_warn_due_ = false;  // ... during this call: take_copy_ops_warning reports it

  // --- events
  Fifo<EventC> events_;              // buffered, oldest first (at most cfg_.max_events)
  Fifo<Tok> event_tokens_;           // the buffered stored events' tokens, in event order
  Fifo<StoredBlockC> event_blocks_;  // ... and their blocks
  // (ntokens, nblocks) of each buffered event, oldest first: what dropping the oldest
  // event must remove from the side queues, read without touching the event itself;
  // ntokens carries kEventHasDigest when its tokens hold digest references to release
  static constexpr std::uint32_t kEventHasDigest = 0x80000000u;
  Fifo<std::pair<std::uint32_t, std::uint32_t>> event_sizes_;
  std::int64_t events_dropped_ = 0;  // events dropped from a full buffer (or never kept)

  // --- stats
  // counters: [requests, query_tokens, reused_tokens, then kNumCounters per lc]
  std::vector<std::int64_t> totals_, iteration_;

  Scratch scratch_;
};

}  // namespace kvcm
