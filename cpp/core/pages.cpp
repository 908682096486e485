// The pages (pages.h).  Python twin: kvcm/python_backend/pages.py (Pages).
#include "core/pages.h"

#include <algorithm>
#include <cstring>
#include <limits>
#include <stdexcept>

#include "core/outbox.h"
#include "core/manager_detail.h"

namespace kvcm {

using namespace detail;

Pages::Pages(const Layout& layout, const RadixTree& tree, Outbox& outbox, const std::int64_t& clock)
    : layout_(layout), tree_(tree), outbox_(outbox), clock_(clock) {
  const auto nlc = static_cast<std::int64_t>(layout_.num_life_cycles());
  pools_.resize(static_cast<std::size_t>(layout_.num_tiers()));
  for (std::int64_t t = 0; t < layout_.num_tiers(); ++t) {
    for (std::int64_t lc = 0; lc < nlc; ++lc) {
      pools_[static_cast<std::size_t>(t)].emplace_back(
          t, lc, layout_.cfg().slots[static_cast<std::size_t>(t)][static_cast<std::size_t>(lc)], &evict_nodes_);
    }
  }
}

void Pages::no_page(std::int64_t handle) { throw InternalErr("kvcm bug: no page " + std::to_string(handle)); }

// A free slot of the page slab (freed slots first, LIFO), its page reset but for the handle.
std::int64_t Pages::take_page_handle() {
  std::int64_t handle;
  if (!free_pages_.empty()) {
    handle = free_pages_.back();
    free_pages_.pop_back();
  } else {
    if (page_slots_ >= std::numeric_limits<std::int32_t>::max()) throw std::length_error("too many pages");
    if (page_slots_ % static_cast<std::int64_t>(kPageChunk) == 0) {
      page_chunks_.push_back(std::make_unique<Page[]>(kPageChunk));
    }
    handle = page_slots_++;
  }
  // built in place, member by member (assigning a Page{} temporary round-trips the stack)
  Page& p = *::new (static_cast<void*>(&slab(handle))) Page;
  p.handle = static_cast<std::int32_t>(handle);
  return handle;
}

// py: pages.py Pages.new_page — SPEC sec. 4
const Page* Pages::new_page(std::int64_t tier, std::int64_t lc, std::int64_t coverage, std::int64_t priority,
                                 std::int64_t ordinal) {
  Pool& pool = pools_[static_cast<std::size_t>(tier)][static_cast<std::size_t>(lc)];
  Page* p = make_page(tier, lc, pool.take_slot(), coverage, priority, ordinal);
  outbox_.count(lc, kAllocatedBlocks);
  return p;
}

// DECISIONS.md "The shared tier".
// py: pages.py Pages.new_shared_page — SPEC sec. 16
const Page* Pages::new_shared_page(std::int64_t lc, std::int64_t priority, std::int64_t ordinal) {
  Page* p = make_page(layout_.shared_pos(), lc, -1, layout_.B(), priority, ordinal);
  outbox_.count(lc, kSharedHitBlocks);
  return p;
}

// py: pages.py Pages.make_page — SPEC sec. 4
Page* Pages::make_page(std::int64_t tier, std::int64_t lc, std::int64_t slot, std::int64_t coverage,
                         std::int64_t priority, std::int64_t ordinal) {
  Page& p = slab(take_page_handle());
  p.serial = next_page_++;
  p.lc = static_cast<std::uint8_t>(lc);
  p.tier = static_cast<std::uint8_t>(tier);
  p.slot = static_cast<std::int32_t>(slot);
  p.coverage = static_cast<std::int16_t>(coverage);
  p.priority = static_cast<std::int8_t>(priority);
  p.last_used = clock_;
  p.ordinal = static_cast<std::int32_t>(ordinal);
  return &p;
}

// py: pages.py Pages.use — SPEC sec. 4
void Pages::use(const Page* cp, bool active, std::int64_t priority) {
  Page* p = own(cp);
  restate(*p, [&] {
    if (active) {
      ++p->locks;
    } else {
      ++p->holds;
    }
    p->last_used = clock_;
    p->priority = static_cast<std::int8_t>(std::max<std::int64_t>(p->priority, priority));
  });
}

// py: pages.py Pages.unuse — SPEC sec. 4
bool Pages::unuse(const Page* cp, bool active) {
  Page* p = own(cp);
  restate(*p, [&] {
    if (active) {
      --p->locks;
    } else {
      --p->holds;
    }
    p->last_used = clock_;
  });
  return p->locks == 0 && p->holds == 0;
}

// py: pages.py Pages.set_active — SPEC sec. 4
void Pages::set_active(const Page* cp, bool active) {
  Page* p = own(cp);
  restate(*p, [&] {
    if (active) {
      --p->holds;
      ++p->locks;
    } else {
      --p->locks;
      ++p->holds;
    }
  });
}

// py: pages.py Pages.move_to — SPEC sec. 8
Retiered Pages::move_to(const Page* cp, std::int64_t dst) {
  Page* p = own(cp);
  Pool& dst_pool = pool_at(dst, p->lc);
  const std::int64_t old_tier = p->tier, old_slot = p->slot;
  const std::int64_t new_slot = dst_pool.take_slot();
  if (old_tier != layout_.shared_pos()) {  // a shared page: no slot, no pool
    unindex(*p);
    pool_at(old_tier, p->lc).give_slot(old_slot);
  }
  p->tier = static_cast<std::uint8_t>(dst);
  p->slot = static_cast<std::int32_t>(new_slot);
  index(*p);
  return {old_tier, old_slot};
}

// py: pages.py Pages.free_page — SPEC sec. 4
void Pages::free_page(const Page* cp) {
  Page* p = own(cp);
  if (p->tier == layout_.shared_pos()) {  // no slot, no pool
    free_pages_.push_back(p->handle);
    p->handle = -1;
    return;
  }
  unindex(*p);
  pools_[static_cast<std::size_t>(p->tier)][static_cast<std::size_t>(p->lc)].give_slot(p->slot);
  free_pages_.push_back(p->handle);
  p->handle = -1;  // dead until the slot is reused
}

// What eviction could free, HELD pages only where a colder tier takes them (Budget::fits).
// py: pages.py Pages.budget — SPEC sec. 8
Budget Pages::budget(std::int64_t lc, std::span<const std::int64_t> releasing) const {
  const Pool& pool = pools_[static_cast<std::size_t>(kGpu)][static_cast<std::size_t>(lc)];
  Budget b{pool.total, pool.nfree(), pool.locked, pool.held, pool.droppable, 0};
  for (std::int64_t h : releasing) {
    const Page& p = page(h);
    if (p.lc != lc || p.locks != 1) continue;
    if (p.node == kNoNode || !tree_.is_attached(p.node)) {  // freed, or kept by a SUSPENDED user
      b.free += p.holds == 0 ? 1 : 0;
      b.held += p.holds ? 1 : 0;
    } else if (p.holds) {
      b.held += 1;
    } else {
      b.droppable += 1;
    }
  }
  b.colder = layout_.num_tiers() > 1 ? capacity_of(kGpu + 1, lc) : 0;
  return b;
}

// The pages pool (tier, lc) could take after eviction (Budget::fits' rule).
// py: pages.py Pages.capacity_of — SPEC sec. 8
std::int64_t Pages::capacity_of(std::int64_t tier, std::int64_t lc) const {
  const Pool& pool = pools_[static_cast<std::size_t>(tier)][static_cast<std::size_t>(lc)];
  const std::int64_t free = pool.nfree(), held = pool.held, droppable = pool.droppable;
  if (tier == layout_.num_tiers() - 1) return free + droppable;
  return free + droppable + std::min(held, capacity_of(tier + 1, lc));
}

// py: pages.py Pages.resize_pool — SPEC sec. 18
void Pages::resize_pool(std::int64_t tier, std::int64_t lc, std::int64_t n) {
  Pool& pool = pools_[static_cast<std::size_t>(tier)][static_cast<std::size_t>(lc)];
  if (n >= pool.total) {
    pool.free_slots.resize(pool.total, n);
    pool.total = n;
    return;
  }
  // the survivors of slots [n, total) move down, by slot, each to the lowest free slot
  std::vector<Page*> movers;
  for (std::int64_t h = 0; h < page_slots_; ++h) {
    if (!page_alive(h)) continue;
    Page& p = slab(h);
    if (p.tier == tier && p.lc == lc && p.slot >= n) movers.push_back(&p);
  }
  std::sort(movers.begin(), movers.end(), [](const Page* a, const Page* b) { return a->slot < b->slot; });
  for (Page* p : movers) relocate(p);
  pool.free_slots.resize(pool.total, n);
  pool.total = n;
}

// py: pages.py Pages.relocate — SPEC sec. 18
void Pages::relocate(Page* p) {
  Pool& pool = pools_[static_cast<std::size_t>(p->tier)][static_cast<std::size_t>(p->lc)];
  const std::int64_t old = p->slot;
  p->slot = static_cast<std::int32_t>(pool.take_slot());
  pool.give_slot(old);
  const std::int64_t t = layout_.tier_id(p->tier);
  outbox_.add_copy_op(CopyOpC{p->lc, t, old, t, p->slot, "relocate"}, p->handle, p->serial);
  outbox_.count(p->lc, kRelocations);
}

std::vector<std::int64_t> Pages::live_pages() const {
  std::vector<std::int64_t> out;
  out.reserve(static_cast<std::size_t>(page_slots_) - free_pages_.size());
  for (std::int64_t h = 0; h < page_slots_; ++h) {
    if (page_alive(h)) out.push_back(h);
  }
  std::sort(out.begin(), out.end(), [this](std::int64_t a, std::int64_t b) { return page(a).serial < page(b).serial; });
  return out;
}

// The pools of each tier, one writer for both views (SPEC sec. 9, 11): stats()["tiers"]
// (the state counters) and snapshot()["pools"] (the free slots); each tier entry is
// `{"tier":N,"kind":"...","quota_bytes":Q,"lc":[...]}`, tier numbered by kind (SPEC sec. 1).
void Pages::pools_json(std::string& o, bool snapshot) const {
  for (std::size_t t = 0; t < pools_.size(); ++t) {
    if (t) o += ',';
    o += "{\"tier\":";
    j_int(o, layout_.tier_id(static_cast<std::int64_t>(t)));
    o += ",\"kind\":";
    j_str(o, layout_.cfg().tier_kinds[t].c_str());
    o += ",\"quota_bytes\":";
    j_int(o, layout_.cfg().quota_bytes[t]);
    o += ",\"lc\":[";
    for (std::size_t lc = 0; lc < pools_[t].size(); ++lc) {
      const Pool& p = pools_[t][lc];
      if (lc) o += ',';
      o += "{\"total\":";
      j_int(o, p.total);
      o += ",\"free\":";
      j_int(o, p.nfree());
      if (snapshot) {
        o += ",\"free_slots\":[";
        const std::vector<std::int64_t> fs = p.free_slots.sorted();
        for (std::size_t k = 0; k < fs.size(); ++k) {
          if (k) o += ',';
          j_int(o, fs[k]);
        }
        o += "]}";
      } else {
        o += ",\"locked\":";
        j_int(o, p.locked);
        o += ",\"held\":";
        j_int(o, p.held);
        o += ",\"droppable\":";
        j_int(o, p.droppable);
        o += '}';
      }
    }
    o += "]}";
  }
}

}  // namespace kvcm
