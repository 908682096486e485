// The KV-cache manager core (SPEC sec. 4, 7, 8, 9, 11).  A faithful port of
// kvcm/python_backend/: the same algorithms with the same order of every side effect, so
// both backends produce identical page indices, copy ops, events, stats and snapshots.
//
// One file per concept, mirroring python_backend/ (docs: DECISIONS.md "Mirrored wings"):
//   lifecycle.h          life cycles, stale ranges, floordiv / ceildiv  (the config module)
//   tree.{h,cpp}         radix tree, matching, prune_match              (tree.py)
//   pools.{h,cpp}        pages, free slots, eviction index, victim      (pools.py)
//   manager.{h,cpp}      page users, moves, events, stats, manager calls (manager.py)
//   request.{h,cpp}      one request's life cycle                       (request.py)
//   batch.cpp            the batched decode step                        (batch.py)
//   observe.cpp          snapshot and invariant checks                  (observe.py)
// Each function implementing a SPEC rule is preceded by one line
//   // py: <file>.py <Class>.<name> — SPEC sec. <N>
// naming its Python twin (same name, possibly with one leading underscore).
//
// Plain C++20, no Python types.  One Manager is not thread-safe by itself; the bindings
// serialise calls with mutex() (taken after releasing the GIL).
#pragma once

#include <algorithm>
#include <array>
#include <cstdint>
#include <deque>
#include <functional>
#include <iterator>
#include <map>
#include <memory>
#include <memory_resource>
#include <mutex>
#include <optional>
#include <set>
#include <span>
#include <stdexcept>
#include <string>
#include <tuple>
#include <type_traits>
#include <unordered_map>
#include <vector>

#include "core/block_keys.h"
#include "core/lifecycle.h"
#include "core/pools.h"
#include "core/request.h"
#include "core/sha256.h"
#include "core/tree.h"
#include "core/types.h"

namespace kvcm {

// ------------------------------------------------------------------ configuration
struct ManagerConfig {
  std::int64_t tokens_per_block = 1;
  std::vector<LcConfig> lcs;
  std::vector<std::vector<std::int64_t>> slots;  // [tier][lc]
  std::vector<std::string> tier_kinds;
  bool enable_partial_reuse = true;
  std::int64_t reuse_match_backoff = 0;
  double max_util_for_resume = 1.0;
  std::int64_t max_events = 10000;
  std::int64_t pending_copy_ops_warning = 1000000;  // 0: never warn
  std::vector<std::int64_t> quota_bytes;  // [tier]: shown by stats / snapshot; set_quota changes it
  // The shared tier (DECISIONS.md "The shared tier"): configured (tier number 3, no pools),
  // and its write policy (false: "commit", write-through; true: "evict", write-back).
  bool shared = false;
  bool shared_write_evict = false;
};

struct StoredBlockC {  // key and tokens are the event's (one block, several life cycles)
  std::int32_t lc = 0, tier = 0;
  std::int64_t priority = 0;
  std::int32_t coverage = 0;  // tokens of the block the page covers
};

enum class EventKind { stored, removed, tier_changed, cleared };

// One buffered event.  Trivially destructible on purpose: when the buffer is full the
// oldest event is dropped without touching its (cold) memory.  A stored event's variable
// parts — its block's tokens and its per-life-cycle blocks — sit in the manager's side
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

// A FIFO in a ring buffer (capacity a power of two, doubled when full, never shrunk):
// pushes and pops are O(1) with no element ever moved once written, memory is reused.
// std::deque frees and allocates a chunk every few elements, and a vector compacted when
// its dead prefix grows moves every live element again: the event buffer (one push and
// one pop per event once full) felt both on every commit and eviction.
template <typename T>
class Fifo {
  static_assert(std::is_trivially_destructible_v<T>);

