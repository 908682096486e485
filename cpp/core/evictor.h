// The evictor (SPEC sec. 8): room in a full pool, by offloading its victim to the next
// colder tier or dropping it; the moves between tiers.  Its policy — which page goes first
// — is a small strategy object (SGLang's EvictionStrategy): LruStrategy, today's sec. 8
// order, the default and only one shipped.  Python twin: kvcm/python_backend/evictor.py
// (Evictor, EvictionStrategy, LruStrategy).
#pragma once

#include <cstdint>
#include <functional>

#include "core/layout.h"
#include "core/pages.h"
#include "core/pools.h"

namespace kvcm {

class Outbox;
class TreeIndex;

// The eviction policy: the victim of a pool, and the order it follows.
class EvictionStrategy {
 public:
  virtual ~EvictionStrategy() = default;
  // The page to evict from `pool`: any HELD or DROPPABLE one when it can move down a tier
  // (can_offload), else a DROPPABLE one; nullptr: nothing to evict.
  virtual const Page* victim(const Pages& pages, const Pool& pool, bool can_offload) const = 0;
  // The order pages leave in (smallest first).
  virtual EvictKey key(const Page& p) const = 0;
};

// SPEC sec. 8: (priority, last_used, -ordinal, serial), the order the pools' eviction
// indexes keep (Page::evict_key), so the victim is the first of an index.
//
// final, and held by value in Evictor: its calls there bind statically (no virtual
// dispatch on the eviction path, which runs once per page made in a full pool); the
// abstract base is the seam another policy plugs into.
class LruStrategy final : public EvictionStrategy {
 public:
  const Page* victim(const Pages& pages, const Pool& pool, bool can_offload) const override;
  EvictKey key(const Page& p) const override { return p.evict_key(); }
};

class Evictor {
 public:
  Evictor(const Layout& layout, Pages& pages, TreeIndex& index, Outbox& outbox)
      : layout_(layout), pages_(pages), index_(index), outbox_(outbox),
        write_back_([this](const Page* p) { store_evicted(p); }) {}
  Evictor(const Evictor&) = delete;
  Evictor& operator=(const Evictor&) = delete;

  // A free slot in pool (tier, lc), evicting when full; false: nothing could go, nothing changed.
  bool make_room(std::int64_t tier, std::int64_t lc);
  // make_room where a feasibility check already promised the slot
  void ensure_room(std::int64_t tier, std::int64_t lc);
  // One more free slot by evicting the pool's first victim (make_room, resize).
  bool evict_one(std::int64_t tier, std::int64_t lc);
  void move(const Page* p, std::int64_t dst, const char* reason);
  void drop_all_droppable();
  // The write-back of a page eviction is about to drop (shared_write="evict").
  void store_evicted(const Page* p);

 private:
  // write_back: the pages freed with p's subtree are written back too (shared_write="evict")
  void drop(const Page* p, const std::function<void(const Page*)>* write_back = nullptr);

  const Layout& layout_;
  Pages& pages_;
  TreeIndex& index_;
  Outbox& outbox_;
  LruStrategy strategy_;
  // shared_write="evict": an eviction drop writes back the pages freed with its subtree
  std::function<void(const Page*)> write_back_;
};

}  // namespace kvcm
