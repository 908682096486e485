// The radix tree of committed blocks (SPEC sec. 5) and the match walk (sec. 6).
//
// A faithful port of kvcm/python_backend/tree.py (class RadixTree): same operations,
// same return values and orders, so the two can be driven in lockstep by
// parity/test_tree_differential.py.  Nodes are addressed by int ids (creation order,
// never reused) and pages by int handles owned by the manager; the tree knows page
// presence and coverage, not tiers or states.
//
// Node life time: a node exists while it is attached (roots always are), while a request
// references it (ref/unref), or while it still holds a page.  Anything else is deleted
// at once, so orphans disappear with their last user.
#pragma once

#include <cstddef>
#include <cstdint>
#include <cstring>
#include <optional>
#include <span>
#include <stdexcept>
#include <string>
#include <unordered_map>
#include <utility>
#include <vector>

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

enum class LcKind { attn, ssm };

// One life cycle as the tree sees it: (kind, window, sinks); window nullopt = full attention.
struct LifeCycleSpec {
  LcKind kind = LcKind::attn;
  std::optional<std::int64_t> window;
  std::int64_t sinks = 0;
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

class RadixTree {
 public:
  RadixTree(std::int64_t tokens_per_block, std::vector<LifeCycleSpec> life_cycles);

  // ------------------------------------------------------------ mutations
  // The root of a scope, created on first use.
  NodeId root(const Digest& scope_key);
  // A detached block with no pages and no references (caller refs or attaches it).
  NodeId new_block(const Digest& key, std::span<const TokenArg> tokens, std::int64_t ordinal);
  // The child of `parent` with `key`, else a covering sibling (a longer child whose tokens
  // start with `tokens`; most tokens first, ties by smaller key), else kNoNode.
  NodeId find_existing(NodeId parent, const Digest& key, std::span<const TokenArg> tokens) const;
  // Link `node` under `parent`; shorter partial siblings whose tokens prefix the node's are
  // detached (returned in key order), the node adopting their pages where they cover more.
  std::vector<NodeId> attach(NodeId parent, NodeId node);
  // Unlink `node` from its parent (it keeps its children links).
  void detach(NodeId node);
  // Detach `node` and every descendant (pre-order, children by key); each loses its children.
  std::vector<NodeId> remove_subtree(NodeId node);
  // From `node` up: detach while attached, childless and pageless.
  std::vector<NodeId> prune_upward(NodeId node);
  // Install `page` for `lc`; returns the page it replaced (or kNoPage).
  PageHandle set_page(NodeId node, std::int64_t lc, PageHandle page, std::int64_t coverage);
  // Remove the page of `lc`; returns it (or kNoPage).  May delete a dead orphan.
  PageHandle clear_page(NodeId node, std::int64_t lc);
  void ref(NodeId node);
  void unref(NodeId node);
  // Delete `node` if nothing keeps it (after the caller freed its orphan pages).
  void collect(NodeId node);
  // Match `tokens` (`keys`: at least the full-block keys walked) under `root`.
  MatchResult match(NodeId root, std::span<const TokenArg> tokens, std::span<const Digest> keys, bool partial,
                    std::int64_t backoff) const;

  // ------------------------------------------------------------ queries
  NodeId parent(NodeId node) const;
  bool is_attached(NodeId node) const;
  bool exists(NodeId node) const noexcept { return nodes_.count(node) != 0; }
  const Digest& key(NodeId node) const;
  PageHandle page(NodeId node, std::int64_t lc) const;
  std::int64_t coverage(NodeId node, std::int64_t lc) const;
  std::size_t num_nodes() const noexcept { return nodes_.size(); }
  std::int64_t tokens_per_block() const noexcept { return B_; }
  std::size_t num_life_cycles() const noexcept { return lcs_.size(); }
  // Canonical picture: every live node by id.
  std::vector<NodeDump> dump() const;

 private:
  // Tokens are stored encoded as u32: ints as themselves (< 2**31), digests as
  // kDigestBit | id of the digest in an interning table.  Equal tokens then have equal
  // codes, so prefix checks and the first-token index are plain integer compares.
  using Code = std::uint32_t;
  static constexpr Code kDigestBit = 0x80000000u;
  static constexpr Code kUnknownDigest = 0xFFFFFFFFu;  // a query digest no node holds

  struct Node {
    NodeId id = 0;
    Digest key{};
    Node* parent = nullptr;  // null when detached (an orphan) or a root
    std::unordered_map<Digest, Node*, DigestHash> children;
    // Children grouped by first token: partial matching and the covering-sibling search
    // only look at children sharing the first token.  Order inside a group is irrelevant
    // (every selection has a total tie-break by key).
    std::unordered_map<Code, std::vector<Node*>> by_first;
    std::vector<Code> tokens;
    std::int64_t ordinal = -1;
    bool is_root = false;
    bool attached = false;
    std::vector<PageHandle> pages;
    std::vector<std::int64_t> coverage;
    std::int64_t refs = 0;

    bool has_page() const noexcept {
      for (PageHandle p : pages) {
        if (p != kNoPage) return true;
      }
      return false;
    }
  };

  Node& get(NodeId id);
  const Node& get(NodeId id) const;
  std::size_t lc_index(std::int64_t lc) const;
  Node& make_node(const Digest& key, std::vector<Code> tokens, std::int64_t ordinal, bool is_root);
  void unlink(Node& n);
  void maybe_delete(Node& n);
  bool deletable(const Node& n) const noexcept;
  void erase_node(Node& n);
  NodeId covering(const Node& p, const std::vector<Code>& tokens) const;
  std::pair<const Node*, std::int64_t> longest_run(const Node& node, const std::vector<Code>& tokens,
                                                   std::size_t start) const;
  std::int64_t fixed_point(const std::vector<const Node*>& path, std::int64_t m, bool use_ssm) const;

  Code intern(const TokenArg& t);
  Code lookup(const TokenArg& t) const;
  void release(Code c) noexcept;
  std::vector<Code> encode_query(std::span<const TokenArg> tokens) const;

  std::int64_t B_;
  std::vector<LifeCycleSpec> lcs_;
  // unordered_map nodes are stable in memory, so Node* links stay valid across rehashes.
  std::unordered_map<NodeId, Node> nodes_;
  std::unordered_map<Digest, Node*, DigestHash> roots_;
  NodeId next_id_ = 0;

  // Digest interning (ref-counted per node token, ids recycled through a free list).
  std::unordered_map<Digest, Code, DigestHash> digest_ids_;
  std::vector<Digest> digests_;
  std::vector<std::uint32_t> digest_refs_;
  std::vector<Code> free_digest_ids_;
};

}  // namespace kvcm
