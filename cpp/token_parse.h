// Python token sequences -> validated tokens, with the exact semantics and messages of
// kvcm.checks.check_tokens.  One implementation for every binding that takes tokens
// (block_keys, the manager calls, the RadixTree port), so their errors cannot drift apart.
// It reads Python objects, so it lives in the binding layer, not in the core.
#pragma once

#include <nanobind/nanobind.h>

#include <algorithm>
#include <bit>
#include <concepts>
#include <cstddef>
#include <cstdint>
#include <cstring>
#include <optional>
#include <span>
#include <string>
#include <string_view>
#include <type_traits>

#include "core/block_keys.h"

namespace kvcm::pyconv {

namespace nb = nanobind;

static_assert(std::endian::native == std::endian::little,
              "the buffer fast path assumes a little-endian host ('@', '=' and '<' formats read as-is)");

using DigestSpan = std::span<const std::uint8_t, kDigestTokenBytes>;

// Where parsed tokens go, in order.  append_ints receives validated int tokens (< 2**31) in
// chunks; a digest's bytes are only guaranteed alive during the call (a sink that keeps the
// pointer must keep the parsed sequence alive itself).
template <class S>
concept TokenSink = requires(S& s, const std::uint32_t* ints, std::size_t n, DigestSpan digest) {
  s.reserve(n);
  s.append_ints(ints, n);
  s.append_digest(digest);
};

// Owns one buffer export; releasing it on every path (including exceptions) is why it exists.
class BufferView {
 public:
  BufferView() = default;
  BufferView(const BufferView&) = delete;
  BufferView& operator=(const BufferView&) = delete;
  ~BufferView() {
    if (held_) PyBuffer_Release(&view_);
  }
  // False (with the Python error cleared) when `obj` cannot export such a buffer.
  bool acquire(PyObject* obj, int flags) {
    if (PyObject_GetBuffer(obj, &view_, flags) != 0) {
      PyErr_Clear();
      return false;
    }
    held_ = true;
    return true;
  }
  const Py_buffer& get() const { return view_; }

