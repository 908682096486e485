// Pages, free slots, the eviction index and the victim choice (SPEC sec. 4 and 8).  Python
// twin: kvcm/python_backend/pools.py (Page, Pool).  The index operations that walk the
// page slab are BlockPool members (block_pool.h).
#include "core/block_pool.h"

#include <algorithm>
#include <bit>

#include "core/manager_detail.h"

namespace kvcm {

using namespace detail;

FreeSlots::FreeSlots(std::int64_t n) {
  const auto un = static_cast<std::size_t>(n);
  words_.assign((un + 63) / 64, ~std::uint64_t{0});
  if (un % 64) words_.back() = (std::uint64_t{1} << (un % 64)) - 1;
  summary_.assign(words_.size() / 64 + 1, 0);
  for (std::size_t w = 0; w < words_.size(); ++w) {
    if (words_[w]) summary_[w >> 6] |= std::uint64_t{1} << (w & 63);
  }
  count_ = n;
}

std::int64_t FreeSlots::take() noexcept {
  std::size_t i = hint_;
  while (summary_[i] == 0) ++i;
  hint_ = i;
  const std::size_t w = (i << 6) | static_cast<std::size_t>(std::countr_zero(summary_[i]));
  const int b = std::countr_zero(words_[w]);
  words_[w] &= words_[w] - 1;
  if (words_[w] == 0) summary_[i] &= summary_[i] - 1;
  --count_;
  return static_cast<std::int64_t>((w << 6) | static_cast<std::size_t>(b));
}

bool FreeSlots::give(std::int64_t slot) noexcept {
  const auto s = static_cast<std::size_t>(slot);
  const std::uint64_t bit = std::uint64_t{1} << (s & 63);
  if (words_[s >> 6] & bit) return false;
  words_[s >> 6] |= bit;
  summary_[s >> 12] |= std::uint64_t{1} << ((s >> 6) & 63);
  hint_ = std::min(hint_, s >> 12);
  ++count_;
  return true;
}

std::vector<std::int64_t> FreeSlots::sorted() const {
  std::vector<std::int64_t> out;
  out.reserve(static_cast<std::size_t>(count_));
  for (std::size_t w = 0; w < words_.size(); ++w) {
    for (std::uint64_t bits = words_[w]; bits; bits &= bits - 1) {
      out.push_back(static_cast<std::int64_t>((w << 6) | static_cast<std::size_t>(std::countr_zero(bits))));
    }
  }
  return out;
}

void FreeSlots::remove(std::int64_t slot) noexcept {
  const auto s = static_cast<std::size_t>(slot);
  words_[s >> 6] &= ~(std::uint64_t{1} << (s & 63));
  if (words_[s >> 6] == 0) summary_[s >> 12] &= ~(std::uint64_t{1} << ((s >> 6) & 63));
  --count_;
}

// Rebuilt at the new size (set_quota is rare): the used slots below min(total, n) stay used.
// py: pools.py Pool.grow — SPEC sec. 18
void FreeSlots::resize(std::int64_t total, std::int64_t n) {
  FreeSlots next(n);
  for (std::int64_t s = 0; s < std::min(total, n); ++s) {
    if (!contains(s)) next.remove(s);
  }
  if (n < total && count_ - next.count_ != total - n) {
    throw InternalErr("kvcm bug: shrink of a used slot");
  }
  *this = std::move(next);
}

// py: pools.py Pool.give_slot — SPEC sec. 4
void Pool::give_slot(std::int64_t slot) {
  if (!free_slots.give(slot)) throw InternalErr("kvcm bug: slot " + std::to_string(slot) + " freed twice");
}

// py: pools.py Pool.index — SPEC sec. 4
void Pool::count(int state, std::int64_t delta) noexcept {
  if (state == kLocked) {
    locked += delta;
  } else if (state == kHeld) {
    held += delta;
  } else if (state == kDroppable) {
    droppable += delta;
  }
}

// py: pools.py Pool.unindex — SPEC sec. 8
void Pages::unindex(Page& p) {
  Pool& pool = pools_[static_cast<std::size_t>(p.tier)][static_cast<std::size_t>(p.lc)];
  pool.count(p.idx_state, -1);
  if (p.idx_state == kHeld || p.idx_state == kDroppable) {
    EvictIndex& ix = pool.index_of(p.idx_state);
    if (!p.in_list) {
      ix.set.erase({p.evict_key(), p.handle});
    } else {
      if (p.prev >= 0) {
        slab(p.prev).next = p.next;
      } else {
        ix.head = p.next;
      }
      if (p.next >= 0) {
        slab(p.next).prev = p.prev;
      } else {
        ix.tail = p.prev;
      }
      // [run, tail] keeps one last_used: step run forward, or onto the new tail
      if (ix.run == p.handle) ix.run = p.next >= 0 ? p.next : ix.tail;
      --ix.list_size;
      p.in_list = false;
      p.prev = p.next = -1;
    }
  }
  p.idx_state = kNone;
}

void Pages::list_insert(EvictIndex& ix, Page& p, std::int64_t before) {
  const std::int64_t after = before >= 0 ? slab(before).prev : ix.tail;
  p.prev = static_cast<std::int32_t>(after);
  p.next = static_cast<std::int32_t>(before);
  if (after >= 0) {
    slab(after).next = p.handle;
  } else {
    ix.head = p.handle;
  }
  if (before >= 0) {
    slab(before).prev = p.handle;
  } else {
    ix.tail = p.handle;
  }
  p.in_list = true;
  ++ix.list_size;
}

// py: pools.py Pool.index — SPEC sec. 8
void Pages::index(Page& p) {
  Pool& pool = pools_[static_cast<std::size_t>(p.tier)][static_cast<std::size_t>(p.lc)];
  p.idx_state = static_cast<std::uint8_t>(p.state());
  pool.count(p.idx_state, +1);
  if (p.idx_state != kHeld && p.idx_state != kDroppable) return;
  EvictIndex& ix = pool.index_of(p.idx_state);
  const std::int64_t last_used = p.last_used;
  const EvictKey key = p.evict_key();
  if (ix.tail < 0 || slab(ix.tail).evict_key() < key) {  // newest: append
    const bool same_run = ix.tail >= 0 && slab(ix.tail).last_used == last_used;
    list_insert(ix, p, -1);
    if (!same_run) ix.run = p.handle;
    return;
  }
  const Page& r = slab(ix.run);
  if (r.last_used == last_used && key < r.evict_key() &&
      (r.prev < 0 || slab(r.prev).evict_key() < key)) {  // just before the tail's run
    list_insert(ix, p, ix.run);
    ix.run = p.handle;
    return;
  }
  ix.set.insert({key, p.handle});
}

// py: pools.py Pool.peek — SPEC sec. 8
const Page* Pages::peek(const Pool& pool, int state) const {
  const EvictIndex& ix = state == kHeld ? pool.held_index : pool.droppable_index;
  const Page* first = ix.head >= 0 ? &slab(ix.head) : nullptr;
  if (!ix.set.empty()) {
    const EvictEntry& e = *ix.set.begin();
    if (first == nullptr || e.first < first->evict_key()) return &page(e.second);
  }
  return first;
}


}  // namespace kvcm
