// The pages (SPEC sec. 4, 8, 18): the page slab and the pools of each (tier, lc) — their
// free slots, state counters and eviction indexes, kept in step with every page change.
// Python twin: kvcm/python_backend/pages.py (Pages).
//
// Pages hands out `const Page&` only: a page's fields change through this class's methods
// (restate, use, unuse, set_active, set_node, restate_node, set_coverage, move_to, ...), so "no page
// writes outside the pool" holds by type.  The Page / Pool records are pools.h's; the
// eviction-index operations over the slab are defined in pools.cpp.
#pragma once

#include <algorithm>
#include <cstdint>
#include <memory>
#include <memory_resource>
#include <span>
#include <string>
#include <unordered_map>
#include <utility>
#include <vector>

#include "core/layout.h"
#include "core/pools.h"
#include "core/tree.h"
#include "core/types.h"

namespace kvcm {

class Outbox;

// The gpu pool of one life cycle as a request's feasibility checks read it (SPEC sec. 8,
// DECISIONS.md "All-or-nothing resume / resize"; Pages::budget).  Python twin: Budget.
struct Budget {
  std::int64_t total = 0, free = 0, locked = 0, held = 0, droppable = 0;
  std::int64_t colder = 0;  // what the colder tiers could take of its HELD pages (0: no colder tier)
  // whether n new pages fit after eviction: free slots, DROPPABLE pages, and HELD pages a
  // colder tier can take
  bool fits(std::int64_t n) const noexcept { return free + droppable + std::min(held, colder) >= n; }
};

// Where a page was before Pages::move_to moved it.
struct Retiered {
  std::int64_t old_tier, old_slot;
};

class Pages {
 public:
  // clock: the pool's clock (a page's last_used); outbox: the counters a new page bumps
  Pages(const Layout& layout, const RadixTree& tree, Outbox& outbox, const std::int64_t& clock);
  Pages(const Pages&) = delete;
  Pages& operator=(const Pages&) = delete;

  // ---------------------------------------------------------------- reading
  // Pages are addressed by handle (a slot of the page slab, reused after the page is
  // freed); snapshots show the page's serial instead.
  const Page& page(std::int64_t handle) const {
    if (!page_alive(handle)) [[unlikely]] no_page(handle);
    return slab(handle);
  }
  const Page* page_ptr(std::int64_t handle) const { return handle < 0 ? nullptr : &page(handle); }
  bool page_alive(std::int64_t handle) const noexcept {
    if (handle < 0 || handle >= page_slots_) return false;
    const auto h = static_cast<std::size_t>(handle);
    return page_chunks_[h / kPageChunk][h % kPageChunk].handle == handle;
  }
  std::int64_t page_serial(std::int64_t handle) const { return handle < 0 ? -1 : page(handle).serial; }
  std::int64_t next_serial() const noexcept { return next_page_; }
  const Pool& pool(std::int64_t tier, std::int64_t lc) const {
    return pools_[static_cast<std::size_t>(tier)][static_cast<std::size_t>(lc)];
  }
  // The first page of `pool`'s index of `state` (kHeld / kDroppable) in eviction order, nullptr: none.
  const Page* peek(const Pool& pool, int state) const;
  std::vector<std::int64_t> live_pages() const;  // handles, by serial
  // The gpu pool of `lc` as a feasibility check reads it (changing nothing); `releasing`:
  // page handles about to lose one ACTIVE user (a resize's releases), counted in the state
  // they will be in.
  Budget budget(std::int64_t lc, std::span<const std::int64_t> releasing = {}) const;
  std::int64_t capacity_of(std::int64_t tier, std::int64_t lc) const;

