// The block pool (block_pool.h): the parts wired together, and the operations that span
// them.  Python twin: kvcm/python_backend/block_pool.py (BlockPool).
#include "core/block_pool.h"

#include <utility>

#include "core/manager_detail.h"

namespace kvcm {

using namespace detail;

BlockPool::BlockPool(ManagerConfig cfg)
    : layout_(std::move(cfg)),
      tree_(layout_.B(), [this] {
        std::vector<LifeCycleSpec> specs;
        for (const LcConfig& lc : layout_.cfg().lcs) specs.push_back(lc.spec());
        return specs;
      }()),
      tokens_(tree_, layout_.B()),
      pages_(layout_, tree_, outbox_, clock_),
      outbox_(layout_, tree_, pages_),
      index_(layout_, tree_, tokens_, pages_, evictor_, outbox_),
      evictor_(layout_, pages_, index_, outbox_) {}

// py: block_pool.py BlockPool.alloc — SPEC sec. 7
const Page* BlockPool::alloc(std::int64_t lc, std::int64_t coverage, std::int64_t ordinal, std::int64_t priority,
                             bool active) {
  evictor_.ensure_room(kGpu, lc);
  const Page* p = pages_.new_page(kGpu, lc, coverage, priority, ordinal);
  pages_.use(p, active, priority);
  return p;
}

void BlockPool::set_active(const Page* p, bool active) {
  if (active && p->tier != kGpu) {  // resumed on a colder tier: onboarded first (resume's check promised the room)
    evictor_.ensure_room(kGpu, p->lc);
    evictor_.move(p, kGpu, "onboard");
  }
  pages_.set_active(p, active);
}

void BlockPool::resize_pool(std::int64_t tier, std::int64_t lc, std::int64_t n) {
  const Pool& pool = pages_.pool(tier, lc);
  if (n < pool.total) {
    while (pool.total - pool.nfree() > n) {  // evict what must go, in the usual order (sec. 8)
      if (!evictor_.evict_one(tier, lc)) throw InternalErr("kvcm bug: set_quota found no victim");
    }
  }
  pages_.resize_pool(tier, lc, n);
}

void BlockPool::forget_pages(const std::vector<std::pair<std::int64_t, std::int64_t>>& lost) {
  for (const auto& [h, serial] : lost) {
    if (!pages_.page_alive(h) || pages_.page(h).serial != serial) continue;  // freed with an earlier subtree
    const Page* p = &pages_.page(h);
    outbox_.count(p->lc, kLostPages);
    if (p->node != kNoNode) {
      if (tree_.is_attached(p->node)) {
        index_.unlink_committed(p);
      } else {
        index_.unlink_from_node(p);
      }
      if (p->locks == 0 && p->holds == 0) pages_.free_page(p);
    }
  }
}

std::vector<std::pair<std::string, std::int64_t>> BlockPool::internal_sizes(std::int64_t num_requests) const {
  const auto n = [](std::size_t v) { return static_cast<std::int64_t>(v); };
  return {{"tree_nodes", n(tree_.num_nodes())},
          {"tree_node_slots", n(tree_.node_slots())},
          {"roots", n(tree_.num_roots())},
          {"trie_node_slots", n(tree_.trie_node_slots())},
          {"digests", n(tree_.num_digests())},
          {"digest_slots", n(tree_.digest_slots())},
          {"pages", pages_.live_count()},
          {"page_slots", pages_.page_slots()},
          {"requests", num_requests},
          {"copy_ops", n(outbox_.num_copy_ops())},
          {"events", n(outbox_.num_events())},
          {"event_tokens", n(outbox_.num_event_tokens())}};
}

}  // namespace kvcm