 public:
  class Iter {  // forward iteration from the oldest element (take_events copies out with it)
   public:
    using iterator_category = std::forward_iterator_tag;
    using value_type = T;
    using difference_type = std::ptrdiff_t;
    using pointer = const T*;
    using reference = const T&;
    Iter() = default;
    Iter(const Fifo* f, std::size_t i) : f_(f), i_(i) {}
    const T& operator*() const noexcept { return (*f_)[i_]; }
    const T* operator->() const noexcept { return &(*f_)[i_]; }
    Iter& operator++() noexcept {
      ++i_;
      return *this;
    }
    Iter operator++(int) noexcept {
      Iter t = *this;
      ++i_;
      return t;
    }
    bool operator==(const Iter& o) const noexcept { return i_ == o.i_; }

   private:
    const Fifo* f_ = nullptr;
    std::size_t i_ = 0;
  };
  std::size_t size() const noexcept { return size_; }
  bool empty() const noexcept { return size_ == 0; }
  const T& operator[](std::size_t i) const noexcept { return v_[(head_ + i) & mask_]; }
  const T& front() const noexcept { return v_[head_]; }
  T& back() noexcept { return v_[(head_ + size_ - 1) & mask_]; }
  Iter begin() const noexcept { return {this, 0}; }
  Iter end() const noexcept { return {this, size_}; }
  template <typename... A>
  T& emplace_back(A&&... a) {
    if (size_ == v_.size()) grow(1);
    // built in place (T is trivially destructible): assigning a temporary would write it
    // to the stack field by field and read it back whole, a store-forwarding stall
    T* at = &v_[(head_ + size_) & mask_];
    T* slot = nullptr;
    if constexpr (sizeof...(A) == 0) {
      slot = ::new (static_cast<void*>(at)) T;  // default-init: each member's initialiser, no memset of the whole
    } else {
      slot = std::construct_at(at, std::forward<A>(a)...);
    }
    ++size_;
    return *slot;
  }
  // Append [first, first + n) (a contiguous range): at most two copies.
  void append(const T* first, std::size_t n) {
    if (size_ + n > v_.size()) grow(n);
    const std::size_t at = (head_ + size_) & mask_;
    const std::size_t k = std::min(n, v_.size() - at);
    std::copy(first, first + k, v_.begin() + static_cast<std::ptrdiff_t>(at));
    std::copy(first + k, first + n, v_.begin());
    size_ += n;
  }
  void pop_front(std::size_t n = 1) noexcept {
    head_ = (head_ + n) & mask_;
    size_ -= n;
  }
  void clear() noexcept { head_ = size_ = 0; }

 private:
  void grow(std::size_t n) {
    std::size_t cap = v_.empty() ? 16 : v_.size();
    while (cap < size_ + n) cap *= 2;
    std::vector<T> next(cap);
    for (std::size_t i = 0; i < size_; ++i) next[i] = (*this)[i];
    v_.swap(next);
    head_ = 0;
    mask_ = cap - 1;
  }
  std::vector<T> v_;
  std::size_t head_ = 0, size_ = 0, mask_ = 0;
};

class Manager {
 public:
  explicit Manager(ManagerConfig cfg);

  std::mutex& mutex() noexcept { return mutex_; }

