// The KV-cache manager core (SPEC sec. 4, 7, 8, 9, 11).  A faithful port of
// kvcm/python_backend/: the same algorithms with the same order of every side effect, so
// both backends produce identical page indices, copy ops, events, stats and snapshots.
//
// One file per concept, mirroring python_backend/ (docs: DECISIONS.md "Mirrored wings"):
//   lifecycle.h          life cycles, stale ranges, floordiv / ceildiv  (the config module)
//   tree.{h,cpp}         radix tree, matching, prune_match              (tree.py)
//   pools.{h,cpp}        pages, free slots, eviction index, victim      (pools.py)
//   block_pool.{h,cpp}   class BlockPool: pages and their users, pools,  (block_pool.py)
//                        moves, drops, tree, clock, copy ops, events,
//                        stats (fifo.h: the event buffer's ring)
//   request.{h,cpp}      class Request: one request's state and life    (request.py)
//                        cycle, working the BlockPool it holds
//   manager.{h,cpp}      class Manager: the facade — ids, the request   (manager.py)
//                        registry, the lock, the manager-level calls
//   batch.cpp            the batched decode step                        (batch.py)
//   observe.cpp          snapshot and invariant checks                  (observe.py)
// The seam (issue 21): a Request calls only BlockPool's public surface, never the Manager;
// the Manager owns one BlockPool, hands it to each Request, and alone touches the registry.
// Each function implementing a SPEC rule is preceded by one line
//   // py: <file>.py <Class>.<name> — SPEC sec. <N>
// naming its Python twin (same name, possibly with one leading underscore), in the
// same-named file and the matching class (tests/house/test_mirror.py).
//
// Plain C++20, no Python types.  One Manager is not thread-safe by itself; the bindings
// serialise calls with mutex() (taken after releasing the GIL).
#pragma once

#include <algorithm>
#include <array>
#include <cstdint>
#include <deque>
#include <functional>
#include <iterator>
#include <map>
#include <memory>
#include <memory_resource>
#include <mutex>
#include <optional>
#include <set>
#include <span>
#include <stdexcept>
#include <string>
#include <tuple>
#include <type_traits>
#include <unordered_map>
#include <vector>

#include "core/block_keys.h"
#include "core/block_pool.h"
#include "core/lifecycle.h"
#include "core/pools.h"
#include "core/request.h"
#include "core/sha256.h"
#include "core/tree.h"
#include "core/types.h"

namespace kvcm {

class Manager {
 public:
  explicit Manager(ManagerConfig cfg);

  std::mutex& mutex() noexcept { return mutex_; }

  // ---------------------------------------------------------------- manager calls
  // Validated arguments only (the Python layer checks them first).
  using SharedHits = kvcm::SharedHits;  // block_pool.h
  // hits: nullptr when create_kv_cache got no shared_hits (DECISIONS.md "The shared tier").
  std::int64_t create(TokenSeq tokens, std::optional<std::uint64_t> lora,
                      std::optional<std::uint64_t> salt, std::int64_t priority, const SharedHits* hits = nullptr);
  // The (key, lc) pairs to look up in the shared tier; no side effect.
  std::vector<std::pair<Digest, std::int64_t>> shared_candidates(TokenSeq tokens, std::optional<std::uint64_t> lora,
                                                                 std::optional<std::uint64_t> salt);
  // probe_reuse_detail (SPEC sec. 6): what create(tokens, lora, salt, hits) would match
  // now, and (with_tiers; probe_reuse leaves them out) the tiers of what it would hold; no
  // side effect.
  struct ProbeResult {
    std::int64_t m = 0, m_before_ssm = 0;
    std::vector<std::int64_t> block_tiers;  // per full block of the match: coldest tier, -1 none
  };
  ProbeResult probe(TokenSeq tokens, std::optional<std::uint64_t> lora, std::optional<std::uint64_t> salt,
                    const SharedHits* hits = nullptr, bool with_tiers = true);
  std::vector<CopyOpC> drain_copy_ops();
  // Failed copies (SPEC sec. 15): forget the pages the given ops of the last drain were
  // meant to fill and roll back the requests that used them; returns their serials in
  // creation order.  ValueErr (nothing changed) naming the first op that is not an
  // unreported op of the last drain.  Types are checked by the Python layer.
  std::vector<std::int64_t> forget_copies(std::span<const CopyOpC> ops);
  // Explicit settlement (DECISIONS.md "Asynchronous copies: settle_copies"): settle the oldest
  // unsettled drain, whose ops in `failed` did not complete: their pages are forgotten and
  // the requests that used them rolled back as by forget_copies; returns their serials in
  // creation order.  ValueErr (nothing changed): not explicit, no unsettled drain, an op
  // not of that drain.  Types are checked by the Python layer.
  std::vector<std::int64_t> settle_copies(std::span<const CopyOpC> failed);
  std::int64_t unsettled_drains() const noexcept { return pool_.outbox().unsettled_drains(); }
  bool explicit_settlement() const noexcept { return pool_.layout().cfg().explicit_settlement; }
  // Sec. 15: the pending copy ops reached the warning figure during the last call (only once
  // per manager): returns the figure and clears the flag, else 0.  The bindings then issue
  // kvcm.api.warn_pending_copy_ops (manager.py: PyKVCacheManager.add_copy_op).
  std::int64_t take_copy_ops_warning() noexcept { return pool_.outbox().take_copy_ops_warning(); }
  void set_pending_copy_ops_warning(std::int64_t n) noexcept { pool_.set_pending_copy_ops_warning(n); }
  // Sizes of the manager's internal tables (tests of SPEC sec. 15: what a long-running
  // server keeps must stay bounded by the live state), as (name, count) pairs.
  std::vector<std::pair<std::string, std::int64_t>> internal_sizes() const;
  void clear_reusable();
  // Quotas at run time (DECISIONS.md): pools of config position `tier` resized to `slots`
  // (per lc, computed and checked by kvcm.config.resolve_quota).  Refused, nothing changed:
  // returns {lc, slots, need, locked, held that must stay} of the first pool that cannot
  // shrink that far (the bindings raise OutOfPagesError); empty when done.
  std::vector<std::int64_t> set_quota(std::int64_t tier, std::int64_t quota_bytes,
                                      const std::vector<std::int64_t>& slots);
  void shutdown();
  bool is_shutdown() const noexcept { return is_shutdown_; }
  std::size_t num_open() const noexcept { return requests_.size(); }
  std::string stats_json(bool take_iteration);
  TakenEvents take_events();
  std::string snapshot_json();
  void check_invariants();

