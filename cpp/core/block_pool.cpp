// The block pool (SPEC sec. 4, 5, 8, 9): tokens, pages and their users (use / unuse / moves /
// drops), copy ops, events and stats.  Python twin: kvcm/python_backend/block_pool.py
// (BlockPool).
#include "core/block_pool.h"

#include <algorithm>
#include <bit>
#include <cstring>
#include <functional>
#include <limits>
#include <stdexcept>

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
      tokens_(tree_, layout_.B()) {
  const auto nlc = static_cast<std::int64_t>(layout_.num_life_cycles());
  pools_.resize(static_cast<std::size_t>(layout_.num_tiers()));
  for (std::int64_t t = 0; t < layout_.num_tiers(); ++t) {
    for (std::int64_t lc = 0; lc < nlc; ++lc) {
      pools_[static_cast<std::size_t>(t)].emplace_back(
          t, lc, layout_.cfg().slots[static_cast<std::size_t>(t)][static_cast<std::size_t>(lc)], &evict_nodes_);
    }
  }
  const std::size_t n = kHeader + static_cast<std::size_t>(nlc) * kNumCounters;
  totals_.assign(n, 0);
  iteration_.assign(n, 0);
}

// py: block_pool.py BlockPool.match_shared — SPEC sec. 16
SharedMatch BlockPool::match_shared(NodeId root, std::span<const Digest> keys, const SharedHits& hits) const {
  SharedMatch sm;
  if (root != kNoNode) sm.path = tree_.key_path(root, keys);
  const auto nlc = static_cast<std::int64_t>(layout_.cfg().lcs.size());
  std::size_t last = 0;  // rows up to the last block with a hit
  for (std::size_t i = sm.path.size(); i < keys.size(); ++i) {
    std::vector<std::int64_t> row(static_cast<std::size_t>(nlc), 0);
    for (std::int64_t lc = 0; lc < nlc; ++lc) {
      if (std::binary_search(hits.begin(), hits.end(), std::pair<Digest, std::int64_t>(keys[i], lc))) {
        row[static_cast<std::size_t>(lc)] = layout_.B();
        last = sm.rows.size() + 1;
      }
    }
    sm.rows.push_back(std::move(row));
  }
  sm.rows.resize(last);
  if (sm.rows.empty()) return sm;
  const std::int64_t n = static_cast<std::int64_t>(sm.path.size() + sm.rows.size());
  const std::int64_t m = std::max<std::int64_t>(0, n * layout_.B() - layout_.cfg().reuse_match_backoff);
  sm.m = tree_.prune_extended(sm.path, sm.rows, m);
  sm.m_before_ssm = tree_.prune_extended(sm.path, sm.rows, m, false);
  return sm;
}

// DECISIONS.md "The shared tier": the extension is taken only when longer.
// py: block_pool.py BlockPool.match_with_hits — SPEC sec. 6
RequestMatch BlockPool::match_with_hits(NodeId root, std::span<const Tok> query, std::span<const Digest> keys,
                                        const SharedHits* hits) const {
  RequestMatch out;
  if (query.empty()) return out;
  if (root != kNoNode) {
    MatchResult mr = tree_.match(root, query, keys, layout_.cfg().enable_partial_reuse, layout_.cfg().reuse_match_backoff);
    out.m = mr.m;
    out.m_before_ssm = mr.m_before_ssm;
    out.path = std::move(mr.path);
  }
  if (hits != nullptr) {
    SharedMatch sm = match_shared(root, keys, *hits);
    if (sm.m > out.m) {
      out.m = sm.m;
      out.m_before_ssm = sm.m_before_ssm;
      out.path = std::move(sm.path);
      out.rows = std::move(sm.rows);
      out.extended = true;
    }
  }
  return out;
}

// What a request created with the match holds per block (Request::match_and_hold): the
// attention pages of blocks not stale at m, the ssm snapshot of the block m ends in.
// py: block_pool.py BlockPool.block_tiers — SPEC sec. 6
std::vector<std::int64_t> BlockPool::block_tiers(const std::vector<NodeId>& path, std::int64_t m) const {
  const std::int64_t last = ceildiv(m, layout_.B()) - 1;  // the block whose snapshot a request holds
  const auto nlc = static_cast<std::int64_t>(layout_.cfg().lcs.size());
  std::vector<std::pair<std::int64_t, std::int64_t>> stale;  // per lc, its stale range at m
  stale.reserve(static_cast<std::size_t>(nlc));
  for (std::int64_t lc = 0; lc < nlc; ++lc) stale.push_back(layout_.stale_range(lc, m));
  const std::int64_t nfull = m / layout_.B();
  std::vector<std::int64_t> out;
  out.reserve(static_cast<std::size_t>(nfull));
  for (std::int64_t j = 0; j < nfull; ++j) {
    std::int64_t tier = -1;
    for (std::int64_t lc = 0; lc < nlc; ++lc) {
      const auto [lo, hi] = stale[static_cast<std::size_t>(lc)];
      if (layout_.cfg().lcs[static_cast<std::size_t>(lc)].ssm ? j != last : (lo <= j && j < hi)) continue;
      if (j >= static_cast<std::int64_t>(path.size())) {  // the shared tier's extension: a shared page
        tier = std::max(tier, tier_id(layout_.shared_pos()));
        continue;
      }
      const Page& p = page(tree_.page(path[static_cast<std::size_t>(j)], lc));
      tier = std::max(tier, tier_id(p.tier));
    }
    out.push_back(tier);
  }
  return out;
}

NodeId BlockPool::new_block(const Digest& key, std::span<const Tok> tokens, std::int64_t ordinal) {
  return tree_.new_block(key, tokens, ordinal);
}

void BlockPool::no_page(std::int64_t handle) { throw InternalErr("kvcm bug: no page " + std::to_string(handle)); }