 private:
  Py_buffer view_{};
  bool held_ = false;
};

// type(obj).__name__, as kvcm.api's messages use it (tp_name would include the module).
inline std::string type_name(PyObject* obj) {
  return nb::cast<std::string>(nb::handle(reinterpret_cast<PyObject*>(Py_TYPE(obj))).attr("__name__"));
}

[[noreturn]] inline void raise_out_of_range(std::string_view name, const std::string& value) {
  throw nb::value_error((std::string(name) + ": token " + value + " out of range [0, 2**31)").c_str());
}

// The value of an exact `int` in [0, 2**31), read straight from its digits; false for
// everything else (bool, int subclasses, negative or large values, other types), which the
// checked path then handles.  This is the per-token cost of a list, so it makes no call.
inline bool small_exact_int(PyObject* t, std::uint32_t& out) noexcept {
  if (!PyLong_CheckExact(t)) return false;
#if PY_VERSION_HEX >= 0x030C0000
  const auto* l = reinterpret_cast<PyLongObject*>(t);
  if (!PyUnstable_Long_IsCompact(l)) return false;
  const Py_ssize_t v = PyUnstable_Long_CompactValue(l);
  if (v < 0 || static_cast<std::uint64_t>(v) >= kTokenLimit) return false;
  out = static_cast<std::uint32_t>(v);
  return true;
#else
  // 3.11: ob_size is the signed digit count (0 for zero, negative for negative values).
  const auto* l = reinterpret_cast<const PyLongObject*>(t);
  switch (Py_SIZE(t)) {
    case 0:
      out = 0;
      return true;
    case 1:
      out = static_cast<std::uint32_t>(l->ob_digit[0]);  // < 2**PyLong_SHIFT <= 2**30
      return true;
    case 2: {
      const std::uint64_t v = std::uint64_t{l->ob_digit[0]} | (std::uint64_t{l->ob_digit[1]} << PyLong_SHIFT);
      if (v >= kTokenLimit) return false;
      out = static_cast<std::uint32_t>(v);
      return true;
    }
    default:
      return false;
  }
#endif
}

// str() of the int value of `t` (an int or int subclass), read without calling any method
// a subclass could override (kvcm.api.as_int: int.__index__ of the base type).
inline std::string exact_int_str(PyObject* t) {
  nb::object v = nb::steal(PyLong_Type.tp_as_number->nb_index(t));
  if (!v.is_valid()) throw nb::python_error();
  return nb::cast<std::string>(nb::str(v));
}

// Any list item that small_exact_int declined: check_tokens' checks and messages (bool is
// rejected; int subclasses are accepted by value; bytes must be exact and 32 long).
template <TokenSink S>
void parse_checked_item(S& out, PyObject* t, std::string_view name) {
  if (PyLong_Check(t) && !PyBool_Check(t)) {
    int overflow = 0;
    const long long v = PyLong_AsLongLongAndOverflow(t, &overflow);
    if (v == -1 && PyErr_Occurred()) throw nb::python_error();
    if (overflow != 0 || v < 0 || static_cast<unsigned long long>(v) >= kTokenLimit) {
      // An int subclass is reported by its int value, like check_tokens does (kvcm.api.as_int).
      if (overflow == 0) raise_out_of_range(name, std::to_string(v));
      raise_out_of_range(name, exact_int_str(t));
    }
    const auto u = static_cast<std::uint32_t>(v);
    out.append_ints(&u, 1);
    return;
  }
  if (PyBytes_CheckExact(t)) {
    const Py_ssize_t n = PyBytes_GET_SIZE(t);
    if (n != static_cast<Py_ssize_t>(kDigestTokenBytes)) {
      throw nb::value_error(
          (std::string(name) + ": a digest token must be 32 bytes, got " + std::to_string(n)).c_str());
    }
    out.append_digest(DigestSpan(reinterpret_cast<const std::uint8_t*>(PyBytes_AS_STRING(t)), kDigestTokenBytes));
    return;
  }
  throw nb::type_error((std::string(name) + ": a token must be an int or 32 bytes, got " + type_name(t)).c_str());
}

// Ints are staged in a small stack chunk and handed over in bulk: the sink's bookkeeping
// runs once per chunk instead of once per token.  The chunk is small on purpose: a sink
// that hashes (kvcm::KeyChain) then alternates a few SHA-256 rounds, which are latency
// bound, with the next chunk's conversion, and the CPU overlaps the two (measured on
// `bench keys`: 256-token chunks were clearly slower than 16 or 32).
inline constexpr std::size_t kChunkTokens = 32;
// A list's int objects are separate heap objects: ask for them this many items ahead, so
// their loads are in flight while the current chunk is hashed.
inline constexpr Py_ssize_t kPrefetchAhead = 64;

// A chunk of `m` list items that are all exact ints below 2**30 — the common case: one
// 30-bit digit on 3.11 — converted with no branch per item (type and size folded into one
// flag); false (the chunk then goes item by item) when any item is anything else.
inline bool small_int_chunk(PyObject* const* items, std::size_t m, std::uint32_t* chunk) noexcept {
#if PY_VERSION_HEX >= 0x030C0000
  bool ok = true;
  for (std::size_t j = 0; j < m; ++j) ok &= small_exact_int(items[j], chunk[j]);
  return ok;
#else
  std::uintptr_t bad = 0;
  for (std::size_t j = 0; j < m; ++j) {
    PyObject* t = items[j];
    bad |= reinterpret_cast<std::uintptr_t>(Py_TYPE(t)) ^ reinterpret_cast<std::uintptr_t>(&PyLong_Type);
    bad |= static_cast<std::size_t>(Py_SIZE(t)) > 1;  // 0 or 1 digit (negative sizes wrap)
    // 3.11 allocates at least one digit (0 for zero), so the read is always in bounds
    chunk[j] = static_cast<std::uint32_t>(reinterpret_cast<const PyLongObject*>(t)->ob_digit[0]);
  }
  return bad == 0;
#endif
}

// An exact list or tuple (or PySequence_Fast's result).  Runs no Python code until it
// raises, so the sequence cannot change under the loop.
template <TokenSink S>
void parse_sequence(S& out, PyObject* seq, std::string_view name) {
  const Py_ssize_t n = PySequence_Fast_GET_SIZE(seq);
  PyObject* const* items = PySequence_Fast_ITEMS(seq);
  out.reserve(static_cast<std::size_t>(n));
  std::uint32_t chunk[kChunkTokens];
  for (Py_ssize_t i = 0; i < n;) {
    const auto m = static_cast<std::size_t>(std::min<Py_ssize_t>(static_cast<Py_ssize_t>(kChunkTokens), n - i));
    if (i + kPrefetchAhead + static_cast<Py_ssize_t>(m) <= n) {
      for (std::size_t j = 0; j < m; ++j) __builtin_prefetch(items[i + kPrefetchAhead + static_cast<Py_ssize_t>(j)]);
    }
    if (small_int_chunk(items + i, m, chunk)) {
      out.append_ints(chunk, m);
      i += static_cast<Py_ssize_t>(m);
      continue;
    }
    std::size_t k = 0;  // this chunk item by item: the checked path for what is no small int
    for (std::size_t j = 0; j < m; ++j, ++i) {
      if (small_exact_int(items[i], chunk[k])) {
        ++k;
        continue;
      }
      out.append_ints(chunk, k);
      k = 0;
      parse_checked_item(out, items[i], name);
    }
    out.append_ints(chunk, k);
  }
}

template <typename T>
constexpr bool token_in_range(T v) noexcept {
  if constexpr (std::is_signed_v<T>) {
    return v >= 0 && static_cast<std::uint64_t>(v) < kTokenLimit;
  } else {
    return static_cast<std::uint64_t>(v) < kTokenLimit;
  }
}

// One chunk of a buffer: convert all, then raise for the first bad value if any.  Checking
// with a branch-free OR keeps the contiguous loop vectorisable.
template <typename T, Py_ssize_t kStride>
void convert_chunk(std::uint32_t* dst, const char* src, std::size_t m, Py_ssize_t stride, std::string_view name) {
  if constexpr (kStride != 0) stride = kStride;
  bool bad = false;
  for (std::size_t j = 0; j < m; ++j) {
    T v;
    std::memcpy(&v, src + static_cast<Py_ssize_t>(j) * stride, sizeof v);  // may be unaligned
    bad |= !token_in_range(v);
    dst[j] = static_cast<std::uint32_t>(v);
  }
  if (!bad) return;
  for (std::size_t j = 0; j < m; ++j) {
    T v;
    std::memcpy(&v, src + static_cast<Py_ssize_t>(j) * stride, sizeof v);
    if (!token_in_range(v)) raise_out_of_range(name, std::to_string(v));
  }
}

template <typename T, TokenSink S>
void parse_buffer_items(S& out, const Py_buffer& view, std::string_view name) {
  const auto n = static_cast<std::size_t>(view.shape[0]);
  const Py_ssize_t stride = view.strides ? view.strides[0] : view.itemsize;
  const auto* base = static_cast<const char*>(view.buf);
  out.reserve(n);
  std::uint32_t chunk[kChunkTokens];
  for (std::size_t i = 0; i < n; i += kChunkTokens) {
    const std::size_t m = std::min(kChunkTokens, n - i);
    const char* src = base + static_cast<Py_ssize_t>(i) * stride;
    if (stride == static_cast<Py_ssize_t>(sizeof(T))) {
      convert_chunk<T, static_cast<Py_ssize_t>(sizeof(T))>(chunk, src, m, stride, name);
    } else {
      convert_chunk<T, 0>(chunk, src, m, stride, name);
    }
    out.append_ints(chunk, m);
  }
}

// The no-Python-loop path for numpy arrays, array('i'), memoryviews...: a 1-D buffer of
// native-order integers.  Returns false (nothing appended) for anything else, which then
// goes through check_tokens itself so the error (or result) is exactly its.
// Whether a buffer's conversion may run without the GIL: only for sinks that touch no
// Python object.  The export pins the buffer's memory (it cannot be resized or freed while
// exported), so reading it unlocked is safe; a concurrent writer can only change the values.
enum class BufferGil { hold, release };

// Below this many items, dropping and retaking the GIL costs more than it lets others run.
inline constexpr Py_ssize_t kReleaseGilItems = 4096;

// Calls fn(T{}) with T the element type of a 1-D buffer of native integers (array('i'),
// numpy int arrays, memoryviews) and returns true; returns false without calling fn for
// any other buffer (floats, bools, 2-D, other formats).
template <typename Fn>
bool with_int_type(const Py_buffer& view, Fn&& fn) {
  if (view.ndim != 1 || view.format == nullptr) return false;
  const char* f = view.format;
  if (*f == '@' || *f == '=' || *f == '<') ++f;
  if (f[0] == '\0' || f[1] != '\0') return false;
  const bool is_signed = std::strchr("bhilqn", f[0]) != nullptr;
  if (!is_signed && std::strchr("BHILQN", f[0]) == nullptr) return false;
  switch (view.itemsize) {
    case 1:
      is_signed ? fn(std::int8_t{}) : fn(std::uint8_t{});
      return true;
    case 2:
      is_signed ? fn(std::int16_t{}) : fn(std::uint16_t{});
      return true;
    case 4:
      is_signed ? fn(std::int32_t{}) : fn(std::uint32_t{});
      return true;
    case 8:
      is_signed ? fn(std::int64_t{}) : fn(std::uint64_t{});
      return true;
    default:
      return false;
  }
}

template <TokenSink S>
bool try_parse_buffer(S& out, PyObject* obj, std::string_view name, BufferGil gil = BufferGil::hold) {
  BufferView bv;
  if (!bv.acquire(obj, PyBUF_FORMAT | PyBUF_STRIDES)) return false;
  const Py_buffer& view = bv.get();
  return with_int_type(view, [&](auto item) {
    // Released after the format checks and retaken (also when a bad value throws) before
    // bv gives the buffer back.  The out-of-range error is built without touching Python.
    std::optional<nb::gil_scoped_release> unlocked;
    if (gil == BufferGil::release && view.shape[0] >= kReleaseGilItems) unlocked.emplace();
    parse_buffer_items<decltype(item)>(out, view, name);
  });
}

// kvcm.checks.check_tokens(tokens, name) into `out`: the same tokens, the same errors.  Fast
// paths for exact list/tuple and 1-D int buffers; anything else (torch tensors, list
// subclasses, ranges, nested arrays, generators...) is normalised or rejected by
// check_tokens itself, so its errors match by construction.
// Python twin: kvcm.checks.check_tokens / _token_items (the one rule for a token sequence,
// DECISIONS "Tokens"; SPEC sec. 1 and 10).
template <TokenSink S>
void parse_tokens(S& out, nb::handle tokens, std::string_view name, BufferGil buffer_gil = BufferGil::hold) {
  PyObject* obj = tokens.ptr();
  if (obj == Py_None || PyUnicode_Check(obj) || PyBytes_Check(obj) || PyByteArray_Check(obj)) {
    throw nb::type_error((std::string(name) + " must be a sequence of tokens, got " + type_name(obj)).c_str());
  }
  if (PyList_CheckExact(obj) || PyTuple_CheckExact(obj)) {
    parse_sequence(out, obj, name);
    return;
  }
  // check_tokens converts via .tolist() exactly when this attribute exists (and obj is no
  // list).  Memoryviews take check_tokens' path: one over bytes is rejected there.
  if (!PyList_Check(obj) && !PyMemoryView_Check(obj) && PyObject_HasAttrString(obj, "tolist") &&
      PyObject_CheckBuffer(obj)) {
    if (try_parse_buffer(out, obj, name, buffer_gil)) return;
  }
  nb::object normalised =
      nb::module_::import_("kvcm.checks").attr("check_tokens")(tokens, nb::str(name.data(), name.size()));
  if (!PyList_CheckExact(normalised.ptr())) throw nb::type_error("check_tokens did not return a list");
  parse_sequence(out, normalised.ptr(), name);
}

}  // namespace kvcm::pyconv
