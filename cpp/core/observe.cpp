// Observability for parity (SPEC sec. 11): the snapshot and the invariant checks.  Python
// twin: kvcm/python_backend/observe.py (snapshot, check_invariants).  The pool's sections
// are BlockPool members, the requests' are the Manager's; Manager::snapshot_json and
// Manager::check_invariants put them together in the snapshot's key order.
#include "core/manager.h"

#include <algorithm>
#include <cstring>
#include <set>
#include <unordered_set>

#include "core/manager_detail.h"

namespace kvcm {

using namespace detail;

namespace {
std::string S(std::int64_t v) { return std::to_string(v); }
void check(bool cond, const std::string& message) {
  if (!cond) throw InvariantErr(message);
}
}  // namespace

// py: observe.py snapshot — SPEC sec. 11
std::string Manager::snapshot_json() {
  std::string o;
  o.reserve(4096);
  pool_.snapshot_head(o);
  o += "],\"requests\":[";
  snapshot_requests(o);
  o += "],\"stats\":";
  pool_.outbox().snapshot_tail(o);
  o += ",\"next\":{";
  pool_.snapshot_next(o);
  o += ",\"request\":";
  j_int(o, next_request_);
  o += ",\"node\":";
  // the tree's next id: one past the largest id ever made (ids are never reused)
  j_int(o, pool_.index().tree().next_uid());
  o += "},\"shutdown\":";
  j_bool(o, is_shutdown_);
  o += '}';
  return o;
}

// "clock", "tree", "pages" and "pools" (up to the pools' closing bracket).
void BlockPool::snapshot_head(std::string& o) const {
  o += "{\"clock\":";
  j_int(o, clock_);
  o += ",\"tree\":[";
  index_.snapshot_tree(o);
  o += "],\"pages\":[";
  pages_.snapshot_pages(o);
  o += "],\"pools\":[";
  pages_.pools_json(o, true);
}

// "stats" .. "events_dropped" (after the "stats" key).
void Outbox::snapshot_tail(std::string& o) const {
  stats_view(o, totals_);
  o += ",\"iteration_stats\":";
  stats_view(o, iteration_);
  o += ",\"copy_ops\":[";
  snapshot_copy_ops(o);
  o += "],\"events\":[";
  snapshot_events(o);
  o += "],\"events_dropped\":";
  j_int(o, events_dropped_);
}

// "event" and "page" of "next".
void BlockPool::snapshot_next(std::string& o) const {
  o += "\"event\":";
  j_int(o, outbox_.next_event());
  o += ",\"page\":";
  j_int(o, pages_.next_serial());
}

// The snapshot's "tree" list.
// py: observe.py snapshot_tree — SPEC sec. 11
void TreeIndex::snapshot_tree(std::string& o) const {
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
        j_int(o, pages_.page_serial(d.pages[lc]));
        o += ",\"coverage\":";
        j_int(o, d.coverage[lc]);
        o += '}';
      }
    }
    o += "]}";
  }
}

// The snapshot's "pages" list.
// py: observe.py snapshot_pages — SPEC sec. 11
void Pages::snapshot_pages(std::string& o) const {
  bool first = true;
  for (std::int64_t h : live_pages()) {
    const Page& p = page(h);
    if (!first) o += ',';
    first = false;
    o += "{\"serial\":";
    j_int(o, p.serial);
    o += ",\"lc\":";
    j_int(o, p.lc);
    o += ",\"tier\":";
    j_int(o, layout_.tier_id(p.tier));
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
    j_id(o, p.node == kNoNode ? kNoNode : tree_.uid(p.node));
    o += ",\"locks\":";
    j_int(o, p.locks);
    o += ",\"holds\":";
    j_int(o, p.holds);
    o += '}';
  }
}