  // ---------------------------------------------------------------- manager calls
  // Validated arguments only (the Python layer checks them first).
  // The store's answer to shared_candidates: (block key, lc) pairs, sorted and unique.
  using SharedHits = std::vector<std::pair<Digest, std::int64_t>>;
  // hits: nullptr when create_kv_cache got no shared_hits (DECISIONS.md "The shared tier").
  std::int64_t create(TokenSeq tokens, std::optional<std::uint64_t> lora,
                      std::optional<std::uint64_t> salt, std::int64_t priority, const SharedHits* hits = nullptr);
  // The (key, lc) pairs to look up in the shared tier; no side effect.
  std::vector<std::pair<Digest, std::int64_t>> shared_candidates(TokenSeq tokens, std::optional<std::uint64_t> lora,
                                                                 std::optional<std::uint64_t> salt);
  std::pair<std::int64_t, std::int64_t> probe(TokenSeq tokens, std::optional<std::uint64_t> lora,
                                              std::optional<std::uint64_t> salt);
  std::vector<CopyOpC> drain_copy_ops();
  // Failed copies (SPEC sec. 15): forget the pages the given ops of the last drain were
  // meant to fill and roll back the requests that used them; returns their serials in
  // creation order.  ValueErr (nothing changed) naming the first op that is not an
  // unreported op of the last drain.  Types are checked by the Python layer.
  std::vector<std::int64_t> forget_copies(std::span<const CopyOpC> ops);
  // Sec. 15: the pending copy ops reached the warning figure during the last call (only once
  // per manager): returns the figure and clears the flag, else 0.  The bindings then issue
  // kvcm.api.warn_pending_copy_ops (manager.py: PyKVCacheManager.add_copy_op).
  std::int64_t take_copy_ops_warning() noexcept {
    const std::int64_t due = copy_ops_warn_due_ ? cfg_.pending_copy_ops_warning : 0;
    copy_ops_warn_due_ = false;
    return due;
  }
  void set_pending_copy_ops_warning(std::int64_t n) noexcept { cfg_.pending_copy_ops_warning = n; }
  // Sizes of the manager's internal tables (tests of SPEC sec. 15: what a long-running
  // server keeps must stay bounded by the live state), as (name, count) pairs.
  std::vector<std::pair<std::string, std::int64_t>> internal_sizes() const;
  void clear_reusable();
  // Quotas at run time (DECISIONS.md): pools of config position `tier` resized to `slots`
  // (per lc, computed and checked by kvcm.config.resolve_quota).  Refused, nothing changed:
  // returns {lc, slots, need, locked, held that must stay} of the first pool that cannot
  // shrink that far (the bindings raise OutOfPagesError); empty when done.
  std::vector<std::int64_t> set_quota(std::int64_t tier, std::int64_t quota_bytes,
                                      const std::vector<std::int64_t>& slots);
  void shutdown();
  bool is_shutdown() const noexcept { return is_shutdown_; }
  std::size_t num_open() const noexcept { return requests_.size(); }
  std::string stats_json(bool take_iteration);
  TakenEvents take_events();
  std::string snapshot_json();
  void check_invariants();

  // ---------------------------------------------------------------- request calls (by serial)
  RequestInfo info(std::int64_t serial) const;
  // InvalidStateErr unless the cache is in `status` (what: the call's name, for the message).
  void require_status(std::int64_t serial, ReqStatus status, const char* what) const;
  std::vector<TokenOut> committed_tokens(std::int64_t serial) const;
  bool resume(std::int64_t serial);
  void suspend(std::int64_t serial);
  bool resize(std::int64_t serial, std::int64_t capacity, std::optional<std::int64_t> history);
  void commit(std::int64_t serial, TokenSeq tokens);
  // commit of the next n input tokens (nullopt: all the rest; kvcm.api.KVCache.commit_input)
  void commit_input(std::int64_t serial, std::optional<std::int64_t> n);
  void stop_committing(std::int64_t serial);
  ClosedTokens close(std::int64_t serial);
  std::vector<std::int32_t> page_indices(std::int64_t serial, std::int64_t lc);
  std::size_t num_life_cycles() const noexcept { return cfg_.lcs.size(); }
  std::size_t num_tiers() const noexcept { return pools_.size(); }
  // Forks (issue 22, DECISIONS.md "Forks (issue 22)"): a new ACTIVE request sharing this
  // one's committed pages; its serial, or -1 (nothing changed) when the gpu cannot take the
  // fork's own pages.  ClosedErr / InvalidStateErr (status, history) change nothing.
  std::int64_t fork(std::int64_t serial);

