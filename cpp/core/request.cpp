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

// create: the scope root (it lives at least as long as the request, sec. 15), the input's
// full-block keys (hashed once, reused by commit for the same tokens), the match held.
// py: request.py Request.__init__ — SPEC sec. 7
Request::Request(BlockPool& pool, std::int64_t serial_no, std::vector<Tok> input, std::optional<std::uint64_t> lora_id,
                 std::optional<std::uint64_t> salt_id, std::int64_t prio, bool digests, const SharedHits* hits)
    : Request(pool, serial_no) {
  lora = lora_id;
  salt = salt_id;
  priority = prio;
  root_key = scope_root_key(lora, salt);
  root = index_.open_scope(root_key);
  const auto nfull = static_cast<std::int64_t>(input.size()) / layout_.B();
  keys = tokens_.chain(root_key, std::span<const Tok>(input.data(), static_cast<std::size_t>(nfull * layout_.B())));
  has_digests = digests;
  input_tokens = std::move(input);
  reused = match_and_hold(input_tokens, keys, hits);
}

// create's match and holds (SPEC sec. 6, 7): the pool holds the match (hold_match).
// py: request.py Request.match_and_hold — SPEC sec. 7
std::int64_t Request::match_and_hold(std::span<const Tok> query, std::span<const Digest> query_keys,
                                     const SharedHits* hits) {
  HeldMatch held = index_.hold_match(root, query, query_keys, hits, priority);
  const std::int64_t m = held.m;
  tokens.assign(query.begin(), query.begin() + m);
  // tokens holds its own digest references (the caller's keep theirs; sec. 15)
  if (has_digests) tokens_.retain_tokens(tokens);
  capacity = m;
  history = m;
  blocks = std::move(held.blocks);
  pages = std::move(held.pages);
  live = -1;
  snap = held.snap;
  cow_block = m % layout_.B() ? m / layout_.B() : -1;
  return m;
}

