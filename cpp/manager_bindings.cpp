// nanobind layer over kvcm::Manager (cpp/core/manager.h).  Thin: converts arguments and
// results, translates core errors into the kvcm.api types, and runs every core call with
// the GIL released and the manager's mutex held (always in that order: no deadlock).
#include <nanobind/nanobind.h>
#include <nanobind/stl/optional.h>
#include <nanobind/stl/pair.h>
#include <nanobind/stl/string.h>
#include <nanobind/stl/tuple.h>
#include <nanobind/stl/vector.h>

#include <structmember.h>

#include <algorithm>
#include <array>
#include <cstring>
#include <deque>
#include <type_traits>
#include <mutex>
#include <set>
#include <unordered_set>
#include <optional>
#include <string>
#include <utility>
#include <vector>

#include "core/manager.h"
#include "token_parse.h"

namespace nb = nanobind;
using namespace nb::literals;

namespace {

using kvcm::Manager;

// kvcm.api objects, looked up once (kept alive for the process: no teardown order issues).
PyObject* api_attr(const char* name) {
  nb::object mod = nb::module_::import_("kvcm.api");
  nb::object o = mod.attr(name);
  return o.release().ptr();
}

struct Api {
  PyObject* CopyOp = api_attr("CopyOp");
  PyObject* CopyRun = api_attr("CopyRun");
  PyObject* StoredEvent = api_attr("StoredEvent");
  PyObject* StoredBlock = api_attr("StoredBlock");
  PyObject* RemovedEvent = api_attr("RemovedEvent");
  PyObject* TierChangedEvent = api_attr("TierChangedEvent");
  PyObject* ClearedEvent = api_attr("ClearedEvent");
  PyObject* InvalidStateError = api_attr("InvalidStateError");
  PyObject* ClosedError = api_attr("ClosedError");
  PyObject* InvariantError = api_attr("InvariantError");
};

const Api& api() {
  static const Api* a = new Api();  // intentionally never freed
  return *a;
}

nb::handle h(PyObject* o) { return nb::handle(o); }

// A copy op's reason as an interned str, borrowed.  Reasons are a handful of string
// literals: the last few seen are remembered by address, so an op costs no strlen and no
// interning lookup (the table only ever grows by the distinct literals the core uses).
PyObject* reason_str(const char* reason) {
  static std::vector<std::pair<const char*, PyObject*>> seen;  // kept for the process
  for (const auto& [p, str] : seen) {
    if (p == reason) return str;
  }
  PyObject* str = PyUnicode_InternFromString(reason);
  if (str == nullptr) throw nb::python_error();
  seen.emplace_back(reason, str);
  return str;
}

// Long calls: release the GIL, then take the manager's mutex (always in this order; the
// locked section never touches Python, so a thread holding the mutex never waits for the GIL).
// After the call (GIL held again): the one-time pending-copy-ops warning (SPEC sec. 15),
// issued through kvcm.api.warn_pending_copy_ops so both backends say the same.
void warn_if_due(std::int64_t pending, bool explicit_settlement) {
  if (pending == 0) return;
  static PyObject* warn = api_attr("warn_pending_copy_ops");  // kept alive for the process
  h(warn)(pending, explicit_settlement);
}

template <typename F>
auto locked(Manager& m, F&& f) {
  std::int64_t warn = 0;
  if constexpr (std::is_void_v<decltype(f())>) {
    {
      nb::gil_scoped_release release;
      std::lock_guard<std::mutex> lock(m.mutex());
      f();
      warn = m.take_copy_ops_warning();
    }
    warn_if_due(warn, m.explicit_settlement());
  } else {
    auto result = [&] {
      nb::gil_scoped_release release;
      std::lock_guard<std::mutex> lock(m.mutex());
      auto r = f();
      warn = m.take_copy_ops_warning();
      return r;
    }();
    warn_if_due(warn, m.explicit_settlement());
    return result;
  }
}

// Short calls (queries): take the mutex without the GIL round trip when it is free; when it
// is contended, fall back to releasing the GIL first, like locked().
template <typename F>
auto quick(Manager& m, F&& f) {
  std::unique_lock<std::mutex> lock(m.mutex(), std::try_to_lock);
  if (!lock.owns_lock()) return locked(m, std::forward<F>(f));
  return f();
}

using kvcm::pyconv::type_name;

// A validated token sequence (kvcm.checks.check_tokens semantics), converted once.  Digests
// are copied (a deque keeps their addresses stable), so the core can run without the GIL.
struct TokenBuf {
  std::vector<std::uint32_t> codes;  // kvcm::TokenSeq layout
  std::vector<kvcm::Digest> digests;

