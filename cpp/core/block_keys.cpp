#include "core/block_keys.h"

#include <algorithm>
#include <chrono>

namespace kvcm {

Digest scope_root_key(std::optional<std::uint64_t> lora_id, std::optional<std::uint64_t> salt) noexcept {
  std::uint8_t data[1 + 8 + 8];
  std::size_t n = 0;
  data[n++] = static_cast<std::uint8_t>((lora_id ? 1u : 0u) | (salt ? 2u : 0u));
  for (const auto& field : {lora_id, salt}) {
    if (!field) continue;
    for (int i = 0; i < 8; ++i) data[n++] = static_cast<std::uint8_t>(*field >> (8 * i));
  }
  return Sha256::hash({data, n});
}

Digest block_key(const Digest& parent, std::span<const std::uint8_t> token_bytes) noexcept {
  Sha256 h;
  h.update(parent);
  h.update(token_bytes);
  return h.finish();
}

void TokenBytes::grow(std::size_t min_capacity) {
  const std::size_t capacity = std::max(min_capacity, capacity_ * 2);
  auto data = std::make_unique_for_overwrite<std::uint8_t[]>(capacity);
  if (size_ != 0) std::memcpy(data.get(), data_.get(), size_);
  data_ = std::move(data);
  capacity_ = capacity;
}

std::size_t TokenBytes::block_end(std::size_t i) const noexcept {
  const std::size_t end_token = std::min((i + 1) * tokens_per_block_, num_tokens_);
  // Each digest token before end_token is 28 bytes longer than an int token.
  const auto digests = static_cast<std::size_t>(
      std::lower_bound(digest_tokens_.begin(), digest_tokens_.end(), end_token) - digest_tokens_.begin());
  return end_token * 4 + digests * (kDigestTokenBytes - 4);
}

std::vector<Digest> chain_keys(const Digest& root, const TokenBytes& tokens) {
  const std::size_t n = tokens.num_blocks();
  std::vector<Digest> keys;
  keys.reserve(n);
  const auto bytes = tokens.bytes();
  const Digest* parent = &root;
  std::size_t begin = 0;
  for (std::size_t i = 0; i < n; ++i) {
    const std::size_t end = tokens.block_end(i);
    keys.push_back(block_key(*parent, bytes.subspan(begin, end - begin)));
    parent = &keys.back();  // reserve() above keeps this pointer valid
    begin = end;
  }
  return keys;
}

std::int64_t raw_sha256_loop(std::size_t n_blocks, std::size_t block_bytes) {
  std::vector<std::uint8_t> data(block_bytes);
  for (std::size_t i = 0; i < block_bytes; ++i) data[i] = static_cast<std::uint8_t>(i * 131u + 7u);
  Digest key{};
  const auto t0 = std::chrono::steady_clock::now();
  for (std::size_t i = 0; i < n_blocks; ++i) key = block_key(key, data);
  const auto t1 = std::chrono::steady_clock::now();
  // Keep the chain observable so the loop cannot be optimised away.
  volatile std::uint8_t sink = key[0];
  (void)sink;
  return std::chrono::duration_cast<std::chrono::nanoseconds>(t1 - t0).count();
}

}  // namespace kvcm
