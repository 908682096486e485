// The token table (SPEC sec. 3, 15): the interning of digest tokens into pool codes, their
// references, and the block keys hashed over pool codes.  The digest table itself lives in
// the RadixTree (tree.h: the data structure underneath, whose blocks hold the codes); this
// class is the one door to it for everything that is not the tree.  C++ only: the Python
// wing keeps tokens as Python objects (its twin for the keys is kvcm/keys.py).
//
// The BlockPool owns the one TokenTable; each Request holds a `TokenTable&`.
#pragma once

#include <cstdint>
#include <span>
#include <vector>

#include "core/block_keys.h"
#include "core/tree.h"
#include "core/types.h"

namespace kvcm {

class TokenTable {
 public:
  TokenTable(RadixTree& tree, std::int64_t B) noexcept : tree_(tree), B_(B) {}
  TokenTable(const TokenTable&) = delete;
  TokenTable& operator=(const TokenTable&) = delete;

  // Append the pool's codes of `tokens` to `out` (interning their digests); nothing
  // changed on an error.
  void intern_into(TokenSeq tokens, std::vector<Tok>& out);
  TokenOut decode(Tok t) const { return tree_.decode(t); }
  std::vector<TokenOut> decode_all(std::span<const Tok> codes) const;
  // The 32 bytes of digest code `c`.
  const Digest& digest(Tok c) const { return tree_.digest(c); }
  // Digest tokens' references (SPEC sec. 15): a request's token lists hold their own.
  void retain_tokens(std::span<const Tok> codes) { tree_.retain_all(codes); }
  void release_tokens(std::span<const Tok> codes) { tree_.release_all(codes); }
  void release(Tok c) { tree_.release(c); }
  // (block keys: KeyChain with the caller's lambda as its callback, inlined)
  Digest block_key_of(const Digest& parent, std::span<const Tok> tokens) const;
  std::vector<Digest> chain(const Digest& root, std::span<const Tok> tokens) const;
  // The keys of the full blocks of `tokens` as the caller gave them (digests not interned:
  // probe and shared_candidates create nothing), chained from `root`.
  static std::vector<Digest> input_chain(const Digest& root, TokenSeq tokens, std::int64_t B);

 private:
  RadixTree& tree_;
  std::int64_t B_;
};

}  // namespace kvcm
