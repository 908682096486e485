// The tree index (tree_index.h).  Python twin: kvcm/python_backend/tree_index.py (TreeIndex).
#include "core/tree_index.h"

#include <algorithm>
#include <cstring>
#include <limits>
#include <stdexcept>

#include "core/outbox.h"
#include "core/manager_detail.h"

namespace kvcm {

using namespace detail;

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

// py: tree_index.py TreeIndex.match_shared — SPEC sec. 16
SharedMatch TreeIndex::match_shared(NodeId root, std::span<const Digest> keys, const SharedHits& hits) const {
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
// py: tree_index.py TreeIndex.match_with_hits — SPEC sec. 6
RequestMatch TreeIndex::match_with_hits(NodeId root, std::span<const Tok> query, std::span<const Digest> keys,
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
// py: tree_index.py TreeIndex.block_tiers — SPEC sec. 6
std::vector<std::int64_t> TreeIndex::block_tiers(const std::vector<NodeId>& path, std::int64_t m) const {
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
        tier = std::max(tier, layout_.tier_id(layout_.shared_pos()));
        continue;
      }
      const Page& p = pages_.page(tree_.page(path[static_cast<std::size_t>(j)], lc));
      tier = std::max(tier, layout_.tier_id(p.tier));
    }
    out.push_back(tier);
  }
  return out;
}

// py: tree_index.py TreeIndex.open_scope — SPEC sec. 15
NodeId TreeIndex::open_scope(const Digest& root_key) {
  const NodeId root = tree_.root(root_key);
  tree_.ref(root);
  return root;
}

// create's match and holds (SPEC sec. 6, 7; DECISIONS.md "The shared tier": the extension
// is taken only when longer, its blocks inserted with shared pages).
// py: tree_index.py TreeIndex.hold_match — SPEC sec. 7
HeldMatch TreeIndex::hold_match(NodeId root, std::span<const Tok> query, std::span<const Digest> keys,
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
      const Page* p = &pages_.page(tree_.page(path[j], lc));
      pages_.use(p, false, priority);
      out.pages[static_cast<std::size_t>(lc)][j] = p->handle;
    }
  }
  if (layout_.ssm_lc() >= 0 && m > 0) {
    const Page* s = &pages_.page(tree_.page(path.back(), layout_.ssm_lc()));
    out.snap = s->handle;
    pages_.use(s, false, priority);
  }
  return out;
}

// DECISIONS.md "The shared tier": the extension's blocks below ceil(m / B) enter the tree at
// once, with a shared page for exactly the pages the request will hold (attention pages of
// blocks non-stale at m, the ssm snapshot of the block m ends in).
// py: tree_index.py TreeIndex.insert_shared_blocks — SPEC sec. 16
std::vector<NodeId> TreeIndex::insert_shared_blocks(NodeId root, std::span<const Tok> query,
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
      const Page* p = pages_.new_shared_page(lc, priority, i);
      tree_.set_page(nid, lc, p->handle, layout_.B());
      pages_.set_node(p, nid);  // (a shared page is in no pool: the field alone)
    }
    attach(parent, nid);
    path.push_back(nid);
    parent = nid;
  }
  return path;
}

// py: tree_index.py TreeIndex.hold — SPEC sec. 18
void TreeIndex::hold(const std::vector<NodeId>& blocks, const std::vector<std::vector<std::int64_t>>& pages,
                     std::int64_t priority) {
  for (NodeId nid : blocks) {
    if (nid != kNoNode) tree_.ref(nid);
  }
  for (std::int64_t lc : layout_.attn_lcs()) {
    for (std::int64_t h : pages[static_cast<std::size_t>(lc)]) {
      if (h >= 0) pages_.use(&pages_.page(h), true, priority);
    }
  }
}

// Whether block i of `chain` (key `key`) would enter the tree with no ssm snapshot covering
// it: no equivalent block under its parent (the chain's orphans re-attached first,
// parent_for, recorded in `done`), or one whose snapshot covers less.
// py: tree_index.py TreeIndex.lacks_snapshot — SPEC sec. 7
bool TreeIndex::lacks_snapshot(const Chain& chain, std::int64_t i, std::span<const Tok> block, const Digest& key,
                               Inserted& done) {
  const NodeId parent = parent_for(chain, i, done);
  const NodeId existing = tree_.find_existing(parent, key, block);
  return existing == kNoNode || tree_.coverage(existing, layout_.ssm_lc()) < static_cast<std::int64_t>(block.size());
}

