// nanobind layer over the plain C++ core: the production module kvcm._kvcm_cpp.  It only
// converts between Python objects and core types, validates arguments exactly like kvcm.api
// (so both backends raise the same errors), and releases the GIL around long-running core
// calls.  Test-only surface (the RadixTree binding, dump, the raw SHA-256 loop) lives in
// the separate module kvcm._kvcm_cpp_testing (cpp/testing_bindings.cpp).
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
        "like kvcm.checks.check_tokens; the GIL is released while hashing.");

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

  bind_manager(m);
}
