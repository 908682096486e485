// The evictor (evictor.h).  Python twin: kvcm/python_backend/evictor.py (Evictor, LruStrategy).
#include "core/evictor.h"

#include <algorithm>
#include <cstring>
#include <limits>
#include <stdexcept>

#include "core/outbox.h"
#include "core/tree_index.h"
#include "core/manager_detail.h"

namespace kvcm {

using namespace detail;

// The eviction victim of a full pool (SPEC sec. 8), the one home of the victim rules: the
// page first in eviction order (priority, last_used, -ordinal, serial) among the HELD and
// the DROPPABLE pages when it can move down a tier (offload); otherwise only a DROPPABLE
// page may go (a drop), so a HELD one is skipped.  nullptr: nothing to evict.
// py: evictor.py LruStrategy.victim — SPEC sec. 8
const Page* LruStrategy::victim(const Pages& pages, const Pool& pool, bool can_offload) const {
  const Page* d = pages.peek(pool, kDroppable);
  if (!can_offload) return d;  // a HELD page is never dropped: the oldest DROPPABLE one
  const Page* h = pages.peek(pool, kHeld);
  if (h == nullptr) return d;
  if (d == nullptr) return h;
  return key(*h) < key(*d) ? h : d;
}

// py: evictor.py Evictor.make_room — SPEC sec. 8
bool Evictor::make_room(std::int64_t tier, std::int64_t lc) {
  const Pool& pool = pages_.pool(tier, lc);
  if (pool.nfree()) return true;
  return evict_one(tier, lc);
}

// py: evictor.py Evictor.ensure_room — SPEC sec. 8
void Evictor::ensure_room(std::int64_t tier, std::int64_t lc) {
  if (!make_room(tier, lc)) throw InternalErr("kvcm bug: a feasibility check passed but eviction found no slot");
}

// One more free slot by evicting the pool's first victim (make_room of a full pool;
// set_quota's shrink with free slots left).  false: nothing could go, nothing changed.
// py: evictor.py Evictor.evict_one — SPEC sec. 8
bool Evictor::evict_one(std::int64_t tier, std::int64_t lc) {
  const Pool& pool = pages_.pool(tier, lc);
  const std::int64_t nfree = pool.nfree();
  const Page* v = strategy_.victim(pages_, pool, /*can_offload=*/true);
  if (v == nullptr) return false;
  if (tier < layout_.num_tiers() - 1 && make_room(tier + 1, lc)) {
    if (pool.nfree() > nfree) return true;  // a drop down there removed a subtree and freed a slot here
    move(v, tier + 1, "offload");
    return true;
  }
  // No room below (a failed make_room changes nothing): drop instead.
  v = strategy_.victim(pages_, pool, /*can_offload=*/false);
  if (v == nullptr) return false;
  const bool write_back = layout_.cfg().shared_write_evict;
  if (write_back) store_evicted(v);
  drop(v, write_back ? &write_back_ : nullptr);
  return true;
}

// py: evictor.py Evictor.move — SPEC sec. 8
void Evictor::move(const Page* p, std::int64_t dst, const char* reason) {
  const RadixTree& tree = index_.tree();
  const Retiered was = pages_.move_to(p, dst);
  CopyOpC op{p->lc, layout_.tier_id(was.old_tier), was.old_slot, layout_.tier_id(dst), p->slot, reason};
  if (was.old_tier == layout_.shared_pos()) {  // a shared page: no slot, no pool; the op names its object
    op.has_key = true;
    op.key = tree.key(p->node);
  }
  outbox_.add_copy_op(op, p->handle, p->serial);
  const std::int64_t nbytes = layout_.cfg().lcs[static_cast<std::size_t>(p->lc)].slot_bytes;
  const bool off = std::strcmp(reason, "offload") == 0;
  outbox_.count(p->lc, off ? kOffloads : kOnboards);
  outbox_.count(p->lc, off ? kOffloadBytes : kOnboardBytes, nbytes);
  if (p->node != kNoNode && tree.is_attached(p->node)) {
    if (EventC* e = outbox_.new_event(EventKind::tier_changed)) {
      e->key = tree.key(p->node);
      e->lc = p->lc;
      e->old_tier = layout_.tier_id(was.old_tier);
      e->new_tier = layout_.tier_id(dst);
    }
  }
}

// py: evictor.py Evictor.drop — SPEC sec. 8
void Evictor::drop(const Page* p, const std::function<void(const Page*)>* write_back) {
  if (p->state() != kDroppable) throw InternalErr("kvcm bug: drop of a non-DROPPABLE page");
  outbox_.count(p->lc, kDrops);
  outbox_.count(p->lc, kDropBytes, layout_.cfg().lcs[static_cast<std::size_t>(p->lc)].slot_bytes);
  index_.unlink_committed(p, write_back);
  pages_.free_page(p);
}

// py: evictor.py Evictor.drop_all_droppable — SPEC sec. 8
void Evictor::drop_all_droppable() {
  bool progress = true;
  while (progress) {
    progress = false;
    for (std::int64_t t = 0; t < layout_.num_tiers(); ++t) {
      for (std::int64_t lc = 0; lc < static_cast<std::int64_t>(layout_.num_life_cycles()); ++lc) {
        while (const Page* p = pages_.peek(pages_.pool(t, lc), kDroppable)) {
          drop(p);
          progress = true;
        }
      }
    }
  }
}

// py: evictor.py Evictor.store_evicted — SPEC sec. 16
void Evictor::store_evicted(const Page* p) {
  const RadixTree& tree = index_.tree();
  if (p->coverage == layout_.B() && static_cast<std::int64_t>(tree.tokens(p->node).size()) == layout_.B()) {
    outbox_.store(p, tree.key(p->node));
  }
}

}  // namespace kvcm