 private:
  // --- helpers: tokens
  // Append the manager codes of `tokens` to `out` (interning their digests).
  void intern_into(TokenSeq tokens, std::vector<Tok>& out);
  TokenOut decode(Tok t) const;
  std::vector<TokenOut> decode_all(std::span<const Tok> codes) const;
  // (block keys: KeyChain with the caller's lambda as its callback, inlined)
  Digest block_key_of(const Digest& parent, std::span<const Tok> tokens) const;
  std::vector<Digest> chain(const Digest& root, std::span<const Tok> tokens) const;

  // --- tree bookkeeping
  NodeId new_block(const Digest& key, std::span<const Tok> tokens, std::int64_t ordinal);
  // The creation number snapshots show for a node handle (kNoNode stays kNoNode).
  std::int64_t node_uid(NodeId id) const { return id == kNoNode ? kNoNode : tree_.uid(id); }

  // --- requests
  Request& req(std::int64_t serial);
  const Request& req(std::int64_t serial) const;
  static void require(const Request& r, ReqStatus s, const char* what);
  std::pair<std::int64_t, std::int64_t> stale_range(std::int64_t lc, std::int64_t history) const;
  // The single calls are check_x (raises, changes nothing) then x_checked (the work); the
  // batched calls run every item's check before the first x_checked.
  void check_resize(const Request& r, std::int64_t capacity, std::int64_t history) const;
  bool resize_checked(Request& r, std::int64_t capacity, std::int64_t history);
  void check_commit(const Request& r, std::int64_t ntokens, const char* what = "commit") const;
  void commit_checked(Request& r, TokenSeq tokens);
  void commit_appended(Request& r, std::int64_t old);
  std::vector<Page*> used_pages(Request& r);
  std::vector<Page*> cow_sources(Request& r);
  void ensure_room(std::int64_t tier, std::int64_t lc);
  Page* alloc_private(Request& r, std::int64_t lc, std::int64_t coverage, std::int64_t ordinal);
  void copy_on_write(Request& r);
  Digest key_for(Request& r, std::int64_t i, std::span<const Tok> tokens);
  NodeId parent_for(Request& r, std::int64_t i);
  void switch_block(Request& r, std::int64_t j, NodeId orphan, NodeId existing);
  void install(NodeId nid, std::int64_t lc, Page* p, std::vector<std::int64_t>& gained);
  void attach(NodeId parent, NodeId nid);
  void insert_block(Request& r, std::int64_t i, std::span<const Tok> tokens, bool want_snapshot,
                    bool defer_prune = false);
  void set_block(Request& r, std::int64_t i, NodeId nid);
  // --- forks (request.cpp): (lc, page handle) pairs of a request's partial block
  using TailPages = std::vector<std::pair<std::int64_t, std::int64_t>>;
  void init_fork(Request& child, const Request& parent);
  TailPages tail_pages(const Request& r) const;
  TailPages shared_tail(const Request& r, std::int64_t history) const;
  void copy_tail(Request& r, const TailPages& shared);
  // Match `tokens` (full-block `keys`) and hold what it found, as a fresh SUSPENDED
  // request (create, and the roll-back of forget_copies); returns the match length.
  std::int64_t match_and_hold(Request& r, std::span<const Tok> tokens, std::span<const Digest> keys,
                              const SharedHits* hits = nullptr);
  // The shared tier (DECISIONS.md): the match extended by the store's hits (m -1: no run),
  // and the insertion of its blocks with shared pages.
  struct SharedMatch {
    std::int64_t m = -1;
    std::vector<NodeId> path;                     // the tree path [0, P)
    std::vector<std::vector<std::int64_t>> rows;  // coverage per lc of blocks P, P+1, ...
  };
  SharedMatch match_shared(NodeId root, std::span<const Digest> keys, const SharedHits& hits) const;
  std::vector<NodeId> insert_shared_blocks(Request& r, std::span<const Tok> tokens, std::span<const Digest> keys,
                                           std::int64_t m, const SharedMatch& sm);
  std::optional<std::int64_t> rollback_point(Request& r, const std::vector<std::int64_t>& lost_handles);
  void roll_back(Request& r, std::int64_t point);
  void release_all(Request& r);
  void json_tier_head(std::string& o, std::size_t t) const;
  void stop(Request& r);
  void release_stale(Request& r, std::int64_t old_history, std::int64_t first_block);
  // O(1): false when the pools could never hold ceil(capacity / B) = nb blocks at `history`.
  bool could_hold(std::int64_t nb, std::int64_t history) const;
  std::int64_t page_at(const Request& r, std::int64_t lc, std::int64_t i) const;