// The snapshot's "requests" list.
// py: observe.py snapshot_requests — SPEC sec. 11
void Manager::snapshot_requests(std::string& o) const {
  bool first = true;
  for (const std::int64_t serial : open_serials()) {
    const RequestState& r = requests_.at(serial).state();
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
      j_tok_snap(o, pool_.tokens().decode(r.tokens[k]));
    }
    o += "],\"reused_tokens\":";
    j_int(o, r.reused);
    o += ",\"stopped\":";
    j_bool(o, r.stopped);
    o += ",\"blocks\":[";
    for (std::size_t k = 0; k < r.blocks.size(); ++k) {
      if (k) o += ',';
      j_id(o, pool_.index().node_uid(r.blocks[k]));
    }
    o += "],\"pages\":{";
    bool f2 = true;
    for (std::int64_t lc : pool_.layout().attn_lcs()) {
      if (!f2) o += ',';
      f2 = false;
      o += '"';
      j_int(o, lc);
      o += "\":[";
      const auto& v = r.pages[static_cast<std::size_t>(lc)];
      for (std::size_t k = 0; k < v.size(); ++k) {
        if (k) o += ',';
        j_id(o, pool_.pages().page_serial(v[k]));
      }
      o += ']';
    }
    o += "},\"live\":";
    j_id(o, pool_.pages().page_serial(r.live));
    o += ",\"snap\":";
    j_id(o, pool_.pages().page_serial(r.snap));
    o += ",\"cow_block\":";
    j_int(o, r.cow_block);
    o += '}';
  }
}

// The snapshot's "copy_ops" and "issued_copy_ops" list.
// py: observe.py snapshot_copy_ops — SPEC sec. 11
void Outbox::snapshot_copy_ops(std::string& o) const {
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
    if (c.has_key) {
      o += ',';
      j_hex(o, c.key);
    }
    o += ']';
  }
  o += "],\"issued_copy_ops\":[";
  // one drain's entries [*op.to_json(), page serial]: the last drain's unreported ops, or
  // (explicit settlement) each unsettled drain as a list, oldest first
  auto drain = [&o](const std::vector<IssuedOp>& issued) {
    for (std::size_t k = 0; k < issued.size(); ++k) {
      const CopyOpC& c = issued[k].op;
      if (k) o += ',';
      o += '[';
      for (std::int64_t v : {c.lc, c.src_tier, c.src_slot, c.dst_tier, c.dst_slot}) {
        j_int(o, v);
        o += ',';
      }
      j_str(o, c.reason);
      o += ',';
      if (c.has_key) {
        j_hex(o, c.key);
        o += ',';
      }
      j_int(o, issued[k].serial);
      o += ']';
    }
  };
  if (!layout_.cfg().explicit_settlement) {
    drain(issued_);
    return;
  }
  for (std::size_t d = 0; d < unsettled_.size(); ++d) {
    if (d) o += ',';
    o += '[';
    drain(unsettled_[d]);
    o += ']';
  }
}

// The snapshot's "events" list.
// py: observe.py snapshot_events — SPEC sec. 11
void Outbox::snapshot_events(std::string& o) const {
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
            j_tok_plain(o, tree_.decode(event_tokens_[tok_at + t]));
          }
          o += "],";
          j_int(o, sb.lc);
          o += ',';
          j_int(o, sb.tier);
          o += ',';
          j_int(o, sb.priority);
          o += ',';
          j_int(o, sb.coverage);
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
}

// py: observe.py check_invariants — SPEC sec. 11
void Manager::check_invariants() {
  pool_.pages().check_pools();
  // page users, recomputed from the requests
  BlockPool::InvariantUsers users;
  for (const std::int64_t serial : open_serials()) check_request(serial, users);
  pool_.index().check_pages_and_tree(users);
  pool_.outbox().check_issued();
}

// The pool rules of check_invariants.
void Pages::check_pools() const {
  const std::vector<std::int64_t> all = live_pages();
  for (std::size_t t = 0; t < pools_.size(); ++t) {
    for (std::size_t lc = 0; lc < layout_.cfg().lcs.size(); ++lc) check_pool(t, lc, all);
  }
}

// The page and tree rules of check_invariants, against the requests' page users.
void TreeIndex::check_pages_and_tree(InvariantUsers& users) const {
  const std::vector<std::int64_t> all = pages_.live_pages();
  const std::vector<NodeDump> dump = tree_.dump();
  NodeIndex nodes;
  for (const NodeDump& n : dump) nodes[n.id] = &n;
  check_page_users(all, users, nodes);
  check_tree_links(dump, nodes, users);
}

