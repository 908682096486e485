#include "core/manager.h"

#include <algorithm>
#include <bit>
#include <cstring>
#include <functional>
#include <unordered_set>

#include "core/block_keys.h"

namespace kvcm {
namespace {

constexpr std::int64_t kGpu = 0;

constexpr std::int64_t floordiv(std::int64_t a, std::int64_t b) noexcept {
  std::int64_t q = a / b;
  if ((a % b != 0) && ((a < 0) != (b < 0))) --q;
  return q;
}
constexpr std::int64_t ceildiv(std::int64_t a, std::int64_t b) noexcept { return -floordiv(-a, b); }

enum Counter : int {
  kReusedBlocks = 0,
  kMissedBlocks,
  kReusedTokens,
  kAllocatedBlocks,
  kOffloads,
  kOffloadBytes,
  kOnboards,
  kOnboardBytes,
  kDrops,
  kDropBytes,
  kCows,
  kSnapshotsTaken,
  kSnapshotsSkipped,
  kLostPages,
  kNumCounters
};
constexpr const char* kCounterNames[kNumCounters] = {
    "reused_blocks", "missed_blocks", "reused_tokens", "allocated_blocks", "offloads",       "offload_bytes",
    "onboards",      "onboard_bytes", "drops",         "drop_bytes",       "cows",           "snapshots_taken",
    "snapshots_skipped", "lost_pages"};
constexpr std::size_t kHeader = 3;  // requests, query_tokens, reused_tokens

const char* state_name(int s) {
  switch (s) {
    case 1: return "\"LOCKED\"";
    case 2: return "\"HELD\"";
    case 3: return "\"DROPPABLE\"";
    default: return "null";
  }
}

const char* status_name(ReqStatus s) {
  switch (s) {
    case ReqStatus::suspended: return "SUSPENDED";
    case ReqStatus::active: return "ACTIVE";
    default: return "CLOSED";
  }
}

// ---- a tiny JSON writer
void j_int(std::string& o, std::int64_t v) { o += std::to_string(v); }
void j_bool(std::string& o, bool v) { o += v ? "true" : "false"; }
// Ids, serials and slots are never negative: -1 (kNoNode, kNoPage, "none") is JSON null.
void j_id(std::string& o, std::int64_t v) {
  if (v < 0) {
    o += "null";
  } else {
    j_int(o, v);
  }
}
void j_hex(std::string& o, const Digest& d) {
  static constexpr char digits[] = "0123456789abcdef";
  o += '"';
  for (std::uint8_t b : d) {
    o += digits[b >> 4];
    o += digits[b & 15];
  }
  o += '"';
}
void j_str(std::string& o, const char* s) {
  o += '"';
  o += s;
  o += '"';
}
void j_tok_plain(std::string& o, const TokenOut& t) {  // events: int or hex string
  if (t.is_digest) {
    j_hex(o, t.digest);
  } else {
    j_int(o, t.value);
  }
}
void j_tok_snap(std::string& o, const TokenOut& t) {  // snapshot: int or {"digest": hex}
  if (t.is_digest) {
    o += "{\"digest\":";
    j_hex(o, t.digest);
    o += '}';
  } else {
    j_int(o, t.value);
  }
}

// Feed `codes` into `chain` and finish it (the keys of its blocks go to its callback):
// runs of int codes go in as they are (an int's code is its value), each digest code as
// the bytes digest_of(code) names.
template <typename Chain, typename DigestOf>
void feed(Chain& chain, std::span<const Tok> codes, DigestOf digest_of) {
  std::size_t i = 0;
  while (i < codes.size()) {
    std::size_t j = i;
    while (j < codes.size() && !(codes[j] & kDigestCode)) ++j;
    chain.append_ints(codes.data() + i, j - i);
    if (j < codes.size()) {
      const Digest& d = digest_of(codes[j]);
      chain.append_digest(std::span<const std::uint8_t, kDigestTokenBytes>(d.data(), kDigestTokenBytes));
      ++j;
    }
    i = j;
  }
  chain.finish();
}

}  // namespace

// ====================================================================== pools

FreeSlots::FreeSlots(std::int64_t n) {
  const auto un = static_cast<std::size_t>(n);
  words_.assign((un + 63) / 64, ~std::uint64_t{0});
  if (un % 64) words_.back() = (std::uint64_t{1} << (un % 64)) - 1;
  summary_.assign(words_.size() / 64 + 1, 0);
  for (std::size_t w = 0; w < words_.size(); ++w) {
    if (words_[w]) summary_[w >> 6] |= std::uint64_t{1} << (w & 63);
  }
  count_ = n;
}

std::int64_t FreeSlots::take() noexcept {
  std::size_t i = hint_;
  while (summary_[i] == 0) ++i;
  hint_ = i;
  const std::size_t w = (i << 6) | static_cast<std::size_t>(std::countr_zero(summary_[i]));
  const int b = std::countr_zero(words_[w]);
  words_[w] &= words_[w] - 1;
  if (words_[w] == 0) summary_[i] &= summary_[i] - 1;
  --count_;
  return static_cast<std::int64_t>((w << 6) | static_cast<std::size_t>(b));
}

bool FreeSlots::give(std::int64_t slot) noexcept {
  const auto s = static_cast<std::size_t>(slot);
  const std::uint64_t bit = std::uint64_t{1} << (s & 63);
  if (words_[s >> 6] & bit) return false;
  words_[s >> 6] |= bit;
  summary_[s >> 12] |= std::uint64_t{1} << ((s >> 6) & 63);
  hint_ = std::min(hint_, s >> 12);
  ++count_;
  return true;
}

std::vector<std::int64_t> FreeSlots::sorted() const {
  std::vector<std::int64_t> out;
  out.reserve(static_cast<std::size_t>(count_));
  for (std::size_t w = 0; w < words_.size(); ++w) {
    for (std::uint64_t bits = words_[w]; bits; bits &= bits - 1) {
      out.push_back(static_cast<std::int64_t>((w << 6) | static_cast<std::size_t>(std::countr_zero(bits))));
    }
  }
  return out;
}

void Manager::Pool::give_slot(std::int64_t slot) {
  if (!free_slots.give(slot)) throw InternalErr("kvcm bug: slot " + std::to_string(slot) + " freed twice");
}

void Manager::Pool::count(int state, std::int64_t delta) noexcept {
  if (state == kLocked) {
    locked += delta;
  } else if (state == kHeld) {
    held += delta;
  } else if (state == kDroppable) {
    droppable += delta;
  }
}

// ====================================================================== construction

Manager::Manager(ManagerConfig cfg)
    : cfg_(std::move(cfg)),
      B_(cfg_.tokens_per_block),
      num_tiers_(static_cast<std::int64_t>(cfg_.slots.size())),
      tree_(cfg_.tokens_per_block, [this] {
        std::vector<LifeCycleSpec> specs;
        for (const LcConfig& lc : cfg_.lcs) {
          LifeCycleSpec s;
          s.kind = lc.ssm ? LcKind::ssm : LcKind::attn;
          if (!lc.ssm && lc.window >= 0) s.window = lc.window;
          s.sinks = lc.ssm ? 0 : lc.sinks;
          specs.push_back(s);
        }
        return specs;
      }()) {
  const auto nlc = static_cast<std::int64_t>(cfg_.lcs.size());
  for (std::int64_t lc = 0; lc < nlc; ++lc) {
    if (cfg_.lcs[static_cast<std::size_t>(lc)].ssm) {
      if (ssm_lc_ < 0) ssm_lc_ = lc;
    } else {
      attn_lcs_.push_back(lc);
    }
  }
  for (const std::string& kind : cfg_.tier_kinds) {
    tier_id_.push_back(kind == "gpu" ? 0 : kind == "host" ? 1 : 2);
  }
  pools_.resize(static_cast<std::size_t>(num_tiers_));
  for (std::int64_t t = 0; t < num_tiers_; ++t) {
    for (std::int64_t lc = 0; lc < nlc; ++lc) {
      pools_[static_cast<std::size_t>(t)].emplace_back(
          t, lc, cfg_.slots[static_cast<std::size_t>(t)][static_cast<std::size_t>(lc)], &evict_nodes_);
    }
  }
  const std::size_t n = kHeader + static_cast<std::size_t>(nlc) * kNumCounters;
  totals_.assign(n, 0);
  iteration_.assign(n, 0);
}

// ====================================================================== tokens

void Manager::intern_into(TokenSeq tokens, std::vector<Tok>& out) {
  if (tokens.digests.empty()) {  // all ints: their codes are final
    out.insert(out.end(), tokens.codes.begin(), tokens.codes.end());
    return;
  }
  const std::size_t before = out.size();
  try {
    out.reserve(before + tokens.size());
    for (Tok c : tokens.codes) {
      out.push_back((c & kDigestCode) ? tree_.intern(TokenArg{0, tokens.digests[c & ~kDigestCode].data()}) : c);
    }
  } catch (...) {  // nothing changed: give back what was interned
    tree_.release_all(std::span<const Tok>(out).subspan(before));
    out.resize(before);
    throw;
  }
}

TokenOut Manager::decode(Tok c) const { return tree_.decode(c); }

std::vector<TokenOut> Manager::decode_all(std::span<const Tok> codes) const {
  std::vector<TokenOut> out;
  out.reserve(codes.size());
  for (Tok c : codes) out.push_back(decode(c));
  return out;
}

Digest Manager::block_key_of(const Digest& parent, std::span<const Tok> tokens) const {
  Digest key{};
  KeyChainFn chain(parent, static_cast<std::uint32_t>(B_), [&key](const Digest& k) { key = k; });
  feed(chain, tokens, [this](Tok c) -> const Digest& { return tree_.digest(c); });
  return key;
}

std::vector<Digest> Manager::chain(const Digest& root, std::span<const Tok> tokens) const {
  std::vector<Digest> keys;
  keys.reserve(tokens.size() / static_cast<std::size_t>(B_) + 1);
  KeyChainFn chain(root, static_cast<std::uint32_t>(B_), [&keys](const Digest& k) { keys.push_back(k); });
  feed(chain, tokens, [this](Tok c) -> const Digest& { return tree_.digest(c); });
  return keys;
}

// ====================================================================== tree bookkeeping

NodeId Manager::new_block(const Digest& key, std::span<const Tok> tokens, std::int64_t ordinal) {
  return tree_.new_block(key, tokens, ordinal);
}

// ====================================================================== pages

Manager::Page& Manager::page(std::int64_t handle) {
  return const_cast<Page&>(static_cast<const Manager&>(*this).page(handle));
}

const Manager::Page& Manager::page(std::int64_t handle) const {
  if (!page_alive(handle)) throw InternalErr("kvcm bug: no page " + std::to_string(handle));
  const auto h = static_cast<std::size_t>(handle);
  return page_chunks_[h / kPageChunk][h % kPageChunk];
}

bool Manager::page_alive(std::int64_t handle) const noexcept {
  if (handle < 0 || handle >= page_slots_) return false;
  const auto h = static_cast<std::size_t>(handle);
  return page_chunks_[h / kPageChunk][h % kPageChunk].handle == handle;
}

Manager::Page* Manager::new_page(std::int64_t tier, std::int64_t lc, std::int64_t coverage, std::int64_t priority,
                                 std::int64_t ordinal) {
  Pool& pool = pools_[static_cast<std::size_t>(tier)][static_cast<std::size_t>(lc)];
  std::int64_t handle;
  if (!free_pages_.empty()) {
    handle = free_pages_.back();
    free_pages_.pop_back();
  } else {
    if (page_slots_ % static_cast<std::int64_t>(kPageChunk) == 0) {
      page_chunks_.push_back(std::make_unique<Page[]>(kPageChunk));
    }
    handle = page_slots_++;
  }
  const auto h = static_cast<std::size_t>(handle);
  Page& p = page_chunks_[h / kPageChunk][h % kPageChunk];
  p = Page{};
  p.handle = handle;
  p.serial = next_page_++;
  p.lc = static_cast<std::uint8_t>(lc);
  p.tier = static_cast<std::uint8_t>(tier);
  p.slot = pool.take_slot();
  p.coverage = static_cast<std::int32_t>(coverage);
  p.priority = static_cast<std::int32_t>(priority);
  p.last_used = clock_;
  p.ordinal = ordinal;
  count(lc, kAllocatedBlocks);
  return &p;
}

void Manager::unindex(Page& p) {
  Pool& pool = pools_[static_cast<std::size_t>(p.tier)][static_cast<std::size_t>(p.lc)];
  pool.count(p.idx_state, -1);
  if (p.idx_state == kHeld || p.idx_state == kDroppable) {
    EvictIndex& ix = pool.index_of(p.idx_state);
    if (!p.in_list) {
      ix.set.erase({p.idx_key(), p.handle});
    } else {
      if (p.prev >= 0) {
        slab(p.prev).next = p.next;
      } else {
        ix.head = p.next;
      }
      if (p.next >= 0) {
        slab(p.next).prev = p.prev;
      } else {
        ix.tail = p.prev;
      }
      // [run, tail] keeps one last_used: step run forward, or onto the new tail
      if (ix.run == p.handle) ix.run = p.next >= 0 ? p.next : ix.tail;
      --ix.list_size;
      p.in_list = false;
      p.prev = p.next = -1;
    }
  }
  p.idx_state = kNone;
}

void Manager::list_insert(EvictIndex& ix, Page& p, std::int64_t before) {
  const std::int64_t after = before >= 0 ? slab(before).prev : ix.tail;
  p.prev = after;
  p.next = before;
  if (after >= 0) {
    slab(after).next = p.handle;
  } else {
    ix.head = p.handle;
  }
  if (before >= 0) {
    slab(before).prev = p.handle;
  } else {
    ix.tail = p.handle;
  }
  p.in_list = true;
  ++ix.list_size;
}

void Manager::index(Page& p) {
  Pool& pool = pools_[static_cast<std::size_t>(p.tier)][static_cast<std::size_t>(p.lc)];
  p.idx_state = static_cast<std::uint8_t>(p.state());
  p.idx_priority = p.priority;
  p.idx_last_used = p.last_used;
  pool.count(p.idx_state, +1);
  if (p.idx_state != kHeld && p.idx_state != kDroppable) return;
  EvictIndex& ix = pool.index_of(p.idx_state);
  const std::int64_t last_used = p.idx_last_used;
  const EvictKey key = p.idx_key();
  if (ix.tail < 0 || slab(ix.tail).idx_key() < key) {  // newest: append
    const bool same_run = ix.tail >= 0 && slab(ix.tail).idx_last_used == last_used;
    list_insert(ix, p, -1);
    if (!same_run) ix.run = p.handle;
    return;
  }
  const Page& r = slab(ix.run);
  if (r.idx_last_used == last_used && key < r.idx_key() &&
      (r.prev < 0 || slab(r.prev).idx_key() < key)) {  // just before the tail's run
    list_insert(ix, p, ix.run);
    ix.run = p.handle;
    return;
  }
  ix.set.insert({key, p.handle});
}

void Manager::use(Page* p, bool active, std::int64_t priority) {
  restate(*p, [&] {
    if (active) {
      ++p->locks;
    } else {
      ++p->holds;
    }
    p->last_used = clock_;
    p->priority = static_cast<std::int32_t>(std::max<std::int64_t>(p->priority, priority));
  });
}

void Manager::unuse(Page* p, bool active) {
  restate(*p, [&] {
    if (active) {
      --p->locks;
    } else {
      --p->holds;
    }
    p->last_used = clock_;
  });
  if (p->locks == 0 && p->holds == 0) {
    if (p->node == kNoNode) {
      free_page(p);
    } else if (!tree_.is_attached(p->node)) {
      free_orphan_page(p);
    }
  }
}

void Manager::set_active(Page* p, bool active) {
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

void Manager::free_page(Page* p) {
  unindex(*p);
  pools_[static_cast<std::size_t>(p->tier)][static_cast<std::size_t>(p->lc)].give_slot(p->slot);
  free_pages_.push_back(p->handle);
  p->handle = -1;  // dead until the slot is reused
}

// ====================================================================== eviction

bool Manager::can_allocate(std::int64_t tier, std::int64_t lc, std::int64_t n, const std::int64_t* adjust) {
  return capacity_of(tier, lc, adjust) >= n;
}

std::int64_t Manager::capacity_of(std::int64_t tier, std::int64_t lc, const std::int64_t* adjust) {
  const Pool& pool = pools_[static_cast<std::size_t>(tier)][static_cast<std::size_t>(lc)];
  std::int64_t free = pool.nfree(), held = pool.held, droppable = pool.droppable;
  if (adjust != nullptr && tier == kGpu) {
    free = adjust[0];
    held = adjust[1];
    droppable = adjust[2];
  }
  if (tier == num_tiers_ - 1) return free + droppable;
  return free + droppable + std::min(held, capacity_of(tier + 1, lc, nullptr));
}

Manager::Page* Manager::peek(Pool& pool, int state) {
  const EvictIndex& ix = pool.index_of(state);
  Page* first = ix.head >= 0 ? &slab(ix.head) : nullptr;
  if (!ix.set.empty()) {
    const EvictEntry& e = *ix.set.begin();
    if (first == nullptr || e.first < first->idx_key()) return &page(e.second);
  }
  return first;
}

Manager::Page* Manager::victim(Pool& pool) {
  Page* h = peek(pool, kHeld);
  Page* d = peek(pool, kDroppable);
  if (h == nullptr) return d;
  if (d == nullptr) return h;
  return h->evict_key() < d->evict_key() ? h : d;
}

bool Manager::make_room(std::int64_t tier, std::int64_t lc) {
  Pool& pool = pools_[static_cast<std::size_t>(tier)][static_cast<std::size_t>(lc)];
  if (pool.nfree()) return true;
  Page* v = victim(pool);
  if (v == nullptr) return false;
  if (tier < num_tiers_ - 1) {
    if (make_room(tier + 1, lc)) {
      if (pool.nfree()) return true;  // a drop down there removed a subtree and freed a slot here
      move(v, tier + 1, "offload");
      return true;
    }
    if (v->state() == kHeld) {
      v = peek(pool, kDroppable);
      if (v == nullptr) return false;
    }
  } else if (v->state() == kHeld) {
    v = peek(pool, kDroppable);
    if (v == nullptr) return false;
  }
  drop(v);
  return true;
}

void Manager::move(Page* p, std::int64_t dst, const char* reason) {
  Pool& dst_pool = pools_[static_cast<std::size_t>(dst)][static_cast<std::size_t>(p->lc)];
  const std::int64_t old_tier = p->tier, old_slot = p->slot;
  const std::int64_t new_slot = dst_pool.take_slot();
  unindex(*p);
  pools_[static_cast<std::size_t>(old_tier)][static_cast<std::size_t>(p->lc)].give_slot(old_slot);
  p->tier = static_cast<std::uint8_t>(dst);
  p->slot = new_slot;
  index(*p);
  add_copy_op(CopyOpC{p->lc, tier_id(old_tier), old_slot, tier_id(dst), new_slot, reason});
  copy_pages_.emplace_back(p->handle, p->serial);
  const std::int64_t nbytes = cfg_.lcs[static_cast<std::size_t>(p->lc)].slot_bytes;
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

void Manager::drop(Page* p) {
  if (p->state() != kDroppable) throw InternalErr("kvcm bug: drop of a non-DROPPABLE page");
  count(p->lc, kDrops);
  count(p->lc, kDropBytes, cfg_.lcs[static_cast<std::size_t>(p->lc)].slot_bytes);
  unlink_committed(p);
  free_page(p);
}

void Manager::unlink_committed(Page* p) {
  const NodeId node = p->node;
  const std::int64_t lc = p->lc;
  const Digest key = tree_.key(node);
  const std::int64_t ordinal = tree_.ordinal(node);
  unlink_from_node(p);
  emit_removed(key, lc);
  const LcConfig& life = cfg_.lcs[static_cast<std::size_t>(lc)];
  const bool full = !life.ssm && life.window < 0;
  if (full || (!life.ssm && ordinal < ceildiv(life.sinks, B_))) {
    const NodeId parent = tree_.parent(node);
    retire_nodes(tree_.remove_subtree(node), true);
    if (parent != kNoNode) tree_.prune_upward(parent);
  } else {
    tree_.prune_upward(node);
  }
}

void Manager::unlink_from_node(Page* p) {
  const NodeId node = p->node;
  restate(*p, [&] { p->node = kNoNode; });
  tree_.clear_page(node, p->lc);  // may delete a dead orphan node
}

void Manager::retire_nodes(const std::vector<NodeId>& ids, bool announce) {
  const auto nlc = static_cast<std::int64_t>(cfg_.lcs.size());
  for (NodeId nid : ids) {
    if (!tree_.exists(nid)) continue;
    const Digest key = tree_.key(nid);
    for (std::int64_t lc = 0; lc < nlc; ++lc) {
      if (!tree_.exists(nid)) break;  // deleted with its last page: nothing left
      const PageHandle h = tree_.page(nid, lc);
      if (h == kNoPage) continue;
      if (announce) emit_removed(key, lc);
      Page* pg = &page(h);
      if (pg->locks == 0 && pg->holds == 0) {
        count(lc, kDrops);
        count(lc, kDropBytes, cfg_.lcs[static_cast<std::size_t>(lc)].slot_bytes);
        free_orphan_page(pg);
      }
    }
    tree_.collect(nid);
  }
}

void Manager::free_orphan_page(Page* p) {
  unlink_from_node(p);
  free_page(p);
}

void Manager::drop_all_droppable() {
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

// ====================================================================== copy ops, events, stats

void Manager::copy(std::int64_t lc, const Page* src, const Page* dst, const char* reason) {
  add_copy_op(CopyOpC{lc, tier_id(src->tier), src->slot, tier_id(dst->tier), dst->slot, reason});
  copy_pages_.emplace_back(dst->handle, dst->serial);
}

// python: PyKVCacheManager._add_copy_op (SPEC sec. 8, 15): warned once, at the call's end.
void Manager::add_copy_op(const CopyOpC& op) {
  copy_ops_.push_back(op);
  if (static_cast<std::int64_t>(copy_ops_.size()) == cfg_.pending_copy_ops_warning && !copy_ops_warned_) {
    copy_ops_warned_ = copy_ops_warn_due_ = true;
  }
}

EventC* Manager::new_event(EventKind kind, std::span<const Tok> tokens) {
  const std::int64_t id = event_id();  // ids advance even for events nobody buffers
  if (cfg_.max_events == 0) {
    ++events_dropped_;
    return nullptr;
  }
  if (static_cast<std::int64_t>(events_.size()) >= cfg_.max_events) {
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
  event_tokens_.append(tokens.begin(), tokens.end());
  std::uint32_t sized = e.ntokens;
  if (RadixTree::any_digest(tokens)) {
    tree_.retain_all(tokens);  // the buffered event holds its digests (released when dropped or taken)
    sized |= kEventHasDigest;
  }
  event_sizes_.emplace_back(sized, 0);
  return &e;
}

void Manager::emit_removed(const Digest& key, std::int64_t lc) {
  if (EventC* e = new_event(EventKind::removed)) {
    e->key = key;
    e->lc = lc;
  }
}

void Manager::emit_stored(NodeId nid, std::span<const std::int64_t> lcs) {
  if (lcs.empty()) return;
  const std::span<const Tok> tokens = tree_.tokens(nid);
  EventC* e = new_event(EventKind::stored, tokens);
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
        StoredBlockC{static_cast<std::int32_t>(lc), static_cast<std::int32_t>(tier_id(p.tier)), p.priority});
    ++e->nblocks;
    ++event_sizes_.back().second;
  }
  e->partial = static_cast<std::int64_t>(tokens.size()) < B_;
}

void Manager::count(std::int64_t lc, int counter, std::int64_t n) {
  const std::size_t i = kHeader + static_cast<std::size_t>(lc) * kNumCounters + static_cast<std::size_t>(counter);
  totals_[i] += n;
  iteration_[i] += n;
}

void Manager::record_match(std::int64_t n_query, std::int64_t m) {
  for (std::vector<std::int64_t>* c : {&totals_, &iteration_}) {
    (*c)[0] += 1;
    (*c)[1] += n_query;
    (*c)[2] += m;
    for (std::int64_t lc : attn_lcs_) {
      const std::size_t base = kHeader + static_cast<std::size_t>(lc) * kNumCounters;
      (*c)[base + kReusedTokens] += m;
      (*c)[base + kReusedBlocks] += ceildiv(m, B_);
      (*c)[base + kMissedBlocks] += ceildiv(n_query, B_) - ceildiv(m, B_);
    }
  }
}

void Manager::stats_view(std::string& o, const std::vector<std::int64_t>& c) const {
  o += "{\"requests\":";
  j_int(o, c[0]);
  o += ",\"query_tokens\":";
  j_int(o, c[1]);
  o += ",\"reused_tokens\":";
  j_int(o, c[2]);
  o += ",\"lc\":[";
  const std::size_t nlc = cfg_.lcs.size();
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
  for (std::size_t t = 0; t < pools_.size(); ++t) {
    if (t) o += ',';
    o += "{\"tier\":";
    j_int(o, tier_id_[t]);
    o += ",\"kind\":";
    j_str(o, cfg_.tier_kinds[t].c_str());
    o += ",\"lc\":[";
    for (std::size_t lc = 0; lc < nlc; ++lc) {
      const Pool& p = pools_[t][lc];
      if (lc) o += ',';
      o += "{\"total\":";
      j_int(o, p.total);
      o += ",\"free\":";
      j_int(o, p.nfree());
      o += ",\"locked\":";
      j_int(o, p.locked);
      o += ",\"held\":";
      j_int(o, p.held);
      o += ",\"droppable\":";
      j_int(o, p.droppable);
      o += '}';
    }
    o += "]}";
  }
  o += "],\"events_dropped\":";
  j_int(o, events_dropped_);
  o += ",\"pending_copy_ops\":";
  j_int(o, static_cast<std::int64_t>(copy_ops_.size()));
  o += '}';
}

// ====================================================================== manager calls

std::int64_t Manager::create(TokenSeq tokens_in, std::optional<std::uint64_t> lora,
                             std::optional<std::uint64_t> salt, std::int64_t priority) {
  if (is_shutdown_) throw InvalidStateErr("the manager is shut down");
  std::vector<Tok> tokens;  // holds one reference per digest token (sec. 15)
  tokens.reserve(tokens_in.size());
  intern_into(tokens_in, tokens);
  tick();
  const std::int64_t serial = next_request_++;
  Request& r = requests_[serial];
  r.serial = serial;
  r.lora = lora;
  r.salt = salt;
  r.priority = priority;
  r.root_key = scope_root_key(lora, salt);
  // the scope root lives at least as long as the request (python: PyKVCache.__init__, sec. 15)
  r.root = tree_.root(r.root_key);
  tree_.ref(r.root);
  const auto n = static_cast<std::int64_t>(tokens.size());
  const std::int64_t nfull = n / B_;
  r.keys = chain(r.root_key, std::span<const Tok>(tokens.data(), static_cast<std::size_t>(nfull * B_)));
  r.has_digests = !tokens_in.digests.empty();
  const std::int64_t m = match_and_hold(r, tokens, r.keys);
  r.input_tokens = std::move(tokens);
  r.reused = m;
  record_match(n, m);
  return serial;
}

// Python twin: PyKVCache._match_and_hold (SPEC sec. 6, 7: create's match and holds).
std::int64_t Manager::match_and_hold(Request& r, std::span<const Tok> tokens, std::span<const Digest> keys) {
  std::int64_t m = 0;
  std::vector<NodeId> path;
  if (!tokens.empty()) {
    MatchResult mr = tree_.match(r.root, tokens, keys, cfg_.enable_partial_reuse, cfg_.reuse_match_backoff);
    m = mr.m;
    path = std::move(mr.path);
  }
  r.tokens.assign(tokens.begin(), tokens.begin() + m);
  // r.tokens holds its own digest references (the caller's tokens keep theirs; sec. 15)
  if (r.has_digests) tree_.retain_all(r.tokens);
  r.capacity = m;
  r.history = m;
  r.blocks = path;
  for (NodeId nid : path) tree_.ref(nid);
  r.pages.assign(cfg_.lcs.size(), {});
  for (std::int64_t lc : attn_lcs_) r.pages[static_cast<std::size_t>(lc)].assign(path.size(), -1);
  for (std::int64_t lc : attn_lcs_) {
    const auto [lo, hi] = stale_range(lc, m);
    for (std::size_t j = 0; j < path.size(); ++j) {
      const auto jj = static_cast<std::int64_t>(j);
      if (lo <= jj && jj < hi) continue;
      Page* p = &page(tree_.page(path[j], lc));
      use(p, false, r.priority);
      r.pages[static_cast<std::size_t>(lc)][j] = p->handle;
    }
  }
  r.live = r.snap = -1;
  if (ssm_lc_ >= 0 && m > 0) {
    Page* s = &page(tree_.page(path.back(), ssm_lc_));
    r.snap = s->handle;
    use(s, false, r.priority);
  }
  r.cow_block = m % B_ ? m / B_ : -1;
  return m;
}

// Python twin: PyKVCache._rollback_point (SPEC sec. 15; DECISIONS.md "Failed copies").
std::optional<std::int64_t> Manager::rollback_point(Request& r, const std::vector<std::int64_t>& lost) {
  auto is_lost = [&lost](std::int64_t h) { return h >= 0 && std::find(lost.begin(), lost.end(), h) != lost.end(); };
  std::optional<std::int64_t> point;
  for (std::int64_t lc : attn_lcs_) {
    const auto& v = r.pages[static_cast<std::size_t>(lc)];
    for (std::size_t i = 0; i < v.size(); ++i) {
      if (is_lost(v[i])) {
        const std::int64_t at = static_cast<std::int64_t>(i) * B_;
        point = point ? std::min(*point, at) : at;
        break;
      }
    }
  }
  const auto ncommitted = static_cast<std::int64_t>(r.tokens.size());
  if ((is_lost(r.snap) || is_lost(r.live)) && !point) point = ncommitted;
  if (point) point = std::min(*point, ncommitted);
  return point;
}

// Python twin: PyKVCache._roll_back (SPEC sec. 15): release everything, then match the
// committed tokens before `point` again and hold them as a SUSPENDED request.
void Manager::roll_back(Request& r, std::int64_t point) {
  const bool active = r.status == ReqStatus::active;
  for (Page* p : used_pages(r)) unuse(p, active);
  r.live = r.snap = -1;
  for (auto& v : r.pages) v.clear();
  for (NodeId nid : r.blocks) {
    if (nid != kNoNode) tree_.unref(nid);
  }
  r.blocks.clear();
  r.status = ReqStatus::suspended;
  r.stopped = false;
  // the old tokens' digest references are released only after the re-match took its own
  // (a digest only they reference must not be freed while its code is still in use)
  const std::vector<Tok> old = std::move(r.tokens);
  const std::vector<Tok> tokens(old.begin(), old.begin() + point);
  const std::vector<Digest> keys =
      chain(r.root_key, std::span<const Tok>(tokens.data(), static_cast<std::size_t>(point / B_ * B_)));
  match_and_hold(r, tokens, keys);
  if (r.has_digests) tree_.release_all(old);
}

// Python twin: PyKVCacheManager.forget_copies (SPEC sec. 15; DECISIONS.md "Failed copies").
std::vector<std::int64_t> Manager::forget_copies(std::span<const CopyOpC> ops) {
  auto same = [](const CopyOpC& a, const CopyOpC& b) {
    return a.lc == b.lc && a.src_tier == b.src_tier && a.src_slot == b.src_slot && a.dst_tier == b.dst_tier &&
           a.dst_slot == b.dst_slot && std::strcmp(a.reason, b.reason) == 0;
  };
  std::vector<bool> taken(issued_.size(), false);
  for (std::size_t i = 0; i < ops.size(); ++i) {
    std::size_t k = 0;
    while (k < issued_.size() && (taken[k] || !same(issued_[k].op, ops[i]))) ++k;
    if (k == issued_.size()) {
      const CopyOpC& o = ops[i];
      throw ValueErr("forget_copies(): ops[" + std::to_string(i) + "] [" + std::to_string(o.lc) + ", " +
                     std::to_string(o.src_tier) + ", " + std::to_string(o.src_slot) + ", " +
                     std::to_string(o.dst_tier) + ", " + std::to_string(o.dst_slot) + ", '" + o.reason +
                     "'] is not an unreported op of the last drain_copy_ops()");
    }
    taken[k] = true;
  }
  std::vector<std::int64_t> out;
  if (ops.empty()) return out;
  tick();
  std::vector<std::int64_t> lost;  // (handle) of each lost page still alive, issue order
  std::vector<std::int64_t> lost_serials;
  std::vector<IssuedOp> keep;
  for (std::size_t k = 0; k < issued_.size(); ++k) {
    const IssuedOp& e = issued_[k];
    if (!taken[k]) {
      keep.push_back(e);
      continue;
    }
    if (page_alive(e.handle) && page(e.handle).serial == e.serial &&
        std::find(lost.begin(), lost.end(), e.handle) == lost.end()) {
      lost.push_back(e.handle);
      lost_serials.push_back(e.serial);
    }
  }
  issued_ = std::move(keep);
  // the requests that use a lost page, and where each rolls back to (before any change)
  std::vector<std::pair<std::int64_t, std::int64_t>> resets;  // (serial, point)
  for (std::int64_t serial : open_serials()) {
    if (auto point = rollback_point(requests_.at(serial), lost)) resets.emplace_back(serial, *point);
  }
  // unlink the lost committed pages (SPEC sec. 5 pruning, removed events)
  for (std::size_t k = 0; k < lost.size(); ++k) {
    const std::int64_t h = lost[k];
    if (!page_alive(h) || page(h).serial != lost_serials[k]) continue;  // freed with an earlier subtree
    Page* p = &page(h);
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
  for (const auto& [serial, point] : resets) {
    roll_back(requests_.at(serial), point);
    out.push_back(serial);
  }
  return out;
}

std::pair<std::int64_t, std::int64_t> Manager::probe(TokenSeq tokens_in, std::optional<std::uint64_t> lora,
                                                     std::optional<std::uint64_t> salt) {
  const Digest root_key = scope_root_key(lora, salt);
  const NodeId root = tree_.find_root(root_key);  // a probe creates nothing (sec. 6, 15)
  if (root == kNoNode || tokens_in.empty()) return {0, 0};
  // Look the digests up without interning them: a probe has no side effect.
  std::vector<Tok> codes(tokens_in.codes.begin(), tokens_in.codes.end());
  if (!tokens_in.digests.empty()) {
    for (Tok& c : codes) {
      if (c & kDigestCode) c = tree_.lookup(TokenArg{0, tokens_in.digests[c & ~kDigestCode].data()});
    }
  }
  const std::size_t nfull = tokens_in.size() / static_cast<std::size_t>(B_) * static_cast<std::size_t>(B_);
  std::vector<Digest> keys;
  keys.reserve(nfull / static_cast<std::size_t>(B_));
  KeyChainFn chain(root_key, static_cast<std::uint32_t>(B_), [&keys](const Digest& k) { keys.push_back(k); });
  feed(chain, tokens_in.codes.first(nfull),
       [&tokens_in](Tok c) -> const Digest& { return tokens_in.digests[c & ~kDigestCode]; });
  const MatchResult mr =
      tree_.match(root, std::span<const Tok>(codes), keys, cfg_.enable_partial_reuse, cfg_.reuse_match_backoff);
  return {mr.m, mr.m_before_ssm};
}

std::vector<CopyOpC> Manager::drain_copy_ops() {
  std::vector<CopyOpC> out;
  out.swap(copy_ops_);
  issued_.clear();
  issued_.reserve(out.size());
  for (std::size_t k = 0; k < out.size(); ++k) issued_.push_back({out[k], copy_pages_[k].first, copy_pages_[k].second});
  copy_pages_.clear();
  return out;
}

// Python twin: PyKVCacheManager.clear_reusable (manager.py); DECISIONS "Shut-down manager".
void Manager::clear_reusable() {
  if (is_shutdown_) throw InvalidStateErr("the manager is shut down");
  tick();
  drop_all_droppable();
  new_event(EventKind::cleared);
}

void Manager::shutdown() {
  if (!requests_.empty()) {
    throw InvalidStateErr("shutdown needs every cache closed; " + std::to_string(requests_.size()) + " still open");
  }
  if (is_shutdown_) return;
  tick();
  drop_all_droppable();
  is_shutdown_ = true;
}

std::string Manager::stats_json(bool take_iteration) {
  std::string o;
  if (take_iteration) {
    stats_view(o, iteration_);
    std::fill(iteration_.begin(), iteration_.end(), 0);
  } else {
    stats_view(o, totals_);
  }
  return o;
}

TakenEvents Manager::take_events() {
  TakenEvents out;
  out.events.assign(events_.begin(), events_.end());
  out.tokens.reserve(event_tokens_.size());
  for (Tok c : event_tokens_) out.tokens.push_back(decode(c));
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

// ====================================================================== requests

Manager::Request& Manager::req(std::int64_t serial) {
  auto it = requests_.find(serial);
  if (it == requests_.end()) throw ClosedErr("call on a closed cache");
  return it->second;
}

const Manager::Request& Manager::req(std::int64_t serial) const {
  auto it = requests_.find(serial);
  if (it == requests_.end()) throw ClosedErr("call on a closed cache");
  return it->second;
}

void Manager::require_status(std::int64_t serial, ReqStatus status, const char* what) const {
  auto it = requests_.find(serial);
  if (it == requests_.end()) throw ClosedErr(std::string(what) + "() on a closed cache");
  require(it->second, status, what);
}

void Manager::require(const Request& r, ReqStatus s, const char* what) {
  if (r.status != s) {
    throw InvalidStateErr(std::string(what) + "() needs a " + status_name(s) + " cache, this one is " +
                          status_name(r.status));
  }
}

RequestInfo Manager::info(std::int64_t serial) const {
  const Request& r = req(serial);
  RequestInfo i;
  i.status = r.status;
  i.stopped = r.stopped;
  i.capacity = r.capacity;
  i.history = r.history;
  i.num_committed = static_cast<std::int64_t>(r.tokens.size());
  i.reused = r.reused;
  i.priority = r.priority;
  return i;
}

std::vector<TokenOut> Manager::committed_tokens(std::int64_t serial) const { return decode_all(req(serial).tokens); }

std::pair<std::int64_t, std::int64_t> Manager::stale_range(std::int64_t lc, std::int64_t history) const {
  const LcConfig& l = cfg_.lcs[static_cast<std::size_t>(lc)];
  if (l.ssm || l.window < 0) return {0, 0};
  const std::int64_t nsink = ceildiv(l.sinks, B_);
  // (history + 1 - window) // B, written so that no history < 2**63 overflows
  return {nsink, std::max(nsink, floordiv(history - (l.window - 1), B_))};
}

std::int64_t Manager::page_at(const Request& r, std::int64_t lc, std::int64_t i) const {
  const auto& v = r.pages[static_cast<std::size_t>(lc)];
  return i < static_cast<std::int64_t>(v.size()) ? v[static_cast<std::size_t>(i)] : -1;
}

std::vector<Manager::Page*> Manager::used_pages(Request& r) {
  std::vector<Page*> out;
  for (std::int64_t lc : attn_lcs_) {
    for (std::int64_t s : r.pages[static_cast<std::size_t>(lc)]) {
      if (s >= 0) out.push_back(&page(s));
    }
  }
  if (r.snap >= 0) out.push_back(&page(r.snap));
  if (r.live >= 0) out.push_back(&page(r.live));
  return out;
}

std::vector<Manager::Page*> Manager::cow_sources(Request& r) {
  std::vector<Page*> out;
  if (r.cow_block >= 0) {
    for (std::int64_t lc : attn_lcs_) {
      const std::int64_t s = page_at(r, lc, r.cow_block);
      if (s >= 0) out.push_back(&page(s));
    }
  }
  if (r.snap >= 0) out.push_back(&page(r.snap));
  return out;
}

void Manager::ensure_room(std::int64_t tier, std::int64_t lc) {
  if (!make_room(tier, lc)) throw InternalErr("kvcm bug: a feasibility check passed but eviction found no slot");
}

Manager::Page* Manager::alloc_private(Request& r, std::int64_t lc, std::int64_t coverage, std::int64_t ordinal) {
  ensure_room(kGpu, lc);
  Page* p = new_page(kGpu, lc, coverage, r.priority, ordinal);
  use(p, r.status == ReqStatus::active, r.priority);
  return p;
}

bool Manager::resume(std::int64_t serial) {
  Request& r = req(serial);
  require(r, ReqStatus::suspended, "resume");
  const std::vector<Page*> used = used_pages(r);
  const std::vector<Page*> cows = cow_sources(r);
  const std::size_t nlc = cfg_.lcs.size();
  std::vector<std::int64_t> need(nlc, 0), locked_after(nlc), held_gpu(nlc);
  for (std::size_t lc = 0; lc < nlc; ++lc) {
    locked_after[lc] = pools_[0][lc].locked;
    held_gpu[lc] = pools_[0][lc].held;
  }
  for (Page* p : used) {
    const auto lc = static_cast<std::size_t>(p->lc);
    if (p->tier != kGpu) {
      ++need[lc];
    } else if (p->locks == 0) {
      --held_gpu[lc];
    }
    if (p->locks == 0 && std::find(cows.begin(), cows.end(), p) == cows.end()) ++locked_after[lc];
  }
  if (ssm_lc_ >= 0 && r.live < 0) {
    ++need[static_cast<std::size_t>(ssm_lc_)];
    ++locked_after[static_cast<std::size_t>(ssm_lc_)];
  }
  for (Page* p : cows) {
    if (p->lc != ssm_lc_) {
      ++need[static_cast<std::size_t>(p->lc)];
      ++locked_after[static_cast<std::size_t>(p->lc)];
    }
  }
  const double limit = cfg_.max_util_for_resume;
  for (std::size_t lc = 0; lc < nlc; ++lc) {
    const Pool& pool = pools_[0][lc];
    if (static_cast<double>(locked_after[lc]) > limit * static_cast<double>(pool.total)) return false;
    const std::int64_t adjust[3] = {pool.nfree(), held_gpu[lc], pool.droppable};
    if (!can_allocate(kGpu, static_cast<std::int64_t>(lc), need[lc], adjust)) return false;
  }

  tick();
  r.status = ReqStatus::active;
  for (Page* p : used) {
    if (p->tier == kGpu) set_active(p, true);
  }
  for (Page* p : used) {
    if (p->tier != kGpu) {
      ensure_room(kGpu, p->lc);
      move(p, kGpu, "onboard");
      set_active(p, true);
    }
  }
  if (ssm_lc_ >= 0 && r.live < 0) {
    r.live = alloc_private(r, ssm_lc_, 0, static_cast<std::int64_t>(r.tokens.size()) / B_)->handle;
  }
  if (r.cow_block >= 0 || r.snap >= 0) copy_on_write(r);
  return true;
}

void Manager::copy_on_write(Request& r) {
  const std::int64_t j = r.cow_block;
  if (j >= 0) {
    const std::int64_t covered = static_cast<std::int64_t>(r.tokens.size()) - j * B_;
    for (std::int64_t lc : attn_lcs_) {
      const std::int64_t s = page_at(r, lc, j);
      if (s < 0) continue;
      Page* dst = alloc_private(r, lc, covered, j);
      Page* src = &page(s);
      copy(lc, src, dst, "cow");
      count(lc, kCows);
      r.pages[static_cast<std::size_t>(lc)][static_cast<std::size_t>(j)] = dst->handle;
      unuse(src, true);
    }
    tree_.unref(r.blocks[static_cast<std::size_t>(j)]);
    r.blocks[static_cast<std::size_t>(j)] = kNoNode;
    r.cow_block = -1;
  }
  if (r.snap >= 0) {
    Page* snap = &page(r.snap);
    copy(ssm_lc_, snap, &page(r.live), "cow");
    count(ssm_lc_, kCows);
    unuse(snap, true);
    r.snap = -1;
  }
}

void Manager::suspend(std::int64_t serial) {
  Request& r = req(serial);
  require(r, ReqStatus::active, "suspend");
  tick();
  for (Page* p : used_pages(r)) set_active(p, false);
  r.status = ReqStatus::suspended;
}

bool Manager::resize(std::int64_t serial, std::int64_t capacity, std::optional<std::int64_t> history_arg) {
  Request& r = req(serial);
  const std::int64_t history = history_arg ? *history_arg : r.history;
  check_resize(r, capacity, history);
  return resize_checked(r, capacity, history);
}

void Manager::check_resize(const Request& r, std::int64_t capacity, std::int64_t history) const {
  require(r, ReqStatus::active, "resize");
  const auto ncommitted = static_cast<std::int64_t>(r.tokens.size());
  if (capacity < ncommitted) {
    throw ValueErr("capacity " + std::to_string(capacity) + " is below the " + std::to_string(ncommitted) +
                   " committed tokens");
  }
  if (history < r.history) {
    throw ValueErr("history_length " + std::to_string(history) + " is below the current history " +
                   std::to_string(r.history));
  }
  if (history > capacity) {
    throw ValueErr("capacity " + std::to_string(capacity) + " is below history_length " + std::to_string(history));
  }
}

// Python twin: PyKVCache._could_hold (cache.py); SPEC sec. 7 (resize: out of pages -> False).
bool Manager::could_hold(std::int64_t nb, std::int64_t history) const {
  if (attn_lcs_.empty()) return true;
  if (nb > kMaxRequestBlocks) return false;
  for (std::int64_t lc : attn_lcs_) {
    const auto [lo, hi] = stale_range(lc, history);
    const std::int64_t stale = std::max<std::int64_t>(0, std::min(hi, nb) - std::min(lo, nb));
    if (nb - stale > pools_[0][static_cast<std::size_t>(lc)].total) return false;
  }
  return true;
}

// Python twin: PyKVCache._resize (cache.py); SPEC sec. 7 (resize) and DECISIONS "All-or-nothing".
bool Manager::resize_checked(Request& r, std::int64_t capacity, std::int64_t history) {
  const std::int64_t nb = ceildiv(capacity, B_);
  if (!could_hold(nb, history)) return false;
  // (lc, block) pairs; members so a decode step's resize does not allocate
  std::vector<std::pair<std::int64_t, std::int64_t>>& releases = scratch_releases_;
  std::vector<std::pair<std::int64_t, std::int64_t>>& allocs = scratch_allocs_;
  releases.clear();
  allocs.clear();
  // Only ordinals that can hold a page are visited: none is held in the stale range of
  // the current history, and none is allocated in the new one.
  for (std::int64_t lc : attn_lcs_) {
    const auto [lo, hi] = stale_range(lc, history);
    const std::int64_t old_hi = stale_range(lc, r.history).second;
    const auto& pages = r.pages[static_cast<std::size_t>(lc)];
    const auto n = static_cast<std::int64_t>(pages.size());
    const auto visit_release = [&](std::int64_t from, std::int64_t to) {
      for (std::int64_t i = from; i < to; ++i) {
        if (pages[static_cast<std::size_t>(i)] >= 0 && (i >= nb || (lo <= i && i < hi))) releases.emplace_back(lc, i);
      }
    };
    visit_release(0, std::min(lo, n));
    visit_release(old_hi, n);
    const auto visit_alloc = [&](std::int64_t from, std::int64_t to) {
      for (std::int64_t i = from; i < to; ++i) {
        if (i >= n || pages[static_cast<std::size_t>(i)] < 0) allocs.emplace_back(lc, i);
      }
    };
    visit_alloc(0, std::min(lo, nb));
    visit_alloc(hi, nb);
  }
  for (std::int64_t lc : attn_lcs_) {
    std::int64_t n = 0;
    for (const auto& a : allocs) n += a.first == lc;
    if (!n) continue;
    const Pool& pool = pools_[0][static_cast<std::size_t>(lc)];
    std::int64_t adjust[3] = {pool.nfree(), pool.held, pool.droppable};
    for (const auto& [rlc, i] : releases) {
      if (rlc != lc) continue;
      const Page& p = page(page_at(r, rlc, i));
      if (p.locks != 1) continue;
      if (p.node == kNoNode || !tree_.is_attached(p.node)) {
        adjust[0] += p.holds == 0 ? 1 : 0;
        adjust[1] += p.holds ? 1 : 0;
      } else if (p.holds) {
        adjust[1] += 1;
      } else {
        adjust[2] += 1;
      }
    }
    if (!can_allocate(kGpu, lc, n, adjust)) return false;
  }

  tick();
  r.capacity = capacity;
  r.history = history;
  for (const auto& [lc, i] : releases) {
    Page* p = &page(page_at(r, lc, i));
    r.pages[static_cast<std::size_t>(lc)][static_cast<std::size_t>(i)] = -1;
    unuse(p, true);
  }
  for (std::int64_t lc : attn_lcs_) r.pages[static_cast<std::size_t>(lc)].resize(static_cast<std::size_t>(nb), -1);
  for (const auto& [lc, i] : allocs) {
    const std::int64_t s = alloc_private(r, lc, 0, i)->handle;
    r.pages[static_cast<std::size_t>(lc)][static_cast<std::size_t>(i)] = s;
  }
  return true;
}

void Manager::commit(std::int64_t serial, TokenSeq tokens_in) {
  auto it = requests_.find(serial);
  if (it == requests_.end()) throw ClosedErr("commit() on a closed cache");
  Request& r = it->second;
  check_commit(r, static_cast<std::int64_t>(tokens_in.size()));
  commit_checked(r, tokens_in);
}

void Manager::check_commit(const Request& r, std::int64_t nnew) const {
  require(r, ReqStatus::active, "commit");
  if (r.stopped) throw InvalidStateErr("commit after stop_committing()");
  const auto ncommitted = static_cast<std::int64_t>(r.tokens.size());
  if (ncommitted + nnew > r.capacity) {
    throw ValueErr("commit of " + std::to_string(nnew) + " tokens exceeds capacity " + std::to_string(r.capacity) +
                   " (" + std::to_string(ncommitted) + " committed)");
  }
}

void Manager::commit_checked(Request& r, TokenSeq tokens_in) {
  if (tokens_in.empty()) return;
  const auto ncommitted = static_cast<std::int64_t>(r.tokens.size());
  try {
    intern_into(tokens_in, r.tokens);
    r.has_digests = r.has_digests || !tokens_in.digests.empty();
  } catch (...) {
    r.tokens.resize(static_cast<std::size_t>(ncommitted));  // nothing changed
    throw;
  }
  tick();
  const std::int64_t old = ncommitted;
  const std::int64_t old_history = r.history;
  const auto now = static_cast<std::int64_t>(r.tokens.size());
  r.history = std::max(r.history, now);
  for (std::int64_t lc : attn_lcs_) {
    for (std::int64_t i = old / B_; i < ceildiv(now, B_); ++i) {
      const std::int64_t s = page_at(r, lc, i);
      if (s < 0) continue;
      Page& p = page(s);
      if (p.node == kNoNode) p.coverage = static_cast<std::int32_t>(std::min(B_, now - i * B_));
    }
  }
  const std::int64_t last = now / B_ - 1;
  for (std::int64_t i = old / B_; i <= last; ++i) {
    const bool snapshot = ssm_lc_ >= 0 && i == last && now % B_ == 0;
    // r.tokens does not change during insert_block, so a view of it is safe
    const std::span<const Tok> block(r.tokens.data() + i * B_, static_cast<std::size_t>(B_));
    insert_block(r, i, block, snapshot, /*defer_prune=*/i < last);
  }
  release_stale(r, old_history, old / B_);
}

// Python twin: PyKVCache._release_stale (cache.py); DECISIONS "Tree and events" (stale pages
// released at the end of the commit).  Ordinals stale at old_history hold no page already,
// except those this commit wrote (from first_block on).
void Manager::release_stale(Request& r, std::int64_t old_history, std::int64_t first_block) {
  const bool active = r.status == ReqStatus::active;
  for (std::int64_t lc : attn_lcs_) {
    const auto [lo, hi] = stale_range(lc, r.history);
    const std::int64_t start = std::max(lo, std::min(stale_range(lc, old_history).second, first_block));
    auto& pages = r.pages[static_cast<std::size_t>(lc)];
    const std::int64_t end = std::min(hi, static_cast<std::int64_t>(pages.size()));
    for (std::int64_t i = start; i < end; ++i) {
      const std::int64_t s = pages[static_cast<std::size_t>(i)];
      if (s >= 0) {
        pages[static_cast<std::size_t>(i)] = -1;
        unuse(&page(s), active);
      }
    }
  }
}

void Manager::stop_committing(std::int64_t serial) {
  Request& r = req(serial);
  if (r.stopped) return;
  tick();
  stop(r);
}

std::vector<TokenOut> ClosedTokens::decode() const {
  std::vector<TokenOut> out(codes.size());
  for (std::size_t i = 0; i < codes.size(); ++i) {
    const Tok c = codes[i];
    if (c & kDigestCode) {
      out[i].is_digest = true;
      for (const auto& [code, d] : digests) {
        if (code == c) {
          out[i].digest = d;
          break;
        }
      }
    } else {
      out[i].value = c;
    }
  }
  return out;
}

ClosedTokens Manager::close(std::int64_t serial) {
  ClosedTokens out;
  auto it = requests_.find(serial);
  if (it == requests_.end()) return out;
  Request& r = it->second;
  tick();
  if (!r.stopped) stop(r);
  const bool active = r.status == ReqStatus::active;
  for (Page* p : used_pages(r)) unuse(p, active);
  r.live = r.snap = -1;
  for (auto& v : r.pages) v.clear();
  for (NodeId nid : r.blocks) {
    if (nid != kNoNode) tree_.unref(nid);
  }
  r.blocks.clear();
  tree_.unref(r.root);  // may release an unused scope root
  r.status = ReqStatus::closed;
  out.closed_now = true;
  out.capacity = r.capacity;
  out.history = r.history;
  out.num_committed = static_cast<std::int64_t>(r.tokens.size());
  out.reused = r.reused;
  out.priority = r.priority;
  out.codes = std::move(r.tokens);
  for (Tok c : out.codes) {
    if (!(c & kDigestCode)) continue;
    bool seen = false;
    for (const auto& [code, d] : out.digests) seen = seen || code == c;
    if (!seen) out.digests.emplace_back(c, tree_.digest(c));
  }
  // the request's digest references (ClosedTokens carries its own copies of the bytes)
  if (r.has_digests) {
    tree_.release_all(out.codes);
    tree_.release_all(r.input_tokens);
  }
  requests_.erase(it);
  return out;
}

std::vector<std::int32_t> Manager::page_indices(std::int64_t serial, std::int64_t lc) {
  Request& r = req(serial);
  require(r, ReqStatus::active, "page_indices");
  std::vector<std::int32_t> out;
  if (lc == ssm_lc_) {
    out.push_back(static_cast<std::int32_t>(page(r.live).slot));
    return out;
  }
  const std::int64_t nb = ceildiv(r.capacity, B_);
  out.reserve(static_cast<std::size_t>(nb));
  for (std::int64_t i = 0; i < nb; ++i) {
    const std::int64_t s = page_at(r, lc, i);
    out.push_back(s >= 0 ? static_cast<std::int32_t>(page(s).slot) : -1);
  }
  return out;
}

Digest Manager::key_for(Request& r, std::int64_t i, std::span<const Tok> tokens) {
  const Digest parent = i > 0 ? tree_.key(r.blocks[static_cast<std::size_t>(i - 1)]) : r.root_key;
  if (static_cast<std::int64_t>(tokens.size()) == B_ && i < static_cast<std::int64_t>(r.keys.size()) &&
      (i == 0 || r.keys[static_cast<std::size_t>(i - 1)] == parent) &&
      static_cast<std::int64_t>(r.input_tokens.size()) >= (i + 1) * B_ &&
      std::equal(tokens.begin(), tokens.end(), r.input_tokens.begin() + i * B_)) {
    return r.keys[static_cast<std::size_t>(i)];  // same parent key and tokens: the hash done at create
  }
  return block_key_of(parent, tokens);
}

NodeId Manager::parent_for(Request& r, std::int64_t i) {
  if (i == 0) return r.root;
  if (tree_.is_attached(r.blocks[static_cast<std::size_t>(i - 1)])) return r.blocks[static_cast<std::size_t>(i - 1)];
  std::int64_t k = i - 1;
  while (k >= 0 && !tree_.is_attached(r.blocks[static_cast<std::size_t>(k)])) --k;
  NodeId parent = k < 0 ? r.root : r.blocks[static_cast<std::size_t>(k)];
  for (std::int64_t j = k + 1; j < i; ++j) {
    const NodeId orphan = r.blocks[static_cast<std::size_t>(j)];
    const NodeId existing = tree_.find_existing(parent, tree_.key(orphan), tree_.tokens(orphan));
    if (existing != kNoNode) {
      switch_block(r, j, orphan, existing);
    } else {
      attach(parent, orphan);
    }
    parent = r.blocks[static_cast<std::size_t>(j)];
  }
  return parent;
}

void Manager::switch_block(Request& r, std::int64_t j, NodeId orphan, NodeId existing) {
  std::vector<std::int64_t> gained;
  for (std::int64_t lc : attn_lcs_) {
    const std::int64_t s = page_at(r, lc, j);
    if (s < 0) continue;
    Page* p = &page(s);
    if (p->node != orphan || tree_.coverage(existing, lc) >= p->coverage) continue;
    install(existing, lc, p, gained);
  }
  tree_.ref(existing);
  r.blocks[static_cast<std::size_t>(j)] = existing;
  tree_.unref(orphan);
  emit_stored(existing, gained);
}

void Manager::install(NodeId nid, std::int64_t lc, Page* p, std::vector<std::int64_t>& gained) {
  if (p->node != kNoNode) {  // moving from an orphan block
    const NodeId old_node = p->node;
    p->node = kNoNode;
    tree_.set_page(old_node, lc, kNoPage, 0);
  }
  const PageHandle old = tree_.set_page(nid, lc, p->handle, p->coverage);
  if (p->locks || p->holds) {
    p->node = nid;  // a used page: its state does not depend on the node
  } else {
    restate(*p, [&] { p->node = nid; });
  }
  if (old == kNoPage) {
    gained.push_back(lc);
    return;
  }
  Page* q = &page(old);
  restate(*q, [&] { q->node = kNoNode; });
  if (q->tier != p->tier) {
    if (EventC* e = new_event(EventKind::tier_changed)) {
      e->key = tree_.key(nid);
      e->lc = lc;
      e->old_tier = tier_id(q->tier);
      e->new_tier = tier_id(p->tier);
    }
  }
  if (q->locks == 0 && q->holds == 0) free_page(q);
}

void Manager::attach(NodeId parent, NodeId nid) {
  const std::vector<NodeId> siblings = tree_.attach(parent, nid);
  const auto nlc = static_cast<std::int64_t>(cfg_.lcs.size());
  std::vector<std::int64_t>& lcs = scratch_lcs_;
  if (siblings.empty()) {  // the common case: nothing stepped aside
    lcs.clear();
    for (std::int64_t lc = 0; lc < nlc; ++lc) {
      const PageHandle h = tree_.page(nid, lc);
      if (h == kNoPage) continue;
      page(h).node = nid;
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
    if (h != kNoPage) page(h).node = nid;
    for (NodeId sid : siblings) {
      const PageHandle hs = tree_.page(sid, lc);
      if (hs != kNoPage) page(hs).node = sid;
    }
  }
  retire_nodes(siblings, false);
  lcs.clear();
  for (std::int64_t lc = 0; lc < nlc; ++lc) {
    if (tree_.page(nid, lc) != kNoPage) lcs.push_back(lc);
  }
  emit_stored(nid, lcs);
}

// python: PyKVCache._insert_block (SPEC sec. 5, 7); defer_prune: more blocks of this commit
// follow, so a pageless new block leaves its parent chain attached (no quadratic re-attach).
void Manager::insert_block(Request& r, std::int64_t i, std::span<const Tok> tokens, bool want_snapshot,
                           bool defer_prune) {
  const auto ntok = static_cast<std::int64_t>(tokens.size());
  const Digest key = key_for(r, i, tokens);
  NodeId parent = parent_for(r, i);
  NodeId existing = tree_.find_existing(parent, key, tokens);
  Page* snap = nullptr;
  const std::int64_t ssm = ssm_lc_;
  if (want_snapshot && (existing == kNoNode || tree_.coverage(existing, ssm) < ntok)) {
    Page* live = page_ptr(r.live);
    if (live == nullptr || live->tier != kGpu || !make_room(kGpu, ssm)) {
      count(ssm, kSnapshotsSkipped);
    } else {
      snap = new_page(kGpu, ssm, ntok, r.priority, i);
      copy(ssm, &page(r.live), snap, "snapshot");
      count(ssm, kSnapshotsTaken);
      // eviction may have pruned this request's chain or the existing block
      parent = parent_for(r, i);
      existing = tree_.find_existing(parent, key, tokens);
    }
  }
  const bool active = r.status == ReqStatus::active;
  if (existing == kNoNode) {
    const NodeId nid = new_block(key, tokens, i);
    for (std::int64_t lc : attn_lcs_) {
      const std::int64_t s = page_at(r, lc, i);
      if (s < 0) continue;
      Page& p = page(s);
      p.coverage = static_cast<std::int32_t>(ntok);
      tree_.set_page(nid, lc, p.handle, ntok);
      p.node = nid;  // a used page: its state does not depend on the node
    }
    if (snap != nullptr) {
      tree_.set_page(nid, ssm, snap->handle, ntok);
      restate(*snap, [&] { snap->node = nid; });
    }
    tree_.ref(nid);
    set_block(r, i, nid);
    if (tree_.has_page(nid)) {
      attach(parent, nid);
    } else if (!defer_prune) {
      tree_.prune_upward(parent);  // a re-attached chain must not stay childless
    }
    return;
  }
  std::vector<std::int64_t> gained;
  for (std::int64_t lc : attn_lcs_) {
    const std::int64_t s = page_at(r, lc, i);
    if (s < 0) continue;
    Page* p = &page(s);
    p->coverage = static_cast<std::int32_t>(ntok);
    const PageHandle qh = tree_.page(existing, lc);
    if (qh == kNoPage || tree_.coverage(existing, lc) < ntok) {
      install(existing, lc, p, gained);
    } else {
      Page* q = &page(qh);
      if (q->tier == kGpu) {  // switch to the tree's page; its index changes
        use(q, active, r.priority);
        r.pages[static_cast<std::size_t>(lc)][static_cast<std::size_t>(i)] = q->handle;
        unuse(p, active);
      }
      // else: keep our page privately (freed at close)
    }
  }
  if (snap != nullptr) install(existing, ssm, snap, gained);
  tree_.ref(existing);
  set_block(r, i, existing);
  emit_stored(existing, gained);
}

void Manager::set_block(Request& r, std::int64_t i, NodeId nid) {
  const auto ii = static_cast<std::size_t>(i);
  if (ii < r.blocks.size()) {
    if (r.blocks[ii] != kNoNode) tree_.unref(r.blocks[ii]);
    r.blocks[ii] = nid;
  } else {
    r.blocks.resize(ii, kNoNode);
    r.blocks.push_back(nid);
  }
}

void Manager::stop(Request& r) {
  r.stopped = true;
  const auto n = static_cast<std::int64_t>(r.tokens.size());
  const std::int64_t tail = n % B_;
  const std::int64_t i = n / B_;
  if (!tail || !cfg_.enable_partial_reuse || r.cow_block == i) return;
  const std::vector<Tok> block(r.tokens.begin() + i * B_, r.tokens.end());
  insert_block(r, i, block, ssm_lc_ >= 0);
}

// ====================================================================== observability

std::string Manager::snapshot_json() {
  std::string o;
  o.reserve(4096);
  o += "{\"clock\":";
  j_int(o, clock_);
  o += ",\"tree\":[";
  bool first = true;
  for (const NodeDump& d : tree_.dump()) {
    if (!first) o += ',';
    first = false;
    o += "{\"id\":";
    j_int(o, d.id);
    o += ",\"key\":";
    j_hex(o, d.key);
    o += ",\"parent\":";
    j_id(o, d.parent);
    o += ",\"attached\":";
    j_bool(o, d.attached);
    o += ",\"root\":";
    j_bool(o, d.is_root);
    o += ",\"ordinal\":";
    j_int(o, d.ordinal);
    o += ",\"tokens\":[";
    for (std::size_t k = 0; k < d.tokens.size(); ++k) {
      if (k) o += ',';
      j_tok_snap(o, d.tokens[k]);
    }
    o += "],\"children\":[";
    for (std::size_t k = 0; k < d.children.size(); ++k) {
      if (k) o += ',';
      j_int(o, d.children[k]);
    }
    o += "],\"refs\":";
    j_int(o, d.refs);
    o += ",\"pages\":[";
    for (std::size_t lc = 0; lc < d.pages.size(); ++lc) {
      if (lc) o += ',';
      if (d.pages[lc] == kNoPage) {
        o += "null";
      } else {
        o += "{\"page\":";
        j_int(o, page_serial(d.pages[lc]));
        o += ",\"coverage\":";
        j_int(o, d.coverage[lc]);
        o += '}';
      }
    }
    o += "]}";
  }
  o += "],\"pages\":[";
  first = true;
  for (std::int64_t h : live_pages()) {
    const Page& p = page(h);
    if (!first) o += ',';
    first = false;
    o += "{\"serial\":";
    j_int(o, p.serial);
    o += ",\"lc\":";
    j_int(o, p.lc);
    o += ",\"tier\":";
    j_int(o, tier_id(p.tier));
    o += ",\"slot\":";
    j_int(o, p.slot);
    o += ",\"coverage\":";
    j_int(o, p.coverage);
    o += ",\"state\":";
    o += state_name(p.state());
    o += ",\"priority\":";
    j_int(o, p.priority);
    o += ",\"last_used\":";
    j_int(o, p.last_used);
    o += ",\"ordinal\":";
    j_int(o, p.ordinal);
    o += ",\"node\":";
    j_id(o, node_uid(p.node));
    o += ",\"locks\":";
    j_int(o, p.locks);
    o += ",\"holds\":";
    j_int(o, p.holds);
    o += '}';
  }
  o += "],\"pools\":[";
  for (std::size_t t = 0; t < pools_.size(); ++t) {
    if (t) o += ',';
    o += "{\"tier\":";
    j_int(o, tier_id_[t]);
    o += ",\"kind\":";
    j_str(o, cfg_.tier_kinds[t].c_str());
    o += ",\"lc\":[";
    for (std::size_t lc = 0; lc < pools_[t].size(); ++lc) {
      const Pool& p = pools_[t][lc];
      if (lc) o += ',';
      o += "{\"total\":";
      j_int(o, p.total);
      o += ",\"free\":";
      j_int(o, p.nfree());
      o += ",\"free_slots\":[";
      const std::vector<std::int64_t> fs = p.free_slots.sorted();
      for (std::size_t k = 0; k < fs.size(); ++k) {
        if (k) o += ',';
        j_int(o, fs[k]);
      }
      o += "]}";
    }
    o += "]}";
  }
  o += "],\"requests\":[";
  first = true;
  for (const std::int64_t serial : open_serials()) {
    const Request& r = requests_.at(serial);
    if (!first) o += ',';
    first = false;
    o += "{\"serial\":";
    j_int(o, serial);
    o += ",\"id\":null,\"status\":";
    j_str(o, status_name(r.status));
    o += ",\"scope\":[";
    if (r.lora) {
      o += std::to_string(*r.lora);
    } else {
      o += "null";
    }
    o += ',';
    if (r.salt) {
      o += std::to_string(*r.salt);
    } else {
      o += "null";
    }
    o += "],\"priority\":";
    j_int(o, r.priority);
    o += ",\"capacity\":";
    j_int(o, r.capacity);
    o += ",\"history_length\":";
    j_int(o, r.history);
    o += ",\"committed_tokens\":[";
    for (std::size_t k = 0; k < r.tokens.size(); ++k) {
      if (k) o += ',';
      j_tok_snap(o, decode(r.tokens[k]));
    }
    o += "],\"reused_tokens\":";
    j_int(o, r.reused);
    o += ",\"stopped\":";
    j_bool(o, r.stopped);
    o += ",\"blocks\":[";
    for (std::size_t k = 0; k < r.blocks.size(); ++k) {
      if (k) o += ',';
      j_id(o, node_uid(r.blocks[k]));
    }
    o += "],\"pages\":{";
    bool f2 = true;
    for (std::int64_t lc : attn_lcs_) {
      if (!f2) o += ',';
      f2 = false;
      o += '"';
      j_int(o, lc);
      o += "\":[";
      const auto& v = r.pages[static_cast<std::size_t>(lc)];
      for (std::size_t k = 0; k < v.size(); ++k) {
        if (k) o += ',';
        j_id(o, page_serial(v[k]));
      }
      o += ']';
    }
    o += "},\"live\":";
    j_id(o, page_serial(r.live));
    o += ",\"snap\":";
    j_id(o, page_serial(r.snap));
    o += ",\"cow_block\":";
    j_int(o, r.cow_block);
    o += '}';
  }
  o += "],\"stats\":";
  stats_view(o, totals_);
  o += ",\"iteration_stats\":";
  stats_view(o, iteration_);
  o += ",\"copy_ops\":[";
  for (std::size_t k = 0; k < copy_ops_.size(); ++k) {
    const CopyOpC& c = copy_ops_[k];
    if (k) o += ',';
    o += '[';
    j_int(o, c.lc);
    o += ',';
    j_int(o, c.src_tier);
    o += ',';
    j_int(o, c.src_slot);
    o += ',';
    j_int(o, c.dst_tier);
    o += ',';
    j_int(o, c.dst_slot);
    o += ',';
    j_str(o, c.reason);
    o += ']';
  }
  o += "],\"issued_copy_ops\":[";
  for (std::size_t k = 0; k < issued_.size(); ++k) {
    const CopyOpC& c = issued_[k].op;
    if (k) o += ',';
    o += '[';
    for (std::int64_t v : {c.lc, c.src_tier, c.src_slot, c.dst_tier, c.dst_slot}) {
      j_int(o, v);
      o += ',';
    }
    j_str(o, c.reason);
    o += ',';
    j_int(o, issued_[k].serial);
    o += ']';
  }
  o += "],\"events\":[";
  std::size_t tok_at = 0, blk_at = 0;  // where the next stored event's tokens / blocks start
  for (std::size_t k = 0; k < events_.size(); ++k) {
    const EventC& e = events_[k];
    if (k) o += ',';
    o += "{\"event_id\":";
    j_int(o, e.id);
    switch (e.kind) {
      case EventKind::stored:
        o += ",\"kind\":\"stored\",\"parent_key\":";
        if (e.has_parent) {
          j_hex(o, e.parent_key);
        } else {
          o += "null";
        }
        o += ",\"partial\":";
        j_bool(o, e.partial);
        o += ",\"blocks\":[";
        for (std::size_t b = 0; b < e.nblocks; ++b) {
          const StoredBlockC& sb = event_blocks_[blk_at + b];
          if (b) o += ',';
          o += '[';
          j_hex(o, e.key);
          o += ',';
          j_int(o, static_cast<std::int64_t>(e.ntokens));
          o += ",[";
          for (std::size_t t = 0; t < e.ntokens; ++t) {
            if (t) o += ',';
            j_tok_plain(o, decode(event_tokens_[tok_at + t]));
          }
          o += "],";
          j_int(o, sb.lc);
          o += ',';
          j_int(o, sb.tier);
          o += ',';
          j_int(o, sb.priority);
          o += ']';
        }
        o += ']';
        tok_at += e.ntokens;
        blk_at += e.nblocks;
        break;
      case EventKind::removed:
        o += ",\"kind\":\"removed\",\"keys\":[";
        j_hex(o, e.key);
        o += "],\"lc\":";
        j_int(o, e.lc);
        break;
      case EventKind::tier_changed:
        o += ",\"kind\":\"tier_changed\",\"key\":";
        j_hex(o, e.key);
        o += ",\"lc\":";
        j_int(o, e.lc);
        o += ",\"old_tier\":";
        j_int(o, e.old_tier);
        o += ",\"new_tier\":";
        j_int(o, e.new_tier);
        break;
      case EventKind::cleared:
        o += ",\"kind\":\"cleared\"";
        break;
    }
    o += '}';
  }
  o += "],\"events_dropped\":";
  j_int(o, events_dropped_);
  o += ",\"next\":{\"event\":";
  j_int(o, next_event_);
  o += ",\"page\":";
  j_int(o, next_page_);
  o += ",\"request\":";
  j_int(o, next_request_);
  o += ",\"node\":";
  // the tree's next id: one past the largest id ever made (ids are never reused)
  j_int(o, tree_.next_uid());
  o += "},\"shutdown\":";
  j_bool(o, is_shutdown_);
  o += '}';
  return o;
}

std::vector<std::pair<std::string, std::int64_t>> Manager::internal_sizes() const {
  const auto n = [](std::size_t v) { return static_cast<std::int64_t>(v); };
  return {{"tree_nodes", n(tree_.num_nodes())},
          {"tree_node_slots", n(tree_.node_slots())},
          {"roots", n(tree_.num_roots())},
          {"trie_node_slots", n(tree_.trie_node_slots())},
          {"digests", n(tree_.num_digests())},
          {"digest_slots", n(tree_.digest_slots())},
          {"pages", page_slots_ - n(free_pages_.size())},
          {"page_slots", page_slots_},
          {"requests", n(requests_.size())},
          {"copy_ops", n(copy_ops_.size())},
          {"events", n(events_.size())},
          {"event_tokens", n(event_tokens_.size())}};
}

std::vector<std::int64_t> Manager::open_serials() const {
  std::vector<std::int64_t> out;
  out.reserve(requests_.size());
  for (const auto& [serial, r] : requests_) out.push_back(serial);
  std::sort(out.begin(), out.end());
  return out;
}

std::vector<std::int64_t> Manager::live_pages() const {
  std::vector<std::int64_t> out;
  out.reserve(static_cast<std::size_t>(page_slots_) - free_pages_.size());
  for (std::int64_t h = 0; h < page_slots_; ++h) {
    if (page_alive(h)) out.push_back(h);
  }
  std::sort(out.begin(), out.end(), [this](std::int64_t a, std::int64_t b) { return page(a).serial < page(b).serial; });
  return out;
}

void Manager::check_invariants() {
  const auto S = [](std::int64_t v) { return std::to_string(v); };
  const std::size_t nlc = cfg_.lcs.size();
  const std::vector<std::int64_t> all = live_pages();
  // --- pools
  for (std::size_t t = 0; t < pools_.size(); ++t) {
    for (std::size_t lc = 0; lc < nlc; ++lc) {
      const Pool& pool = pools_[t][lc];
      const std::string where = "pool(" + S(static_cast<std::int64_t>(t)) + "," + S(static_cast<std::int64_t>(lc)) + ")";
      const std::vector<std::int64_t> fs = pool.free_slots.sorted();
      const std::set<std::int64_t> free(fs.begin(), fs.end());
      check(static_cast<std::int64_t>(fs.size()) == pool.nfree(), where + ": free-slot count out of sync");
      std::vector<const Page*> used;
      for (std::int64_t h : all) {
        const Page& p = page(h);
        if (p.tier == static_cast<std::int64_t>(t) && p.lc == static_cast<std::int64_t>(lc)) used.push_back(&p);
      }
      std::set<std::int64_t> slots;
      bool overlap = false, in_range = true;
      for (const Page* p : used) {
        slots.insert(p->slot);
        if (free.count(p->slot)) overlap = true;
        if (p->slot < 0 || p->slot >= pool.total) in_range = false;
      }
      for (std::int64_t s : free) {
        if (s < 0 || s >= pool.total) in_range = false;
      }
      check(slots.size() == used.size(), where + ": two pages share a slot");
      check(!overlap, where + ": a used slot is also free");
      check(static_cast<std::int64_t>(free.size() + used.size()) == pool.total,
            where + ": " + S(static_cast<std::int64_t>(free.size())) + " free + " +
                S(static_cast<std::int64_t>(used.size())) + " used != " + S(pool.total));
      check(in_range, where + ": slot out of range");
      const std::pair<int, std::int64_t> counted[3] = {{kLocked, pool.locked}, {kHeld, pool.held}, {kDroppable, pool.droppable}};
      for (const auto& [state, have] : counted) {
        std::int64_t n = 0;
        for (const Page* p : used) n += p->state() == state;
        check(n == have, where + ": " + S(have) + " " + std::string(state_name(state)) + " counted, " + S(n) + " found");
      }
      // the eviction index holds exactly the HELD / DROPPABLE pages
      std::size_t nh = 0, nd = 0;
      for (const Page* p : used) {
        nh += p->state() == kHeld;
        nd += p->state() == kDroppable;
      }
      check(pool.held_index.size() == nh && pool.droppable_index.size() == nd, where + ": eviction index out of sync");
      for (const EvictIndex* ix : {&pool.held_index, &pool.droppable_index}) {
        std::size_t n = 0;
        const Page* before = nullptr;
        for (std::int64_t h = ix->head; h >= 0; h = page(h).next) {
          const Page& q = page(h);
          check(q.in_list && (before == nullptr || before->idx_key() < q.idx_key()), where + ": eviction list out of order");
          before = &q;
          ++n;
        }
        check(n == ix->list_size, where + ": eviction list size out of sync");
      }
    }
  }
  // --- page users, recomputed from the requests
  std::unordered_map<std::int64_t, std::int64_t> locks, holds, refs;
  for (const std::int64_t serial : open_serials()) {
    const Request& r = requests_.at(serial);
    const std::string rid = "request " + S(serial);
    const auto nc = static_cast<std::int64_t>(r.tokens.size());
    check(nc <= r.history && r.history <= r.capacity,
          rid + ": committed " + S(nc) + " <= history " + S(r.history) + " <= capacity " + S(r.capacity));
    const bool active = r.status == ReqStatus::active;
    auto& target = active ? locks : holds;
    std::vector<std::int64_t> used;
    for (std::int64_t lc : attn_lcs_) {
      for (std::int64_t s : r.pages[static_cast<std::size_t>(lc)]) {
        if (s >= 0) used.push_back(s);
      }
    }
    if (r.snap >= 0) used.push_back(r.snap);
    if (r.live >= 0) used.push_back(r.live);
    std::set<std::int64_t> uniq(used.begin(), used.end());
    check(uniq.size() == used.size(), rid + ": uses a page twice");
    for (std::int64_t s : used) {
      check(page_alive(s), rid + ": uses a freed page");
      target[s] += 1;
      if (active) {
        check(page(s).tier == kGpu,
              rid + " is ACTIVE but page " + S(page_serial(s)) + " is on tier " + S(page(s).tier));
      }
    }
    const std::int64_t nb = ceildiv(r.capacity, B_);
    for (std::int64_t lc : attn_lcs_) {
      const auto& v = r.pages[static_cast<std::size_t>(lc)];
      check(static_cast<std::int64_t>(v.size()) <= std::max(nb, static_cast<std::int64_t>(r.blocks.size())),
            rid + ": pages beyond capacity");
      const auto [lo, hi] = stale_range(lc, r.history);
      for (std::size_t i = 0; i < v.size(); ++i) {
        const auto ii = static_cast<std::int64_t>(i);
        check(v[i] < 0 || !(lo <= ii && ii < hi),
              rid + ": stale block " + S(ii) + " of lc " + S(lc) + " keeps a page");
      }
    }
    if (active && ssm_lc_ >= 0) check(r.live >= 0, rid + ": ACTIVE without a live ssm state");
    for (NodeId nid : r.blocks) {
      if (nid != kNoNode) {
        check(tree_.exists(nid), rid + ": references a deleted block");
        refs[tree_.uid(nid)] += 1;
      }
    }
    check(tree_.exists(r.root) && tree_.find_root(r.root_key) == r.root, rid + ": its scope root is gone");
    refs[tree_.uid(r.root)] += 1;
  }
  const std::vector<NodeDump> dump = tree_.dump();
  std::unordered_map<NodeId, const NodeDump*> nodes;
  for (const NodeDump& d : dump) nodes[d.id] = &d;
  for (std::int64_t s : all) {
    const Page& p = page(s);
    const std::string pid = "page " + S(p.serial);
    const std::int64_t l = locks.count(s) ? locks[s] : 0;
    const std::int64_t h = holds.count(s) ? holds[s] : 0;
    check(p.locks == l, pid + ": " + S(p.locks) + " locks, " + S(l) + " users ACTIVE");
    check(p.holds == h, pid + ": " + S(p.holds) + " holds, " + S(h) + " users SUSPENDED");
    check(p.state() != kLocked || p.tier == kGpu, pid + ": LOCKED on tier " + S(p.tier));
    check(p.idx_state == p.state(), pid + ": counted under a stale state");
    if (p.node == kNoNode) {
      check(p.locks + p.holds > 0, pid + ": private page without a user");
    } else {
      check(tree_.exists(p.node), pid + ": its block does not exist");
      const std::int64_t uid = tree_.uid(p.node);
      const NodeDump& n = *nodes[uid];
      check(n.pages[static_cast<std::size_t>(p.lc)] == s, pid + ": block " + S(uid) + " does not hold it");
      if (!n.attached) check(p.locks + p.holds > 0, pid + ": orphan block " + S(uid) + " page without a user");
    }
  }
  // --- tree links
  for (const NodeDump& n : dump) {
    const std::string bid = "block " + S(n.id);
    const std::int64_t rf = refs.count(n.id) ? refs[n.id] : 0;
    check(n.refs == rf, bid + ": " + S(n.refs) + " refs, " + S(rf) + " requests");
    bool has_page = false;
    for (std::size_t lc = 0; lc < nlc; ++lc) {
      const PageHandle h = n.pages[lc];
      if (h != kNoPage) {
        has_page = true;
        check(page_alive(h) && node_uid(page(h).node) == n.id,
              bid + ": page " + S(page_alive(h) ? page_serial(h) : h) + " of lc " + S(static_cast<std::int64_t>(lc)) + " not linked back");
        check(n.coverage[lc] > 0, bid + ": page with zero coverage");
      } else {
        check(n.coverage[lc] == 0, bid + ": coverage without a page");
      }
    }
    for (NodeId c : n.children) {
      check(nodes.count(c) != 0 && nodes[c]->parent == n.id, bid + ": child " + S(c) + " link broken");
      check(static_cast<std::int64_t>(n.tokens.size()) == B_ || n.is_root, bid + ": a partial block has children");
    }
    if (n.is_root) {
      check(tree_.find_root(n.key) != kNoNode && tree_.uid(tree_.find_root(n.key)) == n.id,
            "root " + S(n.id) + ": not the root of its scope");
      check(!n.children.empty() || n.refs > 0, "root " + S(n.id) + ": unused (no child, no request) but not released");
      continue;
    }
    bool expect_attached = false;
    if (n.parent != kNoNode && nodes.count(n.parent)) {
      const NodeDump& p = *nodes[n.parent];
      expect_attached = p.attached && std::find(p.children.begin(), p.children.end(), n.id) != p.children.end();
    }
    check(n.attached == expect_attached, bid + ": attached flag " + (n.attached ? "True" : "False") +
                                             " but links say " + (expect_attached ? "True" : "False"));
    if (n.attached) {
      check(!n.children.empty() || has_page, bid + ": attached with neither a child nor a page (prunable)");
      check(n.ordinal == nodes[n.parent]->ordinal + 1,
            bid + ": ordinal " + S(n.ordinal) + " under " + S(nodes[n.parent]->ordinal));
    } else {
      check(n.parent == kNoNode, bid + ": detached but has a parent");
      check(n.refs > 0 || has_page, bid + ": dead orphan not deleted");
    }
  }
}

}  // namespace kvcm
