// The radix tree of committed blocks (SPEC sec. 5) and the match walk (sec. 6).
//
// A faithful port of kvcm/python_backend/tree.py (class RadixTree): same operations,
// same return values and orders, so the two can be driven in lockstep by
// parity/test_tree_differential.py.  Nodes are addressed by int ids (creation order,
// never reused) and pages by int handles owned by the manager; the tree knows page
// presence and coverage, not tiers or states.
//
// Node life time: a node exists while it is attached, while a request references it
// (ref/unref), or while it still holds a page.  Anything else is deleted at once, so
// orphans disappear with their last user.  A root lives while it has a child or a
// reference (the manager refs the root of each open request's scope; SPEC sec. 15).
//
// Layout (the manager's hot path and its memory per cached block): nodes live in one slab
// addressed by slot, children are an intrusive list plus one tree-wide hash table, and a
// block's tokens sit in one arena by slot — no per-node allocation at all.
#pragma once

#include <cstddef>
#include <cstdint>
#include <cstring>
#include <memory>
#include <optional>
#include <span>
#include <stdexcept>
#include <string>
#include <unordered_map>
#include <type_traits>
#include <utility>
#include <vector>

#include "core/lifecycle.h"
#include "core/sha256.h"

namespace kvcm {

using NodeId = std::int64_t;
using PageHandle = std::int64_t;
inline constexpr PageHandle kNoPage = -1;
inline constexpr NodeId kNoNode = -1;

// An unknown node id (Python: KeyError(id) from the nodes dict).
class NoSuchNode : public std::out_of_range {
 public:
  explicit NoSuchNode(NodeId id) : std::out_of_range("no such node: " + std::to_string(id)), id_(id) {}
  NodeId id() const noexcept { return id_; }

 private:
  NodeId id_;
};

// A violated precondition of the caller (Python: AssertionError with the same message).
class TreeAssertion : public std::logic_error {
 public:
  using std::logic_error::logic_error;
};


// A token as callers pass it: an int in [0, 2**31), or (digest != nullptr) a 32-byte
// digest that the caller keeps alive for the duration of the call.
struct TokenArg {
  std::uint32_t value = 0;
  const std::uint8_t* digest = nullptr;
};

struct MatchResult {
  std::int64_t m = 0;
  std::int64_t m_before_ssm = 0;
  std::vector<NodeId> path;  // the ceil(m / B) matched block ids
};

// A decoded token for dump(): either an int or a digest.
struct TokenOut {
  bool is_digest = false;
  std::uint32_t value = 0;
  Digest digest{};
};

struct NodeDump {
  NodeId id = 0;
  Digest key{};
  NodeId parent = kNoNode;
  bool attached = false;
  bool is_root = false;
  std::int64_t ordinal = -1;
  std::vector<TokenOut> tokens;
  std::vector<NodeId> children;  // sorted ids
  std::vector<PageHandle> pages;
  std::vector<std::int64_t> coverage;
  std::int64_t refs = 0;
};

struct DigestHash {
  // Keys are SHA-256 outputs, so any 8 bytes are already uniformly distributed.
  std::size_t operator()(const Digest& d) const noexcept {
    std::size_t h;
    std::memcpy(&h, d.data(), sizeof h);
    return h;
  }
};

// Slab storage in fixed-size chunks: a slot's memory never moves, so growing costs no copy
// of what is there (a vector doubling copies everything and faults in twice the memory),
// and a fresh chunk is not zero-filled (the owner writes a slot before reading it).
// ChunkedSlab: one T per slot; ChunkedRows: `width` T per slot, set at construction.
template <typename T>
class ChunkedSlab {
 public:
  static constexpr std::size_t kShift = 10, kSlots = std::size_t{1} << kShift;
  ChunkedSlab() = default;
  ChunkedSlab(const ChunkedSlab&) = delete;
  ChunkedSlab& operator=(const ChunkedSlab&) = delete;
  ChunkedSlab(ChunkedSlab&&) noexcept = default;
  ChunkedSlab& operator=(ChunkedSlab&&) noexcept = default;
  T& operator[](std::size_t i) noexcept { return chunks_[i >> kShift][i & (kSlots - 1)]; }
  const T& operator[](std::size_t i) const noexcept { return chunks_[i >> kShift][i & (kSlots - 1)]; }
  std::size_t size() const noexcept { return size_; }
  // A new slot at the end (default-initialised: fields with initialisers get them).
  std::size_t push() {
    if ((size_ >> kShift) == chunks_.size()) chunks_.push_back(std::make_unique_for_overwrite<T[]>(kSlots));
    return size_++;
  }

