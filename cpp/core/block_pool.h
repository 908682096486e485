// The block pool (SPEC sec. 4, 5, 8, 9): everything the requests share, as parts with one
// job each — the layout (layout.h: the config facts), the token table (tokens.h: the
// interning), the pages (pages.h: the slab and the pools), the tree index (tree_index.h:
// the radix tree's use by requests), the evictor (evictor.h: room and moves, its policy a
// strategy object) and the outbox (outbox.h: copy ops, events, stats).  BlockPool owns the
// clock and the parts, wires each part to the ones it needs (constructor injection), and
// keeps only the operations that span parts.  Python twin:
// kvcm/python_backend/block_pool.py (BlockPool).
//
// A Request (request.h) reaches the parts it needs through references its constructor takes
// from the pool; the Manager (manager.h) owns one BlockPool and hands it to each Request.
#pragma once

#include <cstdint>
#include <span>
#include <string>
#include <utility>
#include <vector>

#include "core/evictor.h"
#include "core/layout.h"
#include "core/outbox.h"
#include "core/pages.h"
#include "core/pools.h"
#include "core/tokens.h"
#include "core/tree.h"
#include "core/tree_index.h"
#include "core/types.h"

namespace kvcm {

class BlockPool {
 public:
  explicit BlockPool(ManagerConfig cfg);
  BlockPool(const BlockPool&) = delete;
  BlockPool& operator=(const BlockPool&) = delete;

  // ---------------------------------------------------------------- the parts
  const Layout& layout() const noexcept { return layout_; }
  TokenTable& tokens() noexcept { return tokens_; }
  const TokenTable& tokens() const noexcept { return tokens_; }
  Pages& pages() noexcept { return pages_; }
  const Pages& pages() const noexcept { return pages_; }
  TreeIndex& index() noexcept { return index_; }
  const TreeIndex& index() const noexcept { return index_; }
  Evictor& evictor() noexcept { return evictor_; }
  Outbox& outbox() noexcept { return outbox_; }
  const Outbox& outbox() const noexcept { return outbox_; }
  // the manager's setters of the two settings it may change (the layout is const elsewhere)
  void set_quota_bytes(std::int64_t tier, std::int64_t bytes) { layout_.set_quota_bytes(tier, bytes); }
  void set_pending_copy_ops_warning(std::int64_t n) noexcept { layout_.set_pending_copy_ops_warning(n); }

  // ---------------------------------------------------------------- the clock
  std::int64_t tick() { return ++clock_; }

  // ---------------------------------------------------------------- operations over parts
  // A new gpu page private to one request, in its state (LOCKED when active, else HELD);
  // room is made first (the caller's check promised it).
  const Page* alloc(std::int64_t lc, std::int64_t coverage, std::int64_t ordinal, std::int64_t priority, bool active);
  // SPEC sec. 5, 7: block i of `chain` into the tree (TreeIndex::insert_block); with
  // want_snapshot its live ssm state is first copied into a snapshot page when the block
  // would have none covering as much (room made by the evictor, which may prune the chain:
  // the tree index looks for the parent again).  hint: the key hashed at create.
  Inserted insert_block(const Chain& chain, std::int64_t i, std::span<const Tok> block, KeyHint hint,
                        bool want_snapshot, bool defer_prune = false);
  // A request's page changes state (Pages::set_active); resumed on a colder tier, it is
  // onboarded first (resume's check promised the room).
  void set_active(const Page* p, bool active);
  // set_quota's resize of pool (tier, lc) to n slots: what must go is evicted (sec. 8
  // order), then the pool shrinks (Pages::resize_pool).
  void resize_pool(std::int64_t tier, std::int64_t lc, std::int64_t n);
  // stats() (or take_iteration_stats()) as JSON
  void stats_json(std::string& out, bool take_iteration) { outbox_.stats_json(out, take_iteration); }

  // ---------------------------------------------------------------- observe.cpp
  // The snapshot's sections of the pool's state (one per key of observe.snapshot); the
  // requests' parts stay with the Manager.
  void snapshot_head(std::string& o) const;  // "clock" .. "pools"
  void snapshot_next(std::string& o) const;  // "event", "page" of "next"
  using InvariantUsers = TreeIndex::InvariantUsers;
  // Sizes of the internal tables (tests of SPEC sec. 15), as (name, count) pairs, the
  // manager's request count among them.
  std::vector<std::pair<std::string, std::int64_t>> internal_sizes(std::int64_t num_requests) const;

  // ---------------------------------------------------------------- scratch
  // Buffers the request operations reuse, so a decode step does not allocate.
  struct Scratch {
    std::vector<std::pair<std::int64_t, std::int64_t>> releases, allocs;  // Request::resize_checked
  };
  Scratch& scratch() noexcept { return scratch_; }

 private:
  // the snapshot page of block i (ntok tokens, key `key`) filled from the chain's live ssm
  // state, or nullptr (counted skipped) when the state is not on the gpu or no room can be made
  const Page* snapshot(const Chain& chain, std::int64_t i, std::int64_t ntok, const Digest& key);
  // Declaration order is construction order: each part is built after what it reads in its
  // constructor.  Every part knows only the parts below it (Evictor > TreeIndex > Pages >
  // Outbox), but for the outbox's read-only view of the pages (a stored event's tier and
  // priority, a lost op's page, the pools in stats()), bound here and used only once built.
  Layout layout_;      // the config-derived facts (parts and requests hold it const)
  RadixTree tree_;     // the committed blocks, their pages per lc, and the interned digest tokens
  TokenTable tokens_;  // the door to the tree's digest table for everything but the tree index
  std::int64_t clock_ = 0;  // advanced once per mutating call (pages' last_used)
  Pages pages_;
  Outbox outbox_;
  TreeIndex index_;
  Evictor evictor_;
  Scratch scratch_;
};

}  // namespace kvcm
