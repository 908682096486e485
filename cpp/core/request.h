// One request's life cycle (SPEC sec. 7): its status, its blocks and page table, and the
// operations on them.  Python twin: kvcm/python_backend/request.py (Request).  A Request
// works the shared state (pages, pools, tree, copy ops, events, stats) only through the
// BlockPool it holds, never through the manager: the manager looks requests up by serial,
// registers them and drops a closed one from its registry itself.
#pragma once

#include <cstdint>
#include <optional>
#include <span>
#include <utility>
#include <vector>

#include "core/block_keys.h"
#include "core/block_pool.h"
#include "core/tree.h"
#include "core/types.h"

namespace kvcm {

enum class ReqStatus : int { suspended = 0, active = 1, closed = 2 };

struct RequestInfo {
  ReqStatus status = ReqStatus::suspended;
  bool stopped = false;
  std::int64_t capacity = 0, history = 0, num_committed = 0, reused = 0, priority = 0;
};

// The committed tokens of a cache that was just closed (moved out, not copied): the
// Python layer keeps them so a closed cache still answers committed_tokens.
struct ClosedTokens {
  bool closed_now = false;  // false: the cache was already closed (nothing else is set)
  std::int64_t capacity = 0, history = 0, num_committed = 0, reused = 0, priority = 0;
  std::vector<std::uint32_t> codes;
  std::vector<std::pair<std::uint32_t, Digest>> digests;  // the digest of each digest code used
  std::vector<TokenOut> decode() const;
};

// A request's state (SPEC sec. 7).  Request's private base: only Request's operations
// change it; the manager's snapshot, invariant checks and info() read it through
// Request::state().
struct RequestState {
  std::int64_t serial = 0;     // creation number (the manager's registry key)
  Digest root_key{};           // the key of its reuse scope's root (lora, salt)
  NodeId root = kNoNode;       // that root's tree node (one reference held until close)
  std::optional<std::uint64_t> lora, salt;  // the reuse scope
  std::int64_t priority = 0;   // eviction priority given to the pages it uses (0..100)
  ReqStatus status = ReqStatus::suspended;
  bool stopped = false;        // stop_committing ran: no more commits, tail inserted
  std::vector<Tok> input_tokens;  // the prompt as given to create (pool codes)
  std::vector<Digest> keys;       // the block keys of the prompt's full blocks (hashed at create)
  std::vector<Tok> tokens;        // the committed tokens (pool codes)
  std::int64_t reused = 0;        // tokens matched at create
  std::int64_t capacity = 0;      // tokens it may hold (resize)
  std::int64_t history = 0;       // history length (sliding windows' stale ranges)
  std::vector<NodeId> blocks;     // [ordinal] the tree block it references, kNoNode where none
  std::vector<std::vector<std::int64_t>> pages;  // [lc][ordinal] page handle or -1 (attention lcs)
  std::int64_t live = -1;       // ssm: the live state's page handle (ACTIVE), -1: none
  std::int64_t snap = -1;       // ssm: the matched snapshot's page (copied at resume), -1: none
  std::int64_t cow_block = -1;  // the matched partial block to copy at resume, -1: none
  bool has_digests = false;     // its tokens hold digest references (released at close)
};

class Request : private RequestState {
 public:
  // create (SPEC sec. 7): a SUSPENDED request of scope (lora, salt) holding the match of
  // its `input` (pool codes, one digest reference each, which it keeps); `hits`: the
  // store's answer (nullptr: none), which may extend the match into the shared tier.
  Request(BlockPool& pool, std::int64_t serial_no, std::vector<Tok> input, std::optional<std::uint64_t> lora_id,
          std::optional<std::uint64_t> salt_id, std::int64_t prio, bool digests, const SharedHits* hits);
  // A fork's child, set up by the parent's fork() (DECISIONS.md "Forks").
  Request(BlockPool& pool, std::int64_t serial_no) noexcept
      : pool_(pool),
        layout_(pool.layout()),
        tokens_(pool.tokens()),
        pages_(pool.pages()),
        index_(pool.index()),
        outbox_(pool.outbox()) {
    serial = serial_no;
  }

