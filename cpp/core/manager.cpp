// The manager's facade (SPEC sec. 6, 8, 9, 15, 18): ids, the request registry and the
// manager-level calls; the shared state is the BlockPool's (block_pool.h), one request's the
// Request's (request.h).  Python twin: kvcm/python_backend/manager.py (PyKVCacheManager).
#include "core/manager.h"

#include <algorithm>
#include <cstring>
#include <utility>

#include "core/manager_detail.h"

namespace kvcm {

using namespace detail;

Manager::Manager(ManagerConfig cfg) : pool_(std::move(cfg)) {}

// py: manager.py PyKVCacheManager.create_kv_cache — SPEC sec. 7
std::int64_t Manager::create(TokenSeq tokens_in, std::optional<std::uint64_t> lora,
                             std::optional<std::uint64_t> salt, std::int64_t priority, const SharedHits* hits) {
  if (is_shutdown_) throw InvalidStateErr("the manager is shut down");
  std::vector<Tok> tokens;  // holds one reference per digest token (sec. 15)
  tokens.reserve(tokens_in.size());
  pool_.tokens().intern_into(tokens_in, tokens);
  pool_.tick();
  const std::int64_t serial = next_request_++;
  const auto n = static_cast<std::int64_t>(tokens.size());
  const Request& r = requests_
                         .try_emplace(serial, pool_, serial, std::move(tokens), lora, salt, priority,
                                      !tokens_in.digests.empty(), hits)
                         .first->second;
  const std::int64_t m = r.state().reused;
  pool_.outbox().record_match(n, m);
  return serial;
}

// DECISIONS.md "Failed copies".
// py: manager.py PyKVCacheManager.forget_copies — SPEC sec. 15
std::vector<std::int64_t> Manager::forget_copies(std::span<const CopyOpC> ops) {
  // the text of kvcm.checks.FORGET_IN_EXPLICIT
  if (explicit_settlement()) {
    throw ValueErr("forget_copies() is not used with copy_settlement='explicit': report the failed ops of each "
                   "drain with settle_copies(failed), oldest drain first");
  }
  const std::vector<std::pair<std::int64_t, std::int64_t>> lost = pool_.outbox().take_issued(ops);
  if (ops.empty()) return {};
  return roll_back_lost(lost);
}

// DECISIONS.md "Asynchronous copies: settle_copies".
// py: manager.py PyKVCacheManager.settle_copies — SPEC sec. 15
std::vector<std::int64_t> Manager::settle_copies(std::span<const CopyOpC> failed) {
  // the text of kvcm.checks.SETTLE_IN_DRAIN
  if (!explicit_settlement()) {
    throw ValueErr("settle_copies() needs KVCacheManagerConfig(copy_settlement='explicit'); with "
                   "copy_settlement='drain' report the failed ops of the last drain with forget_copies(ops)");
  }
  const std::vector<std::pair<std::int64_t, std::int64_t>> lost = pool_.outbox().settle_oldest(failed);
  if (failed.empty()) return {};
  return roll_back_lost(lost);
}

// py: manager.py PyKVCacheManager.roll_back_lost — SPEC sec. 15
std::vector<std::int64_t> Manager::roll_back_lost(const std::vector<std::pair<std::int64_t, std::int64_t>>& lost) {
  std::vector<std::int64_t> out;
  pool_.tick();
  std::vector<std::int64_t> lost_handles;
  for (const auto& [h, serial] : lost) lost_handles.push_back(h);
  // the requests that use a lost page, and where each rolls back to (before any change)
  std::vector<std::pair<std::int64_t, std::int64_t>> resets;  // (serial, point)
  for (std::int64_t serial : open_serials()) {
    if (auto point = requests_.at(serial).rollback_point(lost_handles)) resets.emplace_back(serial, *point);
  }
  // unlink the lost committed pages (SPEC sec. 5 pruning, removed events)
  pool_.index().forget_pages(lost);
  for (const auto& [serial, point] : resets) {
    requests_.at(serial).roll_back(point);
    out.push_back(serial);
  }
  return out;
}

// The match create would take now (BlockPool::match_with_hits) and the tiers of what the
// request would hold (BlockPool::block_tiers); no side effect at all.
// py: manager.py PyKVCacheManager.probe_reuse_detail — SPEC sec. 6
Manager::ProbeResult Manager::probe(TokenSeq tokens_in, std::optional<std::uint64_t> lora,
                                    std::optional<std::uint64_t> salt, const SharedHits* hits, bool with_tiers) {
  const Digest root_key = scope_root_key(lora, salt);
  const NodeId root = pool_.index().tree().find_root(root_key);  // a probe creates nothing (sec. 6, 15)
  if (tokens_in.empty() || (root == kNoNode && hits == nullptr)) return {};
  // Look the digests up without interning them: a probe has no side effect.
  std::vector<Tok> codes(tokens_in.codes.begin(), tokens_in.codes.end());
  if (!tokens_in.digests.empty()) {
    for (Tok& c : codes) {
      if (c & kDigestCode) c = pool_.index().tree().lookup(TokenArg{0, tokens_in.digests[c & ~kDigestCode].data()});
    }
  }
  const std::vector<Digest> keys = TokenTable::input_chain(root_key, tokens_in, pool_.layout().B());
  const RequestMatch match = pool_.index().match_with_hits(root, std::span<const Tok>(codes), keys, hits);
  return ProbeResult{match.m, match.m_before_ssm,
                     with_tiers ? pool_.index().block_tiers(match.path, match.m) : std::vector<std::int64_t>{}};
}

// DECISIONS.md "The shared tier".
// py: manager.py PyKVCacheManager.shared_candidates — SPEC sec. 16
std::vector<std::pair<Digest, std::int64_t>> Manager::shared_candidates(TokenSeq tokens_in,
                                                                        std::optional<std::uint64_t> lora,
                                                                        std::optional<std::uint64_t> salt) {
  std::vector<std::pair<Digest, std::int64_t>> out;
  if (!pool_.layout().cfg().shared) return out;
  const Digest root_key = scope_root_key(lora, salt);
  const std::vector<Digest> keys = TokenTable::input_chain(root_key, tokens_in, pool_.layout().B());
  const NodeId root = pool_.index().tree().find_root(root_key);  // creates nothing
  const std::size_t start = root == kNoNode ? 0 : pool_.index().tree().key_path(root, keys).size();
  const auto nlc = static_cast<std::int64_t>(pool_.layout().cfg().lcs.size());
  for (std::size_t i = start; i < keys.size(); ++i) {
    for (std::int64_t lc = 0; lc < nlc; ++lc) out.emplace_back(keys[i], lc);
  }
  return out;
}

// py: manager.py PyKVCacheManager.drain_copy_ops — SPEC sec. 8
std::vector<CopyOpC> Manager::drain_copy_ops() { return pool_.outbox().drain_copy_ops(); }

// py: manager.py PyKVCacheManager.take_events — SPEC sec. 9
TakenEvents Manager::take_events() { return pool_.outbox().take_events(); }

// DECISIONS "Shut-down manager".
// py: manager.py PyKVCacheManager.clear_reusable — SPEC sec. 8
void Manager::clear_reusable() {
  if (is_shutdown_) throw InvalidStateErr("the manager is shut down");
  pool_.tick();
  pool_.evictor().drop_all_droppable();
  pool_.outbox().new_event(EventKind::cleared);
}

// ------------------------------------------------ quotas at run time (issue 22)

// DECISIONS.md "Quotas at run time": every pool is checked before any changes.
// py: manager.py PyKVCacheManager.set_quota — SPEC sec. 18
std::vector<std::int64_t> Manager::set_quota(std::int64_t tier, std::int64_t quota_bytes,
                                             const std::vector<std::int64_t>& slots) {
  if (is_shutdown_) throw InvalidStateErr("the manager is shut down");
  const auto nlc = static_cast<std::int64_t>(pool_.layout().num_life_cycles());
  for (std::int64_t ilc = 0; ilc < nlc; ++ilc) {
    const auto lc = static_cast<std::size_t>(ilc);
    const Pool& pool = pool_.pages().pool(tier, ilc);
    const std::int64_t movable =
        tier < pool_.layout().num_tiers() - 1 ? std::min(pool.held, pool_.pages().capacity_of(tier + 1, ilc)) : 0;
    const std::int64_t need = pool.total - pool.nfree() - pool.droppable - movable;
    if (slots[lc] < need) return {ilc, slots[lc], need, pool.locked, pool.held - movable};
  }
  pool_.tick();
  for (std::int64_t lc = 0; lc < nlc; ++lc) pool_.resize_pool(tier, lc, slots[static_cast<std::size_t>(lc)]);
  pool_.set_quota_bytes(tier, quota_bytes);
  return {};
}

// py: manager.py PyKVCacheManager.shutdown — SPEC sec. 8
void Manager::shutdown() {
  if (!requests_.empty()) {
    throw InvalidStateErr("shutdown needs every cache closed; " + std::to_string(requests_.size()) + " still open");
  }
  if (is_shutdown_) return;
  pool_.tick();
  pool_.evictor().drop_all_droppable();
  is_shutdown_ = true;
}

// py: manager.py PyKVCacheManager.stats — SPEC sec. 9
std::string Manager::stats_json(bool take_iteration) {
  std::string o;
  pool_.stats_json(o, take_iteration);
  return o;
}

std::vector<std::pair<std::string, std::int64_t>> Manager::internal_sizes() const {
  return pool_.internal_sizes(static_cast<std::int64_t>(requests_.size()));
}

std::vector<std::int64_t> Manager::open_serials() const {
  std::vector<std::int64_t> out;
  out.reserve(requests_.size());
  for (const auto& [serial, r] : requests_) out.push_back(serial);
  std::sort(out.begin(), out.end());
  return out;
}

// ------------------------------------------------------------------ request calls (by serial)
// Each looks the open request up and runs its Request operation (request.cpp).

Request& Manager::req(std::int64_t serial) {
  auto it = requests_.find(serial);
  if (it == requests_.end()) throw ClosedErr("call on a closed cache");
  return it->second;
}

const Request& Manager::req(std::int64_t serial) const {
  auto it = requests_.find(serial);
  if (it == requests_.end()) throw ClosedErr("call on a closed cache");
  return it->second;
}

void Manager::require_status(std::int64_t serial, ReqStatus status, const char* what) const {
  auto it = requests_.find(serial);
  if (it == requests_.end()) throw ClosedErr(std::string(what) + "() on a closed cache");
  it->second.require(status, what);
}

RequestInfo Manager::info(std::int64_t serial) const {
  const RequestState& r = req(serial).state();
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

std::vector<TokenOut> Manager::committed_tokens(std::int64_t serial) const { return req(serial).committed_tokens(); }

bool Manager::resume(std::int64_t serial) { return req(serial).resume(); }

void Manager::suspend(std::int64_t serial) { req(serial).suspend(); }

bool Manager::resize(std::int64_t serial, std::int64_t capacity, std::optional<std::int64_t> history) {
  return req(serial).resize(capacity, history);
}

void Manager::commit(std::int64_t serial, TokenSeq tokens) {
  auto it = requests_.find(serial);
  if (it == requests_.end()) throw ClosedErr("commit() on a closed cache");
  it->second.commit(tokens);
}

void Manager::commit_input(std::int64_t serial, std::optional<std::int64_t> n) {
  auto it = requests_.find(serial);
  if (it == requests_.end()) throw ClosedErr("commit_input() on a closed cache");
  it->second.commit_input(n);
}

void Manager::stop_committing(std::int64_t serial) { req(serial).stop_committing(); }

// A closed request leaves the registry here (the Request does not remove itself).
ClosedTokens Manager::close(std::int64_t serial) {
  auto it = requests_.find(serial);
  if (it == requests_.end()) return ClosedTokens{};
  ClosedTokens out = it->second.close();
  requests_.erase(it);
  return out;
}

std::vector<std::int32_t> Manager::page_indices(std::int64_t serial, std::int64_t lc, std::int64_t start,
                                                std::int64_t stop) {
  return req(serial).page_indices(lc, start, stop);
}

// Fork registration (DECISIONS.md "Forks (issue 22)"): the child gets the next serial and
// joins the registry once Request::fork made it (the Request never touches the registry).
std::int64_t Manager::fork(std::int64_t serial) {
  Request& parent = req(serial);
  const std::int64_t child_serial = next_request_;
  Request child(pool_, child_serial);
  if (!parent.fork(child)) return -1;
  ++next_request_;
  requests_.emplace(child_serial, std::move(child));  // (unordered_map: `parent` stays valid)
  return child_serial;
}

}  // namespace kvcm
