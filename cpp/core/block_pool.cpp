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
      index_(layout_, tree_, tokens_, pages_, outbox_),
      evictor_(layout_, pages_, index_, outbox_) {}

// py: block_pool.py BlockPool.alloc — SPEC sec. 7
const Page* BlockPool::alloc(std::int64_t lc, std::int64_t coverage, std::int64_t ordinal, std::int64_t priority,
                             bool active) {
  evictor_.ensure_room(kGpu, lc);
  const Page* p = pages_.new_page(kGpu, lc, coverage, priority, ordinal);
  pages_.use(p, active, priority);
  return p;
}

// py: block_pool.py BlockPool.insert_block — SPEC sec. 5
Inserted BlockPool::insert_block(const Chain& chain, std::int64_t i, std::span<const Tok> block, KeyHint hint,
                                 bool want_snapshot, bool defer_prune) {
  const Digest key = index_.key_for(chain, i, block, hint);
  Inserted done;
  const Page* snap = nullptr;
  if (want_snapshot && index_.lacks_snapshot(chain, i, block, key, done)) {
    snap = snapshot(chain, i, static_cast<std::int64_t>(block.size()), key);
  }
  return index_.insert_block(chain, i, block, key, std::move(done), snap, defer_prune);
}

// py: block_pool.py BlockPool.snapshot — SPEC sec. 7
const Page* BlockPool::snapshot(const Chain& chain, std::int64_t i, std::int64_t ntok, const Digest& key) {
  const std::int64_t ssm = layout_.ssm_lc();
  const Page* live = pages_.page_ptr(chain.live);
  if (live == nullptr || live->tier != kGpu || !evictor_.make_room(kGpu, ssm)) {
    outbox_.count(ssm, kSnapshotsSkipped);
    return nullptr;
  }
  const Page* snap = pages_.new_page(kGpu, ssm, ntok, chain.priority, i);
  outbox_.copy(ssm, &pages_.page(chain.live), snap, "snapshot");
  if (layout_.store_on_commit() && ntok == layout_.B()) outbox_.store(snap, key);  // shared_write="commit"
  return snap;
}

// py: block_pool.py BlockPool.set_active — SPEC sec. 4
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