// A free slot of the page slab (freed slots first, LIFO), its page reset but for the handle.
std::int64_t BlockPool::take_page_handle() {
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

// py: block_pool.py BlockPool.new_page — SPEC sec. 4
Page* BlockPool::new_page(std::int64_t tier, std::int64_t lc, std::int64_t coverage, std::int64_t priority,
                                 std::int64_t ordinal) {
  Pool& pool = pools_[static_cast<std::size_t>(tier)][static_cast<std::size_t>(lc)];
  Page* p = make_page(tier, lc, pool.take_slot(), coverage, priority, ordinal);
  count(lc, kAllocatedBlocks);
  return p;
}

// DECISIONS.md "The shared tier".
// py: block_pool.py BlockPool.new_shared_page — SPEC sec. 16
Page* BlockPool::new_shared_page(std::int64_t lc, std::int64_t priority, std::int64_t ordinal) {
  Page* p = make_page(layout_.shared_pos(), lc, -1, layout_.B(), priority, ordinal);
  count(lc, kSharedHitBlocks);
  return p;
}

// py: block_pool.py BlockPool.make_page — SPEC sec. 4
Page* BlockPool::make_page(std::int64_t tier, std::int64_t lc, std::int64_t slot, std::int64_t coverage,
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

// py: block_pool.py BlockPool.use — SPEC sec. 4
void BlockPool::use(Page* p, bool active, std::int64_t priority) {
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

// py: block_pool.py BlockPool.unuse — SPEC sec. 4
void BlockPool::unuse(const Page* cp, bool active) {
  Page* p = own(cp);
  restate(*p, [&] {
    if (active) {
      --p->locks;
    } else {
      --p->holds;
    }
    p->last_used = clock_;
  });
  if (p->locks == 0 && p->holds == 0) {
    if (p->tier == layout_.shared_pos() && p->node != kNoNode && tree_.is_attached(p->node)) {
      // DECISIONS.md "The shared tier": a shared page lives only while a request uses it
      unlink_committed(p);
      free_page(p);
    } else if (p->node == kNoNode) {
      free_page(p);
    } else if (!tree_.is_attached(p->node)) {
      free_orphan_page(p);
    }
  }
}

// py: block_pool.py BlockPool.set_active — SPEC sec. 4
void BlockPool::set_active(const Page* cp, bool active) {
  Page* p = own(cp);
  if (active && p->tier != kGpu) {  // resumed on a colder tier: onboarded first (resume's check promised the room)
    ensure_room(kGpu, p->lc);
    move(p, kGpu, "onboard");
  }
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

// py: block_pool.py BlockPool.free_page — SPEC sec. 4
void BlockPool::free_page(Page* p) {
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
// py: block_pool.py BlockPool.budget — SPEC sec. 8
Budget BlockPool::budget(std::int64_t lc, std::span<const std::int64_t> releasing) const {
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
// py: block_pool.py BlockPool.capacity_of — SPEC sec. 8
std::int64_t BlockPool::capacity_of(std::int64_t tier, std::int64_t lc) const {
  const Pool& pool = pools_[static_cast<std::size_t>(tier)][static_cast<std::size_t>(lc)];
  const std::int64_t free = pool.nfree(), held = pool.held, droppable = pool.droppable;
  if (tier == layout_.num_tiers() - 1) return free + droppable;
  return free + droppable + std::min(held, capacity_of(tier + 1, lc));
}

// py: block_pool.py BlockPool.make_room — SPEC sec. 8
bool BlockPool::make_room(std::int64_t tier, std::int64_t lc) {
  Pool& pool = pools_[static_cast<std::size_t>(tier)][static_cast<std::size_t>(lc)];
  if (pool.nfree()) return true;
  return evict_one(tier, lc);
}

// One more free slot by evicting the pool's first victim (make_room of a full pool;
// set_quota's shrink with free slots left).  false: nothing could go, nothing changed.
// py: block_pool.py BlockPool.evict_one — SPEC sec. 8
bool BlockPool::evict_one(std::int64_t tier, std::int64_t lc) {
  Pool& pool = pools_[static_cast<std::size_t>(tier)][static_cast<std::size_t>(lc)];
  const std::int64_t nfree = pool.nfree();
  Page* v = victim(pool, /*can_offload=*/true);
  if (v == nullptr) return false;
  if (tier < layout_.num_tiers() - 1 && make_room(tier + 1, lc)) {
    if (pool.nfree() > nfree) return true;  // a drop down there removed a subtree and freed a slot here
    move(v, tier + 1, "offload");
    return true;
  }
  // No room below (a failed make_room changes nothing): drop instead.
  v = victim(pool, /*can_offload=*/false);
  if (v == nullptr) return false;
  if (layout_.cfg().shared_write_evict) store_evicted(v);
  evicting_ = layout_.cfg().shared_write_evict;
  drop(v);
  evicting_ = false;
  return true;
}

// py: block_pool.py BlockPool.move — SPEC sec. 8
void BlockPool::move(Page* p, std::int64_t dst, const char* reason) {
  Pool& dst_pool = pools_[static_cast<std::size_t>(dst)][static_cast<std::size_t>(p->lc)];
  const std::int64_t old_tier = p->tier, old_slot = p->slot;
  const std::int64_t new_slot = dst_pool.take_slot();
  CopyOpC op{p->lc, tier_id(old_tier), old_slot, tier_id(dst), new_slot, reason};
  if (old_tier == layout_.shared_pos()) {  // a shared page: no slot, no pool; the op names its object
    op.has_key = true;
    op.key = tree_.key(p->node);
  } else {
    unindex(*p);
    pools_[static_cast<std::size_t>(old_tier)][static_cast<std::size_t>(p->lc)].give_slot(old_slot);
  }
  p->tier = static_cast<std::uint8_t>(dst);
  p->slot = static_cast<std::int32_t>(new_slot);
  index(*p);
  add_copy_op(op);
  copy_pages_.emplace_back(p->handle, p->serial);
  const std::int64_t nbytes = layout_.cfg().lcs[static_cast<std::size_t>(p->lc)].slot_bytes;
  const bool off = std::strcmp(reason, "offload") == 0;
  count(p->lc, off ? kOffloads : kOnboards);
  count(p->lc, off ? kOffloadBytes : kOnboardBytes, nbytes);
  if (p->node != kNoNode && tree_.is_attached(p->node)) {
    if (EventC* e = new_event(EventKind::tier_changed)) {
      e->key = tree_.key(p->node);
      e->lc = p->lc;
      e->old_tier = tier_id(old_tier);
      e->new_tier = tier_id(dst);
    }
  }
}

// py: block_pool.py BlockPool.drop — SPEC sec. 8
void BlockPool::drop(Page* p) {
  if (p->state() != kDroppable) throw InternalErr("kvcm bug: drop of a non-DROPPABLE page");
  count(p->lc, kDrops);
  count(p->lc, kDropBytes, layout_.cfg().lcs[static_cast<std::size_t>(p->lc)].slot_bytes);
  unlink_committed(p);
  free_page(p);
}

// py: block_pool.py BlockPool.unlink_committed — SPEC sec. 5
void BlockPool::unlink_committed(Page* p) {
  const NodeId node = p->node;
  const std::int64_t lc = p->lc;
  const Digest key = tree_.key(node);
  const std::int64_t ordinal = tree_.ordinal(node);
  unlink_from_node(p);
  emit_removed(key, lc);
  const LcConfig& life = layout_.cfg().lcs[static_cast<std::size_t>(lc)];
  const bool full = !life.ssm && life.window < 0;
  if (full || (!life.ssm && ordinal < sink_blocks(life.sinks, layout_.B()))) {
    const NodeId parent = tree_.parent(node);
    if (tree_.is_bare_leaf(node)) {
      // the usual victim (a leaf holding no other page): what remove_subtree + retire_nodes
      // do to it, without the lists — it leaves the tree and dies, nothing to announce
      tree_.detach(node);
      tree_.collect(node);
    } else {
      retire_nodes(tree_.remove_subtree(node), true);
    }
    if (parent != kNoNode) tree_.prune_upward(parent);
  } else {
    tree_.prune_upward(node);
  }
}

// py: block_pool.py BlockPool.unlink_from_node — SPEC sec. 5
void BlockPool::unlink_from_node(Page* p) {
  const NodeId node = p->node;
  restate(*p, [&] { p->node = kNoNode; });
  tree_.clear_page(node, p->lc);  // may delete a dead orphan node
}

// py: block_pool.py BlockPool.retire_nodes — SPEC sec. 5
void BlockPool::retire_nodes(const std::vector<NodeId>& ids, bool announce) {
  const auto nlc = static_cast<std::int64_t>(layout_.cfg().lcs.size());
  for (NodeId nid : ids) {
    if (!tree_.exists(nid)) continue;
    const Digest key = tree_.key(nid);
    for (std::int64_t lc = 0; lc < nlc; ++lc) {
      if (!tree_.exists(nid)) break;  // deleted with its last page: nothing left
      const PageHandle h = tree_.page(nid, lc);
      if (h == kNoPage) continue;
      if (announce) emit_removed(key, lc);
      Page* pg = &mut(h);
      if (pg->locks == 0 && pg->holds == 0) {
        if (evicting_) store_evicted(pg);  // freed with an evicted page: written back too
        count(lc, kDrops);
        count(lc, kDropBytes, layout_.cfg().lcs[static_cast<std::size_t>(lc)].slot_bytes);
        free_orphan_page(pg);
      }
    }
    tree_.collect(nid);
  }
}

// py: block_pool.py BlockPool.free_orphan_page — SPEC sec. 5
void BlockPool::free_orphan_page(Page* p) {
  unlink_from_node(p);
  free_page(p);
}

// py: block_pool.py BlockPool.drop_all_droppable — SPEC sec. 8
void BlockPool::drop_all_droppable() {
  bool progress = true;
  while (progress) {
    progress = false;
    for (auto& tier_pools : pools_) {
      for (Pool& pool : tier_pools) {
        while (Page* p = peek(pool, kDroppable)) {
          drop(p);
          progress = true;
        }
      }
    }
  }
}

// The pools of each tier, one writer for both views (SPEC sec. 9, 11): stats()["tiers"]
// (the state counters) and snapshot()["pools"] (the free slots); each tier entry is
// `{"tier":N,"kind":"...","quota_bytes":Q,"lc":[...]}`, tier numbered by kind (SPEC sec. 1).
void BlockPool::pools_json(std::string& o, bool snapshot) const {
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

// py: block_pool.py BlockPool.copy — SPEC sec. 8
void BlockPool::copy(std::int64_t lc, const Page* src, const Page* dst, const char* reason) {
  add_copy_op(CopyOpC{lc, tier_id(src->tier), src->slot, tier_id(dst->tier), dst->slot, reason});
  copy_pages_.emplace_back(dst->handle, dst->serial);
  count(lc, std::strcmp(reason, "snapshot") == 0 ? kSnapshotsTaken : kCows);
}

// DECISIONS.md "The shared tier": it fills no page here (forget_copies forgets nothing).
// py: block_pool.py BlockPool.store — SPEC sec. 16
void BlockPool::store(const Page* p, const Digest& key) {
  CopyOpC op{p->lc, tier_id(p->tier), p->slot, 3, -1, "store"};
  op.has_key = true;
  op.key = key;
  add_copy_op(op);
  copy_pages_.emplace_back(-1, -1);
  count(p->lc, kSharedStores);
  count(p->lc, kSharedStoreBytes, layout_.cfg().lcs[static_cast<std::size_t>(p->lc)].slot_bytes);
}

// py: block_pool.py BlockPool.store_evicted — SPEC sec. 16
void BlockPool::store_evicted(const Page* p) {
  if (p->coverage == layout_.B() && static_cast<std::int64_t>(tree_.tokens(p->node).size()) == layout_.B()) store(p, tree_.key(p->node));
}

// The pending copy ops warning (sec. 15): warned once, at the call's end.
// py: block_pool.py BlockPool.add_copy_op — SPEC sec. 8
void BlockPool::add_copy_op(const CopyOpC& op) {
  copy_ops_.push_back(op);
  // (the figure, with the unsettled ops, grows only here, one op at a time: == catches the crossing)
  if (static_cast<std::int64_t>(copy_ops_.size()) + unsettled_ops_ == layout_.cfg().pending_copy_ops_warning &&
      !copy_ops_warned_) {
    copy_ops_warned_ = copy_ops_warn_due_ = true;
  }
}

// py: block_pool.py BlockPool.emit — SPEC sec. 9
EventC* BlockPool::new_event(EventKind kind, std::span<const Tok> tokens, bool tokens_have_digest) {
  const std::int64_t id = event_id();  // ids advance even for events nobody buffers
  if (layout_.cfg().max_events == 0) {
    ++events_dropped_;
    return nullptr;
  }
  if (static_cast<std::int64_t>(events_.size()) >= layout_.cfg().max_events) {
    const auto [sized, nblk] = event_sizes_.front();
    const std::uint32_t ntok = sized & ~kEventHasDigest;
    if (sized & kEventHasDigest) {  // the digests it referenced (rare: most events skip this)
      for (std::size_t i = 0; i < ntok; ++i) tree_.release(event_tokens_[i]);
    }
    event_tokens_.pop_front(ntok);
    event_blocks_.pop_front(nblk);
    event_sizes_.pop_front();
    events_.pop_front();
    ++events_dropped_;
  }
  EventC& e = events_.emplace_back();
  e.kind = kind;
  e.id = id;
  e.ntokens = static_cast<std::uint32_t>(tokens.size());
  event_tokens_.append(tokens.data(), tokens.size());
  std::uint32_t sized = e.ntokens;
  if (tokens_have_digest) {
    tree_.retain_all(tokens);  // the buffered event holds its digests (released when dropped or taken)
    sized |= kEventHasDigest;
  }
  event_sizes_.emplace_back(sized, 0);
  return &e;
}

// py: block_pool.py BlockPool.emit_removed — SPEC sec. 9
void BlockPool::emit_removed(const Digest& key, std::int64_t lc) {
  if (EventC* e = new_event(EventKind::removed)) {
    e->key = key;
    e->lc = lc;
  }
}

// py: block_pool.py BlockPool.emit_stored — SPEC sec. 9
void BlockPool::emit_stored(NodeId nid, std::span<const std::int64_t> lcs) {
  if (lcs.empty()) return;
  const std::span<const Tok> tokens = tree_.tokens(nid);
  EventC* e = new_event(EventKind::stored, tokens, tree_.has_digest(nid));
  if (e == nullptr) return;
  const NodeId parent = tree_.parent(nid);
  if (parent != kNoNode) {
    e->has_parent = true;
    e->parent_key = tree_.key(parent);
  }
  e->key = tree_.key(nid);
  for (std::int64_t lc : lcs) {
    const Page& p = page(tree_.page(nid, lc));
    event_blocks_.emplace_back(
        StoredBlockC{static_cast<std::int32_t>(lc), static_cast<std::int32_t>(tier_id(p.tier)), p.priority,
                     static_cast<std::int32_t>(tree_.coverage(nid, lc))});
    ++e->nblocks;
    ++event_sizes_.back().second;
  }
  e->partial = static_cast<std::int64_t>(tokens.size()) < layout_.B();
}

// py: block_pool.py BlockPool.count — SPEC sec. 9
void BlockPool::count(std::int64_t lc, int counter, std::int64_t n) {
  const std::size_t i = kHeader + static_cast<std::size_t>(lc) * kNumCounters + static_cast<std::size_t>(counter);
  totals_[i] += n;
  iteration_[i] += n;
}

// py: block_pool.py BlockPool.record_match — SPEC sec. 9
void BlockPool::record_match(std::int64_t n_query, std::int64_t m) {
  for (std::vector<std::int64_t>* c : {&totals_, &iteration_}) {
    (*c)[0] += 1;
    (*c)[1] += n_query;
    (*c)[2] += m;
    for (std::int64_t lc : layout_.attn_lcs()) {
      const std::size_t base = kHeader + static_cast<std::size_t>(lc) * kNumCounters;
      (*c)[base + kReusedTokens] += m;
      (*c)[base + kReusedBlocks] += ceildiv(m, layout_.B());
      (*c)[base + kMissedBlocks] += ceildiv(n_query, layout_.B()) - ceildiv(m, layout_.B());
    }
  }
}

// py: block_pool.py BlockPool.stats_view — SPEC sec. 9
void BlockPool::stats_view(std::string& o, const std::vector<std::int64_t>& c) const {
  o += "{\"requests\":";
  j_int(o, c[0]);
  o += ",\"query_tokens\":";
  j_int(o, c[1]);
  o += ",\"reused_tokens\":";
  j_int(o, c[2]);
  o += ",\"lc\":[";
  const std::size_t nlc = layout_.cfg().lcs.size();
  for (std::size_t lc = 0; lc < nlc; ++lc) {
    if (lc) o += ',';
    o += '{';
    for (int k = 0; k < kNumCounters; ++k) {
      if (k) o += ',';
      j_str(o, kCounterNames[k]);
      o += ':';
      j_int(o, c[kHeader + lc * kNumCounters + static_cast<std::size_t>(k)]);
    }
    o += '}';
  }
  o += "],\"tiers\":[";
  pools_json(o, false);
  o += "],\"events_dropped\":";
  j_int(o, events_dropped_);
  o += ",\"pending_copy_ops\":";
  j_int(o, static_cast<std::int64_t>(copy_ops_.size()));
  o += '}';
}

// The body of Manager::drain_copy_ops.
// py: block_pool.py BlockPool.take_copy_ops — SPEC sec. 8
std::vector<CopyOpC> BlockPool::drain_copy_ops() {
  std::vector<CopyOpC> out;
  out.swap(copy_ops_);
  copy_ops_.reserve(out.size());  // the next step's ops: one allocation, not a doubling chain
  // explicit settlement: a drain with ops becomes the newest unsettled one (an empty one
  // records nothing); else it is the last drain (forget_copies)
  if (layout_.cfg().explicit_settlement && out.empty()) return out;
  std::vector<IssuedOp>& issued = layout_.cfg().explicit_settlement ? unsettled_.emplace_back() : issued_;
  if (layout_.cfg().explicit_settlement) unsettled_ops_ += static_cast<std::int64_t>(out.size());
  // field by field into place: an IssuedOp temporary went through the stack in pieces and
  // was read back whole, a store-forwarding stall per op
  issued.resize(out.size());
  for (std::size_t k = 0; k < out.size(); ++k) {
    IssuedOp& io = issued[k];
    io.op = out[k];
    io.handle = copy_pages_[k].first;
    io.serial = copy_pages_[k].second;
  }
  copy_pages_.clear();
  return out;
}

// py: block_pool.py BlockPool.resize_pool — SPEC sec. 18
void BlockPool::resize_pool(std::int64_t tier, std::int64_t lc, std::int64_t n) {
  Pool& pool = pools_[static_cast<std::size_t>(tier)][static_cast<std::size_t>(lc)];
  if (n >= pool.total) {
    pool.free_slots.resize(pool.total, n);
    pool.total = n;
    return;
  }
  while (pool.total - pool.nfree() > n) {  // evict what must go, in the usual order (sec. 8)
    if (!evict_one(tier, lc)) throw InternalErr("kvcm bug: set_quota found no victim");
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

// py: block_pool.py BlockPool.relocate — SPEC sec. 18
void BlockPool::relocate(Page* p) {
  Pool& pool = pools_[static_cast<std::size_t>(p->tier)][static_cast<std::size_t>(p->lc)];
  const std::int64_t old = p->slot;
  p->slot = static_cast<std::int32_t>(pool.take_slot());
  pool.give_slot(old);
  const std::int64_t t = tier_id(p->tier);
  add_copy_op(CopyOpC{p->lc, t, old, t, p->slot, "relocate"});
  copy_pages_.emplace_back(p->handle, p->serial);
  count(p->lc, kRelocations);
}

// The body of Manager::take_events.
TakenEvents BlockPool::take_events() {
  TakenEvents out;
  out.events.assign(events_.begin(), events_.end());
  out.tokens.reserve(event_tokens_.size());
  for (Tok c : event_tokens_) out.tokens.push_back(tokens_.decode(c));
  for (Tok c : event_tokens_) {
    if (c & kDigestCode) tree_.release(c);
  }
  out.blocks.assign(event_blocks_.begin(), event_blocks_.end());
  events_.clear();
  event_tokens_.clear();
  event_blocks_.clear();
  event_sizes_.clear();
  return out;
}

std::vector<std::int64_t> BlockPool::live_pages() const {
  std::vector<std::int64_t> out;
  out.reserve(static_cast<std::size_t>(page_slots_) - free_pages_.size());
  for (std::int64_t h = 0; h < page_slots_; ++h) {
    if (page_alive(h)) out.push_back(h);
  }
  std::sort(out.begin(), out.end(), [this](std::int64_t a, std::int64_t b) { return page(a).serial < page(b).serial; });
  return out;
}


namespace {
// An op as kvcm.api.CopyOp.to_json() shows in a Python message: [0, 1, 2, 3, 4, 'offload'(, 'hex')].
std::string op_text(const CopyOpC& o) {
  std::string t = "[";  // (appended piece by piece: GCC 12 warns on "[" + std::to_string(...))
  for (std::int64_t v : {o.lc, o.src_tier, o.src_slot, o.dst_tier, o.dst_slot}) {
    t += std::to_string(v);
    t += ", ";
  }
  t += '\'';
  t += o.reason;
  t += '\'';
  if (o.has_key) {
    t += ", ";
    j_hex(t, o.key);  // "..." -> '...'
    t.back() = '\'';
    t[t.size() - 2 * o.key.size() - 2] = '\'';
  }
  t += ']';
  return t;
}
}  // namespace

// py: block_pool.py BlockPool.match_issued — SPEC sec. 15
std::vector<bool> BlockPool::match_issued(std::span<const IssuedOp> drain, std::span<const CopyOpC> ops, bool settle) {
  auto same = [](const CopyOpC& a, const CopyOpC& b) {
    return a.lc == b.lc && a.src_tier == b.src_tier && a.src_slot == b.src_slot && a.dst_tier == b.dst_tier &&
           a.dst_slot == b.dst_slot && std::strcmp(a.reason, b.reason) == 0 && a.has_key == b.has_key &&
           (!a.has_key || a.key == b.key);
  };
  std::vector<bool> taken(drain.size(), false);
  for (std::size_t i = 0; i < ops.size(); ++i) {
    std::size_t k = 0;
    while (k < drain.size() && (taken[k] || !same(drain[k].op, ops[i]))) ++k;
    if (k == drain.size()) {
      std::string at = "[";
      at += std::to_string(i);
      at += "] ";
      at += op_text(ops[i]);
      // the texts of kvcm.checks.not_in_oldest_drain_error / not_issued_error
      throw ValueErr(settle ? "settle_copies(): failed" + at +
                                  " is not an op of the oldest unsettled drain (or is listed more times than that "
                                  "drain returned it)"
                            : "forget_copies(): ops" + at + " is not an unreported op of the last drain_copy_ops()");
    }
    taken[k] = true;
  }
  return taken;
}

// py: block_pool.py BlockPool.live_fills — SPEC sec. 15
std::vector<std::pair<std::int64_t, std::int64_t>> BlockPool::live_fills(std::span<const IssuedOp> drain,
                                                                         const std::vector<bool>& taken) const {
  std::vector<std::pair<std::int64_t, std::int64_t>> lost;  // (handle, serial) of each lost live page
  for (std::size_t k = 0; k < drain.size(); ++k) {
    const IssuedOp& e = drain[k];
    if (taken[k] && page_alive(e.handle) && page(e.handle).serial == e.serial &&
        std::find_if(lost.begin(), lost.end(), [&e](const auto& l) { return l.first == e.handle; }) == lost.end()) {
      lost.emplace_back(e.handle, e.serial);
    }
  }
  return lost;
}

// py: block_pool.py BlockPool.take_issued — SPEC sec. 15
std::vector<std::pair<std::int64_t, std::int64_t>> BlockPool::take_issued(std::span<const CopyOpC> ops) {
  const std::vector<bool> taken = match_issued(issued_, ops, false);
  std::vector<std::pair<std::int64_t, std::int64_t>> lost;
  if (ops.empty()) return lost;
  lost = live_fills(issued_, taken);
  std::vector<IssuedOp> keep;
  for (std::size_t k = 0; k < issued_.size(); ++k) {
    if (!taken[k]) keep.push_back(issued_[k]);
  }
  issued_ = std::move(keep);
  return lost;
}

// DECISIONS.md "Asynchronous copies: settle_copies".
// py: block_pool.py BlockPool.settle_oldest — SPEC sec. 15
std::vector<std::pair<std::int64_t, std::int64_t>> BlockPool::settle_oldest(std::span<const CopyOpC> failed) {
  // the text of kvcm.checks.NOTHING_TO_SETTLE
  if (unsettled_.empty()) {
    throw ValueErr("settle_copies(): no unsettled drain (each drain_copy_ops() / drain_copy_runs() that returned "
                   "ops is settled once)");
  }
  const std::vector<IssuedOp>& drain = unsettled_.front();
  std::vector<std::pair<std::int64_t, std::int64_t>> lost = live_fills(drain, match_issued(drain, failed, true));
  unsettled_ops_ -= static_cast<std::int64_t>(drain.size());
  unsettled_.pop_front();
  return lost;
}

void BlockPool::forget_pages(const std::vector<std::pair<std::int64_t, std::int64_t>>& lost) {
  for (const auto& [h, serial] : lost) {
    if (!page_alive(h) || page(h).serial != serial) continue;  // freed with an earlier subtree
    Page* p = &mut(h);
    count(p->lc, kLostPages);
    if (p->node != kNoNode) {
      if (tree_.is_attached(p->node)) {
        unlink_committed(p);
      } else {
        unlink_from_node(p);
      }
      if (p->locks == 0 && p->holds == 0) free_page(p);
    }
  }
}

void BlockPool::stats_json(std::string& o, bool take_iteration) {
  if (take_iteration) {
    stats_view(o, iteration_);
    std::fill(iteration_.begin(), iteration_.end(), 0);
  } else {
    stats_view(o, totals_);
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
                         {"pages", page_slots_ - n(free_pages_.size())},
                         {"page_slots", page_slots_},
                         {"requests", num_requests},
                         {"copy_ops", n(copy_ops_.size())},
                         {"events", n(events_.size())},
                         {"event_tokens", n(event_tokens_.size())}};
}

// ------------------------------------------------------------------ a request's references

namespace {
// The page handle `chain` uses for block i of lc, -1 when none.
std::int64_t chain_page(const Chain& chain, std::int64_t lc, std::int64_t i) {
  const auto& v = chain.pages[static_cast<std::size_t>(lc)];
  return i < static_cast<std::int64_t>(v.size()) ? v[static_cast<std::size_t>(i)] : -1;
}

// The block `chain` references for ordinal j, read through the insertion's switches so far.
NodeId chain_block(const Chain& chain, const Inserted& done, std::int64_t j) {
  const auto it = done.switched.find(j);
  return it == done.switched.end() ? chain.blocks[static_cast<std::size_t>(j)] : it->second;
}
}  // namespace

// py: block_pool.py BlockPool.open_scope — SPEC sec. 15
NodeId BlockPool::open_scope(const Digest& root_key) {
  const NodeId root = tree_.root(root_key);
  tree_.ref(root);
  return root;
}

// create's match and holds (SPEC sec. 6, 7; DECISIONS.md "The shared tier": the extension
// is taken only when longer, its blocks inserted with shared pages).
// py: block_pool.py BlockPool.hold_match — SPEC sec. 7
HeldMatch BlockPool::hold_match(NodeId root, std::span<const Tok> query, std::span<const Digest> keys,
                                const SharedHits* hits, std::int64_t priority) {
  RequestMatch match = match_with_hits(root, query, keys, hits);
  HeldMatch out;
  const std::int64_t m = out.m = match.m;
  out.blocks = match.extended ? insert_shared_blocks(root, query, keys, m, match, priority) : std::move(match.path);
  const std::vector<NodeId>& path = out.blocks;
  for (NodeId nid : path) tree_.ref(nid);
  out.pages.assign(layout_.cfg().lcs.size(), {});
  for (std::int64_t lc : layout_.attn_lcs()) out.pages[static_cast<std::size_t>(lc)].assign(path.size(), -1);
  for (std::int64_t lc : layout_.attn_lcs()) {
    const auto [lo, hi] = layout_.stale_range(lc, m);
    for (std::size_t j = 0; j < path.size(); ++j) {
      const auto jj = static_cast<std::int64_t>(j);
      if (lo <= jj && jj < hi) continue;
      Page* p = &mut(tree_.page(path[j], lc));
      use(p, false, priority);
      out.pages[static_cast<std::size_t>(lc)][j] = p->handle;
    }
  }
  if (layout_.ssm_lc() >= 0 && m > 0) {
    Page* s = &mut(tree_.page(path.back(), layout_.ssm_lc()));
    out.snap = s->handle;
    use(s, false, priority);
  }
  return out;
}

// DECISIONS.md "The shared tier": the extension's blocks below ceil(m / B) enter the tree at
// once, with a shared page for exactly the pages the request will hold (attention pages of
// blocks non-stale at m, the ssm snapshot of the block m ends in).
// py: block_pool.py BlockPool.insert_shared_blocks — SPEC sec. 16
std::vector<NodeId> BlockPool::insert_shared_blocks(NodeId root, std::span<const Tok> query,
                                                    std::span<const Digest> keys, std::int64_t m,
                                                    const RequestMatch& sm, std::int64_t priority) {
  const std::int64_t nb = ceildiv(m, layout_.B());
  const auto np = static_cast<std::int64_t>(sm.path.size());
  std::vector<NodeId> path(sm.path.begin(), sm.path.begin() + std::min(nb, np));
  NodeId parent = path.empty() ? root : path.back();
  const auto nlc = static_cast<std::int64_t>(layout_.cfg().lcs.size());
  for (std::int64_t i = np; i < nb; ++i) {
    const std::vector<std::int64_t>& row = sm.rows[static_cast<std::size_t>(i - np)];
    const NodeId nid = new_block(keys[static_cast<std::size_t>(i)],
                                 query.subspan(static_cast<std::size_t>(i * layout_.B()), static_cast<std::size_t>(layout_.B())), i);
    for (std::int64_t lc = 0; lc < nlc; ++lc) {
      bool held;
      if (layout_.cfg().lcs[static_cast<std::size_t>(lc)].ssm) {
        held = i == nb - 1;
      } else {
        const auto [lo, hi] = layout_.stale_range(lc, m);
        held = !(lo <= i && i < hi);
      }
      if (!held) continue;
      if (row[static_cast<std::size_t>(lc)] != layout_.B()) {
        throw InternalErr("kvcm bug: the fixed point kept a block without its page");
      }
      Page* p = new_shared_page(lc, priority, i);
      tree_.set_page(nid, lc, p->handle, layout_.B());
      p->node = static_cast<std::int32_t>(nid);  // (a shared page is in no pool: the field alone)
    }
    attach(parent, nid);
    path.push_back(nid);
    parent = nid;
  }
  return path;
}

// py: block_pool.py BlockPool.hold — SPEC sec. 18
void BlockPool::hold(const std::vector<NodeId>& blocks, const std::vector<std::vector<std::int64_t>>& pages,
                     std::int64_t priority) {
  for (NodeId nid : blocks) {
    if (nid != kNoNode) tree_.ref(nid);
  }
  for (std::int64_t lc : layout_.attn_lcs()) {
    for (std::int64_t h : pages[static_cast<std::size_t>(lc)]) {
      if (h >= 0) use(&mut(h), true, priority);
    }
  }
}

// py: block_pool.py BlockPool.alloc — SPEC sec. 7
const Page* BlockPool::alloc(std::int64_t lc, std::int64_t coverage, std::int64_t ordinal, std::int64_t priority,
                       bool active) {
  ensure_room(kGpu, lc);
  Page* p = new_page(kGpu, lc, coverage, priority, ordinal);
  use(p, active, priority);
  return p;
}

// py: block_pool.py BlockPool.ensure_room — SPEC sec. 8
void BlockPool::ensure_room(std::int64_t tier, std::int64_t lc) {
  if (!make_room(tier, lc)) throw InternalErr("kvcm bug: a feasibility check passed but eviction found no slot");
}

// ------------------------------------------------------------------ tree insertion (sec. 5)

// Also SPEC sec. 7: a new block adopting the request's pages, or the existing equivalent
// one, which takes the request's pages where they cover more (and the request the tree's
// gpu page where the tree's covers as much); with want_snapshot the live ssm state is
// copied into a snapshot page first when the block has none covering as much.
// defer_prune: more blocks of this commit follow, so a pageless new block leaves its parent
// chain attached (no quadratic re-attach; DECISIONS.md).
// py: block_pool.py BlockPool.insert_block — SPEC sec. 5
Inserted BlockPool::insert_block(const Chain& chain, std::int64_t i, std::span<const Tok> block, KeyHint hint,
                                 bool want_snapshot, bool defer_prune) {
  Inserted done;
  const auto ntok = static_cast<std::int64_t>(block.size());
  const Digest key = key_for(chain, i, block, hint);
  NodeId parent = parent_for(chain, i, done);
  NodeId existing = tree_.find_existing(parent, key, block);
  Page* snap_page = nullptr;
  const std::int64_t ssm = layout_.ssm_lc();
  // shared_write="commit": a full-coverage page of a full block that becomes a tree page
  // here is written to the shared tier (DECISIONS.md "The shared tier")
  const bool do_store = layout_.store_on_commit() && ntok == layout_.B();
  if (want_snapshot && (existing == kNoNode || tree_.coverage(existing, ssm) < ntok)) {
    Page* live_page = page_ptr(chain.live);
    if (live_page == nullptr || live_page->tier != kGpu || !make_room(kGpu, ssm)) {
      count(ssm, kSnapshotsSkipped);
    } else {
      snap_page = new_page(kGpu, ssm, ntok, chain.priority, i);
      copy(ssm, &mut(chain.live), snap_page, "snapshot");
      if (do_store) store(snap_page, key);
      // eviction may have pruned this request's chain or the existing block
      parent = parent_for(chain, i, done);
      existing = tree_.find_existing(parent, key, block);
    }
  }
  const NodeId old = i < static_cast<std::int64_t>(chain.blocks.size()) ? chain.blocks[static_cast<std::size_t>(i)]
                                                                         : kNoNode;
  if (existing == kNoNode) {
    const NodeId nid = new_block(key, block, i);
    for (std::int64_t lc : layout_.attn_lcs()) {
      const std::int64_t s = chain_page(chain, lc, i);
      if (s < 0) continue;
      Page& p = mut(s);
      // forks: a shared partial page another user's stop_committing put into a block that
      // was detached since (so not found): it moves here (DECISIONS.md "Forks", the tail
      // block of a stop)
      if (p.node != kNoNode) unlink_from_node(&p);
      p.coverage = static_cast<std::int16_t>(ntok);
      tree_.set_page(nid, lc, p.handle, ntok);
      p.node = static_cast<std::int32_t>(nid);  // a used page: its state does not depend on the node
      if (do_store) store(&p, key);
    }
    if (snap_page != nullptr) {
      tree_.set_page(nid, ssm, snap_page->handle, ntok);
      restate(*snap_page, [&] { snap_page->node = static_cast<std::int32_t>(nid); });
    }
    move_reference(old, nid);
    done.node = nid;
    if (tree_.has_page(nid)) {
      attach(parent, nid);
    } else if (!defer_prune) {
      tree_.prune_upward(parent);  // a re-attached chain must not stay childless
    }
    return done;
  }
  std::vector<std::int64_t> gained;
  for (std::int64_t lc : layout_.attn_lcs()) {
    const std::int64_t s = chain_page(chain, lc, i);
    if (s < 0) continue;
    Page* p = &mut(s);
    p->coverage = static_cast<std::int16_t>(ntok);
    const PageHandle qh = tree_.page(existing, lc);
    if (qh == kNoPage || tree_.coverage(existing, lc) < ntok) {
      install(existing, lc, p, gained);
      if (do_store) store(p, key);
    } else {
      Page* q = &mut(qh);
      if (q->tier == kGpu) {  // the request switches to the tree's page; its index changes
        use(q, chain.active, chain.priority);
        done.replaced.emplace_back(lc, q->handle);
        unuse(p, chain.active);
      }
      // else: the request keeps its page privately (freed at close)
    }
  }
  if (snap_page != nullptr) install(existing, ssm, snap_page, gained);
  move_reference(old, existing);
  done.node = existing;
  emit_stored(existing, gained);
  return done;
}

// A request's ordinal now references `nid` instead of `old` (kNoNode: none): `nid` is
// referenced first, so a block referenced by both never dies in between.
// py: block_pool.py BlockPool.move_reference — SPEC sec. 5
void BlockPool::move_reference(NodeId old, NodeId nid) {
  tree_.ref(nid);
  if (old != kNoNode) tree_.unref(old);
}

// py: block_pool.py BlockPool.key_for — SPEC sec. 3
Digest BlockPool::key_for(const Chain& chain, std::int64_t i, std::span<const Tok> block, KeyHint hint) const {
  const Digest parent = tree_.key(i > 0 ? chain.blocks[static_cast<std::size_t>(i - 1)] : chain.root);
  if (hint.key != nullptr && (i == 0 || *hint.prev == parent)) return *hint.key;  // the hash done at create
  return tokens_.block_key_of(parent, block);
}

// py: block_pool.py BlockPool.parent_for — SPEC sec. 5
NodeId BlockPool::parent_for(const Chain& chain, std::int64_t i, Inserted& done) {
  if (i == 0) return chain.root;
  const NodeId prev = chain_block(chain, done, i - 1);
  if (tree_.is_attached(prev)) return prev;
  std::int64_t k = i - 1;
  while (k >= 0 && !tree_.is_attached(chain_block(chain, done, k))) --k;
  NodeId parent = k < 0 ? chain.root : chain_block(chain, done, k);
  for (std::int64_t j = k + 1; j < i; ++j) {
    const NodeId orphan = chain_block(chain, done, j);
    const NodeId existing = tree_.find_existing(parent, tree_.key(orphan), tree_.tokens(orphan));
    if (existing != kNoNode) {
      switch_block(chain, j, orphan, existing, done);
    } else {
      attach(parent, orphan);
    }
    parent = chain_block(chain, done, j);
  }
  return parent;
}

// py: block_pool.py BlockPool.switch_block — SPEC sec. 5
void BlockPool::switch_block(const Chain& chain, std::int64_t j, NodeId orphan, NodeId existing, Inserted& done) {
  std::vector<std::int64_t> gained;
  for (std::int64_t lc : layout_.attn_lcs()) {
    const std::int64_t s = chain_page(chain, lc, j);
    if (s < 0) continue;
    Page* p = &mut(s);
    if (p->node != orphan || tree_.coverage(existing, lc) >= p->coverage) continue;
    install(existing, lc, p, gained);
  }
  tree_.ref(existing);
  done.switched[j] = existing;
  tree_.unref(orphan);
  emit_stored(existing, gained);
}

// py: block_pool.py BlockPool.install — SPEC sec. 5
void BlockPool::install(NodeId nid, std::int64_t lc, Page* p, std::vector<std::int64_t>& gained) {
  if (p->node != kNoNode) {  // moving from an orphan block
    const NodeId old_node = p->node;
    p->node = kNoNode;
    tree_.set_page(old_node, lc, kNoPage, 0);
  }
  const PageHandle old = tree_.set_page(nid, lc, p->handle, p->coverage);
  if (p->locks || p->holds) {
    p->node = static_cast<std::int32_t>(nid);  // a used page: its state does not depend on the node
  } else {
    restate(*p, [&] { p->node = static_cast<std::int32_t>(nid); });
  }
  if (old == kNoPage) {
    gained.push_back(lc);
    return;
  }
  Page* q = &mut(old);
  restate(*q, [&] { q->node = kNoNode; });
  emit_removed(tree_.key(nid), lc);  // a coverage upgrade: removed now, stored by the caller
  gained.push_back(lc);
  if (q->locks == 0 && q->holds == 0) free_page(q);
}

// SPEC sec. 5 attach: link block nid under parent and announce it: removed for every lc the
// detached partial siblings had (adopted pages included), then stored.
// py: block_pool.py BlockPool.attach — SPEC sec. 5
void BlockPool::attach(NodeId parent, NodeId nid) {
  const std::vector<NodeId> siblings = tree_.attach(parent, nid);
  const auto nlc = static_cast<std::int64_t>(layout_.cfg().lcs.size());
  std::vector<std::int64_t>& lcs = scratch_.lcs;
  if (siblings.empty()) {  // the common case: nothing stepped aside
    lcs.clear();
    for (std::int64_t lc = 0; lc < nlc; ++lc) {
      const PageHandle h = tree_.page(nid, lc);
      if (h == kNoPage) continue;
      mut(h).node = static_cast<std::int32_t>(nid);
      lcs.push_back(lc);
    }
    emit_stored(nid, lcs);
    return;
  }
  std::vector<std::vector<std::int64_t>> had(siblings.size());
  auto sib_index = [&](NodeId id) -> std::int64_t {
    for (std::size_t k = 0; k < siblings.size(); ++k) {
      if (siblings[k] == id) return static_cast<std::int64_t>(k);
    }
    return -1;
  };
  for (std::size_t k = 0; k < siblings.size(); ++k) {
    for (std::int64_t lc = 0; lc < nlc; ++lc) {
      const PageHandle h = tree_.page(siblings[k], lc);
      if (h != kNoPage && page(h).node == siblings[k]) had[k].push_back(lc);
    }
  }
  for (std::int64_t lc = 0; lc < nlc; ++lc) {
    const PageHandle h = tree_.page(nid, lc);
    if (h == kNoPage) continue;
    const std::int64_t k = sib_index(page(h).node);
    if (k >= 0) {
      auto& v = had[static_cast<std::size_t>(k)];
      if (std::find(v.begin(), v.end(), lc) == v.end()) v.push_back(lc);
    }
  }
  for (std::size_t k = 0; k < siblings.size(); ++k) {
    std::vector<std::int64_t> lost = had[k];
    std::sort(lost.begin(), lost.end());
    const Digest key = tree_.key(siblings[k]);
    for (std::int64_t lc : lost) emit_removed(key, lc);
  }
  for (std::int64_t lc = 0; lc < nlc; ++lc) {
    const PageHandle h = tree_.page(nid, lc);
    if (h != kNoPage) mut(h).node = static_cast<std::int32_t>(nid);
    for (NodeId sid : siblings) {
      const PageHandle hs = tree_.page(sid, lc);
      if (hs != kNoPage) mut(hs).node = static_cast<std::int32_t>(sid);
    }
  }
  retire_nodes(siblings, false);
  lcs.clear();
  for (std::int64_t lc = 0; lc < nlc; ++lc) {
    if (tree_.page(nid, lc) != kNoPage) lcs.push_back(lc);
  }
  emit_stored(nid, lcs);
}

}  // namespace kvcm
