// nanobind layer over the plain C++ core.  It only converts between Python objects
// and core types, validates arguments exactly like kvcm.api (so both backends raise the
// same errors), and releases the GIL around long-running core calls.
#include <nanobind/nanobind.h>
#include <nanobind/stl/optional.h>
#include <nanobind/stl/string.h>
#include <nanobind/stl/tuple.h>
#include <nanobind/stl/vector.h>

#include <cstring>
#include <optional>
#include <stdexcept>
#include <string>

#include "core/block_keys.h"
#include "core/tree.h"
#include "core/sha256.h"
#include "token_parse.h"

namespace nb = nanobind;
using namespace nb::literals;
namespace pyconv = kvcm::pyconv;

namespace {

using pyconv::BufferView;
using pyconv::type_name;

std::uint32_t check_tokens_per_block(nb::handle b) {
  // Same rule and message as kvcm.keys.block_keys_py: an exact int in 1..4096.
  if (PyLong_CheckExact(b.ptr())) {
    int overflow = 0;
    const long long v = PyLong_AsLongLongAndOverflow(b.ptr(), &overflow);
    if (overflow == 0 && v >= 1 && v <= kvcm::kMaxTokensPerBlock) return static_cast<std::uint32_t>(v);
  }
  PyErr_Clear();
  const std::string r = nb::cast<std::string>(nb::repr(b));
  throw nb::value_error(("tokens_per_block must be an int in 1..4096, got " + r).c_str());
}

nb::bytes to_bytes(const kvcm::Digest& d) { return nb::bytes(reinterpret_cast<const char*>(d.data()), d.size()); }

nb::list block_keys(nb::handle tokens, nb::handle tokens_per_block, std::optional<std::uint64_t> lora_id,
                    std::optional<std::uint64_t> salt) {
  const std::uint32_t b = check_tokens_per_block(tokens_per_block);
  const kvcm::Digest root = kvcm::scope_root_key(lora_id, salt);
  PyObject* obj = tokens.ptr();
  if (PyList_CheckExact(obj) || PyTuple_CheckExact(obj)) {
    // A list's tokens are Python objects, read under the GIL anyway.  Hashing each chunk
    // as it is read (and storing each key straight into the result) lets the CPU overlap
    // the object loads and the bytes allocations with the latency-bound SHA rounds, where
    // converting everything first and hashing without the GIL paid for both in turn
    // (`bench keys`: about 2x the raw SHA-256 loop that way).  The price: the GIL is held
    // while such a list is hashed, a few ms per million tokens.
    const Py_ssize_t n = PySequence_Fast_GET_SIZE(obj);
    nb::list out = nb::steal<nb::list>(PyList_New((n + b - 1) / b));  // NULL items until set
    if (!out.is_valid()) throw nb::python_error();
    // Allocating the list can run the garbage collector, hence finalizers that could
    // resize `tokens`; from here on no Python code runs until the keys are in place.
    if (PySequence_Fast_GET_SIZE(obj) != n) throw std::runtime_error("tokens changed size during block_keys");
    Py_ssize_t next = 0;
    kvcm::KeyChain chain(root, b, [&](const kvcm::Digest& key) {
      PyList_SET_ITEM(out.ptr(), next++, to_bytes(key).release().ptr());
    });
    pyconv::parse_sequence(chain, obj, "tokens");
    chain.finish();
    return out;
  }
  // Buffers (numpy, array('i')...) are converted and hashed without the GIL; anything
  // else goes through check_tokens, and its list is hashed like the one above.
  std::vector<kvcm::Digest> keys;
  kvcm::KeyChain chain(root, b, [&keys](const kvcm::Digest& key) { keys.push_back(key); });
  pyconv::parse_tokens(chain, tokens, "tokens", pyconv::BufferGil::release);
  chain.finish();
  nb::list out = nb::steal<nb::list>(PyList_New(static_cast<Py_ssize_t>(keys.size())));
  if (!out.is_valid()) throw nb::python_error();
  for (std::size_t i = 0; i < keys.size(); ++i) {
    PyList_SET_ITEM(out.ptr(), static_cast<Py_ssize_t>(i), to_bytes(keys[i]).release().ptr());
  }
  return out;
}

nb::bytes sha256(nb::handle data) {
  PyObject* obj = data.ptr();
  if (PyUnicode_Check(obj)) throw nb::type_error("Strings must be encoded before hashing");
  BufferView bv;
  if (!bv.acquire(obj, PyBUF_SIMPLE)) {
    throw nb::type_error(("sha256() needs a bytes-like object, got " + type_name(obj)).c_str());
  }
  const Py_buffer& view = bv.get();
  const std::span<const std::uint8_t> span(static_cast<const std::uint8_t*>(view.buf),
                                           static_cast<std::size_t>(view.len));
  kvcm::Digest d;
  if (span.size() >= 2048) {
    // The export pins the memory (a bytearray cannot resize while exported).
    nb::gil_scoped_release release;
    d = kvcm::Sha256::hash(span);
  } else {
    d = kvcm::Sha256::hash(span);
  }
  return to_bytes(d);
}


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

