// The batched decode step: Manager::resize_batch and Manager::commit_batch (see the block
// at the end of class Manager in manager.h).
//
// Contract (kvcm.api.KVCacheManager.resize_batch / commit_batch, DECISIONS.md "Batched
// decode step"): the result and every side effect equal those of the single calls run in
// batch order, except that the whole batch is validated before anything changes, so a bad
// argument anywhere raises and leaves the manager untouched.  Up-front validation is
// sound because no single call can change what another cache's checks look at (status,
// stopped flag, committed count, history, capacity of *that* cache) and a cache appears
// at most once per batch.
//
// Each item then runs through the very same Manager::resize / Manager::commit the single
// calls use (their own checks pass by construction), so the two paths cannot drift.
#include <algorithm>
#include <string>
#include <vector>

#include "core/manager.h"

namespace kvcm {
namespace {

std::string item(const char* what, std::size_t i) {
  return std::string(what) + "(): caches[" + std::to_string(i) + "]: ";
}

// Re-throw a single call's check error with the batch index in front, keeping its type
// (the Python layer maps the type to the documented exception).
template <typename F>
void with_index(const char* what, std::size_t i, F&& check) {
  try {
    check();
  } catch (const ClosedErr& e) {
    throw ClosedErr(item(what, i) + e.what());
  } catch (const InvalidStateErr& e) {
    throw InvalidStateErr(item(what, i) + e.what());
  } catch (const ValueErr& e) {
    throw ValueErr(item(what, i) + e.what());
  }
}

}  // namespace

// py: batch.py check_batch — SPEC sec. 7
void Manager::check_batch_serials(std::span<const std::int64_t> serials, const char* what) {
  // Items are checked in batch order: the first item that is not a cache of this manager
  // or repeats an earlier one is reported (what kvcm.python_backend does item by item).
  const auto first_foreign = static_cast<std::size_t>(
      std::find_if(serials.begin(), serials.end(), [](std::int64_t s) { return s < 0; }) - serials.begin());
  const std::span<const std::int64_t> head = serials.first(first_foreign);
  std::size_t dup = head.size();  // the first index repeating an earlier one
  if (head.size() > 1) {
    // Duplicates in O(n): a bitmap over the serials' range.  Serials are creation numbers,
    // so the requests of one batch are usually close together; a range much wider than
    // the batch falls back to sorting (O(n log n)).
    const auto [lo_it, hi_it] = std::minmax_element(head.begin(), head.end());
    const std::int64_t lo = *lo_it;
    const auto range = static_cast<std::uint64_t>(*hi_it - lo) + 1;
    if (range <= 64 * head.size() + 4096) {
      std::vector<std::uint64_t> seen((range + 63) / 64, 0);
      for (std::size_t i = 0; i < head.size(); ++i) {
        const auto bit = static_cast<std::uint64_t>(head[i] - lo);
        std::uint64_t& word = seen[bit / 64];
        const std::uint64_t mask = std::uint64_t{1} << (bit % 64);
        if (word & mask) {
          dup = i;
          break;
        }
        word |= mask;
      }
    } else {
      std::vector<std::pair<std::int64_t, std::size_t>> sorted;
      sorted.reserve(head.size());
      for (std::size_t i = 0; i < head.size(); ++i) sorted.emplace_back(head[i], i);
      std::sort(sorted.begin(), sorted.end());  // equal serials: smaller index first
      for (std::size_t k = 1; k < sorted.size(); ++k) {
        if (sorted[k].first == sorted[k - 1].first) dup = std::min(dup, sorted[k].second);
      }
    }
  }
  if (dup < head.size()) throw ValueErr(item(what, dup) + "the same cache appears twice in the batch");
  if (first_foreign < serials.size()) throw ValueErr(item(what, first_foreign) + "not a cache of this manager");
}

// py: batch.py check_batch — SPEC sec. 7
template <typename Check>
std::vector<Request*>& Manager::check_batch(std::span<const std::int64_t> serials, const char* what,
                                                     const char* single, Check check) {
  std::vector<Request*>& out = scratch_batch_;
  out.clear();
  out.reserve(serials.size());
  for (std::size_t i = 0; i < serials.size(); ++i) {
    const auto it = requests_.find(serials[i]);
    if (it == requests_.end()) throw ClosedErr(item(what, i) + single + "() on a closed cache");
    with_index(what, i, [&] { check(i, it->second); });
    out.push_back(&it->second);
  }
  return out;
}

// py: batch.py resize_batch — SPEC sec. 7
void Manager::resize_batch(std::span<const std::int64_t> serials, std::span<const std::int64_t> capacities,
                           std::span<const std::int64_t> histories, std::span<std::uint8_t> results) {
  const std::size_t n = serials.size();
  if (capacities.size() != n || results.size() != n || !(histories.empty() || histories.size() == n)) {
    throw InternalErr("kvcm bug: resize_batch spans of different lengths");
  }
  check_batch_serials(serials, "resize_batch");
  // Validation pass: the single call's checks, in its order, item by item (one lookup
  // each: the execution pass reuses the pointers; no call below opens or closes a request,
  // and the hash map keeps its elements in place).
  const std::vector<Request*>& reqs =
      check_batch(serials, "resize_batch", "resize", [&](std::size_t i, const Request& r) {
        r.check_resize(capacities[i], histories.empty() ? r.state().history : histories[i]);
      });
  // Execution pass: nothing above changed state; from here on nothing can raise a
  // documented error (a False result is a per-item outcome, as for the single call).
  for (std::size_t i = 0; i < n; ++i) {
    Request& r = *reqs[i];
    results[i] = r.resize_checked(capacities[i], histories.empty() ? r.state().history : histories[i]) ? 1 : 0;
  }
}

// py: batch.py commit_batch — SPEC sec. 7
void Manager::commit_batch(std::span<const std::int64_t> serials, TokenSeq tokens) {
  const std::size_t n = serials.size();
  if (tokens.size() != n) throw InternalErr("kvcm bug: commit_batch spans of different lengths");
  check_batch_serials(serials, "commit_batch");
  const std::vector<Request*>& reqs = check_batch(
      serials, "commit_batch", "commit", [](std::size_t, const Request& r) { r.check_commit(1); });
  for (std::size_t i = 0; i < n; ++i) reqs[i]->commit_checked(tokens.subseq(i, 1));
}

}  // namespace kvcm
