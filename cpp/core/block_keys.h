// Block keys (SPEC sec. 3): a SHA-256 chain over blocks of tokens, rooted at a key
// derived from the ReuseScope.  Plain C++: the bindings convert Python tokens into a
// TokenBytes and release the GIL for chain_keys().
#pragma once

#include <bit>
#include <cstddef>
#include <cstdint>
#include <algorithm>
#include <cstring>
#include <memory>
#include <optional>
#include <span>
#include <utility>
#include <vector>

#include "core/sha256.h"

namespace kvcm {

inline constexpr std::uint32_t kMaxTokensPerBlock = 4096;
inline constexpr std::uint64_t kTokenLimit = std::uint64_t{1} << 31;  // tokens are in [0, 2**31)
inline constexpr std::size_t kDigestTokenBytes = 32;

// sha256(mask || lora_le64? || salt_le64?); bit0 of mask = lora present, bit1 = salt present.
Digest scope_root_key(std::optional<std::uint64_t> lora_id, std::optional<std::uint64_t> salt) noexcept;

// The byte encoding of a token sequence, cut into blocks of `tokens_per_block` tokens.
// Int tokens are 4 bytes little endian, digest tokens their 32 raw bytes.  Block byte
// ranges are derived on demand from the token indices of the (rare) digest tokens, so
// appending an int is a 4-byte store: no per-token bookkeeping on the hot path.
class TokenBytes {
 public:
  explicit TokenBytes(std::uint32_t tokens_per_block) : tokens_per_block_(tokens_per_block) {}

  // Room for `n_tokens` more int tokens without reallocating.
  void reserve(std::size_t n_tokens) { ensure(n_tokens * 4); }
  // `token` must be < 2**31 (the caller validates; the encoding itself would accept any u32).
  void append_int(std::uint32_t token) {
    ensure(4);
    store_le32(data_.get() + size_, token);
    size_ += 4;
    ++num_tokens_;
  }
  // `n` validated int tokens at once (the bindings' parsers convert in chunks).
  void append_ints(const std::uint32_t* tokens, std::size_t n) {
    ensure(n * 4);
    std::uint8_t* dst = data_.get() + size_;
    if constexpr (std::endian::native == std::endian::little) {
      if (n != 0) std::memcpy(dst, tokens, n * 4);
    } else {
      for (std::size_t i = 0; i < n; ++i) store_le32(dst + 4 * i, tokens[i]);
    }
    size_ += n * 4;
    num_tokens_ += n;
  }
  void append_digest(std::span<const std::uint8_t, kDigestTokenBytes> digest) {
    ensure(kDigestTokenBytes);
    std::memcpy(data_.get() + size_, digest.data(), kDigestTokenBytes);
    size_ += kDigestTokenBytes;
    digest_tokens_.push_back(num_tokens_);
    ++num_tokens_;
  }

  std::size_t num_tokens() const noexcept { return num_tokens_; }
  std::uint32_t tokens_per_block() const noexcept { return tokens_per_block_; }
  // Number of full or partial blocks.
  std::size_t num_blocks() const noexcept {
    return (num_tokens_ + tokens_per_block_ - 1) / tokens_per_block_;
  }
  std::span<const std::uint8_t> bytes() const noexcept { return {data_.get(), size_}; }
  // Block i covers bytes [i == 0 ? 0 : block_end(i-1), block_end(i)); the partial tail
  // block (if any) ends at bytes().size().
  std::size_t block_end(std::size_t i) const noexcept;

 private:
  static void store_le32(std::uint8_t* p, std::uint32_t v) noexcept {
    p[0] = static_cast<std::uint8_t>(v);
    p[1] = static_cast<std::uint8_t>(v >> 8);
    p[2] = static_cast<std::uint8_t>(v >> 16);
    p[3] = static_cast<std::uint8_t>(v >> 24);
  }
  void ensure(std::size_t more) {
    if (capacity_ - size_ < more) grow(size_ + more);
  }
  void grow(std::size_t min_capacity);

  std::uint32_t tokens_per_block_;
  std::size_t num_tokens_ = 0;
  // Uninitialised storage: every byte below size_ is written before it is read, and a
  // value-initialised vector would zero megabytes per call only to overwrite them.
  std::unique_ptr<std::uint8_t[]> data_;
  std::size_t size_ = 0;
  std::size_t capacity_ = 0;
  std::vector<std::size_t> digest_tokens_;  // token index of each digest token, ascending
};

// Key of one block: sha256(parent_key || token bytes).
Digest block_key(const Digest& parent, std::span<const std::uint8_t> token_bytes) noexcept;

// One key per full or partial block of `tokens`, chained from `root`.
std::vector<Digest> chain_keys(const Digest& root, const TokenBytes& tokens);

// chain_keys() computed while the tokens arrive: each block's hash is fed as its tokens
// come in and finished when the block fills, handing the key to `on_key` (a callable taking
// `const Digest&`, e.g. one storing it).  The whole byte encoding is never materialised (no
// large buffer to allocate and fault in) and the hashing is spread evenly over the input
// whatever the block size, so a caller converting tokens in small chunks interleaves that
// work with the latency-bound SHA rounds.  Same keys as chain_keys() over the same tokens.
template <class OnKey>
class KeyChain {
 public:
  KeyChain(const Digest& root, std::uint32_t tokens_per_block, OnKey on_key)
      : tokens_per_block_(tokens_per_block), on_key_(std::move(on_key)) {
    sha_.update(root);
  }

  // A TokenSink (see cpp/token_parse.h); nothing to reserve: storage is the callback's.
  void reserve(std::size_t) noexcept {}
  // `tokens` must be < 2**31, as for TokenBytes.
  void append_ints(const std::uint32_t* tokens, std::size_t n) {
    while (n > 0) {
      const std::size_t take = std::min<std::size_t>(n, tokens_per_block_ - in_block_);
      if constexpr (std::endian::native == std::endian::little) {
        sha_.update(reinterpret_cast<const std::uint8_t*>(tokens), take * 4);
      } else {
        for (std::size_t i = 0; i < take; ++i) {
          const std::uint32_t t = tokens[i];
          const std::uint8_t le[4] = {static_cast<std::uint8_t>(t), static_cast<std::uint8_t>(t >> 8),
                                      static_cast<std::uint8_t>(t >> 16), static_cast<std::uint8_t>(t >> 24)};
          sha_.update(le, 4);
        }
      }
      in_block_ += static_cast<std::uint32_t>(take);
      tokens += take;
      n -= take;
      if (in_block_ == tokens_per_block_) close_block();
    }
  }
  void append_digest(std::span<const std::uint8_t, kDigestTokenBytes> digest) {
    sha_.update(digest);
    if (++in_block_ == tokens_per_block_) close_block();
  }
  // Hashes the partial tail block, if any.  Call once, after the last token.
  void finish() {
    if (in_block_ > 0) close_block();
  }

 private:
  void close_block() {
    const Digest key = sha_.finish();
    sha_.reset();
    sha_.update(key);  // the next block's parent
    in_block_ = 0;
    on_key_(key);
  }

  std::uint32_t tokens_per_block_;
  std::uint32_t in_block_ = 0;  // tokens of the current block fed to sha_
  Sha256 sha_;                  // sha256(parent || the current block's tokens so far)
  OnKey on_key_;
};

// A raw hashing floor for benchmarks: chain `n_blocks` hashes over `block_bytes` bytes
// each (plus the 32-byte parent key, like real block keys).  Returns elapsed nanoseconds.
std::int64_t raw_sha256_loop(std::size_t n_blocks, std::size_t block_bytes);

}  // namespace kvcm
