// Life cycles (SPEC sec. 2), their stale ranges (sec. 7) and the integer helpers both
// wings share: the one home of the stale-range formula (the tree's match pruning and the
// manager's requests both read it here).  Python: the config module of the interface layer.
#pragma once

#include <algorithm>
#include <cstdint>
#include <optional>
#include <utility>

namespace kvcm {

// Python's // and ceil-by-negation on ints: the port must agree with Python even where the
// numerator is negative (e.g. history + 1 - window).
constexpr std::int64_t floordiv(std::int64_t a, std::int64_t b) noexcept {
  std::int64_t q = a / b;
  if ((a % b != 0) && ((a < 0) != (b < 0))) --q;
  return q;
}
constexpr std::int64_t ceildiv(std::int64_t a, std::int64_t b) noexcept { return -floordiv(-a, b); }

enum class LcKind { attn, ssm };

// One life cycle as the tree sees it: (kind, window, sinks); window nullopt = full attention.
struct LifeCycleSpec {
  LcKind kind = LcKind::attn;
  std::optional<std::int64_t> window;
  std::int64_t sinks = 0;
};

// One life cycle as the manager's config carries it (window -1: full attention).
struct LcConfig {
  bool ssm = false;
  std::int64_t window = -1;  // -1: full attention (attention only)
  std::int64_t sinks = 0;
  std::int64_t slot_bytes = 0;

  LifeCycleSpec spec() const noexcept {
    LifeCycleSpec s;
    s.kind = ssm ? LcKind::ssm : LcKind::attn;
    if (!ssm && window >= 0) s.window = window;
    s.sinks = ssm ? 0 : sinks;
    return s;
  }
};

// The stale blocks [lo, hi) of a sliding-window attention life cycle at history length
// `history` (SPEC sec. 7): lo = ceil(sinks / B), hi = max(lo, (history + 1 - window) // B),
// written so that no history < 2**63 overflows.  Full attention and ssm have none.
// Python twin: stale_range in the interface's config module.
constexpr std::pair<std::int64_t, std::int64_t> stale_range(std::int64_t window, std::int64_t sinks,
                                                            std::int64_t B, std::int64_t history) noexcept {
  const std::int64_t nsink = ceildiv(sinks, B);
  return {nsink, std::max(nsink, floordiv(history - (window - 1), B))};
}

// The first block ordinal past the sinks (ceil(sinks / B)): blocks below it never go stale.
constexpr std::int64_t sink_blocks(std::int64_t sinks, std::int64_t B) noexcept { return ceildiv(sinks, B); }

}  // namespace kvcm