  // --- pages
  std::int64_t tick() { return ++clock_; }
  // Pages are addressed by handle (a slot of the page slab, reused after the page is
  // freed); snapshots show the page's serial instead.
  Page& page(std::int64_t handle) {
    if (!page_alive(handle)) [[unlikely]] no_page(handle);
    return slab(handle);
  }
  const Page& page(std::int64_t handle) const {
    if (!page_alive(handle)) [[unlikely]] no_page(handle);
    const auto h = static_cast<std::size_t>(handle);
    return page_chunks_[h / kPageChunk][h % kPageChunk];
  }
  [[noreturn]] static void no_page(std::int64_t handle);
  Page* page_ptr(std::int64_t handle) { return handle < 0 ? nullptr : &page(handle); }
  bool page_alive(std::int64_t handle) const noexcept {
    if (handle < 0 || handle >= page_slots_) return false;
    const auto h = static_cast<std::size_t>(handle);
    return page_chunks_[h / kPageChunk][h % kPageChunk].handle == handle;
  }
  // Unchecked: for handles the manager's own links hold (the eviction list), always live.
  Page& slab(std::int64_t handle) noexcept {
    const auto h = static_cast<std::size_t>(handle);
    return page_chunks_[h / kPageChunk][h % kPageChunk];
  }
  std::int64_t page_serial(std::int64_t handle) const { return handle < 0 ? -1 : page(handle).serial; }
  std::vector<std::int64_t> live_pages() const;  // handles, by serial
  std::vector<std::int64_t> open_serials() const;  // the open requests' serials, ascending
  std::int64_t take_page_handle();
  Page* new_page(std::int64_t tier, std::int64_t lc, std::int64_t coverage, std::int64_t priority,
                 std::int64_t ordinal);
  void use(Page* p, bool active, std::int64_t priority);
  void unuse(Page* p, bool active);
  void set_active(Page* p, bool active);
  void unindex(Page& p);
  // Link `p` into `ix`'s list just before page `before` (-1: at the tail).
  void list_insert(EvictIndex& ix, Page& p, std::int64_t before);
  void index(Page& p);
  Page* new_shared_page(std::int64_t lc, std::int64_t priority, std::int64_t ordinal);
  // A page with the next serial in a handle of the slab, last used now (new_page, new_shared_page).
  Page* make_page(std::int64_t tier, std::int64_t lc, std::int64_t slot, std::int64_t coverage,
                  std::int64_t priority, std::int64_t ordinal);
  template <typename F>
  void restate(Page& p, F change) {
    if (p.tier == shared_pos_) {  // a shared page is in no pool
      change();
      return;
    }
    unindex(p);
    change();
    index(p);
  }
  void free_page(Page* p);
  bool can_allocate(std::int64_t tier, std::int64_t lc, std::int64_t n, const std::int64_t* adjust);
  std::int64_t capacity_of(std::int64_t tier, std::int64_t lc, const std::int64_t* adjust);
  bool make_room(std::int64_t tier, std::int64_t lc);
  bool evict_one(std::int64_t tier, std::int64_t lc);
  void resize_pool(std::int64_t tier, std::int64_t lc, std::int64_t n);
  void relocate(Page* p);
  Page* peek(Pool& pool, int state);
  Page* victim(Pool& pool, bool can_offload);
  void move(Page* p, std::int64_t dst, const char* reason);
  void drop(Page* p);
  void unlink_committed(Page* p);
  void unlink_from_node(Page* p);
  void retire_nodes(const std::vector<NodeId>& ids, bool announce);
  void free_orphan_page(Page* p);
  void drop_all_droppable();