  kvcm::TokenSeq seq() const { return {codes, digests}; }
  // kvcm::pyconv::TokenSink
  void reserve(std::size_t n) { codes.reserve(n); }
  void append_ints(const std::uint32_t* v, std::size_t n) { codes.insert(codes.end(), v, v + n); }
  void append_digest(kvcm::pyconv::DigestSpan d) {
    kvcm::Digest& copy = digests.emplace_back();
    std::memcpy(copy.data(), d.data(), copy.size());
    codes.push_back(kvcm::kDigestCode | static_cast<std::uint32_t>(digests.size() - 1));
  }
};

TokenBuf parse_tokens(nb::handle tokens, const std::string& name) {
  TokenBuf out;
  kvcm::pyconv::parse_tokens(out, tokens, name);
  return out;
}

nb::object token_obj(const kvcm::TokenOut& t) {
  if (t.is_digest) return nb::bytes(reinterpret_cast<const char*>(t.digest.data()), t.digest.size());
  return nb::int_(t.value);
}

nb::bytes to_bytes(const kvcm::Digest& d) { return nb::bytes(reinterpret_cast<const char*>(d.data()), d.size()); }

nb::list token_list(const std::vector<kvcm::TokenOut>& toks) {
  nb::object out = nb::steal(PyList_New(static_cast<Py_ssize_t>(toks.size())));
  if (!out.is_valid()) throw nb::python_error();
  for (std::size_t i = 0; i < toks.size(); ++i) {
    PyList_SET_ITEM(out.ptr(), static_cast<Py_ssize_t>(i), token_obj(toks[i]).release().ptr());
  }
  return nb::borrow<nb::list>(out);
}

nb::tuple token_tuple(std::span<const kvcm::TokenOut> toks) {
  nb::object out = nb::steal(PyTuple_New(static_cast<Py_ssize_t>(toks.size())));
  if (!out.is_valid()) throw nb::python_error();
  for (std::size_t i = 0; i < toks.size(); ++i) {
    PyTuple_SET_ITEM(out.ptr(), static_cast<Py_ssize_t>(i), token_obj(toks[i]).release().ptr());
  }
  return nb::borrow<nb::tuple>(out);
}

nb::object event_obj(const kvcm::EventC& e, std::span<const kvcm::TokenOut> tokens,
                     std::span<const kvcm::StoredBlockC> stored) {
  const Api& a = api();
  switch (e.kind) {
    case kvcm::EventKind::stored: {
      nb::list blocks;
      nb::bytes key = to_bytes(e.key);
      nb::tuple toks = token_tuple(tokens);
      for (const kvcm::StoredBlockC& b : stored) {
        blocks.append(h(a.StoredBlock)(key, tokens.size(), toks, b.lc, b.tier, b.priority, b.coverage));
      }
      nb::object parent = e.has_parent ? nb::object(to_bytes(e.parent_key)) : nb::none();
      return h(a.StoredEvent)(e.id, parent, nb::tuple(blocks), e.partial);
    }
    case kvcm::EventKind::removed:
      return h(a.RemovedEvent)(e.id, nb::make_tuple(to_bytes(e.key)), e.lc);
    case kvcm::EventKind::tier_changed:
      return h(a.TierChangedEvent)(e.id, to_bytes(e.key), e.lc, e.old_tier, e.new_tier);
    case kvcm::EventKind::cleared:
    default:
      return h(a.ClearedEvent)(e.id);
  }
}

// kvcm.api.CopyOp objects without running the frozen dataclass' __init__ (seven
// object.__setattr__ calls through Python).  CopyOp is a slots dataclass: the instance is
// allocated and each field's slot written directly at the offset its member descriptor
// gives (looked up once) — an op costs two int objects and a few stores, which matters
// when every allocation of a full pool offloads a page.  Should CopyOp ever lose its
// slots, the fields go through the generic setattr instead (same result, slower).
// A new reference to the int `v`.  Slot numbers repeat op after op, so the ints below
// kIntCache are made once and kept for the process (at most kIntCache * 32 bytes); Python
// itself caches only -5..256.
PyObject* cached_int(std::int64_t v) {
  static constexpr std::int64_t kIntCache = 1 << 16;
  static std::vector<PyObject*> ints;  // index v: the int v, or nullptr until first needed
  if (v < 0 || v >= kIntCache) return PyLong_FromLongLong(v);
  const auto i = static_cast<std::size_t>(v);
  if (i >= ints.size()) ints.resize(std::min<std::size_t>(kIntCache, std::max<std::size_t>(i + 1, 2 * ints.size())));
  if (ints[i] == nullptr) {
    ints[i] = PyLong_FromLongLong(v);
    if (ints[i] == nullptr) return nullptr;
  }
  Py_INCREF(ints[i]);
  return ints[i];
}

// Where a slots dataclass of kvcm.api keeps each field, so the bindings can fill a new
// instance directly (no Python __init__; a frozen dataclass's sets every field through
// object.__setattr__).  direct is false when the layout is not the expected one (then
// the caller goes through the type's own construction).
template <int N>
struct SlotsLayout {
  static constexpr int kFields = N;
  PyObject* names[N] = {};
  Py_ssize_t offsets[N] = {};
  bool direct = true;
  SlotsLayout(PyObject* type, const std::array<const char*, N>& fields) {
    auto* tp = reinterpret_cast<PyTypeObject*>(type);
    for (int k = 0; k < N; ++k) {
      names[k] = PyUnicode_InternFromString(fields[static_cast<std::size_t>(k)]);  // kept for the process
      PyObject* d = names[k] != nullptr ? PyDict_GetItemWithError(tp->tp_dict, names[k]) : nullptr;
      if (d != nullptr && Py_TYPE(d) == &PyMemberDescr_Type) {
        const PyMemberDef* m = reinterpret_cast<PyMemberDescrObject*>(d)->d_member;
        direct = direct && m->type == T_OBJECT_EX && !(m->flags & READONLY);
        offsets[k] = m->offset;
      } else {
        direct = false;
      }
    }
    PyErr_Clear();
  }
  // A new instance of `type` owning `fields` (stolen, all non-null), or an invalid object
  // with a Python error set.
  nb::object make(PyObject* type, PyObject* (&fields)[N]) const {
    auto* tp = reinterpret_cast<PyTypeObject*>(type);
    nb::object obj;
    if (direct) {
      obj = nb::steal(tp->tp_alloc(tp, 0));
      if (obj.is_valid()) {
        for (int k = 0; k < N; ++k) {
          *reinterpret_cast<PyObject**>(reinterpret_cast<char*>(obj.ptr()) + offsets[k]) = fields[k];
          fields[k] = nullptr;  // the instance owns it now
        }
      }
    } else {
      static PyObject* no_args = PyTuple_New(0);
      obj = nb::steal(PyBaseObject_Type.tp_new(tp, no_args, nullptr));
      for (int k = 0; obj.is_valid() && k < N; ++k) {
        if (PyObject_GenericSetAttr(obj.ptr(), names[k], fields[k]) != 0) obj = nb::object();
      }
    }
    for (PyObject* f : fields) Py_XDECREF(f);
    return obj;
  }
};

struct CopyOpLayout : SlotsLayout<7> {
  CopyOpLayout() : SlotsLayout(api().CopyOp, {"lc", "src_tier", "src_slot", "dst_tier", "dst_slot", "reason", "key"}) {}
};

// PyObject* fields, all non-null? Else they are released and the pending Python error
// raised.
template <int N>
void require_fields(PyObject* (&fields)[N]) {
  if (std::all_of(fields, fields + N, [](PyObject* f) { return f != nullptr; })) return;
  for (PyObject* f : fields) Py_XDECREF(f);
  throw nb::python_error();
}

nb::list copy_op_list(const std::vector<kvcm::CopyOpC>& ops) {
  static const CopyOpLayout* layout = new CopyOpLayout();  // intentionally never freed
  nb::object out = nb::steal(PyList_New(static_cast<Py_ssize_t>(ops.size())));
  if (!out.is_valid()) throw nb::python_error();
  for (std::size_t i = 0; i < ops.size(); ++i) {
    const kvcm::CopyOpC& o = ops[i];
    PyObject* fields[CopyOpLayout::kFields] = {};
    const std::int64_t values[5] = {o.lc, o.src_tier, o.src_slot, o.dst_tier, o.dst_slot};
    for (int k = 0; k < 5; ++k) fields[k] = cached_int(values[k]);
    fields[5] = reason_str(o.reason);
    Py_INCREF(fields[5]);
    if (o.has_key) {  // an op on the shared tier names its object by the block key
      fields[6] = PyBytes_FromStringAndSize(reinterpret_cast<const char*>(o.key.data()),
                                            static_cast<Py_ssize_t>(o.key.size()));
    } else {
      fields[6] = Py_None;
      Py_INCREF(fields[6]);
    }
    require_fields(fields);
    nb::object obj = layout->make(api().CopyOp, fields);
    if (!obj.is_valid()) throw nb::python_error();
    // An op refers to ints, a str and None or bytes only, so it can never be part of a reference
    // cycle: untracked, the cyclic GC never traverses it nor promotes it to an older
    // generation (CPython untracks tuples and dicts of such values for the same reason).
    // A tight pool issues an op per allocation; tracked, they made the collections the
    // op allocations trigger visit every op still held.
    if (layout->direct) PyObject_GC_UnTrack(obj.ptr());
    PyList_SET_ITEM(out.ptr(), static_cast<Py_ssize_t>(i), obj.release().ptr());
  }
  return nb::borrow<nb::list>(out);
}

// ------------------------------------------------------------------ copy runs
// The locations copy_runs marks in the current run: a slot written (key 2 * slot) or read
// (2 * slot + 1).  A bitmap over the drain's slots (cleared by unmarking what the run
// marked, so a run costs its own length); past 2**24 slots a hash set instead, to bound the
// memory.  Kept between calls (thread_local) with every bit clear.
class SlotMarks {
 public:
  void start(std::int64_t max_slot) {
    big_ = max_slot >= (std::int64_t{1} << 24);
    if (big_) return;
    const auto words = static_cast<std::size_t>((2 * max_slot + 2) / 64 + 1);
    if (bits_.size() < words) bits_.resize(words, 0);
  }
  bool test(std::int64_t k) const noexcept {
    if (big_) return set_.contains(k);
    const auto u = static_cast<std::uint64_t>(k);
    return (bits_[u >> 6] >> (u & 63)) & 1u;
  }
  void mark(std::int64_t k) {
    if (big_) {
      set_.insert(k);
      return;
    }
    const auto u = static_cast<std::uint64_t>(k);
    std::uint64_t& w = bits_[u >> 6];
    if (!((w >> (u & 63)) & 1u)) {
      w |= std::uint64_t{1} << (u & 63);
      marked_.push_back(k);
    }
  }
  void clear() noexcept {
    for (std::int64_t k : marked_) {
      const auto u = static_cast<std::uint64_t>(k);
      bits_[u >> 6] &= ~(std::uint64_t{1} << (u & 63));
    }
    marked_.clear();
    set_.clear();
  }

