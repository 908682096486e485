// Internal to the core's .cpp files (not part of the Manager interface): the stats
// counters, state and status names, a tiny JSON writer and the key-chain feeder, shared by
// block_pool.cpp, manager.cpp, request.cpp, pools.cpp and observe.cpp.
#pragma once

#include <cstdint>
#include <span>
#include <string>

#include "core/block_keys.h"
#include "core/request.h"
#include "core/types.h"

namespace kvcm::detail {

inline constexpr std::int64_t kGpu = 0;

enum Counter : int {
  kReusedBlocks = 0,
  kMissedBlocks,
  kReusedTokens,
  kAllocatedBlocks,
  kOffloads,
  kOffloadBytes,
  kOnboards,
  kOnboardBytes,
  kDrops,
  kDropBytes,
  kCows,
  kSnapshotsTaken,
  kSnapshotsSkipped,
  kLostPages,
  kSharedStores,
  kSharedStoreBytes,
  kSharedHitBlocks,
  kRelocations,
  kNumCounters
};
inline constexpr const char* kCounterNames[kNumCounters] = {
    "reused_blocks", "missed_blocks", "reused_tokens", "allocated_blocks", "offloads",       "offload_bytes",
    "onboards",      "onboard_bytes", "drops",         "drop_bytes",       "cows",           "snapshots_taken",
    "snapshots_skipped", "lost_pages", "shared_stores", "shared_store_bytes", "shared_hit_blocks",
    "relocations"};
inline constexpr std::size_t kHeader = 3;  // requests, query_tokens, reused_tokens

inline const char* state_name(int s) {
  switch (s) {
    case 1: return "\"LOCKED\"";
    case 2: return "\"HELD\"";
    case 3: return "\"DROPPABLE\"";
    default: return "null";
  }
}

inline const char* status_name(ReqStatus s) {
  switch (s) {
    case ReqStatus::suspended: return "SUSPENDED";
    case ReqStatus::active: return "ACTIVE";
    default: return "CLOSED";
  }
}

// ---- a tiny JSON writer
inline void j_int(std::string& o, std::int64_t v) { o += std::to_string(v); }
inline void j_bool(std::string& o, bool v) { o += v ? "true" : "false"; }
// Ids, serials and slots are never negative: -1 (kNoNode, kNoPage, "none") is JSON null.
inline void j_id(std::string& o, std::int64_t v) {
  if (v < 0) {
    o += "null";
  } else {
    j_int(o, v);
  }
}
inline void j_hex(std::string& o, const Digest& d) {
  static constexpr char digits[] = "0123456789abcdef";
  o += '"';
  for (std::uint8_t b : d) {
    o += digits[b >> 4];
    o += digits[b & 15];
  }
  o += '"';
}
inline void j_str(std::string& o, const char* s) {
  o += '"';
  o += s;
  o += '"';
}
inline void j_tok_plain(std::string& o, const TokenOut& t) {  // events: int or hex string
  if (t.is_digest) {
    j_hex(o, t.digest);
  } else {
    j_int(o, t.value);
  }
}
inline void j_tok_snap(std::string& o, const TokenOut& t) {  // snapshot: int or {"digest": hex}
  if (t.is_digest) {
    o += "{\"digest\":";
    j_hex(o, t.digest);
    o += '}';
  } else {
    j_int(o, t.value);
  }
}

// Feed `codes` into `chain` and finish it (the keys of its blocks go to its callback):
// runs of int codes go in as they are (an int's code is its value), each digest code as
// the bytes digest_of(code) names.
template <typename Chain, typename DigestOf>
inline void feed(Chain& chain, std::span<const Tok> codes, DigestOf digest_of) {
  std::size_t i = 0;
  while (i < codes.size()) {
    std::size_t j = i;
    while (j < codes.size() && !(codes[j] & kDigestCode)) ++j;
    chain.append_ints(codes.data() + i, j - i);
    if (j < codes.size()) {
      const Digest& d = digest_of(codes[j]);
      chain.append_digest(std::span<const std::uint8_t, kDigestTokenBytes>(d.data(), kDigestTokenBytes));
      ++j;
    }
    i = j;
  }
  chain.finish();
}

}  // namespace kvcm::detail