// Also SPEC sec. 7: a new block adopting the request's pages, or the existing equivalent
// one, which takes the request's pages where they cover more (and the request the tree's
// gpu page where the tree's covers as much); `snap_page`: a snapshot page of the request's
// live ssm state for the block (nullptr: none; BlockPool::insert_block makes it); `done`:
// the re-attachment's switches so far (lacks_snapshot's).
// defer_prune: more blocks of this commit follow, so a pageless new block leaves its parent
// chain attached (no quadratic re-attach; DECISIONS.md).
// py: tree_index.py TreeIndex.insert_block — SPEC sec. 5
Inserted TreeIndex::insert_block(const Chain& chain, std::int64_t i, std::span<const Tok> block, const Digest& key,
                                 Inserted&& done, const Page* snap_page, bool defer_prune) {
  const auto ntok = static_cast<std::int64_t>(block.size());
  const NodeId parent = parent_for(chain, i, done);
  const NodeId existing = tree_.find_existing(parent, key, block);
  const std::int64_t ssm = layout_.ssm_lc();
  // shared_write="commit": a full-coverage page of a full block that becomes a tree page
  // here is written to the shared tier (DECISIONS.md "The shared tier")
  const bool do_store = layout_.store_on_commit() && ntok == layout_.B();
  const NodeId old = i < static_cast<std::int64_t>(chain.blocks.size()) ? chain.blocks[static_cast<std::size_t>(i)]
                                                                         : kNoNode;
  if (existing == kNoNode) {
    const NodeId nid = new_block(key, block, i);
    for (std::int64_t lc : layout_.attn_lcs()) {
      const std::int64_t s = chain_page(chain, lc, i);
      if (s < 0) continue;
      const Page& p = pages_.page(s);
      // forks: a shared partial page another user's stop_committing put into a block that
      // was detached since (so not found): it moves here (DECISIONS.md "Forks", the tail
      // block of a stop)
      if (p.node != kNoNode) unlink_from_node(&p);
      pages_.set_coverage(&p, ntok);
      tree_.set_page(nid, lc, p.handle, ntok);
      pages_.set_node(&p, nid);  // a used page: its state does not depend on the node
      if (do_store) outbox_.store(&p, key);
    }
    if (snap_page != nullptr) {
      tree_.set_page(nid, ssm, snap_page->handle, ntok);
      pages_.restate_node(snap_page, nid);
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
    const Page* p = &pages_.page(s);
    pages_.set_coverage(p, ntok);
    const PageHandle qh = tree_.page(existing, lc);
    if (qh == kNoPage || tree_.coverage(existing, lc) < ntok) {
      install(existing, lc, p, gained);
      if (do_store) outbox_.store(p, key);
    } else {
      const Page* q = &pages_.page(qh);
      if (q->tier == kGpu) {  // the request switches to the tree's page; its index changes
        pages_.use(q, chain.active, chain.priority);
        done.replaced.emplace_back(lc, q->handle);
        release(p, chain.active);
      }
      // else: the request keeps its page privately (freed at close)
    }
  }
  if (snap_page != nullptr) install(existing, ssm, snap_page, gained);
  move_reference(old, existing);
  done.node = existing;
  outbox_.emit_stored(existing, gained);
  return done;
}

// A request's ordinal now references `nid` instead of `old` (kNoNode: none): `nid` is
// referenced first, so a block referenced by both never dies in between.
// py: tree_index.py TreeIndex.move_reference — SPEC sec. 5
void TreeIndex::move_reference(NodeId old, NodeId nid) {
  tree_.ref(nid);
  if (old != kNoNode) tree_.unref(old);
}

// py: tree_index.py TreeIndex.key_for — SPEC sec. 3
Digest TreeIndex::key_for(const Chain& chain, std::int64_t i, std::span<const Tok> block, KeyHint hint) const {
  const Digest parent = tree_.key(i > 0 ? chain.blocks[static_cast<std::size_t>(i - 1)] : chain.root);
  if (hint.key != nullptr && (i == 0 || *hint.prev == parent)) return *hint.key;  // the hash done at create
  return tokens_.block_key_of(parent, block);
}

// py: tree_index.py TreeIndex.parent_for — SPEC sec. 5
NodeId TreeIndex::parent_for(const Chain& chain, std::int64_t i, Inserted& done) {
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

// py: tree_index.py TreeIndex.switch_block — SPEC sec. 5
void TreeIndex::switch_block(const Chain& chain, std::int64_t j, NodeId orphan, NodeId existing, Inserted& done) {
  std::vector<std::int64_t> gained;
  for (std::int64_t lc : layout_.attn_lcs()) {
    const std::int64_t s = chain_page(chain, lc, j);
    if (s < 0) continue;
    const Page* p = &pages_.page(s);
    if (p->node != orphan || tree_.coverage(existing, lc) >= p->coverage) continue;
    install(existing, lc, p, gained);
  }
  tree_.ref(existing);
  done.switched[j] = existing;
  tree_.unref(orphan);
  outbox_.emit_stored(existing, gained);
}

// py: tree_index.py TreeIndex.install — SPEC sec. 5
void TreeIndex::install(NodeId nid, std::int64_t lc, const Page* p, std::vector<std::int64_t>& gained) {
  if (p->node != kNoNode) {  // moving from an orphan block
    const NodeId old_node = p->node;
    pages_.set_node(p, kNoNode);  // (re-indexed just below, with its new block)
    tree_.set_page(old_node, lc, kNoPage, 0);
  }
  const PageHandle old = tree_.set_page(nid, lc, p->handle, p->coverage);
  if (p->locks || p->holds) {
    pages_.set_node(p, nid);  // a used page: its state does not depend on the node
  } else {
    pages_.restate_node(p, nid);
  }
  if (old == kNoPage) {
    gained.push_back(lc);
    return;
  }
  const Page* q = &pages_.page(old);
  pages_.restate_node(q, kNoNode);
  outbox_.emit_removed(tree_.key(nid), lc);  // a coverage upgrade: removed now, stored by the caller
  gained.push_back(lc);
  if (q->locks == 0 && q->holds == 0) pages_.free_page(q);
}

// SPEC sec. 5 attach: link block nid under parent and announce it: removed for every lc the
// detached partial siblings had (adopted pages included), then stored.
// py: tree_index.py TreeIndex.attach — SPEC sec. 5
void TreeIndex::attach(NodeId parent, NodeId nid) {
  const std::vector<NodeId> siblings = tree_.attach(parent, nid);
  const auto nlc = static_cast<std::int64_t>(layout_.cfg().lcs.size());
  std::vector<std::int64_t>& lcs = lcs_;
  if (siblings.empty()) {  // the common case: nothing stepped aside
    lcs.clear();
    for (std::int64_t lc = 0; lc < nlc; ++lc) {
      const PageHandle h = tree_.page(nid, lc);
      if (h == kNoPage) continue;
      pages_.set_node(&pages_.page(h), nid);
      lcs.push_back(lc);
    }
    outbox_.emit_stored(nid, lcs);
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
      if (h != kNoPage && pages_.page(h).node == siblings[k]) had[k].push_back(lc);
    }
  }
  for (std::int64_t lc = 0; lc < nlc; ++lc) {
    const PageHandle h = tree_.page(nid, lc);
    if (h == kNoPage) continue;
    const std::int64_t k = sib_index(pages_.page(h).node);
    if (k >= 0) {
      auto& v = had[static_cast<std::size_t>(k)];
      if (std::find(v.begin(), v.end(), lc) == v.end()) v.push_back(lc);
    }
  }
  for (std::size_t k = 0; k < siblings.size(); ++k) {
    std::vector<std::int64_t> lost = had[k];
    std::sort(lost.begin(), lost.end());
    const Digest key = tree_.key(siblings[k]);
    for (std::int64_t lc : lost) outbox_.emit_removed(key, lc);
  }
  for (std::int64_t lc = 0; lc < nlc; ++lc) {
    const PageHandle h = tree_.page(nid, lc);
    if (h != kNoPage) pages_.set_node(&pages_.page(h), nid);
    for (NodeId sid : siblings) {
      const PageHandle hs = tree_.page(sid, lc);
      if (hs != kNoPage) pages_.set_node(&pages_.page(hs), sid);
    }
  }
  retire_nodes(siblings, false);
  lcs.clear();
  for (std::int64_t lc = 0; lc < nlc; ++lc) {
    if (tree_.page(nid, lc) != kNoPage) lcs.push_back(lc);
  }
  outbox_.emit_stored(nid, lcs);
}

// py: tree_index.py TreeIndex.unlink_committed — SPEC sec. 5
void TreeIndex::unlink_committed(const Page* p, const WriteBack* write_back) {
  const NodeId node = p->node;
  const std::int64_t lc = p->lc;
  const Digest key = tree_.key(node);
  const std::int64_t ordinal = tree_.ordinal(node);
  unlink_from_node(p);
  outbox_.emit_removed(key, lc);
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
      retire_nodes(tree_.remove_subtree(node), true, write_back);
    }
    if (parent != kNoNode) tree_.prune_upward(parent);
  } else {
    tree_.prune_upward(node);
  }
}