 private:
  bool big_ = false;
  std::vector<std::uint64_t> bits_;
  std::vector<std::int64_t> marked_;
  std::unordered_set<std::int64_t> set_;
};

// Python twin: kvcm.api.copy_runs (DECISIONS.md "Copy runs"), the same rule: an op joins
// the current run when it has the run's lc, tiers and reason and touches no location the
// run wrote, nor writes one it read.  A location is a slot of the run's pool on either side
// (with one pool, src and dst slots are of the same pool), or a key on the shared tier.
// Returns each run's [begin, end) in `ops`.
std::vector<std::pair<std::size_t, std::size_t>> copy_runs(const std::vector<kvcm::CopyOpC>& ops) {
  constexpr std::int64_t kShared = 3;
  std::int64_t max_slot = 0;
  for (const kvcm::CopyOpC& o : ops) max_slot = std::max({max_slot, o.src_slot, o.dst_slot});
  thread_local SlotMarks marks;
  marks.start(max_slot);
  std::set<kvcm::Digest> keys_written;  // shared-tier locations (a store or an onboard run)
  std::vector<std::pair<std::size_t, std::size_t>> runs;
  const auto wkey = [](std::int64_t slot) { return slot * 2; };
  const auto rkey = [](std::int64_t slot) { return slot * 2 + 1; };
  for (std::size_t i = 0; i < ops.size(); ++i) {
    const kvcm::CopyOpC& o = ops[i];
    bool join = !runs.empty();
    if (join) {
      const kvcm::CopyOpC& h = ops[runs.back().first];
      join = o.lc == h.lc && o.src_tier == h.src_tier && o.dst_tier == h.dst_tier && std::strcmp(o.reason, h.reason) == 0;
    }
    const bool one_pool = o.src_tier == o.dst_tier;  // never the shared tier (no slots there)
    if (join) {
      if (o.dst_tier == kShared) {
        join = !keys_written.contains(o.key);
      } else {
        join = !marks.test(wkey(o.dst_slot)) &&
               !(one_pool && (marks.test(wkey(o.src_slot)) || marks.test(rkey(o.dst_slot))));
      }
    }
    if (!join) {
      if (!runs.empty()) runs.back().second = i;
      runs.emplace_back(i, ops.size());
      marks.clear();
      keys_written.clear();
    }
    if (o.dst_tier == kShared) {
      keys_written.insert(o.key);
    } else {
      marks.mark(wkey(o.dst_slot));
      if (one_pool) marks.mark(rkey(o.src_slot));
    }
  }
  marks.clear();
  return runs;
}

// An array.array('q') of `n` int64s (kvcm.api.CopyRun's slot columns: a buffer an engine
// hands to torch as it is, no int object per slot).
nb::object int64_array(const std::int64_t* v, std::size_t n) {
  static PyObject* array_type = [] {
    nb::object mod = nb::module_::import_("array");
    return nb::object(mod.attr("array")).release().ptr();  // kept for the process
  }();
  nb::object raw = nb::steal(PyBytes_FromStringAndSize(reinterpret_cast<const char*>(v),
                                                      static_cast<Py_ssize_t>(n * sizeof(std::int64_t))));
  if (!raw.is_valid()) throw nb::python_error();
  static_assert(sizeof(long long) == sizeof(std::int64_t));
  return nb::handle(array_type)("q", raw);
}

struct CopyRunLayout : SlotsLayout<7> {
  CopyRunLayout()
      : SlotsLayout(api().CopyRun, {"lc", "src_tier", "dst_tier", "reason", "src_slots", "dst_slots", "keys"}) {}
};

// The drained ops as kvcm.api.CopyRun objects (built like copy_op_list's ops).
nb::list copy_run_list(const std::vector<kvcm::CopyOpC>& ops) {
  static const CopyRunLayout* layout = new CopyRunLayout();  // intentionally never freed
  nb::list out;
  constexpr std::int64_t kShared = 3;
  std::vector<std::int64_t> src, dst;
  for (const auto& [b, e] : copy_runs(ops)) {
    const kvcm::CopyOpC& h = ops[b];
    src.clear();
    dst.clear();
    for (std::size_t k = b; k < e; ++k) {
      src.push_back(ops[k].src_slot);
      dst.push_back(ops[k].dst_slot);
    }
    nb::object keys = nb::none();
    if (h.src_tier == kShared || h.dst_tier == kShared) {
      nb::list kl;
      for (std::size_t k = b; k < e; ++k) kl.append(to_bytes(ops[k].key));
      keys = std::move(kl);
    }
    nb::object src_arr = int64_array(src.data(), src.size()), dst_arr = int64_array(dst.data(), dst.size());
    PyObject* fields[CopyRunLayout::kFields] = {cached_int(h.lc), cached_int(h.src_tier), cached_int(h.dst_tier),
                                                reason_str(h.reason)};
    Py_INCREF(fields[3]);
    fields[4] = src_arr.release().ptr();
    fields[5] = dst_arr.release().ptr();
    fields[6] = keys.release().ptr();
    require_fields(fields);
    nb::object run = layout->make(api().CopyRun, fields);
    if (!run.is_valid()) throw nb::python_error();
    out.append(run);
  }
  return out;
}

// The text of an int argument's value in an error: an int subclass by its int value
// (kvcm.api.as_int), never through a method the subclass could override.
std::string int_text(PyObject* v, long long x, int overflow) {
  return overflow == 0 ? std::to_string(x) : kvcm::pyconv::exact_int_str(v);
}

// Python twin: kvcm.checks.check_count (SPEC sec. 10): an int (not bool; a subclass by its
// value) in [0, 2**63), same errors and messages.
std::int64_t check_count(nb::handle o, const char* name) {
  PyObject* v = o.ptr();
  if (!PyLong_Check(v) || PyBool_Check(v)) {
    throw nb::type_error((std::string(name) + " must be an int, got " + type_name(v)).c_str());
  }
  int overflow = 0;
  const long long x = PyLong_AsLongLongAndOverflow(v, &overflow);  // an int's digits: no method call
  if (x == -1 && PyErr_Occurred()) throw nb::python_error();
  if (overflow < 0 || (overflow == 0 && x < 0)) {
    throw nb::value_error((std::string(name) + " must be >= 0, got " + int_text(v, x, overflow)).c_str());
  }
  if (overflow > 0) throw nb::value_error((std::string(name) + " " + int_text(v, x, overflow) + " is too large").c_str());
  return static_cast<std::int64_t>(x);
}

std::optional<std::uint64_t> opt_u64(nb::handle o) {
  if (o.is_none()) return std::nullopt;
  return nb::cast<std::uint64_t>(o);
}

// A copy op as cpp_backend hands it over: (lc, src_tier, src_slot, dst_tier, dst_slot, reason,
// key or b"").
using CopyOpItem = std::tuple<std::int64_t, std::int64_t, std::int64_t, std::int64_t, std::int64_t, std::string,
                              nb::bytes>;

// The core's view of `items`; the reasons point into `items`, which must outlive the result.
std::vector<kvcm::CopyOpC> copy_ops_of(const std::vector<CopyOpItem>& items) {
  std::vector<kvcm::CopyOpC> ops;
  ops.reserve(items.size());
  for (const auto& [lc, st, ss, dt, ds, reason, key] : items) {
    kvcm::CopyOpC op{lc, st, ss, dt, ds, reason.c_str()};
    if (key.size() == sizeof(kvcm::Digest)) {  // b"": no key (the caller passes only these two)
      op.has_key = true;
      std::memcpy(op.key.data(), key.c_str(), op.key.size());
    }
    ops.push_back(op);
  }
  return ops;
}

// The store's hits as given to create / probe (checked by kvcm.checks.check_shared_hits:
// 32-byte keys, valid lcs), sorted and unique for the core's binary search.
using HitPairs = std::vector<std::pair<nb::bytes, std::int64_t>>;
std::optional<kvcm::SharedHits> shared_hits(const std::optional<HitPairs>& hits_in) {
  std::optional<kvcm::SharedHits> hits;
  if (!hits_in) return hits;
  hits.emplace();
  for (const auto& [key, lc] : *hits_in) {
    if (key.size() != sizeof(kvcm::Digest)) throw nb::value_error("shared_hits: a key is not 32 bytes");
    kvcm::Digest d;
    std::memcpy(d.data(), key.c_str(), d.size());
    hits->emplace_back(d, lc);
  }
  std::sort(hits->begin(), hits->end());
  hits->erase(std::unique(hits->begin(), hits->end()), hits->end());
  return hits;
}

kvcm::ManagerConfig make_config(std::int64_t B, nb::list lcs, std::vector<std::vector<std::int64_t>> slots,
                                std::vector<std::string> tier_kinds, bool partial, std::int64_t backoff,
                                double max_util, std::int64_t max_events, bool shared, bool shared_write_evict,
                                std::vector<std::int64_t> quota_bytes, bool explicit_settlement) {
  kvcm::ManagerConfig c;
  c.tokens_per_block = B;
  for (nb::handle item : lcs) {
    auto [ssm, window, sinks, slot_bytes] = nb::cast<std::tuple<bool, std::int64_t, std::int64_t, std::int64_t>>(item);
    kvcm::LcConfig l;
    l.ssm = ssm;
    l.window = window;
    l.sinks = sinks;
    l.slot_bytes = slot_bytes;
    c.lcs.push_back(l);
  }
  c.slots = std::move(slots);
  c.tier_kinds = std::move(tier_kinds);
  c.enable_partial_reuse = partial;
  c.reuse_match_backoff = backoff;
  c.max_util_for_resume = max_util;
  c.max_events = max_events;
  c.shared = shared;
  c.shared_write_evict = shared_write_evict;
  c.quota_bytes = std::move(quota_bytes);
  c.explicit_settlement = explicit_settlement;
  return c;
}

}  // namespace

