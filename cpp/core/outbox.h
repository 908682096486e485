// The outbox (SPEC sec. 8, 9, 15): what leaves the manager — the copy ops (pending, then
// issued until reported or settled), the buffered events and the stats counters.  Python
// twin: kvcm/python_backend/outbox.py (Outbox).
//
// It reads the layout (tier numbers, limits), the tree (an event's key and tokens) and the
// pages (a stored event's tier and priority, a lost op's page, the pools in stats()); it
// changes none of them but the digest references its buffered events hold.
#pragma once

#include <cstdint>
#include <deque>
#include <span>
#include <string>
#include <type_traits>
#include <utility>
#include <vector>

#include "core/fifo.h"
#include "core/layout.h"
#include "core/pools.h"
#include "core/tree.h"
#include "core/types.h"

namespace kvcm {

class Pages;

struct StoredBlockC {  // key and tokens are the event's (one block, several life cycles)
  std::int32_t lc = 0, tier = 0;
  std::int64_t priority = 0;
  std::int32_t coverage = 0;  // tokens of the block the page covers
};

enum class EventKind { stored, removed, tier_changed, cleared };

// One buffered event.  Trivially destructible on purpose: when the buffer is full the
// oldest event is dropped without touching its (cold) memory.  A stored event's variable
// parts — its block's tokens and its per-life-cycle blocks — sit in the outbox's side
// queues, in event order.
struct EventC {
  EventKind kind = EventKind::cleared;
  bool has_parent = false;    // stored
  bool partial = false;       // stored
  std::uint32_t ntokens = 0;  // stored: tokens of the block
  std::uint32_t nblocks = 0;  // stored: life cycles announced
  std::int64_t id = 0;
  std::int64_t lc = 0, old_tier = 0, new_tier = 0;  // removed / tier_changed
  Digest key{};                                     // stored / removed / tier_changed
  Digest parent_key{};                              // stored
};
static_assert(std::is_trivially_destructible_v<EventC>);

// What take_events() hands out: the events, and the stored events' tokens and blocks,
// each concatenated in event order (event i's follow those of the stored events before it).
struct TakenEvents {
  std::vector<EventC> events;
  std::vector<TokenOut> tokens;
  std::vector<StoredBlockC> blocks;
};

// An op of the last drain_copy_ops not reported yet (forget_copies), or of an unsettled
// drain (settle_copies), with the page it was meant to fill.
struct IssuedOp {
  CopyOpC op;
  std::int64_t handle, serial;  // the page's handle and serial (-1, -1: a shared-tier store)
};

class Outbox {
 public:
  // (pages: read only, and only after construction — the pool builds its parts together)
  Outbox(const Layout& layout, RadixTree& tree, const Pages& pages);
  Outbox(const Outbox&) = delete;
  Outbox& operator=(const Outbox&) = delete;

  // ---------------------------------------------------------------- copy ops
  // A copy op from src to dst ("cow" or "snapshot"), counted.
  void copy(std::int64_t lc, const Page* src, const Page* dst, const char* reason);
  // The shared tier's write (DECISIONS.md): a store op for `p`, a full-coverage page of the
  // full block `key` (shared_write="commit").
  void store(const Page* p, const Digest& key);
  // An op, pending, with the page it fills (handle, serial; -1, -1: none); the pending-ops
  // warning is raised when the pending and unsettled ops reach the configured figure.
  void add_copy_op(const CopyOpC& op, std::int64_t handle, std::int64_t serial);
  // The pending ops, handed out; they become the issued ops of this drain.
  std::vector<CopyOpC> drain_copy_ops();
  // forget_copies' first half: take the given ops (each an unreported op of the last drain)
  // out of the issued ops and return the live pages they were meant to fill,
  // as (handle, serial) in issue order.  ValueErr (nothing changed) naming the first op
  // that is not one.
  std::vector<std::pair<std::int64_t, std::int64_t>> take_issued(std::span<const CopyOpC> ops);
  // settle_copies' first half (explicit settlement): settle the oldest unsettled drain,
  // whose ops in `failed` did not complete; returns the live pages they were meant to fill,
  // as (handle, serial) in issue order.  ValueErr (nothing changed) when there is no
  // unsettled drain, or naming the first op that is not one of that drain.
  std::vector<std::pair<std::int64_t, std::int64_t>> settle_oldest(std::span<const CopyOpC> failed);
  std::int64_t unsettled_drains() const noexcept { return static_cast<std::int64_t>(unsettled_.size()); }
  std::int64_t take_copy_ops_warning() noexcept {
    const std::int64_t due = copy_ops_warn_due_ ? layout_.cfg().pending_copy_ops_warning : 0;
    copy_ops_warn_due_ = false;
    return due;
  }