 private:
  std::vector<std::unique_ptr<T[]>> chunks_;
  std::size_t size_ = 0;
};

template <typename T>
class ChunkedRows {
 public:
  static constexpr std::size_t kShift = 10, kSlots = std::size_t{1} << kShift;
  explicit ChunkedRows(std::size_t width) : width_(width) {}
  ChunkedRows(const ChunkedRows&) = delete;
  ChunkedRows& operator=(const ChunkedRows&) = delete;
  ChunkedRows(ChunkedRows&&) noexcept = default;
  ChunkedRows& operator=(ChunkedRows&&) noexcept = default;
  T* row(std::size_t slot) noexcept { return chunks_[slot >> kShift].get() + (slot & (kSlots - 1)) * width_; }
  const T* row(std::size_t slot) const noexcept {
    return chunks_[slot >> kShift].get() + (slot & (kSlots - 1)) * width_;
  }
  // Room for slot `slot` (slots are added in order; uninitialised).
  void ensure(std::size_t slot) {
    while ((slot >> kShift) >= chunks_.size()) chunks_.push_back(std::make_unique_for_overwrite<T[]>(kSlots * width_));
  }

 private:
  std::size_t width_;
  std::vector<std::unique_ptr<T[]>> chunks_;
};

class RadixTree {
 public:
  // Tokens are stored encoded as u32 codes: ints as themselves (< 2**31), digests as
  // kDigestBit | id in an interning table.  Equal tokens have equal codes, so prefix checks
  // are plain integer compares.  Each digest id is reference counted: every stored copy of
  // its code (a node's tokens, and on the manager's side a request's tokens or a buffered
  // event's) holds one reference; the last release frees the id for reuse, so the table is
  // bounded by the live digest tokens (SPEC sec. 15; the python backend keeps the bytes
  // objects themselves, which Python frees the same way).
  using Code = std::uint32_t;
  static constexpr Code kDigestBit = 0x80000000u;
  static constexpr Code kUnknownDigest = 0xFFFFFFFFu;  // a query digest no one interned

  static constexpr std::uint32_t kIndexBuild = 16;  // the default index_threshold
  // index_threshold: a parent with more children than this indexes them in a trie (dropped
  // again at half); the default suits the manager, tests lower it to drive the trie hard.
  RadixTree(std::int64_t tokens_per_block, std::vector<LifeCycleSpec> life_cycles,
            std::uint32_t index_threshold = kIndexBuild);

  // ------------------------------------------------------------ mutations
  // Node ids are handles: slots of the node slab, reused after a node is deleted.  The
  // creation-order number tree.py calls the id is uid(node) (dumps and snapshots show it).

  // The root of a scope, created on first use (the caller refs it; a root with no child and
  // no reference is released by unref, prune_upward or collect).
  NodeId root(const Digest& scope_key);
  // The root of a scope if it exists, else kNoNode (creates nothing: probes use it).
  NodeId find_root(const Digest& scope_key) const;
  // A detached block with no pages and no references (caller refs or attaches it).
  NodeId new_block(const Digest& key, std::span<const TokenArg> tokens, std::int64_t ordinal);
  NodeId new_block(const Digest& key, std::span<const Code> tokens, std::int64_t ordinal);
  // The child of `parent` with `key`, else a covering sibling (a longer child whose tokens
  // start with `tokens`; most tokens first, ties by smaller key), else kNoNode.
  NodeId find_existing(NodeId parent, const Digest& key, std::span<const TokenArg> tokens) const;
  NodeId find_existing(NodeId parent, const Digest& key, std::span<const Code> tokens) const;
  // Link `node` under `parent`; shorter partial siblings whose tokens prefix the node's are
  // detached (returned in key order), the node adopting their pages where they cover more.
  std::vector<NodeId> attach(NodeId parent, NodeId node);
  // Unlink `node` from its parent (it keeps its children links).
  void detach(NodeId node);
  // Detach `node` and every descendant (pre-order, children by key); each loses its children.
  std::vector<NodeId> remove_subtree(NodeId node);
  // From `node` up: detach while attached, childless and pageless; returns the uids of the
  // pruned nodes (deleted by the time it returns, so handles would mean nothing).
  std::vector<NodeId> prune_upward(NodeId node);
  // Install `page` for `lc`; returns the page it replaced (or kNoPage).
  PageHandle set_page(NodeId node, std::int64_t lc, PageHandle page, std::int64_t coverage);
  // Remove the page of `lc`; returns it (or kNoPage).  May delete a dead orphan.
  PageHandle clear_page(NodeId node, std::int64_t lc);
  void ref(NodeId node);
  void unref(NodeId node);
  // Delete `node` if nothing keeps it (after the caller freed its orphan pages).
  void collect(NodeId node);
  // A hint: load the child-table line where a child with `key` would be found, so a
  // lookup of that key soon after (the next block of a commit or match) does not wait.
  void prefetch_child(const Digest& key) const noexcept { __builtin_prefetch(&children_[slot_of(key)]); }
  // Match `tokens` (`keys`: at least the full-block keys walked) under `root`.
  MatchResult match(NodeId root, std::span<const TokenArg> tokens, std::span<const Digest> keys, bool partial,
                    std::int64_t backoff) const;
  MatchResult match(NodeId root, std::span<const Code> tokens, std::span<const Digest> keys, bool partial,
                    std::int64_t backoff) const;

