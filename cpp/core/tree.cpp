#include "core/tree.h"

#include "core/block_keys.h"

#include <algorithm>

namespace kvcm {
namespace {

template <typename T>
const T& at_index(const std::vector<T>& v, std::int64_t i) {
  if (i < 0 || static_cast<std::size_t>(i) >= v.size()) throw std::out_of_range("list index out of range");
  return v[static_cast<std::size_t>(i)];
}

}  // namespace

RadixTree::RadixTree(std::int64_t tokens_per_block, std::vector<LifeCycleSpec> life_cycles,
                     std::uint32_t index_threshold)
    : B_(tokens_per_block),
      lcs_(std::move(life_cycles)),
      index_build_(index_threshold),
      index_drop_(index_threshold / 2),
      arena_(static_cast<std::size_t>(std::max<std::int64_t>(tokens_per_block, 0))),
      pages_(lcs_.size()),
      coverage_(lcs_.size()),
      children_(16) {
  if (B_ < 1) throw std::invalid_argument("tokens_per_block must be >= 1");
  // Node::ntok keeps 13 bits (the manager's config refuses larger blocks first)
  if (B_ > kMaxTokensPerBlock) throw std::invalid_argument("tokens_per_block must be <= 4096");
}

// ---------------------------------------------------------------- public API

// py: tree.py RadixTree.root — SPEC sec. 5
NodeId RadixTree::root(const Digest& scope_key) {
  auto it = roots_.find(scope_key);
  if (it != roots_.end()) return it->second;
  const Ref r = make_node(scope_key, 0, -1, /*is_root=*/true);
  roots_.emplace(scope_key, r);
  return r;
}

// The `roots` lookup of probe_reuse_detail (also SPEC sec. 15).
// py: tree.py RadixTree.find_root — SPEC sec. 6
NodeId RadixTree::find_root(const Digest& scope_key) const {
  auto it = roots_.find(scope_key);
  return it != roots_.end() ? static_cast<NodeId>(it->second) : kNoNode;
}

// py: tree.py RadixTree.new_block — SPEC sec. 5
NodeId RadixTree::new_block(const Digest& key, std::span<const TokenArg> tokens, std::int64_t ordinal) {
  std::vector<Code> codes;
  codes.reserve(tokens.size());
  try {
    for (const TokenArg& t : tokens) codes.push_back(intern(t));
    const NodeId id = new_block(key, std::span<const Code>(codes), ordinal);  // the node retains them
    release_all(codes);
    return id;
  } catch (...) {
    release_all(codes);
    throw;
  }
}

NodeId RadixTree::new_block(const Digest& key, std::span<const Code> tokens, std::int64_t ordinal) {
  if (static_cast<std::int64_t>(tokens.size()) > B_) throw TreeAssertion("new_block: more than B tokens");
  // (the tokens may be another node's: arena rows never move, so the view stays valid)
  const Ref r = make_node(key, tokens.size(), ordinal, /*is_root=*/false);
  std::copy(tokens.begin(), tokens.end(), arena(r));
  if (any_digest(codes(r))) {
    retain_all(codes(r));  // released by erase_node
    at(r).has_digest = true;
  }
  return r;
}

// py: tree.py RadixTree.find_existing — SPEC sec. 5
NodeId RadixTree::find_existing(NodeId parent, const Digest& key, std::span<const TokenArg> tokens) const {
  const Ref p = ref_of(parent);
  const Ref c = find_child(p, key);
  if (c != kNil) return c;
  return covering(p, encode_query(tokens));
}

NodeId RadixTree::find_existing(NodeId parent, const Digest& key, std::span<const Code> tokens) const {
  const Ref p = ref_of(parent);
  const Ref c = find_child(p, key);
  if (c != kNil) return c;
  return covering(p, tokens);
}

// py: tree.py RadixTree.attach — SPEC sec. 5
std::vector<NodeId> RadixTree::attach(NodeId parent, NodeId node) {
  const Ref p = ref_of(parent);
  const Ref r = ref_of(node);
  {
    const Node& n = at(r);
    if (n.parent != kNil || n.attached || n.is_root) throw TreeAssertion("attach: node is linked");
  }
  if (find_child(p, at(r).key) != kNil) throw TreeAssertion("attach: key already present (use find_existing)");
  // Shorter partial siblings whose tokens prefix the node's (same first token) step aside.
  std::vector<Ref> detached;
  if (at(r).ntok > 0 && at(p).npartial > 0) {
    if (at(p).indexed) {
      index_prefixes(p, r, detached);
    } else {
      prefixes_scan(p, r, detached);
    }
    std::sort(detached.begin(), detached.end(), [this](Ref a, Ref b) { return at(a).key < at(b).key; });
  }
  const std::size_t nlc = lcs_.size();
  for (Ref s : detached) {
    unlink(s);
    std::int32_t *sp = pages_.row(s), *np = pages_.row(r);
    std::int16_t *sc = coverage_.row(s), *nc = coverage_.row(r);
    for (std::size_t lc = 0; lc < nlc; ++lc) {
      if (sp[lc] != kNoPage && sc[lc] > nc[lc]) {
        std::swap(np[lc], sp[lc]);
        std::swap(nc[lc], sc[lc]);
      }
    }
  }
  link(p, r);
  return {detached.begin(), detached.end()};
}

// py: tree.py RadixTree.detach — SPEC sec. 5
void RadixTree::detach(NodeId node) { unlink(ref_of(node)); }

// py: tree.py RadixTree.remove_subtree — SPEC sec. 5
std::vector<NodeId> RadixTree::remove_subtree(NodeId node) {
  std::vector<NodeId> out;
  const Ref top = ref_of(node);
  unlink(top);
  if (at(top).first_child == kNil) {  // a leaf (the usual eviction victim): nothing below it
    index_clear(top);
    out.push_back(top);
    return out;
  }
  std::vector<Ref> stack{top};
  while (!stack.empty()) {
    const Ref n = stack.back();
    stack.pop_back();
    out.push_back(n);
    const std::vector<Ref> kids = children_by_key(n);
    index_clear(n);
    for (Ref k : kids) {
      table_erase(k);
      Node& kn = at(k);
      kn.parent = kNil;
      kn.attached = false;
      kn.prev_sibling = kn.next_sibling = kNil;
    }
    at(n).first_child = kNil;
    at(n).npartial = 0;
    at(n).nchildren = 0;
    stack.insert(stack.end(), kids.rbegin(), kids.rend());  // pre-order, smallest key first
  }
  return out;
}

// py: tree.py RadixTree.prune_upward — SPEC sec. 5
std::vector<NodeId> RadixTree::prune_upward(NodeId node) {
  std::vector<NodeId> out;
  Ref n = ref_of(node);
  while (n != kNil) {
    const Node& nn = at(n);
    if (!nn.attached || nn.is_root || nn.first_child != kNil || node_has_page(n)) break;
    const Ref parent = nn.parent;
    out.push_back(nn.uid);
    unlink(n);
    maybe_delete(n);  // pageless: nothing for the caller to free first
    n = parent;
  }
  if (n != kNil && at(n).is_root) release_root_if_unused(n);  // not listed: it is no block
  return out;
}

// py: tree.py RadixTree.set_page — SPEC sec. 5
PageHandle RadixTree::set_page(NodeId node, std::int64_t lc, PageHandle page, std::int64_t coverage) {
  const Ref r = ref_of(node);
  const std::size_t i = lc_index(lc);
  const PageHandle old = pages_.row(r)[i];
  pages_.row(r)[i] = static_cast<std::int32_t>(page);
  coverage_.row(r)[i] = static_cast<std::int16_t>(coverage);
  return old;
}

// py: tree.py RadixTree.clear_page — SPEC sec. 5
PageHandle RadixTree::clear_page(NodeId node, std::int64_t lc) {
  const Ref r = ref_of(node);
  const std::size_t i = lc_index(lc);
  const PageHandle old = pages_.row(r)[i];
  pages_.row(r)[i] = kNoPage;
  coverage_.row(r)[i] = 0;
  maybe_delete(r);
  return old;
}

// py: tree.py RadixTree.ref — SPEC sec. 5
void RadixTree::ref(NodeId node) { ++at(ref_of(node)).refs; }

// py: tree.py RadixTree.unref — SPEC sec. 5
void RadixTree::unref(NodeId node) {
  const Ref r = ref_of(node);
  if (at(r).refs == 0) throw TreeAssertion("unref: not referenced");
  --at(r).refs;
  maybe_delete(r);
}

// py: tree.py RadixTree.collect — SPEC sec. 5
void RadixTree::collect(NodeId node) {
  if (exists(node)) maybe_delete(static_cast<Ref>(node));
}

// py: tree.py RadixTree.match — SPEC sec. 6
MatchResult RadixTree::match(NodeId root, std::span<const TokenArg> tokens, std::span<const Digest> keys,
                             bool partial, std::int64_t backoff) const {
  const std::vector<Code> codes = encode_query(tokens);
  return match(root, std::span<const Code>(codes), keys, partial, backoff);
}

MatchResult RadixTree::match(NodeId root, std::span<const Code> tokens, std::span<const Digest> keys, bool partial,
                             std::int64_t backoff) const {
  const auto n_tok = static_cast<std::int64_t>(tokens.size());
  Ref node = ref_of(root);
  std::vector<Ref> path;
  path.reserve(static_cast<std::size_t>(n_tok / B_) + 1);
  for (std::int64_t i = 0; i < n_tok / B_; ++i) {
    if (static_cast<std::size_t>(i) >= keys.size()) throw std::out_of_range("list index out of range");
    if (static_cast<std::size_t>(i) + 1 < keys.size()) prefetch_child(keys[static_cast<std::size_t>(i) + 1]);
    const Ref c = find_child(node, keys[static_cast<std::size_t>(i)]);
    if (c == kNil) break;
    path.push_back(c);
    node = c;
  }
  std::int64_t m = static_cast<std::int64_t>(path.size()) * B_;
  if (partial && m < n_tok) {
    const auto [best, run] = longest_run(node, tokens, static_cast<std::size_t>(m));
    if (best != kNil) {
      path.push_back(best);
      m += run;
    }
  }
  m = std::max<std::int64_t>(0, m - backoff);
  MatchResult r;
  r.m_before_ssm = prune_match(path, m, /*use_ssm=*/false);
  r.m = prune_match(path, m, /*use_ssm=*/true);
  // path[: ceil(m / B)] with Python slice semantics.
  const auto len = static_cast<std::int64_t>(path.size());
  std::int64_t stop = ceildiv(r.m, B_);
  if (stop < 0) stop = std::max<std::int64_t>(0, stop + len);
  stop = std::min(stop, len);
  r.path.assign(path.begin(), path.begin() + stop);
  return r;
}

// ---------------------------------------------------------------- tokens

RadixTree::Code RadixTree::intern_slow(const TokenArg& t) {
  const Code known = lookup(t);  // ints (range-checked) and digests seen before
  if (known != kUnknownDigest) {
    retain(known);
    return known;
  }
  Digest d;
  std::memcpy(d.data(), t.digest, d.size());
  Code id;
  if (!free_digests_.empty()) {
    id = free_digests_.back();
    digests_[id] = d;
  } else {
    if (digests_.size() >= (kUnknownDigest & ~kDigestBit)) throw std::length_error("too many distinct digest tokens");
    id = static_cast<Code>(digests_.size());
    digests_.push_back(d);
    digest_refs_.push_back(0);
  }
  digest_ids_.emplace(d, id);  // may throw: nothing changed yet but the slot's bytes
  if (!free_digests_.empty() && free_digests_.back() == id) free_digests_.pop_back();
  digest_refs_[id] = 1;
  return kDigestBit | id;
}

void RadixTree::release_digest(Code id) noexcept {
  if (--digest_refs_[id] != 0) return;
  digest_ids_.erase(digests_[id]);
  free_digests_.push_back(id);
}

RadixTree::Code RadixTree::lookup(const TokenArg& t) const {
  if (t.digest == nullptr) {
    if (t.value & kDigestBit) throw std::invalid_argument("token out of range [0, 2**31)");
    return t.value;
  }
  Digest d;
  std::memcpy(d.data(), t.digest, d.size());
  auto it = digest_ids_.find(d);
  return it != digest_ids_.end() ? (kDigestBit | it->second) : kUnknownDigest;
}

TokenOut RadixTree::decode(Code c) const {
  TokenOut t;
  if (c & kDigestBit) {
    t.is_digest = true;
    t.digest = digests_[c & ~kDigestBit];
  } else {
    t.value = c;
  }
  return t;
}

std::vector<RadixTree::Code> RadixTree::encode_query(std::span<const TokenArg> tokens) const {
  std::vector<Code> out;
  out.reserve(tokens.size());
  for (const TokenArg& t : tokens) out.push_back(lookup(t));
  return out;
}

// ---------------------------------------------------------------- queries

NodeId RadixTree::find_uid(std::int64_t uid) const noexcept {
  for (std::size_t r = 0; r < nodes_.size(); ++r) {
    if (nodes_[r].alive && nodes_[r].uid == uid) return static_cast<NodeId>(r);
  }
  return kNoNode;
}

std::vector<NodeDump> RadixTree::dump() const {
  std::vector<Ref> live;
  live.reserve(num_nodes());
  for (std::size_t r = 0; r < nodes_.size(); ++r) {
    if (nodes_[r].alive) live.push_back(static_cast<Ref>(r));
  }
  std::sort(live.begin(), live.end(), [this](Ref a, Ref b) { return at(a).uid < at(b).uid; });
  const std::size_t nlc = lcs_.size();
  std::vector<NodeDump> out;
  out.reserve(live.size());
  for (Ref r : live) {
    const Node& n = at(r);
    NodeDump d;
    d.id = n.uid;
    d.key = n.key;
    d.parent = n.parent != kNil ? at(n.parent).uid : kNoNode;
    d.attached = n.attached;
    d.is_root = n.is_root;
    d.ordinal = n.ordinal;
    d.tokens.reserve(n.ntok);
    for (Code c : codes(r)) d.tokens.push_back(decode(c));
    for (Ref c = n.first_child; c != kNil; c = at(c).next_sibling) d.children.push_back(at(c).uid);
    std::sort(d.children.begin(), d.children.end());
    d.pages.assign(pages_.row(r), pages_.row(r) + nlc);
    d.coverage.assign(coverage_.row(r), coverage_.row(r) + nlc);
    d.refs = n.refs;
    out.push_back(std::move(d));
  }
  return out;
}

// ---------------------------------------------------------------- helpers

RadixTree::Ref RadixTree::make_node(const Digest& key, std::size_t ntok, std::int64_t ordinal, bool is_root) {
  if (next_uid_ > kUidMask) [[unlikely]] throw std::overflow_error("kvcm: 2**47 blocks made, node uids exhausted");
  Ref r;
  if (!free_.empty()) {
    r = free_.back();
    free_.pop_back();
    // a slot is reused clean: set_page(n, lc, kNoPage, c) can leave a coverage behind
  } else {
    // pages name their node in 32 signed bits (Page::node)
    if (nodes_.size() >= 0x7FFFFFFFu) throw std::length_error("too many radix-tree nodes");
    r = static_cast<Ref>(nodes_.size());
    arena_.ensure(r);
    pages_.ensure(r);
    coverage_.ensure(r);
    nodes_.push();
  }
  const std::size_t nlc = lcs_.size();
  std::fill_n(pages_.row(r), nlc, kNoPage);
  std::fill_n(coverage_.row(r), nlc, 0);
  // built in place, member by member (assigning Node{} built a zeroed temporary on the
  // stack and read it back whole: a store-forwarding stall per new block)
  Node& n = *::new (static_cast<void*>(&at(r))) Node;
  n.key = key;
  n.uid = next_uid_++ & kUidMask;  // < 2**47: checked on entry
  n.ordinal = static_cast<std::int32_t>(ordinal);
  n.ntok = ntok & 0x1FFF;  // <= B <= kMaxTokensPerBlock (the constructor's check)
  n.alive = true;
  n.is_root = is_root;
  n.attached = is_root;
  return r;
}

bool RadixTree::node_has_page(Ref r) const noexcept {
  const std::size_t nlc = lcs_.size();
  const std::int32_t* pages = pages_.row(r);
  for (std::size_t lc = 0; lc < nlc; ++lc) {
    if (pages[lc] != kNoPage) return true;
  }
  return false;
}

void RadixTree::link(Ref parent, Ref child) {
  Node& p = at(parent);
  Node& c = at(child);
  c.parent = parent;
  c.attached = true;
  c.prev_sibling = kNil;
  c.next_sibling = p.first_child;
  if (p.first_child != kNil) at(p.first_child).prev_sibling = child;
  p.first_child = child;
  if (c.ntok > 0 && static_cast<std::int64_t>(c.ntok) < B_) ++p.npartial;
  table_insert(child);
  ++p.nchildren;
  if (p.indexed) {
    index_add(parent, child);
  } else if (p.nchildren > index_build_) {
    index_build(parent);
  }
}

void RadixTree::unlink(Ref r) {
  Node& n = at(r);
  if (n.parent != kNil) {
    table_erase(r);
    Node& p = at(n.parent);
    if (n.prev_sibling != kNil) {
      at(n.prev_sibling).next_sibling = n.next_sibling;
    } else {
      p.first_child = n.next_sibling;
    }
    if (n.next_sibling != kNil) at(n.next_sibling).prev_sibling = n.prev_sibling;
    if (n.ntok > 0 && static_cast<std::int64_t>(n.ntok) < B_) --p.npartial;
    --p.nchildren;
    if (p.indexed) {
      if (p.nchildren <= index_drop_) {
        index_clear(n.parent);  // few enough to scan again (r's trie node goes too)
      } else {
        index_remove(n.parent, r);
      }
    }
  }
  n.parent = kNil;
  n.prev_sibling = n.next_sibling = kNil;
  n.attached = false;
}

bool RadixTree::deletable(Ref r) const noexcept {
  const Node& n = at(r);
  return n.alive && !n.attached && !n.is_root && n.refs == 0 && !node_has_page(r);
}

// maybe_delete's root branch: no scope is kept forever.
// py: tree.py RadixTree.release_root_if_unused — SPEC sec. 15
void RadixTree::release_root_if_unused(Ref r) {
  const Node& n = at(r);
  if (!n.alive || !n.is_root || n.refs != 0 || n.first_child != kNil || node_has_page(r)) return;
  roots_.erase(n.key);
  erase_node(r);
}

// py: tree.py RadixTree.maybe_delete — SPEC sec. 5
void RadixTree::maybe_delete(Ref start) {
  if (at(start).is_root) {
    release_root_if_unused(start);
    return;
  }
  // Iterative (tree.py recurses): a dying node's children become detached and may die too.
  // Every node has one parent, so no node is queued twice; the order of deletions does
  // not change the resulting state (slots are internal; uids are what anyone sees).
  if (!deletable(start)) return;
  if (at(start).first_child == kNil) {  // no children to orphan (the common case): no work list
    index_clear(start);
    erase_node(start);
    return;
  }
  std::vector<Ref> work{start};
  while (!work.empty()) {
    const Ref r = work.back();
    work.pop_back();
    if (!deletable(r)) continue;
    index_clear(r);
    for (Ref c = at(r).first_child; c != kNil;) {
      const Ref next = at(c).next_sibling;
      table_erase(c);
      Node& cn = at(c);
      cn.parent = kNil;
      cn.attached = false;
      cn.prev_sibling = cn.next_sibling = kNil;
      work.push_back(c);
      c = next;
    }
    erase_node(r);
  }
}

void RadixTree::erase_node(Ref r) {
  Node& n = at(r);
  if (n.has_digest) release_all(codes(r));  // the references new_block took
  n.nchildren = 0;
  n.alive = false;
  n.first_child = kNil;
  n.npartial = 0;
  free_.push_back(r);
}

std::vector<RadixTree::Ref> RadixTree::children_by_key(Ref r) const {
  std::vector<Ref> kids;
  for (Ref c = at(r).first_child; c != kNil; c = at(c).next_sibling) kids.push_back(c);
  std::sort(kids.begin(), kids.end(), [this](Ref a, Ref b) { return at(a).key < at(b).key; });
  return kids;
}

// find_existing: the children below the walk's
// end all start with `tokens`; the trie's cover aggregate is the one with the most tokens.
// py: tree.py RadixTree.covering — SPEC sec. 5
NodeId RadixTree::covering(Ref p, std::span<const Code> tokens) const {
  if (tokens.empty() || static_cast<std::int64_t>(tokens.size()) >= B_) return kNoNode;
  if (!at(p).indexed) return covering_scan(p, tokens);
  const auto [t, d] = walk(p, tokens, 0);
  if (t == kNil || d < tokens.size()) return kNoNode;
  const Ref best = tn(t).cover;
  return at(best).ntok > tokens.size() ? static_cast<NodeId>(best) : kNoNode;
}

// py: tree.py RadixTree.longest_run — SPEC sec. 6
std::pair<RadixTree::Ref, std::int64_t> RadixTree::longest_run(Ref node, std::span<const Code> tokens,
                                                               std::size_t start) const {
  // SPEC sec. 6 step 1: the children below the walk's end
  // are exactly those sharing the longest leading run d; ties go to the smallest key.
  if (!at(node).indexed) return longest_run_scan(node, tokens, start);
  const auto [t, d] = walk(node, tokens, start);
  if (t == kNil || d == 0) return {kNil, 0};
  return {tn(t).best, static_cast<std::int64_t>(d)};
}

// py: tree.py RadixTree.prune_match — SPEC sec. 6
std::int64_t RadixTree::prune_match(const std::vector<Ref>& path, std::int64_t m, bool use_ssm) const {
  return fixed_point(
      [&](std::int64_t j, std::size_t lc) -> std::int64_t { return coverage_.row(at_index(path, j))[lc]; }, m,
      use_ssm);
}

template <typename Cov>
std::int64_t RadixTree::fixed_point(const Cov& cov, std::int64_t m, bool use_ssm) const {
  const std::int64_t B = B_;
  const std::size_t nlc = lcs_.size();
  while (true) {
    const std::int64_t m0 = m;
    for (std::size_t lc = 0; lc < nlc; ++lc) {
      const LifeCycleSpec& spec = lcs_[lc];
      if (spec.kind == LcKind::ssm) {
        if (!use_ssm) continue;
        // The match must end exactly at a snapshot.
        std::int64_t cut = 0;
        for (std::int64_t j = ceildiv(m, B) - 1; j >= 0; --j) {
          const std::int64_t c = cov(j, lc);
          if (0 < c && j * B + c <= m) {
            cut = j * B + c;
            break;
          }
        }
        m = cut;
        continue;
      }
      // Attention: every non-stale block below m needs a page covering its matched tokens.
      const auto [lo, hi] = spec.window ? stale_range(*spec.window, spec.sinks, B, m)
                                        : std::pair<std::int64_t, std::int64_t>{0, 0};
      const std::int64_t n_blocks = ceildiv(m, B);
      for (std::int64_t j = 0; j < n_blocks; ++j) {
        if (lo <= j && j < hi) continue;
        const std::int64_t need = std::min(B, m - j * B);
        const std::int64_t c = cov(j, lc);
        if (c < need) {
          m = j * B + c;
          break;
        }
      }
    }
    if (m == m0) return m;
  }
}

// py: tree.py RadixTree.key_path — SPEC sec. 6
std::vector<NodeId> RadixTree::key_path(NodeId root, std::span<const Digest> keys) const {
  std::vector<NodeId> out;
  Ref node = ref_of(root);
  for (const Digest& key : keys) {
    const Ref c = find_child(node, key);
    if (c == kNil) break;
    out.push_back(static_cast<NodeId>(c));
    node = c;
  }
  return out;
}

// py: tree.py RadixTree.prune_extended — SPEC sec. 6
std::int64_t RadixTree::prune_extended(const std::vector<NodeId>& path,
                                       const std::vector<std::vector<std::int64_t>>& rows, std::int64_t m,
                                       bool use_ssm) const {
  std::vector<Ref> refs;
  refs.reserve(path.size());
  for (NodeId id : path) refs.push_back(ref_of(id));
  return fixed_point(
      [&](std::int64_t j, std::size_t lc) -> std::int64_t {
        const auto jj = static_cast<std::size_t>(j);
        return jj < refs.size() ? coverage_.row(refs[jj])[lc] : at_index(rows, j - static_cast<std::int64_t>(refs.size()))[lc];
      },
      m, use_ssm);
}

// ---------------------------------------------------------------- the children index
// tree.py: class _Trie and RadixTree.walk / index_add / index_remove / index_prefixes.

RadixTree::TRef RadixTree::new_tnode(std::uint32_t depth, Ref rep, TRef up, Code tok) {
  TRef t;
  if (!tfree_.empty()) {
    t = tfree_.back();
    tfree_.pop_back();
  } else {
    if (tnodes_.size() >= kNil) throw std::length_error("too many trie nodes");
    t = static_cast<TRef>(tnodes_.size());
    tnodes_.emplace_back();
  }
  TNode& x = tn(t);
  x = TNode{};
  x.depth = depth;
  x.rep = rep;
  x.up = up;
  x.tok = tok;
  return t;
}

void RadixTree::free_tnode(TRef t) noexcept {
  tn(t) = TNode{};
  tfree_.push_back(t);
}

bool RadixTree::covers_more(Ref a, Ref b) const noexcept {
  return at(a).ntok > at(b).ntok || (at(a).ntok == at(b).ntok && at(a).key < at(b).key);
}

std::uint32_t RadixTree::edge_end(std::span<const Code> q, std::size_t qstart, TRef c, std::uint32_t d) const noexcept {
  const auto stop = static_cast<std::uint32_t>(std::min<std::size_t>(tn(c).depth, q.size() - qstart));
  const Code* ct = arena(tn(c).rep);
  std::uint32_t e = d + 1;  // the edge's first token matched through the kid table
  while (e < stop && ct[e] == q[qstart + e]) ++e;
  return e;
}

// py: tree.py RadixTree.walk — SPEC sec. 6
std::pair<RadixTree::TRef, std::uint32_t> RadixTree::walk(Ref p, std::span<const Code> q, std::size_t start) const {
  TRef v = index_root(p);
  if (v == kNil) return {kNil, 0};
  std::uint32_t d = 0;
  const std::size_t n = q.size() - start;
  while (d < n) {
    const TRef c = find_kid(v, q[start + d]);
    if (c == kNil) break;
    const std::uint32_t e = edge_end(q, start, c, d);
    if (e < tn(c).depth) return {c, e};
    v = c;
    d = e;
  }
  return {v, d};
}

// py: tree.py RadixTree.index_add — SPEC sec. 5
void RadixTree::index_add(Ref p, Ref n) {
  const std::span<const Code> t = codes(n);
  if (t.empty()) return;
  if (!at(p).indexed) set_index_root(p, new_tnode(0, kNil, kNil, 0));
  TRef v = index_root(p);
  const auto len = static_cast<std::uint32_t>(t.size());
  while (true) {
    if (tn(v).depth == len) {
      tlinks_[n] = TLink{v, tn(v).leaf};
      tn(v).leaf = n;
      break;
    }
    const Code tok = t[tn(v).depth];
    const TRef c = find_kid(v, tok);
    if (c == kNil) {
      const TRef leaf = new_tnode(len, n, v, tok);
      tn(leaf).leaf = n;
      tlinks_[n] = TLink{leaf, kNil};
      add_kid(v, leaf);
      break;
    }
    const std::uint32_t e = edge_end(t, 0, c, tn(v).depth);
    if (e == tn(c).depth) {
      v = c;
      continue;
    }
    // split the edge where t leaves it
    const TRef mid = new_tnode(e, tn(c).rep, v, tok);
    remove_kid(c);
    tn(c).tok = arena(tn(c).rep)[e];
    tn(mid).best = tn(c).best;
    tn(mid).cover = tn(c).cover;
    add_kid(v, mid);
    add_kid(mid, c);
    v = mid;
  }
  for (TRef x = tnode_of(n); x != kNil; x = tn(x).up) {
    TNode& xn = tn(x);
    if (xn.best == kNil || at(n).key < at(xn.best).key) xn.best = n;
    if (xn.cover == kNil || covers_more(n, xn.cover)) xn.cover = n;
  }
}

// py: tree.py RadixTree.index_remove — SPEC sec. 5
void RadixTree::index_remove(Ref p, Ref n) {
  const auto it = tlinks_.find(n);
  if (it == tlinks_.end()) return;
  const TLink l = it->second;
  tlinks_.erase(it);
  TRef v = l.tnode;
  if (tn(v).leaf == n) {
    tn(v).leaf = l.tnext;
  } else {
    Ref x = tn(v).leaf;
    while (tnext_of(x) != n) x = tnext_of(x);
    tlinks_.find(x)->second.tnext = l.tnext;
  }
  if (tn(v).leaf == kNil && tn(v).first_kid == kNil && tn(v).up != kNil) {  // a bare leaf: drop it
    const TRef up = tn(v).up;
    remove_kid(v);
    free_tnode(v);
    v = up;
  }
  if (tn(v).up != kNil && tn(v).leaf == kNil && tn(v).first_kid != kNil &&
      tn(tn(v).first_kid).next_kid == kNil) {  // one kid left: merge it into v's place
    const TRef only = tn(v).first_kid;
    const TRef up = tn(v).up;
    remove_kid(only);
    remove_kid(v);
    tn(only).tok = tn(v).tok;
    free_tnode(v);
    add_kid(up, only);
    v = up;
  }
  if (tn(v).up == kNil && tn(v).first_kid == kNil && tn(v).leaf == kNil) {
    free_tnode(v);
    set_index_root(p, kNil);
    return;
  }
  for (; v != kNil; v = tn(v).up) {  // aggregates and labels that named n
    TNode& vn = tn(v);
    if (vn.best == n || vn.cover == n) {
      Ref best = vn.leaf, cover = vn.leaf;
      for (Ref x = best != kNil ? tnext_of(best) : kNil; x != kNil; x = tnext_of(x)) {
        if (at(x).key < at(best).key) best = x;
        if (covers_more(x, cover)) cover = x;
      }
      for (TRef k = vn.first_kid; k != kNil; k = tn(k).next_kid) {
        if (best == kNil || at(tn(k).best).key < at(best).key) best = tn(k).best;
        if (cover == kNil || covers_more(tn(k).cover, cover)) cover = tn(k).cover;
      }
      vn.best = best;
      vn.cover = cover;
    }
    if (vn.rep == n) vn.rep = vn.best;
  }
}

// py: tree.py RadixTree.index_prefixes — SPEC sec. 5
void RadixTree::index_prefixes(Ref p, Ref n, std::vector<Ref>& out) const {
  const std::span<const Code> t = codes(n);
  TRef v = index_root(p);
  if (v == kNil || t.empty()) return;
  while (true) {
    const TNode& vn = tn(v);
    if (vn.depth < t.size() && static_cast<std::int64_t>(vn.depth) < B_) {
      for (Ref x = vn.leaf; x != kNil; x = tnext_of(x)) out.push_back(x);
    }
    if (vn.depth >= t.size()) return;
    const TRef c = find_kid(v, t[vn.depth]);
    if (c == kNil || edge_end(t, 0, c, vn.depth) < tn(c).depth) return;
    v = c;
  }
}

void RadixTree::index_clear_trie(Ref p) {
  const TRef root = index_root(p);
  set_index_root(p, kNil);
  std::vector<TRef> stack{root};
  while (!stack.empty()) {
    const TRef v = stack.back();
    stack.pop_back();
    for (Ref x = tn(v).leaf; x != kNil;) {
      const auto it = tlinks_.find(x);
      x = it->second.tnext;
      tlinks_.erase(it);
    }
    for (TRef k = tn(v).first_kid; k != kNil; k = tn(k).next_kid) stack.push_back(k);
    if (tn(v).up != kNil) remove_kid_entry_only(v);
    free_tnode(v);
  }
}

void RadixTree::index_build(Ref p) {
  for (Ref c = at(p).first_child; c != kNil; c = at(c).next_sibling) index_add(p, c);
}

// The same answers as the trie, for a parent with few children (no trie): a bounded scan
// (tree.py: covering / longest_run / index_prefixes; SPEC sec. 5 and 6 step 1).
NodeId RadixTree::covering_scan(Ref p, std::span<const Code> tokens) const {
  Ref best = kNil;
  for (Ref s = at(p).first_child; s != kNil; s = at(s).next_sibling) {
    const Node& sn = at(s);
    if (sn.ntok > tokens.size() && std::equal(tokens.begin(), tokens.end(), arena(s)) &&
        (best == kNil || covers_more(s, best))) {
      best = s;
    }
  }
  return best != kNil ? static_cast<NodeId>(best) : kNoNode;
}

std::pair<RadixTree::Ref, std::int64_t> RadixTree::longest_run_scan(Ref node, std::span<const Code> tokens,
                                                                    std::size_t start) const {
  Ref best = kNil;
  std::int64_t best_run = 0;
  for (Ref c = at(node).first_child; c != kNil; c = at(c).next_sibling) {
    const Node& cn = at(c);
    const Code* mine = arena(c);
    const std::size_t limit = std::min<std::size_t>(cn.ntok, tokens.size() - start);
    std::size_t run = 0;
    while (run < limit && mine[run] == tokens[start + run]) ++run;
    const auto r = static_cast<std::int64_t>(run);
    if (r > 0 && (r > best_run || (r == best_run && cn.key < at(best).key))) {
      best = c;
      best_run = r;
    }
  }
  return {best, best_run};
}

void RadixTree::prefixes_scan(Ref p, Ref n, std::vector<Ref>& out) const {
  const std::span<const Code> mine = codes(n);
  for (Ref s = at(p).first_child; s != kNil; s = at(s).next_sibling) {
    const Node& sn = at(s);
    if (sn.ntok > 0 && sn.ntok < mine.size() && static_cast<std::int64_t>(sn.ntok) < B_ &&
        std::equal(arena(s), arena(s) + sn.ntok, mine.begin())) {
      out.push_back(s);
    }
  }
}

// --- the kid table: (up, tok) -> trie node; open addressing with backward-shift deletion,
// like the child table below.  Kids are also linked per node (first_kid / next_kid).

std::size_t RadixTree::kid_slot(TRef up, Code tok) const noexcept {
  const std::uint64_t h = ((static_cast<std::uint64_t>(up) << 32) | tok) * 0x9E3779B97F4A7C15ull;
  return static_cast<std::size_t>(h >> 32) & (tkids_.size() - 1);
}

RadixTree::TRef RadixTree::find_kid(TRef up, Code tok) const noexcept {
  const std::size_t mask = tkids_.size() - 1;
  for (std::size_t i = kid_slot(up, tok);; i = (i + 1) & mask) {
    const KidEntry& e = tkids_[i];
    if (e.ref == kNil) return kNil;
    if (e.up == up && e.tok == tok) return e.ref;
  }
}

void RadixTree::add_kid(TRef up, TRef kid) {
  if ((num_tkids_ + 1) * 2 > tkids_.size()) kid_table_grow();
  TNode& k = tn(kid);
  k.up = up;
  k.prev_kid = kNil;
  k.next_kid = tn(up).first_kid;
  if (k.next_kid != kNil) tn(k.next_kid).prev_kid = kid;
  tn(up).first_kid = kid;
  const std::size_t mask = tkids_.size() - 1;
  std::size_t i = kid_slot(up, k.tok);
  while (tkids_[i].ref != kNil) i = (i + 1) & mask;
  tkids_[i] = KidEntry{kid, up, k.tok};
  ++num_tkids_;
}

void RadixTree::remove_kid(TRef kid) noexcept {
  TNode& k = tn(kid);
  if (k.prev_kid != kNil) {
    tn(k.prev_kid).next_kid = k.next_kid;
  } else {
    tn(k.up).first_kid = k.next_kid;
  }
  if (k.next_kid != kNil) tn(k.next_kid).prev_kid = k.prev_kid;
  remove_kid_entry_only(kid);
  k.prev_kid = k.next_kid = kNil;
  k.up = kNil;
}

void RadixTree::remove_kid_entry_only(TRef kid) noexcept {
  const std::size_t mask = tkids_.size() - 1;
  std::size_t i = kid_slot(tn(kid).up, tn(kid).tok);
  while (tkids_[i].ref != kid) i = (i + 1) & mask;
  for (std::size_t j = (i + 1) & mask; tkids_[j].ref != kNil; j = (j + 1) & mask) {
    const std::size_t home = kid_slot(tkids_[j].up, tkids_[j].tok);
    const bool stays = i <= j ? (i < home && home <= j) : (i < home || home <= j);
    if (!stays) {
      tkids_[i] = tkids_[j];
      i = j;
    }
  }
  tkids_[i] = KidEntry{};
  --num_tkids_;
}

void RadixTree::kid_table_grow() {
  std::vector<KidEntry> old(tkids_.size() * 2);
  old.swap(tkids_);
  const std::size_t mask = tkids_.size() - 1;
  for (const KidEntry& e : old) {
    if (e.ref == kNil) continue;
    std::size_t i = kid_slot(e.up, e.tok);
    while (tkids_[i].ref != kNil) i = (i + 1) & mask;
    tkids_[i] = e;
  }
}

// ---------------------------------------------------------------- the child table

RadixTree::Ref RadixTree::find_child(Ref parent, const Digest& key) const noexcept {
  // A childless parent (the block just made before this one, in a commit of new blocks)
  // has nothing in the table: no probe of its (cold) line.
  if (at(parent).first_child == kNil) return kNil;
  const std::uint32_t h = hash32(key);
  for (std::size_t i = home(h);; i = next_slot(i)) {
    const Entry& e = children_[i];
    if (e.ref == kNil) return kNil;
    if (e.hash != h) continue;
    const Node& n = at(e.ref);
    if (n.parent == parent && n.key == key) return e.ref;
  }
}

void RadixTree::table_insert(Ref r) {
  // at most 3/5 full: linear probing stays short (at 3/4 the tight replay, which erases
  // and inserts all the time, ran ~5% slower), while the table is not far above need
  // (between 2/5 and 3/5 full, 13-20 bytes per child, not 16-32 with 2**k at 1/2)
  if ((num_children_ + 1) * 5 > children_.size() * 3) table_grow();
  const std::uint32_t h = hash32(at(r).key);
  std::size_t i = home(h);
  while (children_[i].ref != kNil) i = next_slot(i);
  children_[i] = Entry{r, h};
  ++num_children_;
}

void RadixTree::table_erase(Ref r) noexcept {
  std::size_t i = slot_of(at(r).key);
  while (children_[i].ref != r) i = next_slot(i);
  // Backward-shift deletion: pull later entries of the probe run into the hole unless
  // their home slot lies cyclically in (hole, entry].
  for (std::size_t j = next_slot(i); children_[j].ref != kNil; j = next_slot(j)) {
    const std::size_t h = home(children_[j].hash);
    const bool stays = i <= j ? (i < h && h <= j) : (i < h || h <= j);
    if (!stays) {
      children_[i] = children_[j];
      i = j;
    }
  }
  children_[i] = Entry{};
  --num_children_;
}

void RadixTree::table_grow() {
  // x1.5: 2/5 full after growing (x2 would leave it 3/10 full)
  std::vector<Entry> old(children_.size() + children_.size() / 2);
  old.swap(children_);
  for (const Entry& e : old) {
    if (e.ref == kNil) continue;
    std::size_t i = home(e.hash);
    while (children_[i].ref != kNil) i = next_slot(i);
    children_[i] = e;
  }
}

}  // namespace kvcm