// py: tree_index.py TreeIndex.unlink_from_node — SPEC sec. 5
void TreeIndex::unlink_from_node(const Page* p) {
  const NodeId node = p->node;
  pages_.restate_node(p, kNoNode);
  tree_.clear_page(node, p->lc);  // may delete a dead orphan node
}

// py: tree_index.py TreeIndex.retire_nodes — SPEC sec. 5
void TreeIndex::retire_nodes(const std::vector<NodeId>& ids, bool announce, const WriteBack* write_back) {
  const auto nlc = static_cast<std::int64_t>(layout_.cfg().lcs.size());
  for (NodeId nid : ids) {
    if (!tree_.exists(nid)) continue;
    const Digest key = tree_.key(nid);
    for (std::int64_t lc = 0; lc < nlc; ++lc) {
      if (!tree_.exists(nid)) break;  // deleted with its last page: nothing left
      const PageHandle h = tree_.page(nid, lc);
      if (h == kNoPage) continue;
      if (announce) outbox_.emit_removed(key, lc);
      const Page* pg = &pages_.page(h);
      if (pg->locks == 0 && pg->holds == 0) {
        if (write_back != nullptr) (*write_back)(pg);  // freed with an evicted page: written back too
        outbox_.count(lc, kDrops);
        outbox_.count(lc, kDropBytes, layout_.cfg().lcs[static_cast<std::size_t>(lc)].slot_bytes);
        free_orphan_page(pg);
      }
    }
    tree_.collect(nid);
  }
}