  // The blocks under `root` whose keys are keys[0], keys[1], ... (the full-block walk of the
  // match, no partial step; the shared tier's tree path).
  std::vector<NodeId> key_path(NodeId root, std::span<const Digest> keys) const;
  // The fixed point of the match over the blocks `path` followed by blocks not in the tree
  // whose coverage per lc is rows[k] (the shared tier's extension); use_ssm false gives
  // m_before_ssm (SPEC sec. 6 step 4).
  std::int64_t prune_extended(const std::vector<NodeId>& path, const std::vector<std::vector<std::int64_t>>& rows,
                              std::int64_t m, bool use_ssm = true) const;

  // ------------------------------------------------------------ tokens
  // The code of `t`; for a digest, one new reference the caller owns (release it).
  Code intern(const TokenArg& t) {
    if (t.digest == nullptr && !(t.value & kDigestBit)) return t.value;  // the common case, inline
    return intern_slow(t);
  }
  // One more / one less reference to a digest code (ints: nothing to do).
  void retain(Code c) noexcept {
    if (c & kDigestBit) ++digest_refs_[c & ~kDigestBit];
  }
  void release(Code c) noexcept {
    if (c & kDigestBit) release_digest(c & ~kDigestBit);
  }
  void retain_all(std::span<const Code> codes) noexcept {
    for (Code c : codes) retain(c);
  }
  void release_all(std::span<const Code> codes) noexcept {
    for (Code c : codes) release(c);
  }
  // Whether any code is a digest (an OR over the codes: vectorised, no branch per token).
  static bool any_digest(std::span<const Code> codes) noexcept {
    Code acc = 0;
    for (Code c : codes) acc |= c;
    return (acc & kDigestBit) != 0;
  }
  // Distinct digest tokens interned now (each referenced by something live).
  std::size_t num_digests() const noexcept { return digest_ids_.size(); }
  // Slots of the digest table (live or free for reuse): its memory.
  std::size_t digest_slots() const noexcept { return digests_.size(); }
  // The code of `t` without interning (kUnknownDigest for a digest never interned).
  Code lookup(const TokenArg& t) const;
  TokenOut decode(Code c) const;
  const Digest& digest(Code c) const noexcept { return digests_[c & ~kDigestBit]; }

