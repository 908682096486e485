// The test-only extension module kvcm._kvcm_cpp_testing (nanobind's pattern of a separate
// test module): surface that tests and benchmarks use but users of kvcm do not — the
// RadixTree port driven in lockstep with tree.py by parity/test_tree_differential.py (with
// its canonical dump), and the raw SHA-256 loop (`python -m kvcm bench keys`' floor).
// It links its own copy of the static core; it shares no state with kvcm._kvcm_cpp.
#include <nanobind/nanobind.h>
#include <nanobind/stl/optional.h>
#include <nanobind/stl/string.h>
#include <nanobind/stl/tuple.h>
#include <nanobind/stl/vector.h>

#include <cstring>
#include <optional>
#include <stdexcept>
#include <string>

#include "core/sha256.h"
#include "core/tree.h"
#include "token_parse.h"

namespace nb = nanobind;
using namespace nb::literals;
namespace pyconv = kvcm::pyconv;

namespace {

using pyconv::type_name;

nb::bytes to_bytes(const kvcm::Digest& d) { return nb::bytes(reinterpret_cast<const char*>(d.data()), d.size()); }

// ---------------------------------------------------------------------------------------
// RadixTree argument conversion
// ---------------------------------------------------------------------------------------

kvcm::Digest to_digest(nb::handle obj, const char* what) {
  if (!PyBytes_Check(obj.ptr())) {
    throw nb::type_error((std::string(what) + " must be bytes, got " + type_name(obj.ptr())).c_str());
  }
  if (PyBytes_GET_SIZE(obj.ptr()) != 32) {
    throw nb::value_error((std::string(what) + " must be 32 bytes, got " +
                           std::to_string(PyBytes_GET_SIZE(obj.ptr()))).c_str());
  }
  kvcm::Digest d;
  std::memcpy(d.data(), PyBytes_AS_STRING(obj.ptr()), d.size());
  return d;
}

// A token sequence borrowed for one tree call: digest tokens point into the bytes objects,
// which `holder` (the sequence being read) keeps alive until the call returns.
struct TokenArgs {
  nb::object holder;
  std::vector<kvcm::TokenArg> args;