  // --- copy ops, events, stats
  void copy(std::int64_t lc, const Page* src, const Page* dst, const char* reason);
  // The shared tier's writes (DECISIONS.md): a store op for `p`, a full-coverage page of the
  // full block `key`; and the write-back of a page eviction is about to drop.
  void store(const Page* p, const Digest& key);
  void store_evicted(const Page* p);
  void add_copy_op(const CopyOpC& op);
  // A new buffered event with the next id (a stored event also buffers its block's
  // `tokens`), the oldest dropped when full; nullptr when no events are kept (max_events 0).
  // tokens_have_digest: whether `tokens` hold a digest code (the node's has_digest).
  EventC* new_event(EventKind kind, std::span<const Tok> tokens = {}, bool tokens_have_digest = false);
  std::int64_t event_id() { return next_event_++; }
  void emit_removed(const Digest& key, std::int64_t lc);
  void emit_stored(NodeId nid, std::span<const std::int64_t> lcs);
  // the SPEC tier number of config position ``t`` (see tier_id_)
  std::int64_t tier_id(std::int64_t t) const { return tier_id_[static_cast<std::size_t>(t)]; }
  void count(std::int64_t lc, int counter, std::int64_t n = 1);
  void record_match(std::int64_t n_query, std::int64_t m);
  void stats_view(std::string& out, const std::vector<std::int64_t>& counters) const;
  // --- observe.cpp: snapshot_json's sections (one per key of observe.snapshot) and
  // check_invariants' rule groups
  void snapshot_tree(std::string& o);
  void snapshot_pages(std::string& o);
  void snapshot_pools(std::string& o);
  void snapshot_requests(std::string& o);
  void snapshot_copy_ops(std::string& o);
  void snapshot_events(std::string& o);
  struct InvariantUsers {  // page users and block references, recomputed from the requests
    std::unordered_map<std::int64_t, std::int64_t> locks, holds, refs;
  };
  using NodeIndex = std::unordered_map<NodeId, const NodeDump*>;
  void check_pool(std::size_t t, std::size_t lc, const std::vector<std::int64_t>& all);
  void check_pool_index(const Pool& pool, const std::string& where, const std::vector<const Page*>& used);
  void check_request(std::int64_t serial, InvariantUsers& users);
  void check_page_users(const std::vector<std::int64_t>& all, InvariantUsers& users, NodeIndex& nodes);
  void check_tree_links(const std::vector<NodeDump>& dump, NodeIndex& nodes, InvariantUsers& users);
  void check(bool cond, const std::string& message) const {
    if (!cond) throw InvariantErr(message);
  }