  // ------------------------------------------------------------ queries
  NodeId parent(NodeId node) const {
    const Ref p = at(ref_of(node)).parent;
    return p != kNil ? static_cast<NodeId>(p) : kNoNode;
  }
  bool is_attached(NodeId node) const { return at(ref_of(node)).attached; }
  bool exists(NodeId node) const noexcept {
    return node >= 0 && static_cast<std::size_t>(node) < nodes_.size() && nodes_[static_cast<std::size_t>(node)].alive;
  }
  const Digest& key(NodeId node) const { return at(ref_of(node)).key; }
  PageHandle page(NodeId node, std::int64_t lc) const { return pages_.row(ref_of(node))[lc_index(lc)]; }
  std::int64_t coverage(NodeId node, std::int64_t lc) const { return coverage_.row(ref_of(node))[lc_index(lc)]; }
  bool has_page(NodeId node) const { return node_has_page(ref_of(node)); }
  // No children and no page: remove_subtree would list it alone, retire_nodes free nothing.
  bool is_bare_leaf(NodeId node) const {
    const Ref r = ref_of(node);
    return at(r).first_child == kNil && !node_has_page(r);
  }
  // Valid until the next node is made (the token arena may move).
  std::span<const Code> tokens(NodeId node) const { return codes(ref_of(node)); }
  std::int64_t ordinal(NodeId node) const { return at(ref_of(node)).ordinal; }
  std::int64_t uid(NodeId node) const { return at(ref_of(node)).uid; }
  // Whether the node's tokens hold a digest (its tokens then hold digest references).
  bool has_digest(NodeId node) const { return at(ref_of(node)).has_digest; }
  // The live node with creation number `uid`, else kNoNode.  A linear scan: for debugging
  // bindings and tests, never on a hot path.
  NodeId find_uid(std::int64_t uid) const noexcept;
  // One past the largest uid ever made (uids are never reused).
  std::int64_t next_uid() const noexcept { return next_uid_; }
  std::size_t num_nodes() const noexcept { return nodes_.size() - free_.size(); }
  std::size_t node_slots() const noexcept { return nodes_.size(); }
  std::size_t num_roots() const noexcept { return roots_.size(); }
  std::size_t trie_node_slots() const noexcept { return tnodes_.size(); }
  std::int64_t tokens_per_block() const noexcept { return B_; }
  std::size_t num_life_cycles() const noexcept { return lcs_.size(); }
  // Canonical picture: every live node by uid; ids in the dump (node, parent, children)
  // are uids, pages are the handles given to set_page.
  std::vector<NodeDump> dump() const;

 private:
  using Ref = std::uint32_t;  // a slot of nodes_
  static constexpr Ref kNil = 0xFFFFFFFFu;

  // One radix-tree block.  Children form an intrusive doubly linked list (first_child,
  // prev/next_sibling), so a node owns no container; finding a child by key goes through
  // the tree-wide table children_.  Per slot, outside the node: its tokens at
  // arena_[slot * B], pages and coverage at pages_/coverage_[slot * num_lcs + lc].
  struct Node {
    Digest key{};
    // creation number (tree.py's id), below 2**47 (make_node refuses more: 1.4e14 blocks)
    std::int64_t uid : 48 = 0;
    std::uint64_t ntok : 13 = 0;  // tokens in arena_ (< B: a partial block; 0 for roots); B <= 4096
    bool alive : 1 = false, is_root : 1 = false, attached : 1 = false;
    std::int32_t ordinal = -1;   // block position in its chain (-1: root)
    std::uint32_t refs = 0;      // requests referencing the block
    Ref parent = kNil;           // kNil when detached (an orphan) or a root
    Ref first_child = kNil, prev_sibling = kNil, next_sibling = kNil;
    // children counts fit 31 bits (node slots are below 2**31), the flags the 32nd
    std::uint32_t npartial : 31 = 0;  // children with fewer than B tokens (attach looks at them only)
    bool has_digest : 1 = false;      // its tokens hold digest references (released by erase_node)
    std::uint32_t nchildren : 31 = 0;  // linked children
    bool indexed : 1 = false;          // its children have a token trie, its root in tindex_
  };
  static constexpr std::int64_t kUidMask = (std::int64_t{1} << 47) - 1;
  // 72 bytes: a cached block costs one node (its tokens and pages live outside it)
  static_assert(sizeof(Node) == 72);
  static_assert(sizeof(Digest) == 32);
  static_assert(std::is_trivially_destructible_v<Node>);  // make_node builds over a dead one

