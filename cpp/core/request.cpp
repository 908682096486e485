// One request's life cycle (SPEC sec. 7): resume, suspend, resize, commit, close, the
// copy-on-write of its last block and the insertion of its blocks into the tree (sec. 5).
// Python twin: kvcm/python_backend/request.py (Request).  Every shared effect goes
// through pool_ (block_pool.h).
#include "core/request.h"

#include <algorithm>
#include <cstring>
#include <unordered_set>

#include "core/manager_detail.h"

namespace kvcm {

using namespace detail;

// create's match and holds (SPEC sec. 6, 7).
// py: request.py Request.match_and_hold — SPEC sec. 7
std::int64_t Request::match_and_hold(std::span<const Tok> query, std::span<const Digest> query_keys,
                                     const SharedHits* hits) {
  // the match probes report; the shared tier's extension is taken only when longer (DECISIONS.md)
  RequestMatch match = pool_.match_with_hits(root, query, query_keys, hits);
  const std::int64_t m = match.m;
  std::vector<NodeId> path = match.extended ? insert_shared_blocks(query, query_keys, m, match) : std::move(match.path);
  tokens.assign(query.begin(), query.begin() + m);
  // tokens holds its own digest references (the caller's keep theirs; sec. 15)
  if (has_digests) pool_.tree().retain_all(tokens);
  capacity = m;
  history = m;
  blocks = path;
  for (NodeId nid : path) pool_.tree().ref(nid);
  pages.assign(pool_.cfg().lcs.size(), {});
  for (std::int64_t lc : pool_.attn_lcs()) pages[static_cast<std::size_t>(lc)].assign(path.size(), -1);
  for (std::int64_t lc : pool_.attn_lcs()) {
    const auto [lo, hi] = pool_.stale_range(lc, m);
    for (std::size_t j = 0; j < path.size(); ++j) {
      const auto jj = static_cast<std::int64_t>(j);
      if (lo <= jj && jj < hi) continue;
      Page* p = &pool_.page(pool_.tree().page(path[j], lc));
      pool_.use(p, false, priority);
      pages[static_cast<std::size_t>(lc)][j] = p->handle;
    }
  }
  live = snap = -1;
  if (pool_.ssm_lc() >= 0 && m > 0) {
    Page* s = &pool_.page(pool_.tree().page(path.back(), pool_.ssm_lc()));
    snap = s->handle;
    pool_.use(s, false, priority);
  }
  cow_block = m % pool_.B() ? m / pool_.B() : -1;
  return m;
}

// DECISIONS.md "The shared tier": the extension's blocks below ceil(m / B) enter the tree at
// once, with a shared page for exactly the pages the request will hold (attention pages of
// blocks non-stale at m, the ssm snapshot of the block m ends in).
// py: request.py Request.insert_shared_blocks — SPEC sec. 16
std::vector<NodeId> Request::insert_shared_blocks(std::span<const Tok> query,
                                                  std::span<const Digest> query_keys, std::int64_t m,
                                                  const RequestMatch& sm) {
  const std::int64_t nb = ceildiv(m, pool_.B());
  const auto np = static_cast<std::int64_t>(sm.path.size());
  std::vector<NodeId> path(sm.path.begin(), sm.path.begin() + std::min(nb, np));
  NodeId parent = path.empty() ? root : path.back();
  const auto nlc = static_cast<std::int64_t>(pool_.cfg().lcs.size());
  for (std::int64_t i = np; i < nb; ++i) {
    const std::vector<std::int64_t>& row = sm.rows[static_cast<std::size_t>(i - np)];
    const NodeId nid = pool_.new_block(query_keys[static_cast<std::size_t>(i)],
                                 query.subspan(static_cast<std::size_t>(i * pool_.B()), static_cast<std::size_t>(pool_.B())), i);
    for (std::int64_t lc = 0; lc < nlc; ++lc) {
      bool held;
      if (pool_.cfg().lcs[static_cast<std::size_t>(lc)].ssm) {
        held = i == nb - 1;
      } else {
        const auto [lo, hi] = pool_.stale_range(lc, m);
        held = !(lo <= i && i < hi);
      }
      if (!held) continue;
      if (row[static_cast<std::size_t>(lc)] != pool_.B()) {
        throw InternalErr("kvcm bug: the fixed point kept a block without its page");
      }
      Page* p = pool_.new_shared_page(lc, priority, i);
      pool_.tree().set_page(nid, lc, p->handle, pool_.B());
      p->node = static_cast<std::int32_t>(nid);
    }
    attach(parent, nid);
    path.push_back(nid);
    parent = nid;
  }
  return path;
}

// DECISIONS.md "Failed copies".
// py: request.py Request.rollback_point — SPEC sec. 15
std::optional<std::int64_t> Request::rollback_point(const std::vector<std::int64_t>& lost) const {
  auto is_lost = [&lost](std::int64_t h) { return h >= 0 && std::find(lost.begin(), lost.end(), h) != lost.end(); };
  std::optional<std::int64_t> point;
  for (std::int64_t lc : pool_.attn_lcs()) {
    const auto& v = pages[static_cast<std::size_t>(lc)];
    for (std::size_t i = 0; i < v.size(); ++i) {
      if (is_lost(v[i])) {
        const std::int64_t at = static_cast<std::int64_t>(i) * pool_.B();
        point = point ? std::min(*point, at) : at;
        break;
      }
    }
  }
  const auto ncommitted = static_cast<std::int64_t>(tokens.size());
  if ((is_lost(snap) || is_lost(live)) && !point) point = ncommitted;
  if (point) point = std::min(*point, ncommitted);
  return point;
}

// Release everything, then match the
// committed tokens before `point` again and hold them as a SUSPENDED request.
// Everything a request uses, let go (close, and the roll-back of forget_copies): its page
// users, the live state, the matched snapshot and its block references.
// py: request.py Request.release_all — SPEC sec. 7
void Request::release_all() {
  const bool active = status == ReqStatus::active;
  for (Page* p : used_pages()) pool_.unuse(p, active);
  live = snap = -1;
  for (auto& v : pages) v.clear();
  for (NodeId nid : blocks) {
    if (nid != kNoNode) pool_.tree().unref(nid);
  }
  blocks.clear();
}

// py: request.py Request.roll_back — SPEC sec. 15
void Request::roll_back(std::int64_t point) {
  release_all();
  status = ReqStatus::suspended;
  stopped = false;
  // the old tokens' digest references are released only after the re-match took its own
  // (a digest only they reference must not be freed while its code is still in use)
  const std::vector<Tok> old = std::move(tokens);
  const std::vector<Tok> kept(old.begin(), old.begin() + point);
  const std::vector<Digest> kept_keys =
      pool_.chain(root_key, std::span<const Tok>(kept.data(), static_cast<std::size_t>(point / pool_.B() * pool_.B())));
  match_and_hold(kept, kept_keys);
  if (has_digests) pool_.tree().release_all(old);
}

// py: request.py Request.require — SPEC sec. 10
void Request::require(ReqStatus s, const char* what) const {
  if (status != s) {
    throw InvalidStateErr(std::string(what) + "() needs a " + status_name(s) + " cache, this one is " +
                          status_name(status));
  }
}

// py: request.py Request.committed_tokens — SPEC sec. 7
std::vector<TokenOut> Request::committed_tokens() const { return pool_.decode_all(tokens); }

std::int64_t Request::page_at(std::int64_t lc, std::int64_t i) const {
  const auto& v = pages[static_cast<std::size_t>(lc)];
  return i < static_cast<std::int64_t>(v.size()) ? v[static_cast<std::size_t>(i)] : -1;
}

// py: request.py Request.used_pages — SPEC sec. 7
std::vector<Page*> Request::used_pages() {
  std::vector<Page*> out;
  for (std::int64_t lc : pool_.attn_lcs()) {
    for (std::int64_t s : pages[static_cast<std::size_t>(lc)]) {
      if (s >= 0) out.push_back(&pool_.page(s));
    }
  }
  if (snap >= 0) out.push_back(&pool_.page(snap));
  if (live >= 0) out.push_back(&pool_.page(live));
  return out;
}

// py: request.py Request.cow_sources — SPEC sec. 7
std::vector<Page*> Request::cow_sources() {
  std::vector<Page*> out;
  if (cow_block >= 0) {
    for (std::int64_t lc : pool_.attn_lcs()) {
      const std::int64_t s = page_at(lc, cow_block);
      if (s >= 0) out.push_back(&pool_.page(s));
    }
  }
  if (snap >= 0) out.push_back(&pool_.page(snap));
  return out;
}

// py: request.py Request.ensure_room — SPEC sec. 8
void Request::ensure_room(std::int64_t tier, std::int64_t lc) {
  if (!pool_.make_room(tier, lc)) throw InternalErr("kvcm bug: a feasibility check passed but eviction found no slot");
}

// py: request.py Request.alloc_private — SPEC sec. 7
Page* Request::alloc_private(std::int64_t lc, std::int64_t coverage, std::int64_t ordinal) {
  ensure_room(kGpu, lc);
  Page* p = pool_.new_page(kGpu, lc, coverage, priority, ordinal);
  pool_.use(p, status == ReqStatus::active, priority);
  return p;
}

// py: request.py Request.resume — SPEC sec. 7
bool Request::resume() {
  require(ReqStatus::suspended, "resume");
  const std::vector<Page*> used = used_pages();
  const std::vector<Page*> cows = cow_sources();
  const std::size_t nlc = pool_.cfg().lcs.size();
  std::vector<std::int64_t> need(nlc, 0), locked_after(nlc), held_gpu(nlc);
  for (std::size_t lc = 0; lc < nlc; ++lc) {
    locked_after[lc] = pool_.pool(0, lc).locked;
    held_gpu[lc] = pool_.pool(0, lc).held;
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
  if (pool_.ssm_lc() >= 0 && live < 0) {
    ++need[static_cast<std::size_t>(pool_.ssm_lc())];
    ++locked_after[static_cast<std::size_t>(pool_.ssm_lc())];
  }
  for (Page* p : cows) {
    if (p->lc != pool_.ssm_lc()) {
      ++need[static_cast<std::size_t>(p->lc)];
      ++locked_after[static_cast<std::size_t>(p->lc)];
    }
  }
  const double limit = pool_.cfg().max_util_for_resume;
  for (std::size_t lc = 0; lc < nlc; ++lc) {
    const Pool& pool = pool_.pool(0, lc);
    if (static_cast<double>(locked_after[lc]) > limit * static_cast<double>(pool.total)) return false;
    const std::int64_t adjust[3] = {pool.nfree(), held_gpu[lc], pool.droppable};
    if (!pool_.can_allocate(kGpu, static_cast<std::int64_t>(lc), need[lc], adjust)) return false;
  }

  pool_.tick();
  status = ReqStatus::active;
  for (Page* p : used) {
    if (p->tier == kGpu) pool_.set_active(p, true);
  }
  for (Page* p : used) {
    if (p->tier != kGpu) {
      ensure_room(kGpu, p->lc);
      pool_.move(p, kGpu, "onboard");
      pool_.set_active(p, true);
    }
  }
  if (pool_.ssm_lc() >= 0 && live < 0) {
    live = alloc_private(pool_.ssm_lc(), 0, static_cast<std::int64_t>(tokens.size()) / pool_.B())->handle;
  }
  if (cow_block >= 0 || snap >= 0) copy_on_write();
  return true;
}

// py: request.py Request.copy_on_write — SPEC sec. 7
void Request::copy_on_write() {
  const std::int64_t j = cow_block;
  if (j >= 0) {
    const std::int64_t covered = static_cast<std::int64_t>(tokens.size()) - j * pool_.B();
    for (std::int64_t lc : pool_.attn_lcs()) {
      const std::int64_t s = page_at(lc, j);
      if (s < 0) continue;
      Page* dst = alloc_private(lc, covered, j);
      Page* src = &pool_.page(s);
      pool_.copy(lc, src, dst, "cow");
      pool_.count(lc, kCows);
      pages[static_cast<std::size_t>(lc)][static_cast<std::size_t>(j)] = dst->handle;
      pool_.unuse(src, true);
    }
    pool_.tree().unref(blocks[static_cast<std::size_t>(j)]);
    blocks[static_cast<std::size_t>(j)] = kNoNode;
    cow_block = -1;
  }
  if (snap >= 0) {
    Page* snap_page = &pool_.page(snap);
    pool_.copy(pool_.ssm_lc(), snap_page, &pool_.page(live), "cow");
    pool_.count(pool_.ssm_lc(), kCows);
    pool_.unuse(snap_page, true);
    snap = -1;
  }
}

// py: request.py Request.suspend — SPEC sec. 7
void Request::suspend() {
  require(ReqStatus::active, "suspend");
  pool_.tick();
  for (Page* p : used_pages()) pool_.set_active(p, false);
  status = ReqStatus::suspended;
}

// py: request.py Request.resize — SPEC sec. 7
bool Request::resize(std::int64_t new_capacity, std::optional<std::int64_t> history_arg) {
  const std::int64_t new_history = history_arg ? *history_arg : history;
  check_resize(new_capacity, new_history);
  return resize_checked(new_capacity, new_history);
}

// py: request.py Request.check_resize — SPEC sec. 7
void Request::check_resize(std::int64_t new_capacity, std::int64_t new_history) const {
  require(ReqStatus::active, "resize");
  const auto ncommitted = static_cast<std::int64_t>(tokens.size());
  if (new_capacity < ncommitted) {
    throw ValueErr("capacity " + std::to_string(new_capacity) + " is below the " + std::to_string(ncommitted) +
                   " committed tokens");
  }
  if (new_history < history) {
    throw ValueErr("history_length " + std::to_string(new_history) + " is below the current history " +
                   std::to_string(history));
  }
  if (new_history > new_capacity) {
    throw ValueErr("capacity " + std::to_string(new_capacity) + " is below history_length " + std::to_string(new_history));
  }
}

// resize: out of pages -> False.
// py: request.py Request.could_hold — SPEC sec. 7
bool Request::could_hold(std::int64_t nb, std::int64_t new_history) const {
  if (pool_.attn_lcs().empty()) return true;
  if (nb > kMaxRequestBlocks) return false;
  for (std::int64_t lc : pool_.attn_lcs()) {
    const auto [lo, hi] = pool_.stale_range(lc, new_history);
    const std::int64_t stale = std::max<std::int64_t>(0, std::min(hi, nb) - std::min(lo, nb));
    if (nb - stale > pool_.pool(0, static_cast<std::size_t>(lc)).total) return false;
  }
  return true;
}

// DECISIONS "All-or-nothing".
// py: request.py Request.resize_checked — SPEC sec. 7
bool Request::resize_checked(std::int64_t new_capacity, std::int64_t new_history) {
  const std::int64_t nb = ceildiv(new_capacity, pool_.B());
  // forks (DECISIONS.md "Forks"): room to write into a shared partial page copies it first
  const TailPages cows =
      new_capacity > static_cast<std::int64_t>(tokens.size()) ? shared_tail(new_history) : TailPages{};
  if (!could_hold(nb, new_history)) return false;
  // (lc, block) pairs; members so a decode step's resize does not allocate
  std::vector<std::pair<std::int64_t, std::int64_t>>& releases = pool_.scratch().releases;
  std::vector<std::pair<std::int64_t, std::int64_t>>& allocs = pool_.scratch().allocs;
  releases.clear();
  allocs.clear();
  // Only the ordinals whose page changes are visited, so a decode step costs the same on
  // any length: below the table's end n a block has a page exactly when it is not stale
  // at the current history (check_invariants checks it), so pages are released where
  // blocks become stale ([old_hi, hi)) or fall beyond the capacity (>= nb), and allocated
  // past n outside the new stale range.  Ascending per lc, as a scan.
  for (std::int64_t lc : pool_.attn_lcs()) {
    const auto [lo, hi] = pool_.stale_range(lc, new_history);
    const std::int64_t old_hi = pool_.stale_range(lc, history).second;
    const auto& table = pages[static_cast<std::size_t>(lc)];
    const auto n = static_cast<std::int64_t>(table.size());
    const auto visit_release = [&](std::int64_t from, std::int64_t to) {
      for (std::int64_t i = from; i < to; ++i) {
        if (table[static_cast<std::size_t>(i)] >= 0) releases.emplace_back(lc, i);
      }
    };
    visit_release(nb, std::min(lo, n));
    visit_release(old_hi, std::min(hi, n));
    visit_release(std::max({old_hi, nb, std::min(hi, n)}), n);
    for (std::int64_t i = n; i < std::min(lo, nb); ++i) allocs.emplace_back(lc, i);
    for (std::int64_t i = std::max(hi, n); i < nb; ++i) allocs.emplace_back(lc, i);
  }
  for (std::int64_t lc : pool_.attn_lcs()) {
    std::int64_t n = 0;
    for (const auto& a : allocs) n += a.first == lc;
    for (const auto& a : cows) n += a.first == lc;
    if (!n) continue;
    const Pool& pool = pool_.pool(0, static_cast<std::size_t>(lc));
    std::int64_t adjust[3] = {pool.nfree(), pool.held, pool.droppable};
    for (const auto& [rlc, i] : releases) {
      if (rlc != lc) continue;
      const Page& p = pool_.page(page_at(rlc, i));
      if (p.locks != 1) continue;
      if (p.node == kNoNode || !pool_.tree().is_attached(p.node)) {
        adjust[0] += p.holds == 0 ? 1 : 0;
        adjust[1] += p.holds ? 1 : 0;
      } else if (p.holds) {
        adjust[1] += 1;
      } else {
        adjust[2] += 1;
      }
    }
    if (!pool_.can_allocate(kGpu, lc, n, adjust)) return false;
  }

  pool_.tick();
  capacity = new_capacity;
  history = new_history;
  for (const auto& [lc, i] : releases) {
    Page* p = &pool_.page(page_at(lc, i));
    pages[static_cast<std::size_t>(lc)][static_cast<std::size_t>(i)] = -1;
    pool_.unuse(p, true);
  }
  for (std::int64_t lc : pool_.attn_lcs()) pages[static_cast<std::size_t>(lc)].resize(static_cast<std::size_t>(nb), -1);
  copy_tail(cows);
  for (const auto& [lc, i] : allocs) {
    const std::int64_t s = alloc_private(lc, 0, i)->handle;
    pages[static_cast<std::size_t>(lc)][static_cast<std::size_t>(i)] = s;
  }
  return true;
}

// py: request.py Request.commit — SPEC sec. 7
void Request::commit(TokenSeq tokens_in) {
  check_commit(static_cast<std::int64_t>(tokens_in.size()));
  commit_checked(tokens_in);
}

// The prompt handed over once (DECISIONS.md "commit_input"): the next n codes of the
// request's input tokens are appended as they are (already in the manager's code space; no
// second token list to parse or intern), then commit's work.
// py: request.py Request.commit_input — SPEC sec. 7
void Request::commit_input(std::optional<std::int64_t> n_arg) {
  const auto nc = static_cast<std::int64_t>(tokens.size());
  const auto nin = static_cast<std::int64_t>(input_tokens.size());
  const std::int64_t avail = std::max<std::int64_t>(0, nin - nc);
  const std::int64_t n = n_arg ? *n_arg : avail;
  check_commit(n, "commit_input");
  if (n > avail) {
    throw ValueErr("commit_input of " + std::to_string(n) + " tokens exceeds the input (" + std::to_string(nin) +
                   " input tokens, " + std::to_string(nc) + " committed)");
  }
  if (n == 0) return;
  const auto from = input_tokens.begin() + nc;
  tokens.insert(tokens.end(), from, from + n);
  // tokens holds its own digest references (sec. 15), as after intern_into
  if (has_digests) pool_.tree().retain_all(std::span<const Tok>(tokens).subspan(static_cast<std::size_t>(nc)));
  commit_appended(nc);
}

// py: request.py Request.check_commit — SPEC sec. 7
void Request::check_commit(std::int64_t nnew, const char* what) const {
  require(ReqStatus::active, what);
  if (stopped) throw InvalidStateErr("commit after stop_committing()");
  const auto ncommitted = static_cast<std::int64_t>(tokens.size());
  if (ncommitted + nnew > capacity) {
    throw ValueErr("commit of " + std::to_string(nnew) + " tokens exceeds capacity " + std::to_string(capacity) +
                   " (" + std::to_string(ncommitted) + " committed)");
  }
}

// py: request.py Request.commit_checked — SPEC sec. 7
void Request::commit_checked(TokenSeq tokens_in) {
  if (tokens_in.empty()) return;
  const auto ncommitted = static_cast<std::int64_t>(tokens.size());
  try {
    pool_.intern_into(tokens_in, tokens);
    has_digests = has_digests || !tokens_in.digests.empty();
  } catch (...) {
    tokens.resize(static_cast<std::size_t>(ncommitted));  // nothing changed
    throw;
  }
  commit_appended(ncommitted);
}

// commit's work once its tokens are appended to `tokens` (the first `old` were there before).
void Request::commit_appended(std::int64_t old) {
  pool_.tick();
  const std::int64_t old_history = history;
  const auto now = static_cast<std::int64_t>(tokens.size());
  history = std::max(history, now);
  for (std::int64_t lc : pool_.attn_lcs()) {
    for (std::int64_t i = old / pool_.B(); i < ceildiv(now, pool_.B()); ++i) {
      const std::int64_t s = page_at(lc, i);
      if (s < 0) continue;
      Page& p = pool_.page(s);
      if (p.node == kNoNode) p.coverage = static_cast<std::int16_t>(std::min(pool_.B(), now - i * pool_.B()));
    }
  }
  const std::int64_t last = now / pool_.B() - 1;
  for (std::int64_t i = old / pool_.B(); i <= last; ++i) {
    // the next block's child-table line (its key was hashed at create), loaded meanwhile
    if (i < last && i + 1 < static_cast<std::int64_t>(keys.size())) pool_.tree().prefetch_child(keys[static_cast<std::size_t>(i + 1)]);
    const bool snapshot = pool_.ssm_lc() >= 0 && i == last && now % pool_.B() == 0;
    // `tokens` does not change during insert_block, so a view of it is safe
    const std::span<const Tok> block(tokens.data() + i * pool_.B(), static_cast<std::size_t>(pool_.B()));
    insert_block(i, block, snapshot, /*defer_prune=*/i < last);
  }
  release_stale(old_history, old / pool_.B());
}

// DECISIONS "Tree and events" (stale pages
// released at the end of the commit).  Ordinals stale at old_history hold no page already,
// except those this commit wrote ([first_block, written)): only those and the newly stale
// ones ([old_hi, hi)) are visited, ascending, so a commit's cost does not grow with the
// request's history.
// py: request.py Request.release_stale — SPEC sec. 7
void Request::release_stale(std::int64_t old_history, std::int64_t first_block) {
  const bool active = status == ReqStatus::active;
  const std::int64_t B = pool_.B();
  const std::int64_t written = (static_cast<std::int64_t>(tokens.size()) + B - 1) / B;
  for (std::int64_t lc : pool_.attn_lcs()) {
    const auto [lo, hi] = pool_.stale_range(lc, history);
    auto& table = pages[static_cast<std::size_t>(lc)];
    const std::int64_t end = std::min(hi, static_cast<std::int64_t>(table.size()));
    const auto release = [&](std::int64_t from, std::int64_t to) {
      for (std::int64_t i = from; i < to; ++i) {
        const std::int64_t s = table[static_cast<std::size_t>(i)];
        if (s >= 0) {
          table[static_cast<std::size_t>(i)] = -1;
          pool_.unuse(&pool_.page(s), active);
        }
      }
    };
    // the union of [a1, b1) and [a2, b2), ascending, each ordinal once
    std::int64_t a1 = std::max(lo, first_block), b1 = std::min(written, end);
    std::int64_t a2 = std::max(lo, pool_.stale_range(lc, old_history).second), b2 = end;
    if (a1 >= b1) {
      release(a2, b2);
    } else if (a2 >= b2) {
      release(a1, b1);
    } else {
      if (a1 > a2) {
        std::swap(a1, a2);
        std::swap(b1, b2);
      }
      if (a2 <= b1) {
        release(a1, std::max(b1, b2));
      } else {
        release(a1, b1);
        release(a2, b2);
      }
    }
  }
}

// py: request.py Request.stop_committing — SPEC sec. 7
void Request::stop_committing() {
  if (stopped) return;
  pool_.tick();
  stop();
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

// py: request.py Request.close — SPEC sec. 7
ClosedTokens Request::close() {
  ClosedTokens out;
  pool_.tick();
  if (!stopped) stop();
  release_all();
  pool_.tree().unref(root);  // may release an unused scope root
  status = ReqStatus::closed;
  out.closed_now = true;
  out.capacity = capacity;
  out.history = history;
  out.num_committed = static_cast<std::int64_t>(tokens.size());
  out.reused = reused;
  out.priority = priority;
  out.codes = std::move(tokens);
  // the request's digest references (ClosedTokens carries its own copies of the bytes)
  if (has_digests) {
    for (Tok c : out.codes) {
      if (!(c & kDigestCode)) continue;
      bool seen = false;
      for (const auto& [code, d] : out.digests) seen = seen || code == c;
      if (!seen) out.digests.emplace_back(c, pool_.tree().digest(c));
    }
    pool_.tree().release_all(out.codes);
    pool_.tree().release_all(input_tokens);
  }
  return out;
}

// ------------------------------------------------------------------ forks (issue 22)

// DECISIONS.md "Forks (issue 22)".
// py: request.py Request.fork — SPEC sec. 18
bool Request::fork(Request& child) {
  require(ReqStatus::active, "fork");
  const auto c = static_cast<std::int64_t>(tokens.size());
  if (history != c) {
    throw InvalidStateErr("fork() needs history_length == num_committed_tokens, this cache has history_length " +
                          std::to_string(history) + " and " + std::to_string(c) + " committed tokens");
  }
  // the partial block is copied at once when the parent may already be writing into it
  const TailPages copies = capacity > c ? tail_pages() : TailPages{};
  for (std::int64_t lc = 0; lc < static_cast<std::int64_t>(pool_.num_life_cycles()); ++lc) {
    std::int64_t need = lc == pool_.ssm_lc() ? 1 : 0;
    for (const auto& [clc, h] : copies) need += clc == lc;
    if (need && !pool_.can_allocate(kGpu, lc, need, nullptr)) return false;
  }

  pool_.tick();
  child.init_fork(*this);
  if (pool_.ssm_lc() >= 0) {  // its own live state, a copy of the parent's
    child.live = child.alloc_private(pool_.ssm_lc(), 0, c / pool_.B())->handle;
    pool_.copy(pool_.ssm_lc(), &pool_.page(live), &pool_.page(child.live), "cow");
    pool_.count(pool_.ssm_lc(), kCows);
  }
  child.copy_tail(copies);
  return true;
}

// py: request.py Request.init_fork — SPEC sec. 18
void Request::init_fork(const Request& parent) {
  root_key = parent.root_key;
  root = parent.root;
  pool_.tree().ref(root);
  lora = parent.lora;
  salt = parent.salt;
  priority = parent.priority;
  status = ReqStatus::active;
  stopped = false;
  input_tokens = parent.input_tokens;
  keys = parent.keys;
  tokens = parent.tokens;
  has_digests = parent.has_digests;
  if (has_digests) {  // its own digest references (released at its close)
    pool_.tree().retain_all(input_tokens);
    pool_.tree().retain_all(tokens);
  }
  capacity = history = static_cast<std::int64_t>(tokens.size());
  reused = parent.reused;
  const auto nb = static_cast<std::size_t>(ceildiv(capacity, pool_.B()));
  blocks.assign(parent.blocks.begin(), parent.blocks.begin() + std::min(nb, parent.blocks.size()));
  for (NodeId nid : blocks) {
    if (nid != kNoNode) pool_.tree().ref(nid);
  }
  pages.assign(pool_.cfg().lcs.size(), {});
  for (std::int64_t lc : pool_.attn_lcs()) {
    const auto& from = parent.pages[static_cast<std::size_t>(lc)];
    auto& table = pages[static_cast<std::size_t>(lc)];
    table.assign(from.begin(), from.begin() + std::min(nb, from.size()));
    for (std::int64_t h : table) {
      if (h >= 0) pool_.use(&pool_.page(h), true, priority);
    }
  }
  live = snap = -1;
  cow_block = -1;
}

// py: request.py Request.tail_pages — SPEC sec. 18
Request::TailPages Request::tail_pages() const {
  TailPages out;
  const auto n = static_cast<std::int64_t>(tokens.size());
  if (n % pool_.B() == 0) return out;
  for (std::int64_t lc : pool_.attn_lcs()) {
    const std::int64_t h = page_at(lc, n / pool_.B());
    if (h >= 0) out.emplace_back(lc, h);
  }
  return out;
}

// py: request.py Request.shared_tail — SPEC sec. 18
Request::TailPages Request::shared_tail(std::int64_t new_history) const {
  TailPages out;
  if (stopped) return out;  // it never writes again
  const std::int64_t j = static_cast<std::int64_t>(tokens.size()) / pool_.B();
  for (const auto& [lc, h] : tail_pages()) {
    const auto [lo, hi] = pool_.stale_range(lc, new_history);
    const Page& p = pool_.page(h);
    if (!(lo <= j && j < hi) && (p.node != kNoNode || p.locks + p.holds > 1)) out.emplace_back(lc, h);
  }
  return out;
}

// py: request.py Request.copy_tail — SPEC sec. 18
void Request::copy_tail(const TailPages& shared) {
  if (shared.empty()) return;
  const std::int64_t j = static_cast<std::int64_t>(tokens.size()) / pool_.B();
  const std::int64_t covered = static_cast<std::int64_t>(tokens.size()) - j * pool_.B();
  for (const auto& [lc, h] : shared) {
    Page* dst = alloc_private(lc, covered, j);
    Page* src = &pool_.page(h);
    pool_.copy(lc, src, dst, "cow");
    pool_.count(lc, kCows);
    pool_.unuse(src, status == ReqStatus::active);
    pages[static_cast<std::size_t>(lc)][static_cast<std::size_t>(j)] = dst->handle;
  }
  if (j < static_cast<std::int64_t>(blocks.size()) && blocks[static_cast<std::size_t>(j)] != kNoNode) {
    pool_.tree().unref(blocks[static_cast<std::size_t>(j)]);
    blocks[static_cast<std::size_t>(j)] = kNoNode;
  }
}

// py: request.py Request.page_indices — SPEC sec. 7
std::vector<std::int32_t> Request::page_indices(std::int64_t lc) {
  require(ReqStatus::active, "page_indices");
  std::vector<std::int32_t> out;
  if (lc == pool_.ssm_lc()) {
    out.push_back(static_cast<std::int32_t>(pool_.page(live).slot));
    return out;
  }
  const std::int64_t nb = ceildiv(capacity, pool_.B());
  out.reserve(static_cast<std::size_t>(nb));
  for (std::int64_t i = 0; i < nb; ++i) {
    const std::int64_t s = page_at(lc, i);
    out.push_back(s >= 0 ? static_cast<std::int32_t>(pool_.page(s).slot) : -1);
  }
  return out;
}

// py: request.py Request.key_for — SPEC sec. 3
Digest Request::key_for(std::int64_t i, std::span<const Tok> block) {
  const Digest parent = i > 0 ? pool_.tree().key(blocks[static_cast<std::size_t>(i - 1)]) : root_key;
  if (static_cast<std::int64_t>(block.size()) == pool_.B() && i < static_cast<std::int64_t>(keys.size()) &&
      (i == 0 || keys[static_cast<std::size_t>(i - 1)] == parent) &&
      static_cast<std::int64_t>(input_tokens.size()) >= (i + 1) * pool_.B() &&
      std::equal(block.begin(), block.end(), input_tokens.begin() + i * pool_.B())) {
    return keys[static_cast<std::size_t>(i)];  // same parent key and block: the hash done at create
  }
  return pool_.block_key_of(parent, block);
}

// py: request.py Request.parent_for — SPEC sec. 5
NodeId Request::parent_for(std::int64_t i) {
  if (i == 0) return root;
  if (pool_.tree().is_attached(blocks[static_cast<std::size_t>(i - 1)])) return blocks[static_cast<std::size_t>(i - 1)];
  std::int64_t k = i - 1;
  while (k >= 0 && !pool_.tree().is_attached(blocks[static_cast<std::size_t>(k)])) --k;
  NodeId parent = k < 0 ? root : blocks[static_cast<std::size_t>(k)];
  for (std::int64_t j = k + 1; j < i; ++j) {
    const NodeId orphan = blocks[static_cast<std::size_t>(j)];
    const NodeId existing = pool_.tree().find_existing(parent, pool_.tree().key(orphan), pool_.tree().tokens(orphan));
    if (existing != kNoNode) {
      switch_block(j, orphan, existing);
    } else {
      attach(parent, orphan);
    }
    parent = blocks[static_cast<std::size_t>(j)];
  }
  return parent;
}

// py: request.py Request.switch_block — SPEC sec. 5
void Request::switch_block(std::int64_t j, NodeId orphan, NodeId existing) {
  std::vector<std::int64_t> gained;
  for (std::int64_t lc : pool_.attn_lcs()) {
    const std::int64_t s = page_at(lc, j);
    if (s < 0) continue;
    Page* p = &pool_.page(s);
    if (p->node != orphan || pool_.tree().coverage(existing, lc) >= p->coverage) continue;
    install(existing, lc, p, gained);
  }
  pool_.tree().ref(existing);
  blocks[static_cast<std::size_t>(j)] = existing;
  pool_.tree().unref(orphan);
  pool_.emit_stored(existing, gained);
}

// py: request.py Request.install — SPEC sec. 5
void Request::install(NodeId nid, std::int64_t lc, Page* p, std::vector<std::int64_t>& gained) {
  if (p->node != kNoNode) {  // moving from an orphan block
    const NodeId old_node = p->node;
    p->node = kNoNode;
    pool_.tree().set_page(old_node, lc, kNoPage, 0);
  }
  const PageHandle old = pool_.tree().set_page(nid, lc, p->handle, p->coverage);
  if (p->locks || p->holds) {
    p->node = static_cast<std::int32_t>(nid);  // a used page: its state does not depend on the node
  } else {
    pool_.restate(*p, [&] { p->node = static_cast<std::int32_t>(nid); });
  }
  if (old == kNoPage) {
    gained.push_back(lc);
    return;
  }
  Page* q = &pool_.page(old);
  pool_.restate(*q, [&] { q->node = kNoNode; });
  pool_.emit_removed(pool_.tree().key(nid), lc);  // a coverage upgrade: removed now, stored by the caller
  gained.push_back(lc);
  if (q->locks == 0 && q->holds == 0) pool_.free_page(q);
}

// py: request.py Request.attach — SPEC sec. 5
void Request::attach(NodeId parent, NodeId nid) {
  const std::vector<NodeId> siblings = pool_.tree().attach(parent, nid);
  const auto nlc = static_cast<std::int64_t>(pool_.cfg().lcs.size());
  std::vector<std::int64_t>& lcs = pool_.scratch().lcs;
  if (siblings.empty()) {  // the common case: nothing stepped aside
    lcs.clear();
    for (std::int64_t lc = 0; lc < nlc; ++lc) {
      const PageHandle h = pool_.tree().page(nid, lc);
      if (h == kNoPage) continue;
      pool_.page(h).node = static_cast<std::int32_t>(nid);
      lcs.push_back(lc);
    }
    pool_.emit_stored(nid, lcs);
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
      const PageHandle h = pool_.tree().page(siblings[k], lc);
      if (h != kNoPage && pool_.page(h).node == siblings[k]) had[k].push_back(lc);
    }
  }
  for (std::int64_t lc = 0; lc < nlc; ++lc) {
    const PageHandle h = pool_.tree().page(nid, lc);
    if (h == kNoPage) continue;
    const std::int64_t k = sib_index(pool_.page(h).node);
    if (k >= 0) {
      auto& v = had[static_cast<std::size_t>(k)];
      if (std::find(v.begin(), v.end(), lc) == v.end()) v.push_back(lc);
    }
  }
  for (std::size_t k = 0; k < siblings.size(); ++k) {
    std::vector<std::int64_t> lost = had[k];
    std::sort(lost.begin(), lost.end());
    const Digest key = pool_.tree().key(siblings[k]);
    for (std::int64_t lc : lost) pool_.emit_removed(key, lc);
  }
  for (std::int64_t lc = 0; lc < nlc; ++lc) {
    const PageHandle h = pool_.tree().page(nid, lc);
    if (h != kNoPage) pool_.page(h).node = static_cast<std::int32_t>(nid);
    for (NodeId sid : siblings) {
      const PageHandle hs = pool_.tree().page(sid, lc);
      if (hs != kNoPage) pool_.page(hs).node = static_cast<std::int32_t>(sid);
    }
  }
  pool_.retire_nodes(siblings, false);
  lcs.clear();
  for (std::int64_t lc = 0; lc < nlc; ++lc) {
    if (pool_.tree().page(nid, lc) != kNoPage) lcs.push_back(lc);
  }
  pool_.emit_stored(nid, lcs);
}

// Also SPEC sec. 7.  defer_prune: more blocks of this commit
// follow, so a pageless new block leaves its parent chain attached (no quadratic re-attach).
// py: request.py Request.insert_block — SPEC sec. 5
void Request::insert_block(std::int64_t i, std::span<const Tok> block, bool want_snapshot,
                           bool defer_prune) {
  const auto ntok = static_cast<std::int64_t>(block.size());
  const Digest key = key_for(i, block);
  NodeId parent = parent_for(i);
  NodeId existing = pool_.tree().find_existing(parent, key, block);
  Page* snap_page = nullptr;
  const std::int64_t ssm = pool_.ssm_lc();
  // shared_write="commit": a full-coverage page of a full block that becomes a tree page
  // here is written to the shared tier (DECISIONS.md "The shared tier")
  const bool do_store = pool_.store_on_commit() && ntok == pool_.B();
  if (want_snapshot && (existing == kNoNode || pool_.tree().coverage(existing, ssm) < ntok)) {
    Page* live_page = pool_.page_ptr(live);
    if (live_page == nullptr || live_page->tier != kGpu || !pool_.make_room(kGpu, ssm)) {
      pool_.count(ssm, kSnapshotsSkipped);
    } else {
      snap_page = pool_.new_page(kGpu, ssm, ntok, priority, i);
      pool_.copy(ssm, &pool_.page(live), snap_page, "snapshot");
      pool_.count(ssm, kSnapshotsTaken);
      if (do_store) pool_.store(snap_page, key);
      // eviction may have pruned this request's chain or the existing block
      parent = parent_for(i);
      existing = pool_.tree().find_existing(parent, key, block);
    }
  }
  const bool active = status == ReqStatus::active;
  if (existing == kNoNode) {
    const NodeId nid = pool_.new_block(key, block, i);
    for (std::int64_t lc : pool_.attn_lcs()) {
      const std::int64_t s = page_at(lc, i);
      if (s < 0) continue;
      Page& p = pool_.page(s);
      // forks: a shared partial page another user's stop_committing put into a block that
      // was detached since (so not found): it moves here (DECISIONS.md "Forks", the tail
      // block of a stop)
      if (p.node != kNoNode) pool_.unlink_from_node(&p);
      p.coverage = static_cast<std::int16_t>(ntok);
      pool_.tree().set_page(nid, lc, p.handle, ntok);
      p.node = static_cast<std::int32_t>(nid);  // a used page: its state does not depend on the node
      if (do_store) pool_.store(&p, key);
    }
    if (snap_page != nullptr) {
      pool_.tree().set_page(nid, ssm, snap_page->handle, ntok);
      pool_.restate(*snap_page, [&] { snap_page->node = static_cast<std::int32_t>(nid); });
    }
    pool_.tree().ref(nid);
    set_block(i, nid);
    if (pool_.tree().has_page(nid)) {
      attach(parent, nid);
    } else if (!defer_prune) {
      pool_.tree().prune_upward(parent);  // a re-attached chain must not stay childless
    }
    return;
  }
  std::vector<std::int64_t> gained;
  for (std::int64_t lc : pool_.attn_lcs()) {
    const std::int64_t s = page_at(lc, i);
    if (s < 0) continue;
    Page* p = &pool_.page(s);
    p->coverage = static_cast<std::int16_t>(ntok);
    const PageHandle qh = pool_.tree().page(existing, lc);
    if (qh == kNoPage || pool_.tree().coverage(existing, lc) < ntok) {
      install(existing, lc, p, gained);
      if (do_store) pool_.store(p, key);
    } else {
      Page* q = &pool_.page(qh);
      if (q->tier == kGpu) {  // switch to the tree's page; its index changes
        pool_.use(q, active, priority);
        pages[static_cast<std::size_t>(lc)][static_cast<std::size_t>(i)] = q->handle;
        pool_.unuse(p, active);
      }
      // else: keep our page privately (freed at close)
    }
  }
  if (snap_page != nullptr) install(existing, ssm, snap_page, gained);
  pool_.tree().ref(existing);
  set_block(i, existing);
  pool_.emit_stored(existing, gained);
}

// py: request.py Request.set_block — SPEC sec. 7
void Request::set_block(std::int64_t i, NodeId nid) {
  const auto ii = static_cast<std::size_t>(i);
  if (ii < blocks.size()) {
    if (blocks[ii] != kNoNode) pool_.tree().unref(blocks[ii]);
    blocks[ii] = nid;
  } else {
    blocks.resize(ii, kNoNode);
    blocks.push_back(nid);
  }
}

// py: request.py Request.stop — SPEC sec. 7
void Request::stop() {
  stopped = true;
  const auto n = static_cast<std::int64_t>(tokens.size());
  const std::int64_t tail = n % pool_.B();
  const std::int64_t i = n / pool_.B();
  if (!tail || !pool_.cfg().enable_partial_reuse || cow_block == i) return;
  const std::vector<Tok> block(tokens.begin() + i * pool_.B(), tokens.end());
  insert_block(i, block, pool_.ssm_lc() >= 0);
}

}  // namespace kvcm
