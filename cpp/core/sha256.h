// SHA-256 (FIPS 180-4) for block keys (SPEC sec. 3).
//
// Written here rather than linked from OpenSSL so the extension has no runtime
// dependency and so both the portable and the SHA-NI paths can be tested against
// each other.  The compression function is picked once at startup from cpuid.
#pragma once

#include <array>
#include <cstddef>
#include <cstdint>
#include <span>
#include <string_view>

namespace kvcm {

using Digest = std::array<std::uint8_t, 32>;

// Which compression function is in use.  `auto` picks SHA-NI when the CPU has it.
enum class Sha256Impl { portable, shani };

// True when this CPU (and this build) can run the SHA-NI path.
bool sha256_shani_available() noexcept;
// The implementation in use now.
Sha256Impl sha256_impl() noexcept;
std::string_view sha256_impl_name() noexcept;
// Select an implementation (tests use this to cover both paths).  Returns false,
// changing nothing, when `shani` is asked for on a CPU without it.
bool sha256_set_impl(Sha256Impl impl) noexcept;

// Streaming SHA-256.  Cheap to construct; not thread-safe per object.
class Sha256 {
 public:
  Sha256() noexcept { reset(); }

  void reset() noexcept;
  void update(std::span<const std::uint8_t> data) noexcept;
  void update(const std::uint8_t* data, std::size_t len) noexcept { update({data, len}); }
  // Finishes the hash; the object must be reset() before reuse.
  Digest finish() noexcept;

  static Digest hash(std::span<const std::uint8_t> data) noexcept {
    Sha256 h;
    h.update(data);
    return h.finish();
  }

 private:
  std::array<std::uint32_t, 8> state_{};
  std::array<std::uint8_t, 64> buf_{};
  std::size_t buf_len_ = 0;
  std::uint64_t total_len_ = 0;  // bytes
};

}  // namespace kvcm
