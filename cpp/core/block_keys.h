// Block keys (SPEC sec. 3): a SHA-256 chain over blocks of tokens, rooted at a key
// derived from the ReuseScope.  Plain C++: the bindings convert Python tokens into a
// TokenBytes and release the GIL for chain_keys().
#pragma once

#include <cstddef>
#include <cstdint>
#include <optional>
#include <span>
#include <vector>

#include "core/sha256.h"

namespace kvcm {

inline constexpr std::uint32_t kMaxTokensPerBlock = 4096;
inline constexpr std::uint64_t kTokenLimit = std::uint64_t{1} << 31;  // tokens are in [0, 2**31)
inline constexpr std::size_t kDigestTokenBytes = 32;

// sha256(mask || lora_le64? || salt_le64?); bit0 of mask = lora present, bit1 = salt present.
Digest scope_root_key(std::optional<std::uint64_t> lora_id, std::optional<std::uint64_t> salt) noexcept;

// The byte encoding of a token sequence, cut into blocks of `tokens_per_block` tokens.
// Int tokens are 4 bytes little endian, digest tokens their 32 raw bytes; since a block
// can mix both, the byte offset where each block ends is recorded as tokens arrive.
class TokenBytes {
 public:
  explicit TokenBytes(std::uint32_t tokens_per_block) : tokens_per_block_(tokens_per_block) {}

  void reserve(std::size_t n_tokens) {
    bytes_.reserve(n_tokens * 4);
    block_ends_.reserve(n_tokens / tokens_per_block_ + 1);
  }
  // `token` must be < 2**31 (the caller validates; the encoding itself would accept any u32).
  void append_int(std::uint32_t token) {
    const std::uint8_t le[4] = {static_cast<std::uint8_t>(token), static_cast<std::uint8_t>(token >> 8),
                                static_cast<std::uint8_t>(token >> 16), static_cast<std::uint8_t>(token >> 24)};
    bytes_.insert(bytes_.end(), le, le + 4);
    count_one();
  }
  void append_digest(std::span<const std::uint8_t, kDigestTokenBytes> digest) {
    bytes_.insert(bytes_.end(), digest.begin(), digest.end());
    count_one();
  }

  std::size_t num_tokens() const noexcept { return num_tokens_; }
  std::uint32_t tokens_per_block() const noexcept { return tokens_per_block_; }
  // Number of full or partial blocks.
  std::size_t num_blocks() const noexcept {
    return (num_tokens_ + tokens_per_block_ - 1) / tokens_per_block_;
  }
  std::span<const std::uint8_t> bytes() const noexcept { return bytes_; }
  // Byte ranges of block i: [i == 0 ? 0 : end(i-1), end(i)).  The partial tail block
  // (if any) ends at bytes().size().
  std::size_t block_end(std::size_t i) const noexcept {
    return i < block_ends_.size() ? block_ends_[i] : bytes_.size();
  }

 private:
  void count_one() {
    ++num_tokens_;
    // A countdown instead of num_tokens_ % B: this runs once per token.
    if (--until_boundary_ == 0) {
      block_ends_.push_back(bytes_.size());
      until_boundary_ = tokens_per_block_;
    }
  }

  std::uint32_t tokens_per_block_;
  std::uint32_t until_boundary_ = tokens_per_block_;
  std::size_t num_tokens_ = 0;
  std::vector<std::uint8_t> bytes_;
  std::vector<std::size_t> block_ends_;  // full blocks only
};

// Key of one block: sha256(parent_key || token bytes).
Digest block_key(const Digest& parent, std::span<const std::uint8_t> token_bytes) noexcept;

// One key per full or partial block of `tokens`, chained from `root`.
std::vector<Digest> chain_keys(const Digest& root, const TokenBytes& tokens);

// A raw hashing floor for benchmarks: chain `n_blocks` hashes over `block_bytes` bytes
// each (plus the 32-byte parent key, like real block keys).  Returns elapsed nanoseconds.
std::int64_t raw_sha256_loop(std::size_t n_blocks, std::size_t block_bytes);

}  // namespace kvcm