  ManagerConfig cfg_;
  std::int64_t B_;
  std::int64_t num_tiers_;
  // SPEC sec. 1 tier number (gpu 0, host 1, disk 2) of each config position: pools are
  // indexed by position; copy ops, events, stats and snapshots report these numbers.
  std::vector<std::int64_t> tier_id_;
  // The shared tier: a shared page's `tier` is shared_pos_ (= num_tiers_, after the local
  // tiers; tier_id_ maps it to 3); it has slot -1 and is in no pool.
  std::int64_t shared_pos_ = -1;
  bool store_on_commit_ = false;
  bool evicting_ = false;  // shared_write="evict": an eviction drop is running (retire_nodes writes too)
  std::vector<std::int64_t> attn_lcs_;
  std::int64_t ssm_lc_ = -1;
  // eviction-index nodes: recycled here instead of a malloc per index change
  std::pmr::unsynchronized_pool_resource evict_nodes_;
  std::vector<std::vector<Pool>> pools_;  // [tier][lc]
  RadixTree tree_;
  // The page slab: fixed-size chunks, so a Page* stays valid while pages are added.
  static constexpr std::size_t kPageChunk = 4096;
  std::vector<std::unique_ptr<Page[]>> page_chunks_;
  std::int64_t page_slots_ = 0;           // slots handed out so far (live or free)
  std::vector<std::int64_t> free_pages_;  // freed slots (LIFO)
  std::int64_t clock_ = 0, next_page_ = 0, next_request_ = 0, next_event_ = 0;
  // open requests by serial (a hash map: a decode step looks up hundreds per call; the
  // few places that list them sort by serial)
  std::unordered_map<std::int64_t, Request> requests_;
  std::vector<std::pair<std::int64_t, std::int64_t>> scratch_releases_, scratch_allocs_;  // resize_checked
  std::vector<std::int64_t> scratch_lcs_;  // attach
  std::vector<CopyOpC> copy_ops_;
  // (handle, serial) of the page each pending op fills, and the ops of the last drain not
  // reported yet with theirs (forget_copies)
  std::vector<std::pair<std::int64_t, std::int64_t>> copy_pages_;
  struct IssuedOp {
    CopyOpC op;
    std::int64_t handle, serial;
  };
  std::vector<IssuedOp> issued_;
  bool copy_ops_warned_ = false, copy_ops_warn_due_ = false;
  Fifo<EventC> events_;
  Fifo<Tok> event_tokens_;           // the buffered stored events' tokens, in event order
  Fifo<StoredBlockC> event_blocks_;  // ... and their blocks
  // (ntokens, nblocks) of each buffered event, oldest first: what dropping the oldest
  // event must remove from the side queues, read without touching the event itself;
  // ntokens carries kEventHasDigest when its tokens hold digest references to release
  static constexpr std::uint32_t kEventHasDigest = 0x80000000u;
  Fifo<std::pair<std::uint32_t, std::uint32_t>> event_sizes_;
  std::int64_t events_dropped_ = 0;
  bool is_shutdown_ = false;
  // counters: [requests, query_tokens, reused_tokens, then kNumCounters per lc]
  std::vector<std::int64_t> totals_, iteration_;
  std::mutex mutex_;

  // ==================================================================== batched decode step
  // resize_batch / commit_batch (defined in batch.cpp; semantics documented on
  // kvcm.api.KVCacheManager.resize_batch / commit_batch and in DECISIONS.md).  One call
  // does what a loop of single calls does, in order, but validates the WHOLE batch before
  // the first mutation, and runs under one lock: an engine's 256-request decode step is one
  // Python -> C++ crossing instead of 512.
 public:
  // The batch's checks that need no manager state (the bindings run them before parsing
  // the other arguments, to keep kvcm.api's check order): serials[i] < 0 marks an item
  // that is not a cache of this manager; no serial may appear twice.  ValueErr naming
  // the first offending index.
  static void check_batch_serials(std::span<const std::int64_t> serials, const char* what);
  // results[i] = what resize(serials[i], capacities[i], histories[i]) returns; an empty
  // `histories` keeps every cache's history.  All spans have the batch's length.
  void resize_batch(std::span<const std::int64_t> serials, std::span<const std::int64_t> capacities,
                    std::span<const std::int64_t> histories, std::span<std::uint8_t> results);
  // commit(serials[i], {tokens[i]}) for each i: one token per cache.
  void commit_batch(std::span<const std::int64_t> serials, TokenSeq tokens);

 private:
  // Item by item: the open request of serials[i] (else ClosedErr), then check(i, request);
  // errors name the item.  The requests go into a reused member vector.
  template <typename Check>
  std::vector<Request*>& check_batch(std::span<const std::int64_t> serials, const char* what, const char* single,
                                     Check check);
  std::vector<Request*> scratch_batch_;
};

}  // namespace kvcm
