// The tree index (SPEC sec. 5, 6, 7, 16): the requests' use of the radix tree — matching a
// prompt (with the shared tier's extension), holding a match, inserting a request's blocks
// (orphan re-attachment, coverage upgrades, snapshots), and unlinking pages and blocks
// from it with their events.  RadixTree (tree.h) is the data structure underneath; this is
// the only part that changes it.  Python twin: kvcm/python_backend/tree_index.py (TreeIndex).
#pragma once

#include <cstdint>
#include <functional>
#include <span>
#include <string>
#include <unordered_map>
#include <utility>
#include <vector>

#include "core/layout.h"
#include "core/pages.h"
#include "core/tokens.h"
#include "core/tree.h"
#include "core/types.h"

namespace kvcm {

class Outbox;

// The shared tier's extension of a create's match (DECISIONS.md "The shared tier"): computed
// by TreeIndex::match_shared from the store's hits, installed by Request::match_and_hold.
struct SharedMatch {
  std::int64_t m = -1;                          // the extended match length (-1: no run)
  std::int64_t m_before_ssm = -1;               // the same fixed point without the ssm rule
  std::vector<NodeId> path;                     // the tree path [0, P)
  std::vector<std::vector<std::int64_t>> rows;  // coverage per lc of blocks P, P+1, ...
};

// The match a request created now takes (SPEC sec. 6, DECISIONS.md "The shared tier"):
// computed by TreeIndex::match_with_hits, held by Request::match_and_hold, reported by
// Manager::probe.  Python twin: RequestMatch.
struct RequestMatch {
  std::int64_t m = 0;
  std::int64_t m_before_ssm = 0;
  // the tree blocks of the match: the ceil(m / B) blocks of the ordinary match, or,
  // extended, the whole tree path [0, P) (the blocks past it are the extension's)
  std::vector<NodeId> path;
  std::vector<std::vector<std::int64_t>> rows;  // extended: coverage per lc of blocks P, P+1, ...
  bool extended = false;
};

// The store's answer to shared_candidates: (block key, lc) pairs, sorted and unique.
using SharedHits = std::vector<std::pair<Digest, std::int64_t>>;

// What a request holds after TreeIndex::hold_match (Python twin: HeldMatch): the match
// length, the blocks it references (ordinal order), its page handles per lc (attention
// lcs; -1: stale) and the ssm snapshot at the match end (-1: none).
struct HeldMatch {
  std::int64_t m = 0;
  std::vector<NodeId> blocks;
  std::vector<std::vector<std::int64_t>> pages;
  std::int64_t snap = -1;
};

// What TreeIndex::insert_block reads of the request whose block it inserts; it changes
// none of it (the request applies the result, Inserted).  Python twin: Chain.
struct Chain {
  NodeId root;                                          // its scope's root
  const std::vector<NodeId>& blocks;                    // the tree block per ordinal (kNoNode: none)
  const std::vector<std::vector<std::int64_t>>& pages;  // its page handles per lc (-1: none)
  std::int64_t live;                                    // its live ssm state (-1: none)
  std::int64_t priority;
  bool active;  // ACTIVE (its pages LOCKED), else SUSPENDED (HELD)
};

// The key of a block hashed at create, with the key it was chained from (prev nullptr:
// the scope's root); TreeIndex::insert_block takes it when the parent still has that key.
struct KeyHint {
  const Digest* prev = nullptr;
  const Digest* key = nullptr;  // nullptr: no hint
};

// TreeIndex::insert_block's result (Python twin: Inserted): the block the request now
// references for the inserted ordinal, the ordinals of its orphaned chain re-attachment
// moved to an equivalent block, and its pages the insertion replaced by the tree's.
struct Inserted {
  NodeId node = kNoNode;
  std::unordered_map<std::int64_t, NodeId> switched;  // ordinal -> block
  std::vector<std::pair<std::int64_t, std::int64_t>> replaced;  // (lc, page handle)
};

class TreeIndex {
 public:
  TreeIndex(const Layout& layout, RadixTree& tree, const TokenTable& tokens, Pages& pages, Outbox& outbox) noexcept
      : layout_(layout), tree_(tree), tokens_(tokens), pages_(pages), outbox_(outbox) {}
  // What an eviction drop does to each page freed with the evicted subtree (shared_write=
  // "evict": the write-back, Evictor::store_evicted); handed down by the evictor, so the
  // tree index needs no evictor.
  using WriteBack = std::function<void(const Page*)>;
  TreeIndex(const TreeIndex&) = delete;
  TreeIndex& operator=(const TreeIndex&) = delete;

  // Read-only: the tree changes only through this class's methods.
  const RadixTree& tree() const noexcept { return tree_; }
  // The creation number snapshots show for a node handle (kNoNode stays kNoNode).
  std::int64_t node_uid(NodeId id) const { return id == kNoNode ? kNoNode : tree_.uid(id); }