// Issued copy ops (sec. 15): each names the page it fills (a serial already made; -1
// exactly for a store, which fills none); explicit settlement keeps no empty drain,
// counts the unsettled ops right and reports nothing through the last drain.
// py: observe.py check_issued — SPEC sec. 11
void Outbox::check_issued() const {
  const bool expl = layout_.cfg().explicit_settlement;
  std::int64_t n = 0;
  auto drain = [&](std::size_t d, const std::vector<IssuedOp>& issued) {
    check(!issued.empty() || !expl, "unsettled drain " + S(static_cast<std::int64_t>(d)) + " is empty");
    for (const IssuedOp& e : issued) {
      const bool store = std::strcmp(e.op.reason, "store") == 0;
      check((e.serial == -1) == store && e.serial >= -1 && e.serial < pages_.next_serial(),
            "issued drain " + S(static_cast<std::int64_t>(d)) + ": a " + e.op.reason + " op fills page " + S(e.serial));
    }
    n += static_cast<std::int64_t>(issued.size());
  };
  if (!expl) {
    drain(0, issued_);
    return;
  }
  for (std::size_t d = 0; d < unsettled_.size(); ++d) drain(d, unsettled_[d]);
  check(n == unsettled_ops_, S(unsettled_ops_) + " unsettled copy ops counted, " + S(n) + " found");
  check(issued_.empty(), "explicit settlement with a last drain to report");
}

// Pool rules: free and used slots partition the pool; the state counters match the pages.
// py: observe.py check_pool — SPEC sec. 11
void Pages::check_pool(std::size_t t, std::size_t lc, const std::vector<std::int64_t>& all) const {
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
  check_pool_index(pool, where, used);
}

// The eviction index holds exactly the HELD / DROPPABLE pages, its lists in key order.
// py: observe.py check_pool — SPEC sec. 11
void Pages::check_pool_index(const Pool& pool, const std::string& where, const std::vector<const Page*>& used) const {
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
      check(q.in_list && (before == nullptr || before->evict_key() < q.evict_key()), where + ": eviction list out of order");
      before = &q;
      ++n;
    }
    check(n == ix->list_size, where + ": eviction list size out of sync");
  }
}

// One request's rules (sec. 7 invariant, page table, blocks, scope root); counts its page
// users and block references into `users`.
// py: observe.py check_request — SPEC sec. 11
void Manager::check_request(std::int64_t serial, BlockPool::InvariantUsers& users) const {
  const RequestState& r = requests_.at(serial).state();
  auto& locks = users.locks;
  auto& holds = users.holds;
  auto& refs = users.refs;
  const std::string rid = "request " + S(serial);
  const auto nc = static_cast<std::int64_t>(r.tokens.size());
  check(nc <= r.history && r.history <= r.capacity,
        rid + ": committed " + S(nc) + " <= history " + S(r.history) + " <= capacity " + S(r.capacity));
  const bool active = r.status == ReqStatus::active;
  auto& target = active ? locks : holds;
  std::vector<std::int64_t> used;
  for (std::int64_t lc : pool_.layout().attn_lcs()) {
    for (std::int64_t s : r.pages[static_cast<std::size_t>(lc)]) {
      if (s >= 0) used.push_back(s);
    }
  }
  if (r.snap >= 0) used.push_back(r.snap);
  if (r.live >= 0) used.push_back(r.live);
  std::set<std::int64_t> uniq(used.begin(), used.end());
  check(uniq.size() == used.size(), rid + ": uses a page twice");
  for (std::int64_t s : used) {
    check(pool_.pages().page_alive(s), rid + ": uses a freed page");
    target[s] += 1;
    if (active) {
      check(pool_.pages().page(s).tier == kGpu,
            rid + " is ACTIVE but page " + S(pool_.pages().page_serial(s)) + " is on tier " + S(pool_.pages().page(s).tier));
    }
  }
  const std::int64_t nb = ceildiv(r.capacity, pool_.layout().B());
  for (std::int64_t lc : pool_.layout().attn_lcs()) {
    const auto& v = r.pages[static_cast<std::size_t>(lc)];
    check(static_cast<std::int64_t>(v.size()) <= std::max(nb, static_cast<std::int64_t>(r.blocks.size())),
          rid + ": pages beyond capacity");
    const auto [lo, hi] = pool_.layout().stale_range(lc, r.history);
    for (std::size_t i = 0; i < v.size(); ++i) {
      const auto ii = static_cast<std::int64_t>(i);
      check(v[i] < 0 || !(lo <= ii && ii < hi),
            rid + ": stale block " + S(ii) + " of lc " + S(lc) + " keeps a page");
      check(v[i] >= 0 || (lo <= ii && ii < hi), rid + ": block " + S(ii) + " of lc " + S(lc) + " has no page");
    }
  }
  if (active && pool_.layout().ssm_lc() >= 0) check(r.live >= 0, rid + ": ACTIVE without a live ssm state");
  for (NodeId nid : r.blocks) {
    if (nid != kNoNode) {
      check(pool_.index().tree().exists(nid), rid + ": references a deleted block");
      refs[pool_.index().tree().uid(nid)] += 1;
    }
  }
  check(pool_.index().tree().exists(r.root) && pool_.index().tree().find_root(r.root_key) == r.root, rid + ": its scope root is gone");
  refs[pool_.index().tree().uid(r.root)] += 1;
}

