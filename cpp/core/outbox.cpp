// The outbox (outbox.h).  Python twin: kvcm/python_backend/outbox.py (Outbox).
#include "core/outbox.h"

#include <algorithm>
#include <cstring>
#include <limits>
#include <stdexcept>

#include "core/pages.h"
#include "core/manager_detail.h"

namespace kvcm {

using namespace detail;

Outbox::Outbox(const Layout& layout, RadixTree& tree, const Pages& pages)
    : layout_(layout), tree_(tree), pages_(pages) {
  const std::size_t n = kHeader + layout_.num_life_cycles() * kNumCounters;
  totals_.assign(n, 0);
  iteration_.assign(n, 0);
}

namespace {
// An op as kvcm.api.CopyOp.to_json() shows in a Python message: [0, 1, 2, 3, 4, 'offload'(, 'hex')].
std::string op_text(const CopyOpC& o) {
  std::string t = "[";  // (appended piece by piece: GCC 12 warns on "[" + std::to_string(...))
  for (std::int64_t v : {o.lc, o.src_tier, o.src_slot, o.dst_tier, o.dst_slot}) {
    t += std::to_string(v);
    t += ", ";
  }
  t += '\'';
  t += o.reason;
  t += '\'';
  if (o.has_key) {
    t += ", ";
    j_hex(t, o.key);  // "..." -> '...'
    t.back() = '\'';
    t[t.size() - 2 * o.key.size() - 2] = '\'';
  }
  t += ']';
  return t;
}
}  // namespace

// py: outbox.py Outbox.copy — SPEC sec. 8
void Outbox::copy(std::int64_t lc, const Page* src, const Page* dst, const char* reason) {
  add_copy_op(CopyOpC{lc, layout_.tier_id(src->tier), src->slot, layout_.tier_id(dst->tier), dst->slot, reason},
              dst->handle, dst->serial);
  count(lc, std::strcmp(reason, "snapshot") == 0 ? kSnapshotsTaken : kCows);
}

// DECISIONS.md "The shared tier": it fills no page here (forget_copies forgets nothing).
// py: outbox.py Outbox.store — SPEC sec. 16
void Outbox::store(const Page* p, const Digest& key) {
  CopyOpC op{p->lc, layout_.tier_id(p->tier), p->slot, 3, -1, "store"};
  op.has_key = true;
  op.key = key;
  add_copy_op(op, -1, -1);
  count(p->lc, kSharedStores);
  count(p->lc, kSharedStoreBytes, layout_.cfg().lcs[static_cast<std::size_t>(p->lc)].slot_bytes);
}

// The pending copy ops warning (sec. 15): warned once, at the call's end.
// py: outbox.py Outbox.add_copy_op — SPEC sec. 8
void Outbox::add_copy_op(const CopyOpC& op, std::int64_t handle, std::int64_t serial) {
  copy_ops_.push_back(op);
  copy_pages_.emplace_back(handle, serial);
  // (the figure, with the unsettled ops, grows only here, one op at a time: == catches the crossing)
  if (static_cast<std::int64_t>(copy_ops_.size()) + unsettled_ops_ == layout_.cfg().pending_copy_ops_warning &&
      !copy_ops_warned_) {
    copy_ops_warned_ = copy_ops_warn_due_ = true;
  }
}

// py: outbox.py Outbox.emit — SPEC sec. 9
EventC* Outbox::new_event(EventKind kind, std::span<const Tok> tokens, bool tokens_have_digest) {
  const std::int64_t id = event_id();  // ids advance even for events nobody buffers
  if (layout_.cfg().max_events == 0) {
    ++events_dropped_;
    return nullptr;
  }
  if (static_cast<std::int64_t>(events_.size()) >= layout_.cfg().max_events) {
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
  event_tokens_.append(tokens.data(), tokens.size());
  std::uint32_t sized = e.ntokens;
  if (tokens_have_digest) {
    tree_.retain_all(tokens);  // the buffered event holds its digests (released when dropped or taken)
    sized |= kEventHasDigest;
  }
  event_sizes_.emplace_back(sized, 0);
  return &e;
}

// py: outbox.py Outbox.emit_removed — SPEC sec. 9
void Outbox::emit_removed(const Digest& key, std::int64_t lc) {
  if (EventC* e = new_event(EventKind::removed)) {
    e->key = key;
    e->lc = lc;
  }
}

// py: outbox.py Outbox.emit_stored — SPEC sec. 9
void Outbox::emit_stored(NodeId nid, std::span<const std::int64_t> lcs) {
  if (lcs.empty()) return;
  const std::span<const Tok> tokens = tree_.tokens(nid);
  EventC* e = new_event(EventKind::stored, tokens, tree_.has_digest(nid));
  if (e == nullptr) return;
  const NodeId parent = tree_.parent(nid);
  if (parent != kNoNode) {
    e->has_parent = true;
    e->parent_key = tree_.key(parent);
  }
  e->key = tree_.key(nid);
  for (std::int64_t lc : lcs) {
    const Page& p = pages_.page(tree_.page(nid, lc));
    event_blocks_.emplace_back(
        StoredBlockC{static_cast<std::int32_t>(lc), static_cast<std::int32_t>(layout_.tier_id(p.tier)), p.priority,
                     static_cast<std::int32_t>(tree_.coverage(nid, lc))});
    ++e->nblocks;
    ++event_sizes_.back().second;
  }
  e->partial = static_cast<std::int64_t>(tokens.size()) < layout_.B();
}

// py: outbox.py Outbox.count — SPEC sec. 9
void Outbox::count(std::int64_t lc, int counter, std::int64_t n) {
  const std::size_t i = kHeader + static_cast<std::size_t>(lc) * kNumCounters + static_cast<std::size_t>(counter);
  totals_[i] += n;
  iteration_[i] += n;
}

// py: outbox.py Outbox.record_match — SPEC sec. 9
void Outbox::record_match(std::int64_t n_query, std::int64_t m) {
  for (std::vector<std::int64_t>* c : {&totals_, &iteration_}) {
    (*c)[0] += 1;
    (*c)[1] += n_query;
    (*c)[2] += m;
    for (std::int64_t lc : layout_.attn_lcs()) {
      const std::size_t base = kHeader + static_cast<std::size_t>(lc) * kNumCounters;
      (*c)[base + kReusedTokens] += m;
      (*c)[base + kReusedBlocks] += ceildiv(m, layout_.B());
      (*c)[base + kMissedBlocks] += ceildiv(n_query, layout_.B()) - ceildiv(m, layout_.B());
    }
  }
}

// py: outbox.py Outbox.stats_view — SPEC sec. 9
void Outbox::stats_view(std::string& o, const std::vector<std::int64_t>& c) const {
  o += "{\"requests\":";
  j_int(o, c[0]);
  o += ",\"query_tokens\":";
  j_int(o, c[1]);
  o += ",\"reused_tokens\":";
  j_int(o, c[2]);
  o += ",\"lc\":[";
  const std::size_t nlc = layout_.cfg().lcs.size();
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
  pages_.pools_json(o, false);
  o += "],\"events_dropped\":";
  j_int(o, events_dropped_);
  o += ",\"pending_copy_ops\":";
  j_int(o, static_cast<std::int64_t>(copy_ops_.size()));
  o += '}';
}

void Outbox::stats_json(std::string& o, bool take_iteration) {
  if (take_iteration) {
    stats_view(o, iteration_);
    std::fill(iteration_.begin(), iteration_.end(), 0);
  } else {
    stats_view(o, totals_);
  }
}

// The body of Manager::drain_copy_ops.
// py: outbox.py Outbox.take_copy_ops — SPEC sec. 8
std::vector<CopyOpC> Outbox::drain_copy_ops() {
  std::vector<CopyOpC> out;
  out.swap(copy_ops_);
  copy_ops_.reserve(out.size());  // the next step's ops: one allocation, not a doubling chain
  // explicit settlement: a drain with ops becomes the newest unsettled one (an empty one
  // records nothing); else it is the last drain (forget_copies)
  if (layout_.cfg().explicit_settlement && out.empty()) return out;
  std::vector<IssuedOp>& issued = layout_.cfg().explicit_settlement ? unsettled_.emplace_back() : issued_;
  if (layout_.cfg().explicit_settlement) unsettled_ops_ += static_cast<std::int64_t>(out.size());
  // field by field into place: an IssuedOp temporary went through the stack in pieces and
  // was read back whole, a store-forwarding stall per op
  issued.resize(out.size());
  for (std::size_t k = 0; k < out.size(); ++k) {
    IssuedOp& io = issued[k];
    io.op = out[k];
    io.handle = copy_pages_[k].first;
    io.serial = copy_pages_[k].second;
  }
  copy_pages_.clear();
  return out;
}

// The body of Manager::take_events.
TakenEvents Outbox::take_events() {
  TakenEvents out;
  out.events.assign(events_.begin(), events_.end());
  out.tokens.reserve(event_tokens_.size());
  for (Tok c : event_tokens_) out.tokens.push_back(tree_.decode(c));
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

// py: outbox.py Outbox.match_issued — SPEC sec. 15
std::vector<bool> Outbox::match_issued(std::span<const IssuedOp> drain, std::span<const CopyOpC> ops, bool settle) {
  auto same = [](const CopyOpC& a, const CopyOpC& b) {
    return a.lc == b.lc && a.src_tier == b.src_tier && a.src_slot == b.src_slot && a.dst_tier == b.dst_tier &&
           a.dst_slot == b.dst_slot && std::strcmp(a.reason, b.reason) == 0 && a.has_key == b.has_key &&
           (!a.has_key || a.key == b.key);
  };
  std::vector<bool> taken(drain.size(), false);
  for (std::size_t i = 0; i < ops.size(); ++i) {
    std::size_t k = 0;
    while (k < drain.size() && (taken[k] || !same(drain[k].op, ops[i]))) ++k;
    if (k == drain.size()) {
      std::string at = "[";
      at += std::to_string(i);
      at += "] ";
      at += op_text(ops[i]);
      // the texts of kvcm.checks.not_in_oldest_drain_error / not_issued_error
      throw ValueErr(settle ? "settle_copies(): failed" + at +
                                  " is not an op of the oldest unsettled drain (or is listed more times than that "
                                  "drain returned it)"
                            : "forget_copies(): ops" + at + " is not an unreported op of the last drain_copy_ops()");
    }
    taken[k] = true;
  }
  return taken;
}

// py: outbox.py Outbox.live_fills — SPEC sec. 15
std::vector<std::pair<std::int64_t, std::int64_t>> Outbox::live_fills(std::span<const IssuedOp> drain,
                                                                         const std::vector<bool>& taken) const {
  std::vector<std::pair<std::int64_t, std::int64_t>> lost;  // (handle, serial) of each lost live page
  for (std::size_t k = 0; k < drain.size(); ++k) {
    const IssuedOp& e = drain[k];
    if (taken[k] && pages_.page_alive(e.handle) && pages_.page(e.handle).serial == e.serial &&
        std::find_if(lost.begin(), lost.end(), [&e](const auto& l) { return l.first == e.handle; }) == lost.end()) {
      lost.emplace_back(e.handle, e.serial);
    }
  }
  return lost;
}

// py: outbox.py Outbox.take_issued — SPEC sec. 15
std::vector<std::pair<std::int64_t, std::int64_t>> Outbox::take_issued(std::span<const CopyOpC> ops) {
  const std::vector<bool> taken = match_issued(issued_, ops, false);
  std::vector<std::pair<std::int64_t, std::int64_t>> lost;
  if (ops.empty()) return lost;
  lost = live_fills(issued_, taken);
  std::vector<IssuedOp> keep;
  for (std::size_t k = 0; k < issued_.size(); ++k) {
    if (!taken[k]) keep.push_back(issued_[k]);
  }
  issued_ = std::move(keep);
  return lost;
}

// DECISIONS.md "Asynchronous copies: settle_copies".
// py: outbox.py Outbox.settle_oldest — SPEC sec. 15
std::vector<std::pair<std::int64_t, std::int64_t>> Outbox::settle_oldest(std::span<const CopyOpC> failed) {
  // the text of kvcm.checks.NOTHING_TO_SETTLE
  if (unsettled_.empty()) {
    throw ValueErr("settle_copies(): no unsettled drain (each drain_copy_ops() / drain_copy_runs() that returned "
                   "ops is settled once)");
  }
  const std::vector<IssuedOp>& drain = unsettled_.front();
  std::vector<std::pair<std::int64_t, std::int64_t>> lost = live_fills(drain, match_issued(drain, failed, true));
  unsettled_ops_ -= static_cast<std::int64_t>(drain.size());
  unsettled_.pop_front();
  return lost;
}

}  // namespace kvcm