// ---------------------------------------------------------------- batched decode step
// resize_batch / commit_batch: argument conversion for Manager::resize_batch/commit_batch.
// Check order (kvcm.api.KVCacheManager.resize_batch, matched by the python backend): the
// caches, then each other argument's container and items, then its length; the checks
// that need manager state run in the core under the lock.
namespace {

// The core serial of each item of a batch, from the list of batch keys the Python wrapper
// extracted with one comprehension (kvcm.cpp_backend: a cache's _batch_key is the tuple
// (its manager's core, its serial)); -1 for a cache of another manager.  Comparing the
// core object by identity needs no per-cache Python call, and the key's reference keeps
// that core alive, so two live managers can never be confused.
std::vector<std::int64_t> batch_serials(nb::handle mgr_obj, nb::handle keys_obj) {
  PyObject* keys = keys_obj.ptr();
  if (!PyList_CheckExact(keys)) throw nb::type_error("batch keys must be a list");
  const Py_ssize_t n = PyList_GET_SIZE(keys);
  std::vector<std::int64_t> out(static_cast<std::size_t>(n));
  for (Py_ssize_t i = 0; i < n; ++i) {
    PyObject* key = PyList_GET_ITEM(keys, i);
    if (!PyTuple_CheckExact(key) || PyTuple_GET_SIZE(key) != 2) throw nb::type_error("a batch key is a 2-tuple");
    std::int64_t serial = -1;
    if (PyTuple_GET_ITEM(key, 0) == mgr_obj.ptr()) {
      const long long v = PyLong_AsLongLong(PyTuple_GET_ITEM(key, 1));
      if (v == -1 && PyErr_Occurred()) throw nb::python_error();
      serial = v;
    }
    out[static_cast<std::size_t>(i)] = serial;
  }
  return out;
}

// kvcm.checks.check_count for item `i` of a batch argument (messages name "capacities[i]").
[[noreturn]] void bad_count(const std::string& name, std::size_t i, const std::string& value, bool too_large) {
  const std::string at = name + "[" + std::to_string(i) + "]";
  if (too_large) throw nb::value_error((at + " " + value + " is too large").c_str());
  throw nb::value_error((at + " must be >= 0, got " + value).c_str());
}

void counts_from_sequence(std::vector<std::int64_t>& out, PyObject* seq, const std::string& name) {
  // exact list/tuple only: the loop runs no Python code, so the sequence cannot change under us
  const Py_ssize_t n = PySequence_Fast_GET_SIZE(seq);
  PyObject** items = PySequence_Fast_ITEMS(seq);
  out.resize(static_cast<std::size_t>(n));
  for (Py_ssize_t k = 0; k < n; ++k) {
    const auto i = static_cast<std::size_t>(k);
    PyObject* v = items[k];
    if (!PyLong_Check(v) || PyBool_Check(v)) {
      throw nb::type_error((name + "[" + std::to_string(i) + "] must be an int, got " + type_name(v)).c_str());
    }
    int overflow = 0;
    const long long x = PyLong_AsLongLongAndOverflow(v, &overflow);
    if (x == -1 && PyErr_Occurred()) throw nb::python_error();
    if (overflow != 0 || x < 0) bad_count(name, i, int_text(v, x, overflow), overflow > 0);
    out[i] = static_cast<std::int64_t>(x);
  }
}

template <typename T>
void counts_from_buffer_items(std::vector<std::int64_t>& out, const Py_buffer& view, const std::string& name) {
  const auto n = static_cast<std::size_t>(view.shape[0]);
  const Py_ssize_t stride = view.strides ? view.strides[0] : view.itemsize;
  const auto* base = static_cast<const char*>(view.buf);
  out.resize(n);
  for (std::size_t i = 0; i < n; ++i) {
    T v;
    std::memcpy(&v, base + static_cast<Py_ssize_t>(i) * stride, sizeof v);
    if constexpr (std::is_signed_v<T>) {
      if (v < 0) bad_count(name, i, std::to_string(v), false);
    } else if constexpr (sizeof(T) == 8) {
      if (v > static_cast<T>(INT64_MAX)) bad_count(name, i, std::to_string(v), true);
    }
    out[i] = static_cast<std::int64_t>(v);
  }
}

// A 1-D buffer of native integers (array('i'/'q'), numpy int arrays, memoryviews):
// converted without a Python-level loop.  False for any other buffer (floats, bools,
// 2-D, ...), which then goes through tolist() like the python backend.
bool counts_from_buffer(std::vector<std::int64_t>& out, PyObject* obj, const std::string& name) {
  kvcm::pyconv::BufferView bv;
  if (!bv.acquire(obj, PyBUF_FORMAT | PyBUF_STRIDES)) return false;
  return kvcm::pyconv::with_int_type(
      bv.get(), [&](auto item) { counts_from_buffer_items<decltype(item)>(out, bv.get(), name); });
}

// kvcm.checks.check_counts(obj, name, n, what): a list/tuple of ints or an integer array
// (array, numpy, CPU torch tensor) of n counts.  Same errors as the python backend.
std::vector<std::int64_t> batch_counts(nb::handle obj_in, const std::string& name, std::size_t n, const char* what) {
  std::vector<std::int64_t> out;
  nb::object obj = nb::borrow(obj_in);
  bool done = false;
  if (PyList_CheckExact(obj.ptr()) || PyTuple_CheckExact(obj.ptr())) {
    counts_from_sequence(out, obj.ptr(), name);
    done = true;
  } else if (PyObject_HasAttrString(obj.ptr(), "tolist")) {
    if (!PyObject_CheckBuffer(obj.ptr()) && PyObject_HasAttrString(obj.ptr(), "numpy")) {
      // a torch tensor has no buffer protocol; its numpy() view shares its memory (CPU only)
      nb::object arr = nb::steal(PyObject_CallMethod(obj.ptr(), "numpy", nullptr));
      if (arr.is_valid()) {
        done = counts_from_buffer(out, arr.ptr(), name);
      } else {
        PyErr_Clear();  // e.g. a CUDA tensor: tolist() below copies it
      }
    } else {
      done = counts_from_buffer(out, obj.ptr(), name);
    }
    if (!done) {
      nb::object list = nb::steal(PyObject_CallMethod(obj.ptr(), "tolist", nullptr));
      if (!list.is_valid()) throw nb::python_error();
      if (!PyList_CheckExact(list.ptr())) {
        throw nb::type_error((name + ".tolist() must return a list, got " + type_name(list.ptr())).c_str());
      }
      counts_from_sequence(out, list.ptr(), name);
      done = true;
    }
  }
  if (!done) {
    throw nb::type_error((std::string(what) + "(): " + name +
                          " must be a list or tuple of ints or an integer array, got " + type_name(obj.ptr()))
                             .c_str());
  }
  if (out.size() != n) {
    throw nb::value_error((std::string(what) + "(): " + name + " has " + std::to_string(out.size()) +
                           " items for " + std::to_string(n) + " caches")
                              .c_str());
  }
  return out;
}

nb::list bool_list(const std::vector<std::uint8_t>& v) {
  nb::object out = nb::steal(PyList_New(static_cast<Py_ssize_t>(v.size())));
  if (!out.is_valid()) throw nb::python_error();
  for (std::size_t i = 0; i < v.size(); ++i) {
    PyObject* b = v[i] ? Py_True : Py_False;
    Py_INCREF(b);
    PyList_SET_ITEM(out.ptr(), static_cast<Py_ssize_t>(i), b);
  }
  return nb::borrow<nb::list>(out);
}

}  // namespace

