#include "core/radix_tree.h"

#include <algorithm>

namespace kvcm {
namespace {

// Python's // and ceil-by-negation on ints: the port must agree with tree.py even where
// the numerator is negative (e.g. history + 1 - window).
constexpr std::int64_t floordiv(std::int64_t a, std::int64_t b) noexcept {
  std::int64_t q = a / b;
  if ((a % b != 0) && ((a < 0) != (b < 0))) --q;
  return q;
}
constexpr std::int64_t ceildiv(std::int64_t a, std::int64_t b) noexcept { return -floordiv(-a, b); }

template <typename T>
const T& at(const std::vector<T>& v, std::int64_t i) {
  if (i < 0 || static_cast<std::size_t>(i) >= v.size()) throw std::out_of_range("list index out of range");
  return v[static_cast<std::size_t>(i)];
}

bool starts_with(const std::vector<std::uint32_t>& longer, const std::vector<std::uint32_t>& prefix) noexcept {
  return prefix.size() <= longer.size() && std::equal(prefix.begin(), prefix.end(), longer.begin());
}

}  // namespace

RadixTree::RadixTree(std::int64_t tokens_per_block, std::vector<LifeCycleSpec> life_cycles)
    : B_(tokens_per_block), lcs_(std::move(life_cycles)) {
  if (B_ < 1) throw std::invalid_argument("tokens_per_block must be >= 1");
}

// ---------------------------------------------------------------- public API

NodeId RadixTree::root(const Digest& scope_key) {
  auto it = roots_.find(scope_key);
  if (it != roots_.end()) return it->second->id;
  Node& n = make_node(scope_key, {}, -1, /*is_root=*/true);
  roots_.emplace(scope_key, &n);
  return n.id;
}

NodeId RadixTree::new_block(const Digest& key, std::span<const TokenArg> tokens, std::int64_t ordinal) {
  std::vector<Code> codes;
  codes.reserve(tokens.size());
  try {
    for (const TokenArg& t : tokens) codes.push_back(intern(t));
  } catch (...) {
    for (Code c : codes) release(c);  // all or nothing
    throw;
  }
  return make_node(key, std::move(codes), ordinal, /*is_root=*/false).id;
}

NodeId RadixTree::find_existing(NodeId parent, const Digest& key, std::span<const TokenArg> tokens) const {
  const Node& p = get(parent);
  auto it = p.children.find(key);
  if (it != p.children.end()) return it->second->id;
  return covering(p, encode_query(tokens));
}

std::vector<NodeId> RadixTree::attach(NodeId parent, NodeId node) {
  Node& p = get(parent);
  Node& n = get(node);
  if (n.parent != nullptr || n.attached || n.is_root) throw TreeAssertion("attach: node is linked");
  if (p.children.count(n.key) != 0) throw TreeAssertion("attach: key already present (use find_existing)");
  std::vector<Node*> detached;
  if (!n.tokens.empty()) {
    auto g = p.by_first.find(n.tokens[0]);
    if (g != p.by_first.end()) {
      std::vector<Node*> group = g->second;
      std::sort(group.begin(), group.end(), [](const Node* a, const Node* b) { return a->key < b->key; });
      for (Node* s : group) {
        if (s->tokens.size() < n.tokens.size() && static_cast<std::int64_t>(s->tokens.size()) < B_ &&
            starts_with(n.tokens, s->tokens)) {
          detached.push_back(s);
        }
      }
    }
  }
  for (Node* s : detached) {
    unlink(*s);
    for (std::size_t lc = 0; lc < lcs_.size(); ++lc) {
      if (s->pages[lc] != kNoPage && s->coverage[lc] > n.coverage[lc]) {
        std::swap(n.pages[lc], s->pages[lc]);
        std::swap(n.coverage[lc], s->coverage[lc]);
      }
    }
  }
  n.parent = &p;
  n.attached = true;
  p.children.emplace(n.key, &n);
  if (!n.tokens.empty()) p.by_first[n.tokens[0]].push_back(&n);
  std::vector<NodeId> out;
  out.reserve(detached.size());
  for (const Node* s : detached) out.push_back(s->id);
  return out;
}

void RadixTree::detach(NodeId node) { unlink(get(node)); }

std::vector<NodeId> RadixTree::remove_subtree(NodeId node) {
  std::vector<NodeId> out;
  Node& top = get(node);
  unlink(top);
  std::vector<Node*> stack{&top};
  while (!stack.empty()) {
    Node* n = stack.back();
    stack.pop_back();
    out.push_back(n->id);
    std::vector<Node*> kids;
    kids.reserve(n->children.size());
    for (auto& [k, child] : n->children) kids.push_back(child);
    std::sort(kids.begin(), kids.end(), [](const Node* a, const Node* b) { return a->key < b->key; });
    for (Node* k : kids) {
      k->parent = nullptr;
      k->attached = false;
    }
    n->children.clear();
    n->by_first.clear();
    stack.insert(stack.end(), kids.rbegin(), kids.rend());  // pre-order, smallest key first
  }
  return out;
}

std::vector<NodeId> RadixTree::prune_upward(NodeId node) {
  std::vector<NodeId> out;
  Node* n = &get(node);
  while (n != nullptr && n->attached && !n->is_root && n->children.empty() && !n->has_page()) {
    Node* parent = n->parent;
    unlink(*n);
    out.push_back(n->id);
    maybe_delete(*n);  // pageless: nothing for the caller to free first
    n = parent;
  }
  return out;
}

PageHandle RadixTree::set_page(NodeId node, std::int64_t lc, PageHandle page, std::int64_t coverage) {
  Node& n = get(node);
  const std::size_t i = lc_index(lc);
  const PageHandle old = n.pages[i];
  n.pages[i] = page;
  n.coverage[i] = coverage;
  return old;
}

PageHandle RadixTree::clear_page(NodeId node, std::int64_t lc) {
  Node& n = get(node);
  const std::size_t i = lc_index(lc);
  const PageHandle old = n.pages[i];
  n.pages[i] = kNoPage;
  n.coverage[i] = 0;
  maybe_delete(n);
  return old;
}

void RadixTree::ref(NodeId node) { ++get(node).refs; }

void RadixTree::unref(NodeId node) {
  Node& n = get(node);
  if (n.refs <= 0) throw TreeAssertion("unref: not referenced");
  --n.refs;
  maybe_delete(n);
}

void RadixTree::collect(NodeId node) {
  auto it = nodes_.find(node);
  if (it != nodes_.end()) maybe_delete(it->second);
}

MatchResult RadixTree::match(NodeId root, std::span<const TokenArg> tokens_in, std::span<const Digest> keys,
                             bool partial, std::int64_t backoff) const {
  const std::vector<Code> tokens = encode_query(tokens_in);
  const auto n_tok = static_cast<std::int64_t>(tokens.size());
  const Node* node = &get(root);
  std::vector<const Node*> path;
  for (std::int64_t i = 0; i < n_tok / B_; ++i) {
    if (static_cast<std::size_t>(i) >= keys.size()) throw std::out_of_range("list index out of range");
    auto it = node->children.find(keys[static_cast<std::size_t>(i)]);
    if (it == node->children.end()) break;
    path.push_back(it->second);
    node = it->second;
  }
  std::int64_t m = static_cast<std::int64_t>(path.size()) * B_;
  if (partial && m < n_tok) {
    const auto [best, run] = longest_run(*node, tokens, static_cast<std::size_t>(m));
    if (best != nullptr) {
      path.push_back(best);
      m += run;
    }
  }
  m = std::max<std::int64_t>(0, m - backoff);
  MatchResult r;
  r.m_before_ssm = fixed_point(path, m, /*use_ssm=*/false);
  r.m = fixed_point(path, m, /*use_ssm=*/true);
  // path[: ceil(m / B)] with Python slice semantics.
  const auto len = static_cast<std::int64_t>(path.size());
  std::int64_t stop = ceildiv(r.m, B_);
  if (stop < 0) stop = std::max<std::int64_t>(0, stop + len);
  stop = std::min(stop, len);
  r.path.reserve(static_cast<std::size_t>(stop));
  for (std::int64_t j = 0; j < stop; ++j) r.path.push_back(path[static_cast<std::size_t>(j)]->id);
  return r;
}

// ---------------------------------------------------------------- queries

NodeId RadixTree::parent(NodeId node) const {
  const Node& n = get(node);
  return n.parent != nullptr ? n.parent->id : kNoNode;
}

bool RadixTree::is_attached(NodeId node) const { return get(node).attached; }

const Digest& RadixTree::key(NodeId node) const { return get(node).key; }

PageHandle RadixTree::page(NodeId node, std::int64_t lc) const { return get(node).pages[lc_index(lc)]; }

std::int64_t RadixTree::coverage(NodeId node, std::int64_t lc) const {
  return get(node).coverage[lc_index(lc)];
}

std::vector<NodeDump> RadixTree::dump() const {
  std::vector<NodeId> ids;
  ids.reserve(nodes_.size());
  for (const auto& [id, n] : nodes_) ids.push_back(id);
  std::sort(ids.begin(), ids.end());
  std::vector<NodeDump> out;
  out.reserve(ids.size());
  for (NodeId id : ids) {
    const Node& n = nodes_.at(id);
    NodeDump d;
    d.id = n.id;
    d.key = n.key;
    d.parent = n.parent != nullptr ? n.parent->id : kNoNode;
    d.attached = n.attached;
    d.is_root = n.is_root;
    d.ordinal = n.ordinal;
    d.tokens.reserve(n.tokens.size());
    for (Code c : n.tokens) {
      TokenOut t;
      if (c & kDigestBit) {
        t.is_digest = true;
        t.digest = digests_[c & ~kDigestBit];
      } else {
        t.value = c;
      }
      d.tokens.push_back(t);
    }
    for (const auto& [k, child] : n.children) d.children.push_back(child->id);
    std::sort(d.children.begin(), d.children.end());
    d.pages = n.pages;
    d.coverage = n.coverage;
    d.refs = n.refs;
    out.push_back(std::move(d));
  }
  return out;
}

// ---------------------------------------------------------------- helpers

RadixTree::Node& RadixTree::get(NodeId id) {
  auto it = nodes_.find(id);
  if (it == nodes_.end()) throw NoSuchNode(id);
  return it->second;
}

const RadixTree::Node& RadixTree::get(NodeId id) const {
  auto it = nodes_.find(id);
  if (it == nodes_.end()) throw NoSuchNode(id);
  return it->second;
}

std::size_t RadixTree::lc_index(std::int64_t lc) const {
  if (lc < 0 || static_cast<std::size_t>(lc) >= lcs_.size()) throw std::out_of_range("list index out of range");
  return static_cast<std::size_t>(lc);
}

RadixTree::Node& RadixTree::make_node(const Digest& key, std::vector<Code> tokens, std::int64_t ordinal,
                                      bool is_root) {
  const NodeId id = next_id_++;
  Node& n = nodes_[id];
  n.id = id;
  n.key = key;
  n.tokens = std::move(tokens);
  n.ordinal = ordinal;
  n.is_root = is_root;
  n.attached = is_root;
  n.pages.assign(lcs_.size(), kNoPage);
  n.coverage.assign(lcs_.size(), 0);
  return n;
}

void RadixTree::unlink(Node& n) {
  if (Node* p = n.parent; p != nullptr) {
    p->children.erase(n.key);
    if (!n.tokens.empty()) {
      auto g = p->by_first.find(n.tokens[0]);
      auto& group = g->second;
      group.erase(std::find(group.begin(), group.end(), &n));
      if (group.empty()) p->by_first.erase(g);
    }
  }
  n.parent = nullptr;
  n.attached = false;
}

bool RadixTree::deletable(const Node& n) const noexcept {
  return !n.attached && !n.is_root && n.refs == 0 && !n.has_page();
}

void RadixTree::maybe_delete(Node& start) {
  // Iterative (tree.py recurses): a dying node's children become detached and may die too.
  // Every node has one parent, so no node is queued twice; the order of deletions does
  // not change the resulting state.
  if (!deletable(start)) return;
  std::vector<Node*> work{&start};
  while (!work.empty()) {
    Node* n = work.back();
    work.pop_back();
    if (!deletable(*n)) continue;
    for (auto& [k, child] : n->children) {
      child->parent = nullptr;
      child->attached = false;
      work.push_back(child);
    }
    erase_node(*n);
  }
}

void RadixTree::erase_node(Node& n) {
  for (Code c : n.tokens) release(c);
  nodes_.erase(n.id);  // destroys n
}

NodeId RadixTree::covering(const Node& p, const std::vector<Code>& tokens) const {
  if (tokens.empty() || static_cast<std::int64_t>(tokens.size()) >= B_) return kNoNode;
  auto g = p.by_first.find(tokens[0]);
  if (g == p.by_first.end()) return kNoNode;
  const Node* best = nullptr;
  for (const Node* s : g->second) {
    if (s->tokens.size() > tokens.size() && starts_with(s->tokens, tokens)) {
      // Most tokens first; ties by smaller key.
      if (best == nullptr || s->tokens.size() > best->tokens.size() ||
          (s->tokens.size() == best->tokens.size() && s->key < best->key)) {
        best = s;
      }
    }
  }
  return best != nullptr ? best->id : kNoNode;
}

std::pair<const RadixTree::Node*, std::int64_t> RadixTree::longest_run(const Node& node,
                                                                       const std::vector<Code>& tokens,
                                                                       std::size_t start) const {
  const Node* best = nullptr;
  std::int64_t best_run = 0;
  auto g = node.by_first.find(tokens[start]);
  if (g == node.by_first.end()) return {nullptr, 0};
  for (const Node* c : g->second) {
    const std::size_t limit = std::min(c->tokens.size(), tokens.size() - start);
    std::size_t run = 0;
    while (run < limit && c->tokens[run] == tokens[start + run]) ++run;
    const auto r = static_cast<std::int64_t>(run);
    if (r > best_run || (r == best_run && best != nullptr && c->key < best->key)) {
      best = c;
      best_run = r;
    }
  }
  return {best, best_run};
}

std::int64_t RadixTree::fixed_point(const std::vector<const Node*>& path, std::int64_t m, bool use_ssm) const {
  const std::int64_t B = B_;
  while (true) {
    const std::int64_t m0 = m;
    for (std::size_t lc = 0; lc < lcs_.size(); ++lc) {
      const LifeCycleSpec& spec = lcs_[lc];
      if (spec.kind == LcKind::ssm) {
        if (!use_ssm) continue;
        // The match must end exactly at a snapshot.
        std::int64_t cut = 0;
        for (std::int64_t j = ceildiv(m, B) - 1; j >= 0; --j) {
          const std::int64_t c = at(path, j)->coverage[lc];
          if (0 < c && j * B + c <= m) {
            cut = j * B + c;
            break;
          }
        }
        m = cut;
        continue;
      }
      // Attention: every non-stale block below m needs a page covering its matched tokens.
      std::int64_t lo = 0, hi = 0;
      if (spec.window) {
        const std::int64_t nsink = ceildiv(spec.sinks, B);
        lo = nsink;
        hi = std::max(nsink, floordiv(m + 1 - *spec.window, B));
      }
      const std::int64_t n_blocks = ceildiv(m, B);
      for (std::int64_t j = 0; j < n_blocks; ++j) {
        if (lo <= j && j < hi) continue;
        const std::int64_t need = std::min(B, m - j * B);
        const std::int64_t cov = at(path, j)->coverage[lc];
        if (cov < need) {
          m = j * B + cov;
          break;
        }
      }
    }
    if (m == m0) return m;
  }
}

RadixTree::Code RadixTree::intern(const TokenArg& t) {
  if (t.digest == nullptr) {
    if (t.value & kDigestBit) throw std::invalid_argument("token out of range [0, 2**31)");
    return t.value;
  }
  Digest d;
  std::memcpy(d.data(), t.digest, d.size());
  auto it = digest_ids_.find(d);
  if (it != digest_ids_.end()) {
    ++digest_refs_[it->second];
    return kDigestBit | it->second;
  }
  Code id;
  if (!free_digest_ids_.empty()) {
    id = free_digest_ids_.back();
    free_digest_ids_.pop_back();
    digests_[id] = d;
    digest_refs_[id] = 1;
  } else {
    if (digests_.size() >= (kUnknownDigest & ~kDigestBit)) throw std::length_error("too many distinct digest tokens");
    id = static_cast<Code>(digests_.size());
    digests_.push_back(d);
    digest_refs_.push_back(1);
  }
  digest_ids_.emplace(d, id);
  return kDigestBit | id;
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

void RadixTree::release(Code c) noexcept {
  if (!(c & kDigestBit)) return;
  const Code id = c & ~kDigestBit;
  if (--digest_refs_[id] == 0) {
    digest_ids_.erase(digests_[id]);
    free_digest_ids_.push_back(id);
  }
}

std::vector<RadixTree::Code> RadixTree::encode_query(std::span<const TokenArg> tokens) const {
  std::vector<Code> out;
  out.reserve(tokens.size());
  for (const TokenArg& t : tokens) out.push_back(lookup(t));
  return out;
}

}  // namespace kvcm