  // ---------------------------------------------------------------- request calls (by serial)
  RequestInfo info(std::int64_t serial) const;
  // InvalidStateErr unless the cache is in `status` (what: the call's name, for the message).
  void require_status(std::int64_t serial, ReqStatus status, const char* what) const;
  std::vector<TokenOut> committed_tokens(std::int64_t serial) const;
  bool resume(std::int64_t serial);
  void suspend(std::int64_t serial);
  bool resize(std::int64_t serial, std::int64_t capacity, std::optional<std::int64_t> history);
  void commit(std::int64_t serial, TokenSeq tokens);
  // commit of the next n input tokens (nullopt: all the rest; kvcm.api.KVCache.commit_input)
  void commit_input(std::int64_t serial, std::optional<std::int64_t> n);
  void stop_committing(std::int64_t serial);
  ClosedTokens close(std::int64_t serial);
  std::vector<std::int32_t> page_indices(std::int64_t serial, std::int64_t lc, std::int64_t start = 0,
                                         std::int64_t stop = -1);
  std::size_t num_life_cycles() const noexcept { return pool_.layout().num_life_cycles(); }
  std::size_t num_tiers() const noexcept { return static_cast<std::size_t>(pool_.layout().num_tiers()); }
  // Forks (issue 22, DECISIONS.md "Forks (issue 22)"): a new ACTIVE request sharing this
  // one's committed pages; its serial, or -1 (nothing changed) when the gpu cannot take the
  // fork's own pages.  ClosedErr / InvalidStateErr (status, history) change nothing.
  std::int64_t fork(std::int64_t serial);

 private:
  // A failure report's second half (forget_copies, settle_copies): tick, forget the `lost`
  // pages ((handle, serial)) and roll back every open request that used one; their serials.
  std::vector<std::int64_t> roll_back_lost(const std::vector<std::pair<std::int64_t, std::int64_t>>& lost);
  // The open request of `serial` (ClosedErr "call on a closed cache" when there is none).
  Request& req(std::int64_t serial);
  const Request& req(std::int64_t serial) const;
  // --- observe.cpp: the requests' parts of snapshot_json and check_invariants
  std::vector<std::int64_t> open_serials() const;  // the open requests' serials, ascending
  void snapshot_requests(std::string& o) const;
  void check_request(std::int64_t serial, BlockPool::InvariantUsers& users) const;

  BlockPool pool_;  // the pages, pools, tree, copy ops, events and stats the requests share
  std::int64_t next_request_ = 0;  // the next request serial
  // open requests by serial (a hash map: a decode step looks up hundreds per call; the
  // few places that list them sort by serial)
  std::unordered_map<std::int64_t, Request> requests_;
  bool is_shutdown_ = false;  // shutdown() ran: creates, set_quota and clear_reusable refuse
  std::mutex mutex_;  // serialises the bindings' calls (taken after releasing the GIL)

  // ==================================================================== batched decode step
  // resize_batch / commit_batch (defined in batch.cpp; semantics documented on
  // kvcm.api.KVCacheManager.resize_batch / commit_batch and in DECISIONS.md).  One call
  // does what a loop of single calls does, in order, but validates the WHOLE batch before
  // the first mutation, and runs under one lock: an engine's 256-request decode step is one
  // Python -> C++ crossing instead of 512.
 public:
  // The batch's checks that need no manager state (the bindings run them before parsing
  // the other arguments, to keep kvcm.api's check order): serials[i] < 0 marks an item
  // that is not a cache of this manager; no serial may appear twice.  ValueErr naming
  // the first offending index.
  static void check_batch_serials(std::span<const std::int64_t> serials, const char* what);
  // results[i] = what resize(serials[i], capacities[i], histories[i]) returns; an empty
  // `histories` keeps every cache's history.  All spans have the batch's length.
  void resize_batch(std::span<const std::int64_t> serials, std::span<const std::int64_t> capacities,
                    std::span<const std::int64_t> histories, std::span<std::uint8_t> results);
  // commit(serials[i], {tokens[i]}) for each i: one token per cache.
  void commit_batch(std::span<const std::int64_t> serials, TokenSeq tokens);

 private:
  // Item by item: the open request of serials[i] (else ClosedErr), then check(i, request);
  // errors name the item.  The requests go into a reused member vector.
  template <typename Check>
  std::vector<Request*>& check_batch(std::span<const std::int64_t> serials, const char* what, const char* single,
                                     Check check);
  std::vector<Request*> scratch_batch_;  // check_batch's result, reused (a decode step does not allocate)
};

}  // namespace kvcm
