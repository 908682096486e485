// The layout (SPEC sec. 1, 2, 7): the facts the configuration fixes, read-only for every
// part of the pool and for the requests — tokens per block, the local tiers and their SPEC
// tier numbers, the life cycles (attention ones ascending, the ssm one), the shared tier's
// write policy, and the stale range of a life cycle at a history length.  Python twin:
// kvcm/python_backend/layout.py (Layout).
//
// The BlockPool owns the one Layout; its parts and each Request hold a `const Layout&`.
// Only the owner may change the two settings the manager's setters reach (set_quota's
// bytes, the pending-copy-ops warning threshold): every other holder sees it const.
#pragma once

#include <cstdint>
#include <string>
#include <utility>
#include <vector>

#include "core/lifecycle.h"

namespace kvcm {

struct ManagerConfig {
  std::int64_t tokens_per_block = 1;
  std::vector<LcConfig> lcs;
  std::vector<std::vector<std::int64_t>> slots;  // [tier][lc]
  std::vector<std::string> tier_kinds;
  bool enable_partial_reuse = true;
  std::int64_t reuse_match_backoff = 0;
  double max_util_for_resume = 1.0;
  std::int64_t max_events = 10000;
  std::int64_t pending_copy_ops_warning = 1000000;  // 0: never warn
  std::vector<std::int64_t> quota_bytes;  // [tier]: shown by stats / snapshot; set_quota changes it
  // The shared tier (DECISIONS.md "The shared tier"): configured (tier number 3, no pools),
  // and its write policy (false: "commit", write-through; true: "evict", write-back).
  bool shared = false;
  bool shared_write_evict = false;
  // copy_settlement="explicit" (DECISIONS.md "Asynchronous copies: settle_copies"): each
  // non-empty drain stays unsettled until settle_copies; false: "drain" (forget_copies).
  bool explicit_settlement = false;
};

class Layout {
 public:
  explicit Layout(ManagerConfig cfg) : cfg_(std::move(cfg)) {
    B_ = cfg_.tokens_per_block;
    num_tiers_ = static_cast<std::int64_t>(cfg_.slots.size());
    const auto nlc = static_cast<std::int64_t>(cfg_.lcs.size());
    for (std::int64_t lc = 0; lc < nlc; ++lc) {
      if (cfg_.lcs[static_cast<std::size_t>(lc)].ssm) {
        if (ssm_lc_ < 0) ssm_lc_ = lc;
      } else {
        attn_lcs_.push_back(lc);
      }
    }
    for (const std::string& kind : cfg_.tier_kinds) tier_id_.push_back(kind == "gpu" ? 0 : kind == "host" ? 1 : 2);
    shared_pos_ = num_tiers_;
    if (cfg_.shared) tier_id_.push_back(3);
    cfg_.shared_write_evict = cfg_.shared && cfg_.shared_write_evict;
    store_on_commit_ = cfg_.shared && !cfg_.shared_write_evict;
    cfg_.quota_bytes.resize(static_cast<std::size_t>(num_tiers_), 0);
  }
  Layout(const Layout&) = delete;
  Layout& operator=(const Layout&) = delete;

  const ManagerConfig& cfg() const noexcept { return cfg_; }
  std::int64_t B() const noexcept { return B_; }                  // tokens per block
  std::int64_t num_tiers() const noexcept { return num_tiers_; }  // local tiers (pools)
  std::size_t num_life_cycles() const noexcept { return cfg_.lcs.size(); }
  const std::vector<std::int64_t>& attn_lcs() const noexcept { return attn_lcs_; }
  std::int64_t ssm_lc() const noexcept { return ssm_lc_; }  // -1: none
  // shared_write="commit": full blocks are stored as they enter the tree
  bool store_on_commit() const noexcept { return store_on_commit_; }
  // The SPEC sec. 1 tier number (gpu 0, host 1, disk 2, shared 3) of config position `t`:
  // pools are indexed by position; copy ops, events, stats and snapshots report numbers.
  std::int64_t tier_id(std::int64_t t) const { return tier_id_[static_cast<std::size_t>(t)]; }
  // The shared tier's position: a shared page's `tier` (after the local tiers; slot -1, no pool).
  std::int64_t shared_pos() const noexcept { return shared_pos_; }
  // py: config.py LifeCycle.stale_range — SPEC sec. 7
  std::pair<std::int64_t, std::int64_t> stale_range(std::int64_t lc, std::int64_t history) const {
    const LcConfig& l = cfg_.lcs[static_cast<std::size_t>(lc)];
    if (l.ssm || l.window < 0) return {0, 0};
    return kvcm::stale_range(l.window, l.sinks, B_, history);
  }

  // The owner's setters (BlockPool holds the only non-const Layout).
  void set_quota_bytes(std::int64_t tier, std::int64_t bytes) { cfg_.quota_bytes[static_cast<std::size_t>(tier)] = bytes; }
  void set_pending_copy_ops_warning(std::int64_t n) noexcept { cfg_.pending_copy_ops_warning = n; }

 private:
  ManagerConfig cfg_;  // as resolved; set_quota changes quota_bytes
  std::int64_t B_ = 1;
  std::int64_t num_tiers_ = 0;
  std::vector<std::int64_t> tier_id_;
  std::int64_t shared_pos_ = -1;
  bool store_on_commit_ = false;
  std::vector<std::int64_t> attn_lcs_;  // the attention life cycles, ascending
  std::int64_t ssm_lc_ = -1;            // the ssm life cycle (at most one), -1: none
};

}  // namespace kvcm