  // ---------------------------------------------------------------- state (read-only)
  const RequestState& state() const noexcept { return *this; }

  // ---------------------------------------------------------------- operations
  // InvalidStateErr unless the request is in `s` (what: the call's name, for the message).
  void require(ReqStatus s, const char* what) const;
  // Match `query` (full-block `query_keys`) and hold what it found, as a fresh SUSPENDED
  // request (create, and roll_back); `hits`: the store's answer, sorted and unique (nullptr:
  // none), which may extend the match into the shared tier.  Returns the match length.
  std::int64_t match_and_hold(std::span<const Tok> query, std::span<const Digest> query_keys,
                              const SharedHits* hits = nullptr);
  std::vector<TokenOut> committed_tokens() const;
  bool resume();
  void suspend();
  bool resize(std::int64_t new_capacity, std::optional<std::int64_t> history_arg);
  // The single calls are check_x (raises, changes nothing) then x_checked (the work); the
  // batched calls run every item's check before the first x_checked.
  void check_resize(std::int64_t new_capacity, std::int64_t new_history) const;
  bool resize_checked(std::int64_t new_capacity, std::int64_t new_history);
  void commit(TokenSeq tokens_in);
  // commit of the next n input tokens (nullopt: all the rest; kvcm.api.KVCache.commit_input)
  void commit_input(std::optional<std::int64_t> n_arg);
  void check_commit(std::int64_t nnew, const char* what = "commit") const;
  void commit_checked(TokenSeq tokens_in);
  void stop_committing();
  // Everything released; the request is CLOSED (the manager drops it from its registry).
  ClosedTokens close();
  std::vector<std::int32_t> page_indices(std::int64_t lc, std::int64_t start = 0, std::int64_t stop = -1);
  // Forks (DECISIONS.md "Forks (issue 22)"): `child`, a fresh Request of the same pool, made
  // an ACTIVE copy sharing this one's committed pages; false (nothing changed) when the gpu
  // cannot take the fork's own pages.
  bool fork(Request& child);
  // Failed copies (DECISIONS.md): where this request rolls back to when the pages
  // `lost_handles` are lost (nullopt: it uses none), and the roll-back itself.
  std::optional<std::int64_t> rollback_point(const std::vector<std::int64_t>& lost_handles) const;
  void roll_back(std::int64_t point);

 private:
  using TailPages = std::vector<std::pair<std::int64_t, std::int64_t>>;  // (lc, page handle)
  void commit_appended(std::int64_t old);
  void release_stale(std::int64_t old_history, std::int64_t first_block);
  void release_all();
  void stop();
  // O(1): false when the pools could never hold ceil(capacity / B) = nb blocks at `new_history`.
  bool could_hold(std::int64_t nb, std::int64_t new_history) const;
  std::int64_t page_at(std::int64_t lc, std::int64_t i) const;
  std::vector<const Page*> used_pages();
  std::vector<const Page*> cow_sources();
  const Page* alloc_private(std::int64_t lc, std::int64_t coverage, std::int64_t ordinal);
  void copy_on_write();
  KeyHint key_hint(std::int64_t i, std::span<const Tok> block) const;
  // defer_prune: more blocks of this commit follow (BlockPool::insert_block)
  void insert_block(std::int64_t i, std::span<const Tok> block, bool want_snapshot, bool defer_prune = false);
  void set_block(std::int64_t i, NodeId nid);
  // forks: the partial block's pages, those of them shared, and their copy
  void init_fork(const Request& parent);
  TailPages tail_pages() const;
  TailPages shared_tail(std::int64_t new_history) const;
  void copy_tail(const TailPages& shared);

  // The shared state, the only thing a request reaches beyond itself: the pool (its clock
  // and the operations that span parts) and the parts it works through, taken from the
  // pool by the constructor; the layout and the token table are not pool members.
  BlockPool& pool_;
  const Layout& layout_;  // the config facts (read-only)
  TokenTable& tokens_;    // the token interning
  Pages& pages_;          // pages read (page, budget), a private page's coverage set
  TreeIndex& index_;      // match, hold, insert, scopes
  Outbox& outbox_;        // copy ops
};

}  // namespace kvcm