  // ---------------------------------------------------------------- events
  // A new buffered event with the next id (a stored event also buffers its block's
  // `tokens`), the oldest dropped when full; nullptr when no events are kept (max_events 0).
  // tokens_have_digest: whether `tokens` hold a digest code (the node's has_digest).
  EventC* new_event(EventKind kind, std::span<const Tok> tokens = {}, bool tokens_have_digest = false);
  void emit_removed(const Digest& key, std::int64_t lc);
  void emit_stored(NodeId nid, std::span<const std::int64_t> lcs);
  TakenEvents take_events();

  // ---------------------------------------------------------------- stats
  void count(std::int64_t lc, int counter, std::int64_t n = 1);
  void record_match(std::int64_t n_query, std::int64_t m);
  // stats() (or take_iteration_stats(): the iteration counters, then zeroed) as JSON
  void stats_json(std::string& out, bool take_iteration);

  // ---------------------------------------------------------------- observe.cpp
  void snapshot_tail(std::string& o) const;      // "stats" .. "events_dropped" (after the "stats" key)
  void snapshot_copy_ops(std::string& o) const;  // "copy_ops" .. "issued_copy_ops"
  void snapshot_events(std::string& o) const;    // "events" list
  std::int64_t events_dropped() const noexcept { return events_dropped_; }
  std::int64_t next_event() const noexcept { return next_event_; }
  void check_issued() const;  // the issued (unreported / unsettled) copy ops
  std::size_t num_copy_ops() const noexcept { return copy_ops_.size(); }
  std::size_t num_events() const noexcept { return events_.size(); }
  std::size_t num_event_tokens() const noexcept { return event_tokens_.size(); }

 private:
  // One drain's ops that `ops` name, matched by value in order (one per listed op): a flag
  // per op of `drain`.  ValueErr (settle: settle_copies' message, else forget_copies')
  // naming the first op with no unmatched equal left.
  static std::vector<bool> match_issued(std::span<const IssuedOp> drain, std::span<const CopyOpC> ops, bool settle);
  // The live pages the flagged ops of `drain` were meant to fill, once each, in issue order.
  std::vector<std::pair<std::int64_t, std::int64_t>> live_fills(std::span<const IssuedOp> drain,
                                                                const std::vector<bool>& taken) const;
  std::int64_t event_id() { return next_event_++; }
  void stats_view(std::string& out, const std::vector<std::int64_t>& counters) const;

  const Layout& layout_;
  RadixTree& tree_;  // an event's key, tokens and their digest references
  const Pages& pages_;

  // --- copy ops
  std::vector<CopyOpC> copy_ops_;  // pending, in issue order
  // (handle, serial) of the page each pending op fills ((-1, -1): a store)
  std::vector<std::pair<std::int64_t, std::int64_t>> copy_pages_;
  std::vector<IssuedOp> issued_;  // the ops of the last drain not reported yet (forget_copies)
  // explicit settlement: the drains not settled yet, oldest first (issued_ stays empty), and
  // their ops in all (the pending-ops warning counts them)
  std::deque<std::vector<IssuedOp>> unsettled_;
  std::int64_t unsettled_ops_ = 0;
  bool copy_ops_warned_ = false;    // the pending-ops warning was raised (once per manager)
  bool copy_ops_warn_due_ = false;  // ... during this call: take_copy_ops_warning reports it

  // --- events
  std::int64_t next_event_ = 0;      // the next event id
  Fifo<EventC> events_;              // buffered, oldest first (at most max_events)
  Fifo<Tok> event_tokens_;           // the buffered stored events' tokens, in event order
  Fifo<StoredBlockC> event_blocks_;  // ... and their blocks
  // (ntokens, nblocks) of each buffered event, oldest first: what dropping the oldest
  // event must remove from the side queues, read without touching the event itself;
  // ntokens carries kEventHasDigest when its tokens hold digest references to release
  static constexpr std::uint32_t kEventHasDigest = 0x80000000u;
  Fifo<std::pair<std::uint32_t, std::uint32_t>> event_sizes_;
  std::int64_t events_dropped_ = 0;  // events dropped from a full buffer (or never kept)

  // --- stats
  // counters: [requests, query_tokens, reused_tokens, then kNumCounters per lc]
  std::vector<std::int64_t> totals_, iteration_;
};

}  // namespace kvcm
