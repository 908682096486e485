// The token table (tokens.h).
#include "core/tokens.h"

#include "core/manager_detail.h"

namespace kvcm {

using detail::feed;

void TokenTable::intern_into(TokenSeq tokens, std::vector<Tok>& out) {
  if (tokens.digests.empty()) {  // all ints: their codes are final
    out.insert(out.end(), tokens.codes.begin(), tokens.codes.end());
    return;
  }
  const std::size_t before = out.size();
  try {
    out.reserve(before + tokens.size());
    for (Tok c : tokens.codes) {
      out.push_back((c & kDigestCode) ? tree_.intern(TokenArg{0, tokens.digests[c & ~kDigestCode].data()}) : c);
    }
  } catch (...) {  // nothing changed: give back what was interned
    tree_.release_all(std::span<const Tok>(out).subspan(before));
    out.resize(before);
    throw;
  }
}

std::vector<TokenOut> TokenTable::decode_all(std::span<const Tok> codes) const {
  std::vector<TokenOut> out;
  out.reserve(codes.size());
  for (Tok c : codes) out.push_back(decode(c));
  return out;
}

Digest TokenTable::block_key_of(const Digest& parent, std::span<const Tok> tokens) const {
  Digest key{};
  KeyChain chain(parent, static_cast<std::uint32_t>(B_), [&key](const Digest& k) { key = k; });
  feed(chain, tokens, [this](Tok c) -> const Digest& { return tree_.digest(c); });
  return key;
}

std::vector<Digest> TokenTable::chain(const Digest& root, std::span<const Tok> tokens) const {
  std::vector<Digest> keys;
  keys.reserve(tokens.size() / static_cast<std::size_t>(B_) + 1);
  KeyChain chain(root, static_cast<std::uint32_t>(B_), [&keys](const Digest& k) { keys.push_back(k); });
  feed(chain, tokens, [this](Tok c) -> const Digest& { return tree_.digest(c); });
  return keys;
}

std::vector<Digest> TokenTable::input_chain(const Digest& root, TokenSeq tokens, std::int64_t B) {
  const auto b = static_cast<std::size_t>(B);
  const std::size_t nfull = tokens.size() / b * b;
  std::vector<Digest> keys;
  keys.reserve(nfull / b);
  KeyChain chain(root, static_cast<std::uint32_t>(B), [&keys](const Digest& k) { keys.push_back(k); });
  feed(chain, tokens.codes.first(nfull), [&tokens](Tok c) -> const Digest& { return tokens.digests[c & ~kDigestCode]; });
  return keys;
}

}  // namespace kvcm