  // The children index (tree.py: class _Trie): per parent, a compressed trie over the
  // children's token sequences, so partial matching (sec. 6 step 1), covering siblings
  // (find_existing) and prefix siblings (attach) walk O(tokens) trie nodes instead of
  // scanning every sibling with the same first token (SPEC sec. 15).  A trie node's prefix
  // is spelled by arena(rep)[0, depth); `leaf` heads the list (TLink::tnext) of children
  // whose tokens end here; best / cover aggregate the children below (smallest key / most
  // tokens then smallest key).  Every node but the root has a leaf or two kids.
  // A parent with few children has no trie (they are scanned, a bounded cost): the trie is
  // built when it gets more than index_threshold children and dropped at half that, so a
  // chain's blocks (one child each) pay nothing for it on the hot path.
  using TRef = std::uint32_t;
  struct TNode {
    Ref rep = kNil, leaf = kNil, best = kNil, cover = kNil;
    TRef up = kNil, first_kid = kNil, next_kid = kNil, prev_kid = kNil;
    std::uint32_t depth = 0;
    Code tok = 0;  // the first token of the edge from `up`
  };
  struct TLink {
    TRef tnode = kNil;
    Ref tnext = kNil;
  };
  struct KidEntry {  // the kid table: (up, tok) -> trie node, open addressing
    TRef ref = kNil, up = kNil;
    Code tok = 0;
  };
  TNode& tn(TRef t) noexcept { return tnodes_[t]; }
  const TNode& tn(TRef t) const noexcept { return tnodes_[t]; }
  TRef new_tnode(std::uint32_t depth, Ref rep, TRef up, Code tok);
  void free_tnode(TRef t) noexcept;
  void add_kid(TRef up, TRef kid);
  void remove_kid(TRef kid) noexcept;
  void remove_kid_entry_only(TRef kid) noexcept;
  TRef find_kid(TRef up, Code tok) const noexcept;
  std::size_t kid_slot(TRef up, Code tok) const noexcept;
  void kid_table_grow();
  bool covers_more(Ref a, Ref b) const noexcept;
  std::uint32_t edge_end(std::span<const Code> q, std::size_t qstart, TRef c, std::uint32_t d) const noexcept;
  std::pair<TRef, std::uint32_t> walk(Ref p, std::span<const Code> q, std::size_t start) const;
  void index_add(Ref p, Ref n);
  void index_remove(Ref p, Ref n);
  void index_prefixes(Ref p, Ref n, std::vector<Ref>& out) const;
  // p loses every child at once (remove_subtree, a dying node); inline for the usual
  // parent with no trie, which every evicted leaf is
  void index_clear(Ref p) {
    if (at(p).indexed) index_clear_trie(p);
  }
  // The root of p's children trie (kNil: none).  Only parents with more than
  // index_threshold children have one, so it lives in a side table, not in every node.
  TRef index_root(Ref p) const noexcept { return at(p).indexed ? tindex_.find(p)->second : kNil; }
  // Where a child of an indexed parent sits in that parent's trie: the trie node its tokens
  // end at, and the next child ending there too (the node's `leaf` list; same tokens are
  // rare).  Only children of indexed parents have one, so they live in a side table.
  TRef tnode_of(Ref n) const noexcept {
    const auto it = tlinks_.find(n);
    return it != tlinks_.end() ? it->second.tnode : kNil;
  }
  Ref tnext_of(Ref n) const noexcept { return tlinks_.find(n)->second.tnext; }  // n is in a leaf list
  void set_index_root(Ref p, TRef t) {
    if (t == kNil) {
      tindex_.erase(p);
      at(p).indexed = false;
    } else {
      tindex_[p] = t;
      at(p).indexed = true;
    }
  }
  void index_clear_trie(Ref p);
  void index_build(Ref p);
  NodeId covering_scan(Ref p, std::span<const Code> tokens) const;
  std::pair<Ref, std::int64_t> longest_run_scan(Ref node, std::span<const Code> tokens, std::size_t start) const;
  void prefixes_scan(Ref p, Ref n, std::vector<Ref>& out) const;