// Page rules: each page's users match the requests', its state and tier agree, and a
// tree page is held by its block.
// py: observe.py check_page_users — SPEC sec. 11
void TreeIndex::check_page_users(const std::vector<std::int64_t>& all, InvariantUsers& users, NodeIndex& nodes) const {
  auto& locks = users.locks;
  auto& holds = users.holds;
  for (std::int64_t s : all) {
    const Page& p = pages_.page(s);
    const std::string pid = "page " + S(p.serial);
    const std::int64_t l = locks.count(s) ? locks[s] : 0;
    const std::int64_t h = holds.count(s) ? holds[s] : 0;
    check(p.locks == l, pid + ": " + S(p.locks) + " locks, " + S(l) + " users ACTIVE");
    check(p.holds == h, pid + ": " + S(p.holds) + " holds, " + S(h) + " users SUSPENDED");
    check(p.state() != kLocked || p.tier == kGpu, pid + ": LOCKED on tier " + S(p.tier));
    if (p.tier == layout_.shared_pos()) {  // DECISIONS.md "The shared tier": HELD, linked, full, no slot, in no pool
      check(p.slot == -1 && p.locks == 0 && p.holds > 0, pid + ": a shared page must be HELD, slot -1 (" +
                                                            S(p.locks) + " locks, " + S(p.holds) + " holds, slot " +
                                                            S(p.slot) + ")");
      check(p.node != kNoNode && p.coverage == layout_.B(), pid + ": a shared page outside a full block");
    } else {
      check(p.idx_state == p.state(), pid + ": counted under a stale state");
    }
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
}

// Tree rules: references, page links, children, roots, attached flags and ordinals.
// py: observe.py check_tree_links — SPEC sec. 11
void TreeIndex::check_tree_links(const std::vector<NodeDump>& dump, NodeIndex& nodes, InvariantUsers& users) const {
  const std::size_t nlc = layout_.cfg().lcs.size();
  auto& refs = users.refs;
  for (const NodeDump& n : dump) {
    const std::string bid = "block " + S(n.id);
    const std::int64_t rf = refs.count(n.id) ? refs[n.id] : 0;
    check(n.refs == rf, bid + ": " + S(n.refs) + " refs, " + S(rf) + " requests");
    bool has_page = false;
    for (std::size_t lc = 0; lc < nlc; ++lc) {
      const PageHandle h = n.pages[lc];
      if (h != kNoPage) {
        has_page = true;
        check(pages_.page_alive(h) && node_uid(pages_.page(h).node) == n.id,
              bid + ": page " + S(pages_.page_alive(h) ? pages_.page_serial(h) : h) + " of lc " + S(static_cast<std::int64_t>(lc)) + " not linked back");
        check(n.coverage[lc] > 0, bid + ": page with zero coverage");
      } else {
        check(n.coverage[lc] == 0, bid + ": coverage without a page");
      }
    }
    for (NodeId c : n.children) {
      check(nodes.count(c) != 0 && nodes[c]->parent == n.id, bid + ": child " + S(c) + " link broken");
      check(static_cast<std::int64_t>(n.tokens.size()) == layout_.B() || n.is_root, bid + ": a partial block has children");
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