  // pyconv::TokenSink
  void reserve(std::size_t n) { args.reserve(n); }
  void append_ints(const std::uint32_t* v, std::size_t n) {
    for (std::size_t i = 0; i < n; ++i) args.push_back({v[i], nullptr});
  }
  void append_digest(pyconv::DigestSpan d) { args.push_back({0, d.data()}); }
};

TokenArgs to_token_args(nb::handle seq) {
  // tree.py takes any sequence as-is (no None, no .tolist()), hence not pyconv::parse_tokens.
  TokenArgs out;
  out.holder = nb::steal(PySequence_Fast(seq.ptr(), "tokens must be a sequence"));
  if (!out.holder.is_valid()) throw nb::python_error();
  pyconv::parse_sequence(out, out.holder.ptr(), "tokens");
  return out;
}

std::vector<kvcm::LifeCycleSpec> to_life_cycles(nb::handle seq) {
  std::vector<kvcm::LifeCycleSpec> out;
  for (nb::handle item : seq) {
    auto [kind, window, sinks] = nb::cast<std::tuple<std::string, std::optional<std::int64_t>, std::int64_t>>(item);
    kvcm::LifeCycleSpec lc;
    if (kind == "attn") {
      lc.kind = kvcm::LcKind::attn;
    } else if (kind == "ssm") {
      lc.kind = kvcm::LcKind::ssm;
    } else {
      throw nb::value_error(("life cycle kind must be 'attn' or 'ssm', got '" + kind + "'").c_str());
    }
    lc.window = window;
    lc.sinks = sinks;
    out.push_back(lc);
  }
  return out;
}

std::string hex(const kvcm::Digest& d) {
  static constexpr char digits[] = "0123456789abcdef";
  std::string s(d.size() * 2, '0');
  for (std::size_t i = 0; i < d.size(); ++i) {
    s[2 * i] = digits[d[i] >> 4];
    s[2 * i + 1] = digits[d[i] & 15];
  }
  return s;
}

template <typename T>
nb::list int_list(const std::vector<T>& v) {
  nb::list out;
  for (const T& x : v) out.append(nb::int_(x));
  return out;
}

// Same layout as tree.py's RadixTree.dump().
nb::list dump_tree(const kvcm::RadixTree& tree) {
  nb::list out;
  for (const kvcm::NodeDump& d : tree.dump()) {
    nb::list tokens;
    for (const kvcm::TokenOut& t : d.tokens) {
      if (t.is_digest) {
        tokens.append(nb::str(hex(t.digest).c_str()));
      } else {
        tokens.append(nb::int_(t.value));
      }
    }
    nb::list row;
    row.append(nb::int_(d.id));
    row.append(nb::str(hex(d.key).c_str()));
    row.append(nb::int_(d.parent));
    row.append(nb::bool_(d.attached));
    row.append(nb::bool_(d.is_root));
    row.append(nb::int_(d.ordinal));
    row.append(tokens);
    row.append(int_list(d.children));
    row.append(int_list(d.pages));
    row.append(int_list(d.coverage));
    row.append(nb::int_(d.refs));
    out.append(row);
  }
  return out;
}

using kvcm::NodeId;
using kvcm::RadixTree;

// The core addresses nodes by slab handle; Python (and tree.py) by creation number.
// Translate at this boundary: uid -> handle by a scan (test-sized trees only).
NodeId h(const RadixTree& t, NodeId uid) {
  const NodeId x = t.find_uid(uid);
  if (x == kvcm::kNoNode) throw kvcm::NoSuchNode(uid);
  return x;
}
NodeId u(const RadixTree& t, NodeId handle) { return handle == kvcm::kNoNode ? handle : t.uid(handle); }
std::vector<NodeId> uids(const RadixTree& t, const std::vector<NodeId>& handles) {
  std::vector<NodeId> out;
  for (NodeId x : handles) out.push_back(u(t, x));
  return out;
}

void bind_tree_mutations(nb::class_<RadixTree>& cls);
void bind_tree_queries(nb::class_<RadixTree>& cls);

void bind_radix_tree(nb::module_& m) {
  // tree.py signals caller mistakes with KeyError(node_id) and AssertionError; keep both.
  nb::register_exception_translator([](const std::exception_ptr& p, void*) {
    try {
      std::rethrow_exception(p);
    } catch (const kvcm::NoSuchNode& e) {
      nb::object id = nb::int_(e.id());
      PyErr_SetObject(PyExc_KeyError, id.ptr());
    } catch (const kvcm::TreeAssertion& e) {
      PyErr_SetString(PyExc_AssertionError, e.what());
    }
  });

  m.attr("NO_PAGE") = kvcm::kNoPage;
  m.attr("NO_NODE") = kvcm::kNoNode;

  nb::class_<RadixTree> cls(m, "RadixTree",
                           "C++ port of kvcm.python_backend.tree.RadixTree (same methods, same results).");
  bind_tree_mutations(cls);
  bind_tree_queries(cls);
}

// RadixTree's construction and mutations (tree.py's order).
void bind_tree_mutations(nb::class_<RadixTree>& cls) {
  cls
      .def(
          "__init__",
          [](RadixTree* self, std::int64_t tokens_per_block, nb::handle life_cycles, std::uint32_t index_threshold) {
            new (self) RadixTree(tokens_per_block, to_life_cycles(life_cycles), index_threshold);
          },
          "tokens_per_block"_a, "life_cycles"_a, "index_threshold"_a = RadixTree::kIndexBuild,
          nb::sig("def __init__(self, tokens_per_block: int, "
                  "life_cycles: typing.Sequence[tuple[str, int | None, int]], index_threshold: int = 16) -> None"))
      .def("root", [](RadixTree& t, nb::handle key) { return u(t, t.root(to_digest(key, "scope_key"))); },
           "scope_key"_a, nb::sig("def root(self, scope_key: bytes) -> int"))
      .def(
          "new_block",
          [](RadixTree& t, nb::handle key, nb::handle tokens, std::int64_t ordinal) {
            const kvcm::Digest k = to_digest(key, "key");
            const TokenArgs ta = to_token_args(tokens);
            return u(t, t.new_block(k, ta.args, ordinal));
          },
          "key"_a, "tokens"_a, "ordinal"_a,
          nb::sig("def new_block(self, key: bytes, tokens: typing.Sequence[int | bytes], ordinal: int) -> int"))
      .def(
          "find_existing",
          [](const RadixTree& t, NodeId parent, nb::handle key, nb::handle tokens) {
            const NodeId p = h(t, parent);
            const kvcm::Digest k = to_digest(key, "key");
            const TokenArgs ta = to_token_args(tokens);
            return u(t, t.find_existing(p, k, std::span<const kvcm::TokenArg>(ta.args)));
          },
          "parent"_a, "key"_a, "tokens"_a,
          nb::sig("def find_existing(self, parent: int, key: bytes, tokens: typing.Sequence[int | bytes]) -> int"))
      .def("attach", [](RadixTree& t, NodeId parent, NodeId node) {
             const NodeId p = h(t, parent);  // tree.py looks the parent up first
             return uids(t, t.attach(p, h(t, node)));
           }, "parent"_a, "node"_a)
      .def("detach", [](RadixTree& t, NodeId node) { t.detach(h(t, node)); }, "node"_a)
      .def("remove_subtree", [](RadixTree& t, NodeId node) { return uids(t, t.remove_subtree(h(t, node))); },
           "node"_a)
      .def("prune_upward", [](RadixTree& t, NodeId node) { return t.prune_upward(h(t, node)); }, "node"_a)
      .def("set_page", [](RadixTree& t, NodeId node, std::int64_t lc, kvcm::PageHandle page, std::int64_t coverage) {
             return t.set_page(h(t, node), lc, page, coverage);
           }, "node"_a, "lc"_a, "page"_a, "coverage"_a)
      .def("clear_page", [](RadixTree& t, NodeId node, std::int64_t lc) { return t.clear_page(h(t, node), lc); },
           "node"_a, "lc"_a)
      .def("ref", [](RadixTree& t, NodeId node) { t.ref(h(t, node)); }, "node"_a)
      .def("unref", [](RadixTree& t, NodeId node) { t.unref(h(t, node)); }, "node"_a)
      .def("collect", [](RadixTree& t, NodeId node) {
             const NodeId x = t.find_uid(node);
             if (x != kvcm::kNoNode) t.collect(x);
           }, "node"_a);
}

// RadixTree's match and queries.
void bind_tree_queries(nb::class_<RadixTree>& cls) {
  cls
      .def(
          "match",
          [](const RadixTree& t, NodeId root, nb::handle tokens, nb::handle keys, bool partial,
                    std::int64_t backoff) {
            const NodeId r0 = h(t, root);
            const TokenArgs ta = to_token_args(tokens);
            std::vector<kvcm::Digest> ks;
            for (nb::handle k : keys) ks.push_back(to_digest(k, "key"));
            kvcm::MatchResult r = t.match(r0, std::span<const kvcm::TokenArg>(ta.args), ks, partial, backoff);
            return std::make_tuple(r.m, r.m_before_ssm, uids(t, r.path));
          },
          "root"_a, "tokens"_a, "keys"_a, "partial"_a, "backoff"_a,
          nb::sig("def match(self, root: int, tokens: typing.Sequence[int | bytes], keys: typing.Sequence[bytes], "
                  "partial: bool, backoff: int) -> tuple[int, int, list[int]]"))
      .def("parent", [](const RadixTree& t, NodeId node) { return u(t, t.parent(h(t, node))); }, "node"_a)
      .def("is_attached", [](const RadixTree& t, NodeId node) { return t.is_attached(h(t, node)); }, "node"_a)
      .def("exists", [](const RadixTree& t, NodeId node) { return t.find_uid(node) != kvcm::kNoNode; }, "node"_a)
      .def("key", [](const RadixTree& t, NodeId node) { return to_bytes(t.key(h(t, node))); }, "node"_a)
      .def("page", [](const RadixTree& t, NodeId node, std::int64_t lc) { return t.page(h(t, node), lc); },
           "node"_a, "lc"_a)
      .def("coverage", [](const RadixTree& t, NodeId node, std::int64_t lc) { return t.coverage(h(t, node), lc); },
           "node"_a, "lc"_a)
      .def("dump", &dump_tree, nb::sig("def dump(self) -> list"), "Canonical picture: every live node by id.")
      .def("__len__", &RadixTree::num_nodes)
      .def_prop_ro("B", &RadixTree::tokens_per_block)
      .def_prop_ro("num_lcs", &RadixTree::num_life_cycles);
}

}  // namespace

NB_MODULE(_kvcm_cpp_testing, m) {
  m.doc() = "kvcm C++ core: test-only surface (the RadixTree port, the raw SHA-256 loop)";
  m.def(
      "raw_sha256_loop",
      [](std::size_t n_blocks, std::size_t block_bytes) {
        nb::gil_scoped_release release;
        return kvcm::raw_sha256_loop(n_blocks, block_bytes);
      },
      "n_blocks"_a, "block_bytes"_a,
      "Chain ``n_blocks`` hashes of (32-byte parent || ``block_bytes`` bytes); returns elapsed ns.");

  bind_radix_tree(m);
}