  // ---------------------------------------------------------------- matching (pure)
  // The match extended by the store's hits (DECISIONS.md "The shared tier"; m -1: no run;
  // root kNoNode: a scope with no root, no tree path).
  SharedMatch match_shared(NodeId root, std::span<const Digest> keys, const SharedHits& hits) const;
  // The match a request created now takes: the ordinary one (none under root kNoNode), or
  // the extension by `hits` (nullptr: none) when longer.
  RequestMatch match_with_hits(NodeId root, std::span<const Tok> query, std::span<const Digest> keys,
                               const SharedHits* hits) const;
  // ReuseProbe.block_tiers (SPEC sec. 6): per full block of a match of length m over the
  // tree blocks `path` (past its end: the shared extension's), the coldest tier number of
  // the pages a request created with it holds for the block, -1 when none.  O(m / B).
  std::vector<std::int64_t> block_tiers(const std::vector<NodeId>& path, std::int64_t m) const;

  // ---------------------------------------------------------------- a request's references
  // The root of the scope root_key, made on first use, with one more reference (each open
  // request holds one, a fork its own).
  NodeId open_scope(const Digest& root_key);
  // create's match (match_with_hits; hits nullptr: none), held as a SUSPENDED request holds
  // it: blocks referenced, the pages of blocks not stale at the match end and the ssm
  // snapshot there used (HELD, priority raised); a shared extension's blocks enter the tree.
  HeldMatch hold_match(NodeId root, std::span<const Tok> query, std::span<const Digest> keys,
                       const SharedHits* hits, std::int64_t priority);
  // A fork takes its own references of `blocks` (kNoNode skipped) and uses `pages` (per
  // attention lc; -1 skipped), LOCKED.
  void hold(const std::vector<NodeId>& blocks, const std::vector<std::vector<std::int64_t>>& pages,
            std::int64_t priority);
  // A request stops referencing tree block (or scope root) `node`.
  void unref(NodeId node) { tree_.unref(node); }
  // The key of block i of `chain`: the hint's (hashed at create) when its parent still has
  // the key it was chained from, else hashed now.
  Digest key_for(const Chain& chain, std::int64_t i, std::span<const Tok> block, KeyHint hint) const;
  // Whether block i would enter the tree with no ssm snapshot covering it (the chain's
  // orphans re-attached first, their switches recorded in `done`).
  bool lacks_snapshot(const Chain& chain, std::int64_t i, std::span<const Tok> block, const Digest& key,
                      Inserted& done);
  // SPEC sec. 5, 7: block i of `chain` (full, or its partial tail; key `key`) into the tree
  // (see tree_index.cpp); snap_page: its snapshot page (nullptr: none); defer_prune: more
  // blocks of this commit follow.
  Inserted insert_block(const Chain& chain, std::int64_t i, std::span<const Tok> block, const Digest& key,
                        Inserted&& done, const Page* snap_page, bool defer_prune);
  // A request stops using `p` (Pages::unuse); with no user left it is freed, or unlinked
  // and freed (an orphan's, a shared one), or stays in the tree DROPPABLE.
  void release(const Page* p, bool active);
  // forget_copies / settle_copies' second half: unlink the lost pages still alive (SPEC
  // sec. 5 pruning, removed events) and free the unused ones; (handle, serial) pairs.
  void forget_pages(const std::vector<std::pair<std::int64_t, std::int64_t>>& lost);

  // ---------------------------------------------------------------- unlinking (sec. 5)
  void unlink_committed(const Page* p, const WriteBack* write_back = nullptr);
  // `p` leaves its block's slot (no event, no pruning); may delete a dead orphan block
  void unlink_from_node(const Page* p);
  void retire_nodes(const std::vector<NodeId>& ids, bool announce, const WriteBack* write_back = nullptr);
  void free_orphan_page(const Page* p);

  // ---------------------------------------------------------------- observe.cpp
  void snapshot_tree(std::string& o) const;
  // Page users and block references, recomputed from the requests.
  struct InvariantUsers {
    std::unordered_map<std::int64_t, std::int64_t> locks, holds, refs;
  };
  void check_pages_and_tree(InvariantUsers& users) const;

 private:
  NodeId new_block(const Digest& key, std::span<const Tok> tokens, std::int64_t ordinal) {
    return tree_.new_block(key, tokens, ordinal);
  }
  std::vector<NodeId> insert_shared_blocks(NodeId root, std::span<const Tok> query, std::span<const Digest> keys,
                                           std::int64_t m, const RequestMatch& sm, std::int64_t priority);
  NodeId parent_for(const Chain& chain, std::int64_t i, Inserted& done);
  void switch_block(const Chain& chain, std::int64_t j, NodeId orphan, NodeId existing, Inserted& done);
  void install(NodeId nid, std::int64_t lc, const Page* p, std::vector<std::int64_t>& gained);
  void attach(NodeId parent, NodeId nid);
  void move_reference(NodeId old, NodeId nid);
  using NodeIndex = std::unordered_map<NodeId, const NodeDump*>;
  void check_page_users(const std::vector<std::int64_t>& all, InvariantUsers& users, NodeIndex& nodes) const;
  void check_tree_links(const std::vector<NodeDump>& dump, NodeIndex& nodes, InvariantUsers& users) const;

  const Layout& layout_;
  RadixTree& tree_;
  const TokenTable& tokens_;
  Pages& pages_;
  Outbox& outbox_;
  std::vector<std::int64_t> lcs_;  // attach's scratch (no allocation per insertion)
};

}  // namespace kvcm
