// Pages, the free slots of a pool, the eviction index and the victim choice (SPEC sec. 4
// page states, sec. 8 eviction order).  Python twin: kvcm/python_backend/pools.py (Page,
// Pool).  The index operations that walk the page slab are BlockPool members defined in
// pools.cpp (BlockPool::index / unindex / list_insert / peek / victim).
#pragma once

#include <cstddef>
#include <cstdint>
#include <memory_resource>
#include <set>
#include <tuple>
#include <type_traits>
#include <utility>
#include <vector>

#include "core/tree.h"

namespace kvcm {

// The free slots of one pool.  A new page takes the lowest free slot (the python backend's
// heap does the same), so slot indices agree between backends.  A two-level bitmap: bit s
// of words_ is set while slot s is free, bit w of summary_ while words_[w] is non-zero;
// take() scans summary_ upward from hint_, below which every summary word is zero.
class FreeSlots {
 public:
  explicit FreeSlots(std::int64_t n);
  std::int64_t size() const noexcept { return count_; }
  std::int64_t take() noexcept;     // precondition: size() > 0
  bool give(std::int64_t slot) noexcept;  // false: the slot was already free (a kvcm bug)
  bool contains(std::int64_t slot) const noexcept {
    return (words_[static_cast<std::size_t>(slot) >> 6] >> (slot & 63)) & 1u;
  }
  std::vector<std::int64_t> sorted() const;
  // set_quota: from `total` slots to `n`: slots [total, n) join free; shrinking, the
  // caller emptied [n, total) first (DECISIONS.md "Quotas at run time").
  void resize(std::int64_t total, std::int64_t n);

 private:
  void remove(std::int64_t slot) noexcept;  // mark a free slot used (resize)
  std::vector<std::uint64_t> words_, summary_;
  std::size_t hint_ = 0;
  std::int64_t count_ = 0;
};

enum PageState : int { kNone = 0, kLocked = 1, kHeld = 2, kDroppable = 3 };
using EvictKey = std::tuple<std::int64_t, std::int64_t, std::int64_t, std::int64_t>;
// An eviction-index entry: the key, then the page handle (serials are unique, so the
// handle never decides the order).
using EvictEntry = std::pair<EvictKey, std::int64_t>;

// One slot's worth of KV (or ssm state) in one pool.  Kept small — 56 bytes, under a
// cache line: a cached block costs one Page besides its tree node, and an eviction walks the
// coldest pages.  Handles, node slots, pool slots and ordinals fit 32 bits (pool slots are
// at most 2**31 - 1, DECISIONS "Configuration bounds"; the page and node slabs refuse to
// grow past that), coverage is at most B <= 4096, priority 0..100.
struct Page {
  std::int64_t serial = 0;     // creation number (snapshots, the eviction tie-break)
  std::int64_t last_used = 0;  // clock of the last use / release
  std::int32_t ordinal = 0;    // block position in its request's chain
  std::int32_t slot = 0;
  std::int32_t handle = -1;    // this page's slot in the page slab
  std::int32_t node = -1;      // the tree block holding it (kNoNode: private to a request)
  std::int32_t prev = -1, next = -1;  // links of the eviction index's list (in_list)
  std::int32_t locks = 0, holds = 0;  // users ACTIVE / SUSPENDED
  std::int16_t coverage = 0;   // tokens of the block it holds (<= B)
  std::int8_t priority = 0;    // 0..100
  std::uint8_t lc = 0, tier = 0;
  std::uint8_t idx_state = kNone;  // the state this page is counted/indexed under in its pool
  bool in_list = false;
  int state() const noexcept {
    if (locks) return kLocked;
    if (holds) return kHeld;
    if (node != kNoNode) return kDroppable;
    return kNone;
  }
  // The key it is indexed under while idx_state is HELD / DROPPABLE: priority and
  // last_used change only inside BlockPool::restate (unindex, change, index again) or before
  // a new page is first indexed, so the live fields are the indexed key (no copy kept).
  EvictKey evict_key() const noexcept { return {priority, last_used, -std::int64_t{ordinal}, serial}; }
};
static_assert(sizeof(Page) == 56);
static_assert(std::is_trivially_destructible_v<Page>);  // reset in place, never destroyed

// The HELD (or the DROPPABLE) pages of one pool in eviction order.  Pages mostly arrive
// in order — a page released now carries the newest last_used, and the pages a call
// releases together come by ascending ordinal, i.e. each sorts just before the previous
// one — so they go on an intrusive list threaded through the pages: an append at the
// tail, or an insert just before `run`, in O(1) without allocating.  Any other arrival
// (e.g. a page suspended with an old last_used) goes into the ordered set.  The next
// victim is the smaller of the two heads.  Invariants: the list is sorted by key; every
// page from `run` to `tail` has the tail's last_used.
struct EvictIndex {
  std::pmr::set<EvictEntry> set;  // the pages that arrived out of order, by key
  std::int64_t head = -1, tail = -1, run = -1;  // page handles (-1: empty list)
  std::size_t list_size = 0;  // pages on the list
  explicit EvictIndex(std::pmr::memory_resource* mem) : set(mem) {}
  std::size_t size() const noexcept { return set.size() + list_size; }
};

struct Pool {
  std::int64_t tier = 0, lc = 0;  // config position of its tier, and its life cycle
  std::int64_t total = 0;         // slots (set_quota changes it)
  FreeSlots free_slots;           // the slots no page holds
  std::int64_t locked = 0, held = 0, droppable = 0;  // pages counted under each state (idx_state)
  EvictIndex held_index, droppable_index;  // set nodes come from the block pool's pool resource
  Pool(std::int64_t tier_, std::int64_t lc_, std::int64_t total_, std::pmr::memory_resource* mem)
      : tier(tier_), lc(lc_), total(total_), free_slots(total_), held_index(mem), droppable_index(mem) {}
  EvictIndex& index_of(int state) noexcept { return state == kHeld ? held_index : droppable_index; }
  std::int64_t nfree() const noexcept { return free_slots.size(); }
  std::int64_t take_slot() noexcept { return free_slots.take(); }
  void give_slot(std::int64_t slot);
  void count(int state, std::int64_t delta) noexcept;
};

}  // namespace kvcm