  Node& at(Ref r) noexcept { return nodes_[r]; }
  const Node& at(Ref r) const noexcept { return nodes_[r]; }
  Ref ref_of(NodeId id) const {  // throws NoSuchNode for a dead or unknown id
    if (!exists(id)) [[unlikely]] throw NoSuchNode(id);
    return static_cast<Ref>(id);
  }
  std::size_t lc_index(std::int64_t lc) const {
    if (lc < 0 || static_cast<std::size_t>(lc) >= lcs_.size()) [[unlikely]] {
      throw std::out_of_range("list index out of range");
    }
    return static_cast<std::size_t>(lc);
  }
  // A new live node with room for B tokens in arena_ (the caller writes them).
  Ref make_node(const Digest& key, std::size_t ntok, std::int64_t ordinal, bool is_root);
  Code* arena(Ref r) noexcept { return arena_.row(r); }
  const Code* arena(Ref r) const noexcept { return arena_.row(r); }
  Code first(Ref r) const noexcept { return arena(r)[0]; }
  std::span<const Code> codes(Ref r) const noexcept { return {arena(r), at(r).ntok}; }
  bool node_has_page(Ref r) const noexcept;
  void link(Ref parent, Ref child);
  void unlink(Ref r);
  void maybe_delete(Ref r);
  void release_root_if_unused(Ref r);
  bool deletable(Ref r) const noexcept;
  void erase_node(Ref r);
  std::vector<Ref> children_by_key(Ref r) const;
  NodeId covering(Ref p, std::span<const Code> tokens) const;
  std::pair<Ref, std::int64_t> longest_run(Ref node, std::span<const Code> tokens, std::size_t start) const;
  std::int64_t prune_match(const std::vector<Ref>& path, std::int64_t m, bool use_ssm) const;
  // prune_match's fixed point over any blocks: cov(j, lc) is block j's coverage of lc.
  template <typename Cov>
  std::int64_t fixed_point(const Cov& cov, std::int64_t m, bool use_ssm) const;
  std::vector<Code> encode_query(std::span<const TokenArg> tokens) const;
  Code intern_slow(const TokenArg& t);
  void release_digest(Code id) noexcept;

  // --- children_: open addressing (linear probing, backward-shift deletion) over node
  // slots, keyed by (parent, key).  Holds exactly the nodes that have a parent.  Each
  // entry carries the low 32 bits of its key's hash (DigestHash), so a probe touches a
  // node only when they agree, and growing or deleting (which need each entry's home slot)
  // touch no node at all: a lookup costs one cache line of the table.
  struct Entry {
    Ref ref = kNil;
    std::uint32_t hash = 0;
  };
  static std::uint32_t hash32(const Digest& key) noexcept { return static_cast<std::uint32_t>(DigestHash{}(key)); }
  // Any table size: the hash scaled onto [0, size) (multiply-shift, no division), so the
  // home slots keep the hashes' order and the table grows by a load factor, not by 2**k.
  std::size_t home(std::uint32_t hash) const noexcept {
    return static_cast<std::size_t>((std::uint64_t{hash} * children_.size()) >> 32);
  }
  std::size_t next_slot(std::size_t i) const noexcept { return i + 1 == children_.size() ? 0 : i + 1; }
  std::size_t slot_of(const Digest& key) const noexcept { return home(hash32(key)); }
  Ref find_child(Ref parent, const Digest& key) const noexcept;
  void table_insert(Ref r);
  void table_erase(Ref r) noexcept;
  void table_grow();

  std::int64_t B_;
  std::vector<LifeCycleSpec> lcs_;
  std::uint32_t index_build_, index_drop_;  // trie above index_build_ children, none at index_drop_
  ChunkedSlab<Node> nodes_;        // the slab; a slot is reused after its node dies
  std::vector<Ref> free_;          // dead slots (LIFO)
  ChunkedRows<Code> arena_;              // row(slot)[i]: token i of the node in slot
  // row(slot)[lc]: page handle or kNoPage (handles fit 32 bits: the manager's page slab
  // refuses to grow past 2**31 - 1), and the tokens it covers (<= B <= 4096)
  ChunkedRows<std::int32_t> pages_;
  ChunkedRows<std::int16_t> coverage_;
  std::vector<Entry> children_;    // the child table (ref kNil = empty); at most 3/5 full
  std::size_t num_children_ = 0;
  std::unordered_map<Digest, Ref, DigestHash> roots_;
  std::vector<TNode> tnodes_;      // the children tries' nodes (slab)
  std::vector<TRef> tfree_;        // dead trie slots (LIFO)
  std::unordered_map<Ref, TRef> tindex_;  // parent slot -> its children trie's root (Node::indexed)
  std::unordered_map<Ref, TLink> tlinks_;  // child slot -> its place in its parent's trie
  std::vector<KidEntry> tkids_ = std::vector<KidEntry>(16);  // size a power of two
  std::size_t num_tkids_ = 0;
  std::int64_t next_uid_ = 0;

  std::unordered_map<Digest, Code, DigestHash> digest_ids_;  // live digests only
  std::vector<Digest> digests_;             // by id
  std::vector<std::uint32_t> digest_refs_;  // by id; 0: free
  std::vector<Code> free_digests_;          // free ids (LIFO)
};

}  // namespace kvcm