// DECISIONS.md "Failed copies".
// py: request.py Request.rollback_point — SPEC sec. 15
std::optional<std::int64_t> Request::rollback_point(const std::vector<std::int64_t>& lost) const {
  auto is_lost = [&lost](std::int64_t h) { return h >= 0 && std::find(lost.begin(), lost.end(), h) != lost.end(); };
  std::optional<std::int64_t> point;
  for (std::int64_t lc : layout_.attn_lcs()) {
    const auto& v = pages[static_cast<std::size_t>(lc)];
    for (std::size_t i = 0; i < v.size(); ++i) {
      if (is_lost(v[i])) {
        const std::int64_t at = static_cast<std::int64_t>(i) * layout_.B();
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
  for (const Page* p : used_pages()) index_.release(p, active);
  live = snap = -1;
  for (auto& v : pages) v.clear();
  for (NodeId nid : blocks) {
    if (nid != kNoNode) index_.unref(nid);
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
      tokens_.chain(root_key, std::span<const Tok>(kept.data(), static_cast<std::size_t>(point / layout_.B() * layout_.B())));
  match_and_hold(kept, kept_keys);
  if (has_digests) tokens_.release_tokens(old);
}

// py: request.py Request.require — SPEC sec. 10
void Request::require(ReqStatus s, const char* what) const {
  if (status != s) {
    throw InvalidStateErr(std::string(what) + "() needs a " + status_name(s) + " cache, this one is " +
                          status_name(status));
  }
}

// py: request.py Request.committed_tokens — SPEC sec. 7
std::vector<TokenOut> Request::committed_tokens() const { return tokens_.decode_all(tokens); }

std::int64_t Request::page_at(std::int64_t lc, std::int64_t i) const {
  const auto& v = pages[static_cast<std::size_t>(lc)];
  return i < static_cast<std::int64_t>(v.size()) ? v[static_cast<std::size_t>(i)] : -1;
}

// py: request.py Request.used_pages — SPEC sec. 7
std::vector<const Page*> Request::used_pages() {
  std::vector<const Page*> out;
  for (std::int64_t lc : layout_.attn_lcs()) {
    for (std::int64_t s : pages[static_cast<std::size_t>(lc)]) {
      if (s >= 0) out.push_back(&pages_.page(s));
    }
  }
  if (snap >= 0) out.push_back(&pages_.page(snap));
  if (live >= 0) out.push_back(&pages_.page(live));
  return out;
}

// py: request.py Request.cow_sources — SPEC sec. 7
std::vector<const Page*> Request::cow_sources() {
  std::vector<const Page*> out;
  if (cow_block >= 0) {
    for (std::int64_t lc : layout_.attn_lcs()) {
      const std::int64_t s = page_at(lc, cow_block);
      if (s >= 0) out.push_back(&pages_.page(s));
    }
  }
  if (snap >= 0) out.push_back(&pages_.page(snap));
  return out;
}

// py: request.py Request.alloc_private — SPEC sec. 7
const Page* Request::alloc_private(std::int64_t lc, std::int64_t coverage, std::int64_t ordinal) {
  return pool_.alloc(lc, coverage, ordinal, priority, status == ReqStatus::active);
}

// py: request.py Request.resume — SPEC sec. 7
bool Request::resume() {
  require(ReqStatus::suspended, "resume");
  const std::vector<const Page*> used = used_pages();
  const std::vector<const Page*> cows = cow_sources();
  const std::size_t nlc = layout_.num_life_cycles();
  std::vector<Budget> budgets(nlc);
  std::vector<std::int64_t> need(nlc, 0), locked_after(nlc), held_gpu(nlc);
  for (std::size_t lc = 0; lc < nlc; ++lc) {
    budgets[lc] = pages_.budget(static_cast<std::int64_t>(lc));
    locked_after[lc] = budgets[lc].locked;
    held_gpu[lc] = budgets[lc].held;
  }
  for (const Page* p : used) {
    const auto lc = static_cast<std::size_t>(p->lc);
    if (p->tier != kGpu) {
      ++need[lc];
    } else if (p->locks == 0) {
      --held_gpu[lc];
    }
    if (p->locks == 0 && std::find(cows.begin(), cows.end(), p) == cows.end()) ++locked_after[lc];
  }
  if (layout_.ssm_lc() >= 0 && live < 0) {
    ++need[static_cast<std::size_t>(layout_.ssm_lc())];
    ++locked_after[static_cast<std::size_t>(layout_.ssm_lc())];
  }
  for (const Page* p : cows) {
    if (p->lc != layout_.ssm_lc()) {
      ++need[static_cast<std::size_t>(p->lc)];
      ++locked_after[static_cast<std::size_t>(p->lc)];
    }
  }
  const double limit = layout_.cfg().max_util_for_resume;
  for (std::size_t lc = 0; lc < nlc; ++lc) {
    Budget& b = budgets[lc];
    if (static_cast<double>(locked_after[lc]) > limit * static_cast<double>(b.total)) return false;
    b.held = held_gpu[lc];
    if (!b.fits(need[lc])) return false;
  }

  pool_.tick();
  status = ReqStatus::active;
  for (const Page* p : used) {
    if (p->tier == kGpu) pool_.set_active(p, true);
  }
  for (const Page* p : used) {
    if (p->tier != kGpu) pool_.set_active(p, true);  // onboarded first
  }
  if (layout_.ssm_lc() >= 0 && live < 0) {
    live = alloc_private(layout_.ssm_lc(), 0, static_cast<std::int64_t>(tokens.size()) / layout_.B())->handle;
  }
  if (cow_block >= 0 || snap >= 0) copy_on_write();
  return true;
}

// py: request.py Request.copy_on_write — SPEC sec. 7
void Request::copy_on_write() {
  const std::int64_t j = cow_block;
  if (j >= 0) {
    const std::int64_t covered = static_cast<std::int64_t>(tokens.size()) - j * layout_.B();
    for (std::int64_t lc : layout_.attn_lcs()) {
      const std::int64_t s = page_at(lc, j);
      if (s < 0) continue;
      const Page* dst = alloc_private(lc, covered, j);
      const Page* src = &pages_.page(s);
      outbox_.copy(lc, src, dst, "cow");
      pages[static_cast<std::size_t>(lc)][static_cast<std::size_t>(j)] = dst->handle;
      index_.release(src, true);
    }
    index_.unref(blocks[static_cast<std::size_t>(j)]);
    blocks[static_cast<std::size_t>(j)] = kNoNode;
    cow_block = -1;
  }
  if (snap >= 0) {
    const Page* snap_page = &pages_.page(snap);
    outbox_.copy(layout_.ssm_lc(), snap_page, &pages_.page(live), "cow");
    index_.release(snap_page, true);
    snap = -1;
  }
}

// py: request.py Request.suspend — SPEC sec. 7
void Request::suspend() {
  require(ReqStatus::active, "suspend");
  pool_.tick();
  for (const Page* p : used_pages()) pool_.set_active(p, false);
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
  if (layout_.attn_lcs().empty()) return true;
  if (nb > kMaxRequestBlocks) return false;
  for (std::int64_t lc : layout_.attn_lcs()) {
    const auto [lo, hi] = layout_.stale_range(lc, new_history);
    const std::int64_t stale = std::max<std::int64_t>(0, std::min(hi, nb) - std::min(lo, nb));
    if (nb - stale > pages_.budget(lc).total) return false;
  }
  return true;
}

// DECISIONS "All-or-nothing".
// py: request.py Request.resize_checked — SPEC sec. 7
bool Request::resize_checked(std::int64_t new_capacity, std::int64_t new_history) {
  const std::int64_t nb = ceildiv(new_capacity, layout_.B());
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
  for (std::int64_t lc : layout_.attn_lcs()) {
    const auto [lo, hi] = layout_.stale_range(lc, new_history);
    const std::int64_t old_hi = layout_.stale_range(lc, history).second;
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
  // feasibility from counters, with the releases applied (DECISIONS.md)
  std::vector<std::int64_t> released;
  bool released_known = false;
  for (std::int64_t lc : layout_.attn_lcs()) {
    std::int64_t n = 0;
    for (const auto& a : allocs) n += a.first == lc;
    for (const auto& a : cows) n += a.first == lc;
    if (!n) continue;
    if (!released_known) {
      for (const auto& [rlc, i] : releases) released.push_back(page_at(rlc, i));
      released_known = true;
    }
    if (!pages_.budget(lc, released).fits(n)) return false;
  }

  pool_.tick();
  capacity = new_capacity;
  history = new_history;
  for (const auto& [lc, i] : releases) {
    const Page* p = &pages_.page(page_at(lc, i));
    pages[static_cast<std::size_t>(lc)][static_cast<std::size_t>(i)] = -1;
    index_.release(p, true);
  }
  for (std::int64_t lc : layout_.attn_lcs()) pages[static_cast<std::size_t>(lc)].resize(static_cast<std::size_t>(nb), -1);
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
  if (has_digests) tokens_.retain_tokens(std::span<const Tok>(tokens).subspan(static_cast<std::size_t>(nc)));
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
    tokens_.intern_into(tokens_in, tokens);
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
  for (std::int64_t lc : layout_.attn_lcs()) {
    for (std::int64_t i = old / layout_.B(); i < ceildiv(now, layout_.B()); ++i) {
      const std::int64_t s = page_at(lc, i);
      if (s < 0) continue;
      const Page* p = &pages_.page(s);
      if (p->node == kNoNode) pages_.set_coverage(p, std::min(layout_.B(), now - i * layout_.B()));
    }
  }
  const std::int64_t last = now / layout_.B() - 1;
  for (std::int64_t i = old / layout_.B(); i <= last; ++i) {
    // the next block's child-table line (its key was hashed at create), loaded meanwhile
    if (i < last && i + 1 < static_cast<std::int64_t>(keys.size())) index_.tree().prefetch_child(keys[static_cast<std::size_t>(i + 1)]);
    const bool snapshot = layout_.ssm_lc() >= 0 && i == last && now % layout_.B() == 0;
    // `tokens` does not change during insert_block, so a view of it is safe
    const std::span<const Tok> block(tokens.data() + i * layout_.B(), static_cast<std::size_t>(layout_.B()));
    insert_block(i, block, snapshot, /*defer_prune=*/i < last);
  }
  release_stale(old_history, old / layout_.B());
}

// DECISIONS "Tree and events" (stale pages
// released at the end of the commit).  Ordinals stale at old_history hold no page already,
// except those this commit wrote ([first_block, written)): only those and the newly stale
// ones ([old_hi, hi)) are visited, ascending, so a commit's cost does not grow with the
// request's history.
// py: request.py Request.release_stale — SPEC sec. 7
void Request::release_stale(std::int64_t old_history, std::int64_t first_block) {
  const bool active = status == ReqStatus::active;
  const std::int64_t B = layout_.B();
  const std::int64_t written = (static_cast<std::int64_t>(tokens.size()) + B - 1) / B;
  for (std::int64_t lc : layout_.attn_lcs()) {
    const auto [lo, hi] = layout_.stale_range(lc, history);
    auto& table = pages[static_cast<std::size_t>(lc)];
    const std::int64_t end = std::min(hi, static_cast<std::int64_t>(table.size()));
    const auto release = [&](std::int64_t from, std::int64_t to) {
      for (std::int64_t i = from; i < to; ++i) {
        const std::int64_t s = table[static_cast<std::size_t>(i)];
        if (s >= 0) {
          table[static_cast<std::size_t>(i)] = -1;
          index_.release(&pages_.page(s), active);
        }
      }
    };
    // the union of [a1, b1) and [a2, b2), ascending, each ordinal once
    std::int64_t a1 = std::max(lo, first_block), b1 = std::min(written, end);
    std::int64_t a2 = std::max(lo, layout_.stale_range(lc, old_history).second), b2 = end;
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
  index_.unref(root);  // may release an unused scope root
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
      if (!seen) out.digests.emplace_back(c, tokens_.digest(c));
    }
    tokens_.release_tokens(out.codes);
    tokens_.release_tokens(input_tokens);
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
  for (std::int64_t lc = 0; lc < static_cast<std::int64_t>(layout_.num_life_cycles()); ++lc) {
    std::int64_t need = lc == layout_.ssm_lc() ? 1 : 0;
    for (const auto& [clc, h] : copies) need += clc == lc;
    if (need && !pages_.budget(lc).fits(need)) return false;
  }

  pool_.tick();
  child.init_fork(*this);
  if (layout_.ssm_lc() >= 0) {  // its own live state, a copy of the parent's
    child.live = child.alloc_private(layout_.ssm_lc(), 0, c / layout_.B())->handle;
    outbox_.copy(layout_.ssm_lc(), &pages_.page(live), &pages_.page(child.live), "cow");
  }
  child.copy_tail(copies);
  return true;
}

// py: request.py Request.init_fork — SPEC sec. 18
void Request::init_fork(const Request& parent) {
  root_key = parent.root_key;
  root = index_.open_scope(root_key);  // (the parent's root: it holds it)
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
    tokens_.retain_tokens(input_tokens);
    tokens_.retain_tokens(tokens);
  }
  capacity = history = static_cast<std::int64_t>(tokens.size());
  reused = parent.reused;
  const auto nb = static_cast<std::size_t>(ceildiv(capacity, layout_.B()));
  blocks.assign(parent.blocks.begin(), parent.blocks.begin() + std::min(nb, parent.blocks.size()));
  pages.assign(layout_.num_life_cycles(), {});
  for (std::int64_t lc : layout_.attn_lcs()) {
    const auto& from = parent.pages[static_cast<std::size_t>(lc)];
    pages[static_cast<std::size_t>(lc)].assign(from.begin(), from.begin() + std::min(nb, from.size()));
  }
  index_.hold(blocks, pages, priority);
  live = snap = -1;
  cow_block = -1;
}

// py: request.py Request.tail_pages — SPEC sec. 18
Request::TailPages Request::tail_pages() const {
  TailPages out;
  const auto n = static_cast<std::int64_t>(tokens.size());
  if (n % layout_.B() == 0) return out;
  for (std::int64_t lc : layout_.attn_lcs()) {
    const std::int64_t h = page_at(lc, n / layout_.B());
    if (h >= 0) out.emplace_back(lc, h);
  }
  return out;
}

// py: request.py Request.shared_tail — SPEC sec. 18
Request::TailPages Request::shared_tail(std::int64_t new_history) const {
  TailPages out;
  if (stopped) return out;  // it never writes again
  const std::int64_t j = static_cast<std::int64_t>(tokens.size()) / layout_.B();
  for (const auto& [lc, h] : tail_pages()) {
    const auto [lo, hi] = layout_.stale_range(lc, new_history);
    const Page& p = pages_.page(h);
    if (!(lo <= j && j < hi) && (p.node != kNoNode || p.locks + p.holds > 1)) out.emplace_back(lc, h);
  }
  return out;
}

// py: request.py Request.copy_tail — SPEC sec. 18
void Request::copy_tail(const TailPages& shared) {
  if (shared.empty()) return;
  const std::int64_t j = static_cast<std::int64_t>(tokens.size()) / layout_.B();
  const std::int64_t covered = static_cast<std::int64_t>(tokens.size()) - j * layout_.B();
  for (const auto& [lc, h] : shared) {
    const Page* dst = alloc_private(lc, covered, j);
    const Page* src = &pages_.page(h);
    outbox_.copy(lc, src, dst, "cow");
    index_.release(src, status == ReqStatus::active);
    pages[static_cast<std::size_t>(lc)][static_cast<std::size_t>(j)] = dst->handle;
  }
  if (j < static_cast<std::int64_t>(blocks.size()) && blocks[static_cast<std::size_t>(j)] != kNoNode) {
    index_.unref(blocks[static_cast<std::size_t>(j)]);
    blocks[static_cast<std::size_t>(j)] = kNoNode;
  }
}

// The ordinals [start, stop) only (stop -1: to the end; the Python layer checked the range,
// kvcm.checks.check_block_range): the cost is the range's.
// py: request.py Request.page_indices — SPEC sec. 7
std::vector<std::int32_t> Request::page_indices(std::int64_t lc, std::int64_t start, std::int64_t stop) {
  require(ReqStatus::active, "page_indices");
  std::vector<std::int32_t> out;
  if (lc == layout_.ssm_lc()) {
    if (start == 0 && stop != 0) out.push_back(static_cast<std::int32_t>(pages_.page(live).slot));
    return out;
  }
  const std::int64_t nb = ceildiv(capacity, layout_.B());
  const std::int64_t end = stop < 0 ? nb : std::min(stop, nb);
  if (start >= end) return out;
  out.reserve(static_cast<std::size_t>(end - start));
  for (std::int64_t i = start; i < end; ++i) {
    const std::int64_t s = page_at(lc, i);
    out.push_back(s >= 0 ? static_cast<std::int32_t>(pages_.page(s).slot) : -1);
  }
  return out;
}

// The key of block i hashed at create, when `block` is the input's tokens there, with the
// key it was chained from; the pool takes it when block i - 1 still has that key.
// py: request.py Request.key_hint — SPEC sec. 3
KeyHint Request::key_hint(std::int64_t i, std::span<const Tok> block) const {
  const std::int64_t B = layout_.B();
  if (static_cast<std::int64_t>(block.size()) == B && i < static_cast<std::int64_t>(keys.size()) &&
      static_cast<std::int64_t>(input_tokens.size()) >= (i + 1) * B &&
      std::equal(block.begin(), block.end(), input_tokens.begin() + i * B)) {
    return KeyHint{i > 0 ? &keys[static_cast<std::size_t>(i - 1)] : nullptr, &keys[static_cast<std::size_t>(i)]};
  }
  return KeyHint{};
}

// Commit block i (full, or the partial tail) into the tree (sec. 5 and 7): the pool inserts
// it (BlockPool::insert_block: the orphaned chain re-attached, a snapshot where wanted, the
// pages moved in or switched); this request then references what the insertion gave it.
// py: request.py Request.insert_block — SPEC sec. 5
void Request::insert_block(std::int64_t i, std::span<const Tok> block, bool want_snapshot, bool defer_prune) {
  const Chain chain{root, blocks, pages, live, priority, status == ReqStatus::active};
  const Inserted done = pool_.insert_block(chain, i, block, key_hint(i, block), want_snapshot, defer_prune);
  for (const auto& [j, nid] : done.switched) blocks[static_cast<std::size_t>(j)] = nid;
  for (const auto& [lc, h] : done.replaced) pages[static_cast<std::size_t>(lc)][static_cast<std::size_t>(i)] = h;
  set_block(i, done.node);
}

// py: request.py Request.set_block — SPEC sec. 7
void Request::set_block(std::int64_t i, NodeId nid) {
  const auto ii = static_cast<std::size_t>(i);
  if (ii < blocks.size()) {
    blocks[ii] = nid;  // (the pool moved the reference: Inserted)
  } else {
    blocks.resize(ii, kNoNode);
    blocks.push_back(nid);
  }
}

// py: request.py Request.stop — SPEC sec. 7
void Request::stop() {
  stopped = true;
  const auto n = static_cast<std::int64_t>(tokens.size());
  const std::int64_t tail = n % layout_.B();
  const std::int64_t i = n / layout_.B();
  if (!tail || !layout_.cfg().enable_partial_reuse || cow_block == i) return;
  const std::vector<Tok> block(tokens.begin() + i * layout_.B(), tokens.end());
  insert_block(i, block, layout_.ssm_lc() >= 0);
}

}  // namespace kvcm