namespace {

// The core's errors as kvcm.api's (and Python's) exception types.
void register_errors() {
  nb::register_exception_translator([](const std::exception_ptr& p, void*) {
    try {
      std::rethrow_exception(p);
    } catch (const kvcm::InvalidStateErr& e) {
      PyErr_SetString(api().InvalidStateError, e.what());
    } catch (const kvcm::ClosedErr& e) {
      PyErr_SetString(api().ClosedError, e.what());
    } catch (const kvcm::InvariantErr& e) {
      PyErr_SetString(api().InvariantError, e.what());
    } catch (const kvcm::ValueErr& e) {
      PyErr_SetString(PyExc_ValueError, e.what());
    } catch (const kvcm::InternalErr& e) {
      PyErr_SetString(PyExc_AssertionError, e.what());
    }
  });
}

// Tokens (a validated token sequence) and ClosedTokens (what a closed cache still answers).
void bind_tokens(nb::module_& m) {
  nb::class_<TokenBuf>(m, "Tokens", "A validated token sequence, converted once (see parse_tokens).")
      .def("__len__", [](const TokenBuf& t) { return t.codes.size(); });
  m.def("parse_tokens", &parse_tokens, "tokens"_a.none(), "name"_a = "tokens",
        nb::sig("def parse_tokens(tokens: object, name: str = 'tokens') -> Tokens"),
        "kvcm.checks.check_tokens without a Python-level loop (lists, tuples, int buffers such as numpy "
        "arrays and array('i')): the same errors, as a Tokens object for the manager calls.");

  nb::class_<kvcm::ClosedTokens>(m, "ClosedTokens",
                                 "What a closed cache still answers: its final properties and committed tokens.")
      .def_ro("closed_now", &kvcm::ClosedTokens::closed_now)
      .def_prop_ro("info",
                   [](const kvcm::ClosedTokens& t) {
                     return nb::make_tuple(2, true, t.capacity, t.history, t.num_committed, t.reused, t.priority);
                   })
      .def("__len__", [](const kvcm::ClosedTokens& t) { return t.codes.size(); })
      .def("tolist", [](const kvcm::ClosedTokens& t) { return token_list(t.decode()); });
}

// Manager: construction and the manager-level calls (kvcm.api.KVCacheManager).
void bind_manager_calls(nb::class_<Manager>& cls) {
  cls
      .def(
          "__init__",
          [](Manager* self, std::int64_t B, nb::list lcs, std::vector<std::vector<std::int64_t>> slots,
             std::vector<std::string> tier_kinds, bool partial, std::int64_t backoff, double max_util,
             std::int64_t max_events, bool shared_tier, bool shared_write_evict,
             std::vector<std::int64_t> quota_bytes, bool explicit_settlement) {
            new (self) Manager(make_config(B, lcs, std::move(slots), std::move(tier_kinds), partial, backoff,
                                           max_util, max_events, shared_tier, shared_write_evict,
                                           std::move(quota_bytes), explicit_settlement));
          },
          "tokens_per_block"_a, "life_cycles"_a, "slots"_a, "tier_kinds"_a, "enable_partial_reuse"_a,
          "reuse_match_backoff"_a, "max_util_for_resume"_a, "max_events"_a, "shared_tier"_a = false,
          "shared_write_evict"_a = false, "quota_bytes"_a = std::vector<std::int64_t>{},
          "explicit_settlement"_a = false)
      .def(
          "create",
          [](Manager& mgr, const TokenBuf& t, nb::handle lora, nb::handle salt, std::int64_t priority,
             std::optional<HitPairs> hits_in) {
            auto l = opt_u64(lora), s = opt_u64(salt);
            const std::optional<Manager::SharedHits> hits = shared_hits(hits_in);
            return locked(mgr, [&] { return mgr.create(t.seq(), l, s, priority, hits ? &*hits : nullptr); });
          },
          "tokens"_a, "lora_id"_a.none(), "salt"_a.none(), "priority"_a, "shared_hits"_a.none() = nb::none())
      .def(
          "shared_candidates",
          [](Manager& mgr, const TokenBuf& t, nb::handle lora, nb::handle salt) {
            auto l = opt_u64(lora), s = opt_u64(salt);
            // hashes the prompt's blocks: the GIL is released, as for probe
            const auto cands = locked(mgr, [&] { return mgr.shared_candidates(t.seq(), l, s); });
            nb::list out;
            for (const auto& [key, lc] : cands) out.append(nb::make_tuple(to_bytes(key), lc));
            return out;
          },
          "tokens"_a, "lora_id"_a.none(), "salt"_a.none())
      .def(
          "probe",
          [](Manager& mgr, const TokenBuf& t, nb::handle lora, nb::handle salt, std::optional<HitPairs> hits_in,
             bool block_tiers) {
            auto l = opt_u64(lora), s = opt_u64(salt);
            const std::optional<Manager::SharedHits> hits = shared_hits(hits_in);
            Manager::ProbeResult r =
                locked(mgr, [&] { return mgr.probe(t.seq(), l, s, hits ? &*hits : nullptr, block_tiers); });
            // kvcm.api.ReuseProbe's fields: (m, m_before_ssm, block tiers; empty without block_tiers)
            return std::make_tuple(r.m, r.m_before_ssm, std::move(r.block_tiers));
          },
          "tokens"_a, "lora_id"_a.none(), "salt"_a.none(), "shared_hits"_a.none() = nb::none(),
          "block_tiers"_a = true)
      .def("drain_copy_ops",
           [](Manager& mgr) {
             std::vector<kvcm::CopyOpC> ops = quick(mgr, [&] { return mgr.drain_copy_ops(); });
             return copy_op_list(ops);
           })
      .def("drain_copy_runs",
           [](Manager& mgr) {
             std::vector<kvcm::CopyOpC> ops = quick(mgr, [&] { return mgr.drain_copy_ops(); });
             return copy_run_list(ops);
           })
      .def(
          "forget_copies",
          [](Manager& mgr, const std::vector<CopyOpItem>& items) {
            const std::vector<kvcm::CopyOpC> ops = copy_ops_of(items);  // (reasons point into `items`)
            return locked(mgr, [&] { return mgr.forget_copies(ops); });
          },
          "ops"_a)
      .def(
          "settle_copies",
          [](Manager& mgr, const std::vector<CopyOpItem>& items) {
            const std::vector<kvcm::CopyOpC> ops = copy_ops_of(items);  // (reasons point into `items`)
            return locked(mgr, [&] { return mgr.settle_copies(ops); });
          },
          "failed"_a)
      .def("unsettled_drains", [](Manager& mgr) { return quick(mgr, [&] { return mgr.unsettled_drains(); }); })
      .def("clear_reusable", [](Manager& mgr) { locked(mgr, [&] { mgr.clear_reusable(); }); })
      // quotas at run time: arguments checked by kvcm.config.resolve_quota; a refusal
      // comes back as {lc, slots, need, locked, held} (cpp_backend raises OutOfPagesError)
      .def(
          "set_quota",
          [](Manager& mgr, std::int64_t tier, std::int64_t quota_bytes, std::vector<std::int64_t> slots) {
            if (tier < 0 || static_cast<std::size_t>(tier) >= mgr.num_tiers() ||
                slots.size() != mgr.num_life_cycles()) {
              throw nb::value_error("set_quota: bad tier position or slot list");
            }
            return locked(mgr, [&] { return mgr.set_quota(tier, quota_bytes, slots); });
          },
          "tier"_a, "quota_bytes"_a, "slots"_a)
      .def(
          "set_pending_copy_ops_warning",
          [](Manager& mgr, std::int64_t n) { quick(mgr, [&] { mgr.set_pending_copy_ops_warning(n); }); }, "n"_a)
      .def("shutdown", [](Manager& mgr) { locked(mgr, [&] { mgr.shutdown(); }); })
      .def("is_shutdown", [](Manager& mgr) { return quick(mgr, [&] { return mgr.is_shutdown(); }); })
      .def("num_open", [](Manager& mgr) { return quick(mgr, [&] { return mgr.num_open(); }); })
      .def(
          "stats_json", [](Manager& mgr, bool take) { return quick(mgr, [&] { return mgr.stats_json(take); }); },
          "take_iteration"_a)
      .def("take_events",
           [](Manager& mgr) {
             const kvcm::TakenEvents taken = quick(mgr, [&] { return mgr.take_events(); });
             nb::list out;
             // the stored events' tokens and blocks follow one another in taken.tokens / .blocks
             std::size_t tok_at = 0, blk_at = 0;
             for (const kvcm::EventC& e : taken.events) {
               out.append(event_obj(e, std::span<const kvcm::TokenOut>(taken.tokens).subspan(tok_at, e.ntokens),
                                    std::span<const kvcm::StoredBlockC>(taken.blocks).subspan(blk_at, e.nblocks)));
               tok_at += e.ntokens;
               blk_at += e.nblocks;
             }
             return out;
           })
      .def("snapshot_json", [](Manager& mgr) { return locked(mgr, [&] { return mgr.snapshot_json(); }); })
      .def("check_invariants", [](Manager& mgr) { locked(mgr, [&] { mgr.check_invariants(); }); })
      .def("internal_sizes",
           [](Manager& mgr) {
             const auto sizes = quick(mgr, [&] { return mgr.internal_sizes(); });
             nb::dict out;
             for (const auto& [name, v] : sizes) out[name.c_str()] = v;
             return out;
           },
           nb::sig("def internal_sizes(self) -> dict[str, int]"),
           "Sizes of the core's internal tables (bounded-memory tests, SPEC sec. 15).");
}

// Manager.page_indices_into: `out` is a writable, contiguous 1-D int32 buffer (checked by
// the caller); the values are written straight into it (zero-copy), or nothing on error.
std::size_t page_indices_into(Manager& mgr, std::int64_t serial, std::int64_t lc, nb::handle out) {
  std::vector<std::int32_t> v = quick(mgr, [&] { return mgr.page_indices(serial, lc); });
  Py_buffer view;
  if (PyObject_GetBuffer(out.ptr(), &view, PyBUF_WRITABLE | PyBUF_C_CONTIGUOUS) != 0) {
    throw nb::python_error();
  }
  const auto capacity = static_cast<std::size_t>(view.len) / sizeof(std::int32_t);
  if (v.size() > capacity) {
    PyBuffer_Release(&view);
    throw nb::value_error(("buffer holds " + std::to_string(capacity) + " int32 values, " +
                           std::to_string(v.size()) + " needed")
                              .c_str());
  }
  if (!v.empty()) std::memcpy(view.buf, v.data(), v.size() * sizeof(std::int32_t));
  PyBuffer_Release(&view);
  return v.size();
}

// Manager: the request calls, addressed by the cache's serial (kvcm.api.KVCache).
void bind_request_calls(nb::class_<Manager>& cls) {
  cls
      .def(
          "info",
          [](Manager& mgr, std::int64_t serial) {
            kvcm::RequestInfo i = quick(mgr, [&] { return mgr.info(serial); });
            return nb::make_tuple(static_cast<int>(i.status), i.stopped, i.capacity, i.history, i.num_committed,
                                  i.reused, i.priority);
          },
          "serial"_a)
      .def(
          "committed_tokens",
          [](Manager& mgr, std::int64_t serial) {
            std::vector<kvcm::TokenOut> t = quick(mgr, [&] { return mgr.committed_tokens(serial); });
            return token_list(t);
          },
          "serial"_a)
      .def(
          "resume", [](Manager& mgr, std::int64_t serial) { return locked(mgr, [&] { return mgr.resume(serial); }); },
          "serial"_a)
      .def(
          "suspend", [](Manager& mgr, std::int64_t serial) { locked(mgr, [&] { mgr.suspend(serial); }); },
          "serial"_a)
      .def(
          "resize",
          [](Manager& mgr, std::int64_t serial, nb::handle capacity_obj, nb::handle history_obj) {
            // the python backend's order: status first, then the argument checks
            quick(mgr, [&] { mgr.require_status(serial, kvcm::ReqStatus::active, "resize"); });
            const std::int64_t capacity = check_count(capacity_obj, "capacity");
            std::optional<std::int64_t> history;
            if (!history_obj.is_none()) history = check_count(history_obj, "history_length");
            return locked(mgr, [&] { return mgr.resize(serial, capacity, history); });
          },
          "serial"_a, "capacity"_a.none(), "history_length"_a.none())
      .def(
          "commit",
          [](Manager& mgr, std::int64_t serial, nb::handle tokens) {
            // Python twin: Request.commit (SPEC sec. 7, DECISIONS "Tokens"): the tokens
            // first (any Python code they run runs before any state is looked at), then
            // status, stopped and room, checked in the core under the lock
            const TokenBuf t = parse_tokens(tokens, "tokens");
            locked(mgr, [&] { mgr.commit(serial, t.seq()); });
          },
          "serial"_a, "tokens"_a.none())
      .def(
          "commit_input",
          [](Manager& mgr, std::int64_t serial, std::optional<std::int64_t> n) {
            // n was checked by the Python layer (kvcm.checks.check_count); the rest here
            locked(mgr, [&] { mgr.commit_input(serial, n); });
          },
          "serial"_a, "n"_a.none())
      .def(
          "stop_committing",
          [](Manager& mgr, std::int64_t serial) { locked(mgr, [&] { mgr.stop_committing(serial); }); }, "serial"_a)
      .def(
          "close", [](Manager& mgr, std::int64_t serial) { return locked(mgr, [&] { return mgr.close(serial); }); },
          "serial"_a, "Close the cache (idempotent); returns its final state, the tokens moved out of the core.")
      .def(
          "page_indices",
          [](Manager& mgr, std::int64_t serial, std::int64_t lc, std::int64_t start, std::int64_t stop) {
            std::vector<std::int32_t> v = quick(mgr, [&] { return mgr.page_indices(serial, lc, start, stop); });
            nb::object out = nb::steal(PyList_New(static_cast<Py_ssize_t>(v.size())));
            if (!out.is_valid()) throw nb::python_error();
            for (std::size_t i = 0; i < v.size(); ++i) {
              PyList_SET_ITEM(out.ptr(), static_cast<Py_ssize_t>(i), PyLong_FromLong(v[i]));
            }
            return nb::borrow<nb::list>(out);
          },
          "serial"_a, "lc"_a, "start"_a = 0, "stop"_a = -1)
      .def("page_indices_into", &page_indices_into, "serial"_a, "lc"_a, "out"_a);
}

// The batched decode step: module functions (not Manager methods).
void bind_batch(nb::module_& m) {
  // ---------------------------------------------------------------- batched decode step
  // Module functions (not Manager methods) so the class definition above stays untouched.
  m.def(
      "resize_batch",
      [](nb::handle mgr_obj, nb::handle keys_obj, nb::handle capacities_obj, nb::handle histories_obj) {
        Manager& mgr = nb::cast<Manager&>(mgr_obj);
        const std::vector<std::int64_t> serials = batch_serials(mgr_obj, keys_obj);
        Manager::check_batch_serials(serials, "resize_batch");
        const std::vector<std::int64_t> capacities = batch_counts(capacities_obj, "capacities", serials.size(), "resize_batch");
        std::vector<std::int64_t> histories;
        if (!histories_obj.is_none()) histories = batch_counts(histories_obj, "history_lengths", serials.size(), "resize_batch");
        std::vector<std::uint8_t> results(serials.size(), 0);
        locked(mgr, [&] { mgr.resize_batch(serials, capacities, histories, results); });
        return bool_list(results);
      },
      "manager"_a, "keys"_a, "capacities"_a.none(), "history_lengths"_a.none(),
      nb::sig("def resize_batch(manager: Manager, keys: list[tuple[Manager, int]], capacities: object, "
              "history_lengths: object | None) -> list[bool]"),
      "Manager.resize for each (cache, capacity, history) in order, the whole batch validated first "
      "(kvcm.api.KVCacheManager.resize_batch); keys: each cache's (core, serial).");
  m.def(
      "commit_batch",
      [](nb::handle mgr_obj, nb::handle keys_obj, nb::handle tokens_obj) {
        Manager& mgr = nb::cast<Manager&>(mgr_obj);
        const std::vector<std::int64_t> serials = batch_serials(mgr_obj, keys_obj);
        Manager::check_batch_serials(serials, "commit_batch");
        const TokenBuf tokens = parse_tokens(tokens_obj, "tokens");
        if (tokens.codes.size() != serials.size()) {
          throw nb::value_error(("commit_batch(): tokens has " + std::to_string(tokens.codes.size()) +
                                 " items for " + std::to_string(serials.size()) + " caches")
                                    .c_str());
        }
        locked(mgr, [&] { mgr.commit_batch(serials, tokens.seq()); });
      },
      "manager"_a, "keys"_a, "tokens"_a.none(),
      nb::sig("def commit_batch(manager: Manager, keys: list[tuple[Manager, int]], tokens: object) -> None"),
      "Manager.commit of one token per cache, in order, the whole batch validated first "
      "(kvcm.api.KVCacheManager.commit_batch); keys: each cache's (core, serial).");
}

// Forks (issue 22, DECISIONS.md "Forks (issue 22)"): their own section, so the class
// definitions above stay untouched.
void bind_forks(nb::class_<Manager>& cls) {
  cls.def(
      "fork", [](Manager& mgr, std::int64_t serial) { return locked(mgr, [&] { return mgr.fork(serial); }); },
      "serial"_a,
      "Fork the ACTIVE cache `serial` (kvcm.api.KVCache.fork): the new cache's serial, or -1 (nothing "
      "changed) when the gpu cannot take its own pages.");
}

}  // namespace

void bind_manager(nb::module_& m) {
  register_errors();
  bind_tokens(m);
  nb::class_<Manager> cls(m, "Manager", "The C++ manager core; driven by kvcm.cpp_backend.");
  bind_manager_calls(cls);
  bind_request_calls(cls);
  bind_batch(m);
  bind_forks(cls);
}
