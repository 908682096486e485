// Types both halves of the core and the bindings share: the errors (kvcm.api's types), the
// token codes and the validated token sequence the bindings hand over, and a copy op.
#pragma once

#include <cstddef>
#include <cstdint>
#include <span>
#include <stdexcept>

#include "core/sha256.h"

namespace kvcm {

// ------------------------------------------------------------------ errors (kvcm.api types)
class KvcmCoreError : public std::runtime_error {
 public:
  using std::runtime_error::runtime_error;
};
class InvalidStateErr : public KvcmCoreError {
 public:
  using KvcmCoreError::KvcmCoreError;
};
class ClosedErr : public KvcmCoreError {
 public:
  using KvcmCoreError::KvcmCoreError;
};
class InvariantErr : public KvcmCoreError {
 public:
  using KvcmCoreError::KvcmCoreError;
};
class ValueErr : public KvcmCoreError {
 public:
  using KvcmCoreError::KvcmCoreError;
};
// A kvcm bug (Python: AssertionError).
class InternalErr : public std::logic_error {
 public:
  using std::logic_error::logic_error;
};

// A request's page table has at most this many block ordinals (kvcm.api.MAX_REQUEST_BLOCKS).
inline constexpr std::int64_t kMaxRequestBlocks = std::int64_t{1} << 24;

// A token code: ints as themselves (< 2**31), digests as kDigestCode | interned id.
using Tok = std::uint32_t;
inline constexpr Tok kDigestCode = 0x80000000u;

// A validated token sequence as the bindings hand it over: ints as their values, the k-th
// digest token (in order of appearance) as kDigestCode | k with its bytes in digests[k].
// An all-int prompt is then already in the manager's code space: no per-token work.
struct TokenSeq {
  std::span<const std::uint32_t> codes;
  std::span<const Digest> digests;
  std::size_t size() const noexcept { return codes.size(); }
  bool empty() const noexcept { return codes.empty(); }
  TokenSeq subseq(std::size_t at, std::size_t n) const { return {codes.subspan(at, n), digests}; }
};

struct CopyOpC {
  std::int64_t lc, src_tier, src_slot, dst_tier, dst_slot;
  const char* reason;
  // An op that touches the shared tier names its object by block key (kvcm.api.CopyOp.key).
  bool has_key = false;
  Digest key{};
};

}  // namespace kvcm
