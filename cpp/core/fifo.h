// A FIFO in a ring buffer: the block pool's event buffer and its side queues.
#pragma once

#include <algorithm>
#include <cstddef>
#include <iterator>
#include <memory>
#include <new>
#include <type_traits>
#include <utility>
#include <vector>

namespace kvcm {

// A FIFO in a ring buffer (capacity a power of two, doubled when full, never shrunk):
// pushes and pops are O(1) with no element ever moved once written, memory is reused.
// std::deque frees and allocates a chunk every few elements, and a vector compacted when
// its dead prefix grows moves every live element again: the event buffer (one push and
// one pop per event once full) felt both on every commit and eviction.
template <typename T>
class Fifo {
  static_assert(std::is_trivially_destructible_v<T>);

 public:
  class Iter {  // forward iteration from the oldest element (take_events copies out with it)
   public:
    using iterator_category = std::forward_iterator_tag;
    using value_type = T;
    using difference_type = std::ptrdiff_t;
    using pointer = const T*;
    using reference = const T&;
    Iter() = default;
    Iter(const Fifo* f, std::size_t i) : f_(f), i_(i) {}
    const T& operator*() const noexcept { return (*f_)[i_]; }
    const T* operator->() const noexcept { return &(*f_)[i_]; }
    Iter& operator++() noexcept {
      ++i_;
      return *this;
    }
    Iter operator++(int) noexcept {
      Iter t = *this;
      ++i_;
      return t;
    }
    bool operator==(const Iter& o) const noexcept { return i_ == o.i_; }

   private:
    const Fifo* f_ = nullptr;
    std::size_t i_ = 0;
  };
  std::size_t size() const noexcept { return size_; }
  bool empty() const noexcept { return size_ == 0; }
  const T& operator[](std::size_t i) const noexcept { return v_[(head_ + i) & mask_]; }
  const T& front() const noexcept { return v_[head_]; }
  T& back() noexcept { return v_[(head_ + size_ - 1) & mask_]; }
  Iter begin() const noexcept { return {this, 0}; }
  Iter end() const noexcept { return {this, size_}; }
  template <typename... A>
  T& emplace_back(A&&... a) {
    if (size_ == v_.size()) grow(1);
    // built in place (T is trivially destructible): assigning a temporary would write it
    // to the stack field by field and read it back whole, a store-forwarding stall
    T* at = &v_[(head_ + size_) & mask_];
    T* slot = nullptr;
    if constexpr (sizeof...(A) == 0) {
      slot = ::new (static_cast<void*>(at)) T;  // default-init: each member's initialiser, no memset of the whole
    } else {
      slot = std::construct_at(at, std::forward<A>(a)...);
    }
    ++size_;
    return *slot;
  }
  // Append [first, first + n) (a contiguous range): at most two copies.
  void append(const T* first, std::size_t n) {
    if (size_ + n > v_.size()) grow(n);
    const std::size_t at = (head_ + size_) & mask_;
    const std::size_t k = std::min(n, v_.size() - at);
    std::copy(first, first + k, v_.begin() + static_cast<std::ptrdiff_t>(at));
    std::copy(first + k, first + n, v_.begin());
    size_ += n;
  }
  void pop_front(std::size_t n = 1) noexcept {
    head_ = (head_ + n) & mask_;
    size_ -= n;
  }
  void clear() noexcept { head_ = size_ = 0; }

 private:
  void grow(std::size_t n) {
    std::size_t cap = v_.empty() ? 16 : v_.size();
    while (cap < size_ + n) cap *= 2;
    std::vector<T> next(cap);
    for (std::size_t i = 0; i < size_; ++i) next[i] = (*this)[i];
    v_.swap(next);
    head_ = 0;
    mask_ = cap - 1;
  }
  std::vector<T> v_;
  std::size_t head_ = 0, size_ = 0, mask_ = 0;
};

}  // namespace kvcm