  // ---------------------------------------------------------------- changing
  const Page* new_page(std::int64_t tier, std::int64_t lc, std::int64_t coverage, std::int64_t priority,
                       std::int64_t ordinal);
  const Page* new_shared_page(std::int64_t lc, std::int64_t priority, std::int64_t ordinal);
  // use / unuse / set_active: one call of restate each (page users, SPEC sec. 4); unuse
  // returns whether the page has no user left (its owner then frees or unlinks it).
  void use(const Page* p, bool active, std::int64_t priority);
  bool unuse(const Page* p, bool active);
  void set_active(const Page* p, bool active);
  // The tokens a request wrote into its private page `p` (no part of its state or key).
  void set_coverage(const Page* p, std::int64_t coverage) { own(p)->coverage = static_cast<std::int16_t>(coverage); }
  // `p` now belongs to tree block `nid` (kNoNode: to none), re-indexed (its state may change).
  void restate_node(const Page* p, NodeId nid) {
    Page* m = own(p);
    restate(*m, [&] { m->node = static_cast<std::int32_t>(nid); });
  }
  // The same without re-indexing, where the page's state does not depend on the node: a
  // used page, a shared page (in no pool), a page re-linked to the block it is counted under.
  void set_node(const Page* p, NodeId nid) noexcept { own(p)->node = static_cast<std::int32_t>(nid); }
  // Move `p` to a slot of tier `dst` (its pool, re-indexed); where it was.
  Retiered move_to(const Page* p, std::int64_t dst);
  void free_page(const Page* p);
  // Shrink pool (tier, lc) to n slots once its used pages fit (the caller evicted): the
  // survivors of slots [n, total) move down (relocate), or grow it.
  void resize_pool(std::int64_t tier, std::int64_t lc, std::int64_t n);

  // ---------------------------------------------------------------- observe.cpp
  void snapshot_pages(std::string& o) const;
  // stats()["tiers"] (snapshot false) or snapshot()["pools"] (true): the one writer of both
  void pools_json(std::string& o, bool snapshot) const;
  void check_pools() const;
  std::int64_t page_slots() const noexcept { return page_slots_; }
  std::int64_t live_count() const noexcept { return page_slots_ - static_cast<std::int64_t>(free_pages_.size()); }

 private:
  [[noreturn]] static void no_page(std::int64_t handle);
  // Pages' own write access to a page it handed out as const: every page is a (non-const)
  // object of the slab this class owns, so the cast is the owner's view, not a loophole.
  static Page* own(const Page* p) noexcept { return const_cast<Page*>(p); }
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
  std::int64_t take_page_handle();
  // A page with the next serial in a handle of the slab, last used now (new_page, new_shared_page).
  Page* make_page(std::int64_t tier, std::int64_t lc, std::int64_t slot, std::int64_t coverage,
                  std::int64_t priority, std::int64_t ordinal);
  void relocate(Page* p);
  void unindex(Page& p);
  // Link `p` into `ix`'s list just before page `before` (-1: at the tail).
  void list_insert(EvictIndex& ix, Page& p, std::int64_t before);
  void index(Page& p);
  void check_pool(std::size_t t, std::size_t lc, const std::vector<std::int64_t>& all) const;
  void check_pool_index(const Pool& pool, const std::string& where, const std::vector<const Page*>& used) const;

  const Layout& layout_;
  const RadixTree& tree_;  // whether a page's block is attached (budget)
  Outbox& outbox_;         // the allocation counters
  const std::int64_t& clock_;
  // eviction-index nodes: recycled here instead of a malloc per index change
  std::pmr::unsynchronized_pool_resource evict_nodes_;
  std::vector<std::vector<Pool>> pools_;  // [tier][lc]: free slots, state counters, eviction indexes
  // The page slab: fixed-size chunks, so a Page* stays valid while pages are added.
  static constexpr std::size_t kPageChunk = 4096;
  std::vector<std::unique_ptr<Page[]>> page_chunks_;
  std::int64_t page_slots_ = 0;           // slots handed out so far (live or free)
  std::vector<std::int64_t> free_pages_;  // freed slots (LIFO)
  std::int64_t next_page_ = 0;            // the next page serial
};

}  // namespace kvcm
