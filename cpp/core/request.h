// One request's life cycle (SPEC sec. 7): its status, its blocks and page table.  Python
// twin: kvcm/python_backend/request.py (PyKVCache).  The operations are Manager members
// defined in request.cpp (they touch the manager's pools, tree and events).
#pragma once

#include <cstdint>
#include <optional>
#include <utility>
#include <vector>

#include "core/block_keys.h"
#include "core/tree.h"
#include "core/types.h"

namespace kvcm {

enum class ReqStatus : int { suspended = 0, active = 1, closed = 2 };

struct RequestInfo {
  ReqStatus status = ReqStatus::suspended;
  bool stopped = false;
  std::int64_t capacity = 0, history = 0, num_committed = 0, reused = 0, priority = 0;
};

// The committed tokens of a cache that was just closed (moved out, not copied): the
// Python layer keeps them so a closed cache still answers committed_tokens.
struct ClosedTokens {
  bool closed_now = false;  // false: the cache was already closed (nothing else is set)
  std::int64_t capacity = 0, history = 0, num_committed = 0, reused = 0, priority = 0;
  std::vector<std::uint32_t> codes;
  std::vector<std::pair<std::uint32_t, Digest>> digests;  // the digest of each digest code used
  std::vector<TokenOut> decode() const;
};

struct Request {
  std::int64_t serial = 0;
  Digest root_key{};
  NodeId root = kNoNode;
  std::optional<std::uint64_t> lora, salt;
  std::int64_t priority = 0;
  ReqStatus status = ReqStatus::suspended;
  bool stopped = false;
  std::vector<Tok> input_tokens;
  std::vector<Digest> keys;
  std::vector<Tok> tokens;
  std::int64_t reused = 0, capacity = 0, history = 0;
  std::vector<NodeId> blocks;
  std::vector<std::vector<std::int64_t>> pages;  // [lc][ordinal] page serial or -1 (attention lcs)
  std::int64_t live = -1, snap = -1;
  std::int64_t cow_block = -1;
  bool has_digests = false;  // its tokens hold digest references (released at close)
};

}  // namespace kvcm