  using kvcm::NodeId;
  using kvcm::RadixTree;
  // The core addresses nodes by slab handle; Python (and tree.py) by creation number.
  // Translate at this boundary: uid -> handle by a scan (test-sized trees only).
  const auto h = [](const RadixTree& t, NodeId uid) {
    const NodeId x = t.find_uid(uid);
    if (x == kvcm::kNoNode) throw kvcm::NoSuchNode(uid);
    return x;
  };
  const auto u = [](const RadixTree& t, NodeId handle) { return handle == kvcm::kNoNode ? handle : t.uid(handle); };
  const auto uids = [u](const RadixTree& t, const std::vector<NodeId>& handles) {
    std::vector<NodeId> out;
    for (NodeId x : handles) out.push_back(u(t, x));
    return out;
  };
  nb::class_<RadixTree>(m, "RadixTree",
                        "C++ port of kvcm.python_backend.tree.RadixTree (same methods, same results).")
      .def(
          "__init__",
          [](RadixTree* self, std::int64_t tokens_per_block, nb::handle life_cycles, std::uint32_t index_threshold) {
            new (self) RadixTree(tokens_per_block, to_life_cycles(life_cycles), index_threshold);
          },
          "tokens_per_block"_a, "life_cycles"_a, "index_threshold"_a = RadixTree::kIndexBuild,
          nb::sig("def __init__(self, tokens_per_block: int, "
                  "life_cycles: typing.Sequence[tuple[str, int | None, int]], index_threshold: int = 16) -> None"))
      .def("root", [u](RadixTree& t, nb::handle key) { return u(t, t.root(to_digest(key, "scope_key"))); },
           "scope_key"_a, nb::sig("def root(self, scope_key: bytes) -> int"))
      .def(
          "new_block",
          [u](RadixTree& t, nb::handle key, nb::handle tokens, std::int64_t ordinal) {
            const kvcm::Digest k = to_digest(key, "key");
            const TokenArgs ta = to_token_args(tokens);
            return u(t, t.new_block(k, ta.args, ordinal));
          },
          "key"_a, "tokens"_a, "ordinal"_a,
          nb::sig("def new_block(self, key: bytes, tokens: typing.Sequence[int | bytes], ordinal: int) -> int"))
      .def(
          "find_existing",
          [h, u](const RadixTree& t, NodeId parent, nb::handle key, nb::handle tokens) {
            const NodeId p = h(t, parent);
            const kvcm::Digest k = to_digest(key, "key");
            const TokenArgs ta = to_token_args(tokens);
            return u(t, t.find_existing(p, k, std::span<const kvcm::TokenArg>(ta.args)));
          },
          "parent"_a, "key"_a, "tokens"_a,
          nb::sig("def find_existing(self, parent: int, key: bytes, tokens: typing.Sequence[int | bytes]) -> int"))
      .def("attach", [h, uids](RadixTree& t, NodeId parent, NodeId node) {
             const NodeId p = h(t, parent);  // tree.py looks the parent up first
             return uids(t, t.attach(p, h(t, node)));
           }, "parent"_a, "node"_a)
      .def("detach", [h](RadixTree& t, NodeId node) { t.detach(h(t, node)); }, "node"_a)
      .def("remove_subtree", [h, uids](RadixTree& t, NodeId node) { return uids(t, t.remove_subtree(h(t, node))); },
           "node"_a)
      .def("prune_upward", [h](RadixTree& t, NodeId node) { return t.prune_upward(h(t, node)); }, "node"_a)
      .def("set_page", [h](RadixTree& t, NodeId node, std::int64_t lc, kvcm::PageHandle page, std::int64_t coverage) {
             return t.set_page(h(t, node), lc, page, coverage);
           }, "node"_a, "lc"_a, "page"_a, "coverage"_a)
      .def("clear_page", [h](RadixTree& t, NodeId node, std::int64_t lc) { return t.clear_page(h(t, node), lc); },
           "node"_a, "lc"_a)
      .def("ref", [h](RadixTree& t, NodeId node) { t.ref(h(t, node)); }, "node"_a)
      .def("unref", [h](RadixTree& t, NodeId node) { t.unref(h(t, node)); }, "node"_a)
      .def("collect", [](RadixTree& t, NodeId node) {
             const NodeId x = t.find_uid(node);
             if (x != kvcm::kNoNode) t.collect(x);
           }, "node"_a)
      .def(
          "match",
          [h, uids](const RadixTree& t, NodeId root, nb::handle tokens, nb::handle keys, bool partial,
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
      .def("parent", [h, u](const RadixTree& t, NodeId node) { return u(t, t.parent(h(t, node))); }, "node"_a)
      .def("is_attached", [h](const RadixTree& t, NodeId node) { return t.is_attached(h(t, node)); }, "node"_a)
      .def("exists", [](const RadixTree& t, NodeId node) { return t.find_uid(node) != kvcm::kNoNode; }, "node"_a)
      .def("key", [h](const RadixTree& t, NodeId node) { return to_bytes(t.key(h(t, node))); }, "node"_a)
      .def("page", [h](const RadixTree& t, NodeId node, std::int64_t lc) { return t.page(h(t, node), lc); },
           "node"_a, "lc"_a)
      .def("coverage", [h](const RadixTree& t, NodeId node, std::int64_t lc) { return t.coverage(h(t, node), lc); },
           "node"_a, "lc"_a)
      .def("dump", &dump_tree, nb::sig("def dump(self) -> list"), "Canonical picture: every live node by id.")
      .def("__len__", &RadixTree::num_nodes)
      .def_prop_ro("B", &RadixTree::tokens_per_block)
      .def_prop_ro("num_lcs", &RadixTree::num_life_cycles);
}

}  // namespace

// cpp/manager_bindings.cpp
void bind_manager(nb::module_& m);

NB_MODULE(_kvcm_cpp, m) {
  m.doc() = "kvcm C++ core (nanobind bindings)";

  m.def("block_keys", &block_keys, "tokens"_a.none(), "tokens_per_block"_a, "lora_id"_a = nb::none(),
        "salt"_a = nb::none(),
        nb::sig("def block_keys(tokens: object, tokens_per_block: int, lora_id: int | None = None, "
                "salt: int | None = None) -> list[bytes]"),
        "One SHA-256 key per full or partial block of ``tokens`` (SPEC sec. 3).  Tokens are validated "
        "like kvcm.api.check_tokens; the GIL is released while hashing.");

  m.def(
      "scope_root_key",
      [](std::optional<std::uint64_t> lora_id, std::optional<std::uint64_t> salt) {
        return to_bytes(kvcm::scope_root_key(lora_id, salt));
      },
      "lora_id"_a = nb::none(), "salt"_a = nb::none(),
      "sha256(mask || lora_le64? || salt_le64?), the root key of a ReuseScope.");

  m.def("sha256", &sha256, "data"_a, nb::sig("def sha256(data: bytes | bytearray | memoryview) -> bytes"),
        "SHA-256 digest of a bytes-like object.");

  m.def(
      "raw_sha256_loop",
      [](std::size_t n_blocks, std::size_t block_bytes) {
        nb::gil_scoped_release release;
        return kvcm::raw_sha256_loop(n_blocks, block_bytes);
      },
      "n_blocks"_a, "block_bytes"_a,
      "Chain ``n_blocks`` hashes of (32-byte parent || ``block_bytes`` bytes); returns elapsed ns.");

  m.def(
      "sha256_impl", []() { return std::string(kvcm::sha256_impl_name()); },
      "The SHA-256 compression in use: 'shani' or 'portable'.");
  m.def("sha256_shani_available", &kvcm::sha256_shani_available, "True when the CPU supports SHA-NI.");
  m.def(
      "_set_sha256_impl",
      [](const std::string& name) {
        if (name == "portable") return kvcm::sha256_set_impl(kvcm::Sha256Impl::portable);
        if (name == "shani") return kvcm::sha256_set_impl(kvcm::Sha256Impl::shani);
        if (name == "auto") {
          return kvcm::sha256_set_impl(kvcm::sha256_shani_available() ? kvcm::Sha256Impl::shani
                                                                       : kvcm::Sha256Impl::portable);
        }
        throw nb::value_error("impl must be 'portable', 'shani' or 'auto'");
      },
      "name"_a, "Testing hook: select the SHA-256 compression; False if unavailable.");

  m.def(
      "build_info",
      []() {
        nb::dict d;
        d["version"] = KVCM_VERSION;
        d["build_type"] = KVCM_BUILD_TYPE;
        d["sanitize"] = static_cast<bool>(KVCM_SANITIZE_ON);
        d["compiler"] = __VERSION__;
        d["cxx_standard"] = static_cast<long>(__cplusplus);
        d["sha256_impl"] = std::string(kvcm::sha256_impl_name());
        return d;
      },
      "Build details for `python -m kvcm info`.");

  bind_radix_tree(m);
  bind_manager(m);
}