// py: tree_index.py TreeIndex.free_orphan_page — SPEC sec. 5
void TreeIndex::free_orphan_page(const Page* p) {
  unlink_from_node(p);
  pages_.free_page(p);
}


// A request stops using `p`: a private or orphaned page with no user left is freed; a tree
// page becomes DROPPABLE (a shared one goes: DECISIONS.md "The shared tier", it lives only
// while a request uses it).
// py: tree_index.py TreeIndex.release — SPEC sec. 4
void TreeIndex::release(const Page* p, bool active) {
  if (!pages_.unuse(p, active)) return;
  if (p->tier == layout_.shared_pos() && p->node != kNoNode && tree_.is_attached(p->node)) {
    unlink_committed(p);
    pages_.free_page(p);
  } else if (p->node == kNoNode) {
    pages_.free_page(p);
  } else if (!tree_.is_attached(p->node)) {
    free_orphan_page(p);
  }
}

// forget_copies / settle_copies' second half: unlink the lost pages still alive (SPEC sec. 5
// pruning, removed events) and free the unused ones.
// py: tree_index.py TreeIndex.forget_pages — SPEC sec. 15
void TreeIndex::forget_pages(const std::vector<std::pair<std::int64_t, std::int64_t>>& lost) {
  for (const auto& [h, serial] : lost) {
    if (!pages_.page_alive(h) || pages_.page(h).serial != serial) continue;  // freed with an earlier subtree
    const Page* p = &pages_.page(h);
    outbox_.count(p->lc, kLostPages);
    if (p->node != kNoNode) {
      if (tree_.is_attached(p->node)) {
        unlink_committed(p);
      } else {
        unlink_from_node(p);
      }
      if (p->locks == 0 && p->holds == 0) pages_.free_page(p);
    }
  }
}

}  // namespace kvcm
