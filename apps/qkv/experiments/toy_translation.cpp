#include "toy_translation.hpp"

#include <fmt/format.h>

#include <algorithm>
#include <array>
#include <set>
#include <string>
#include <string_view>
#include <utility>

#include "qkv/core/error.hpp"

namespace qkv::cli {
namespace {

struct Entry {
  std::string_view source;
  std::string_view target;
};

// One lexicon per word class; each source word has one target word.
constexpr std::array<Entry, 2> kDeterminers = {{{"the", "le"}, {"a", "un"}}};
constexpr std::array<Entry, 12> kNouns = {{{"dog", "hundo"},
                                           {"cat", "kato"},
                                           {"bird", "birdo"},
                                           {"house", "kasa"},
                                           {"tree", "arbo"},
                                           {"river", "rivero"},
                                           {"child", "infano"},
                                           {"teacher", "instruisto"},
                                           {"king", "rego"},
                                           {"horse", "cevalo"},
                                           {"garden", "gardeno"},
                                           {"city", "urbo"}}};
constexpr std::array<Entry, 8> kAdjectives = {{{"big", "granda"},
                                               {"small", "eta"},
                                               {"red", "ruga"},
                                               {"old", "malnova"},
                                               {"young", "juna"},
                                               {"happy", "gaja"},
                                               {"green", "verda"},
                                               {"quiet", "kvieta"}}};
constexpr std::array<Entry, 6> kTransitive = {{{"sees", "vidas"},
                                               {"likes", "satas"},
                                               {"follows", "sekvas"},
                                               {"finds", "trovas"},
                                               {"paints", "pentras"},
                                               {"helps", "helpas"}}};
constexpr std::array<Entry, 4> kIntransitive = {
    {{"sleeps", "dormas"}, {"runs", "kuras"}, {"sings", "kantas"}, {"waits", "atendas"}}};
constexpr std::array<Entry, 5> kPrepositions = {
    {{"in", "ene"}, {"near", "apud"}, {"under", "sube"}, {"behind", "malantau"}, {"with", "kune"}}};
constexpr std::array<Entry, 3> kAdverbs = {{{"quickly", "rapide"}, {"often", "ofte"}, {"today", "hodiau"}}};

template <size_t N>
void add_words(const std::array<Entry, N>& entries, std::vector<std::string>& source,
               std::vector<std::string>& target) {
  for (const Entry& e : entries) {
    source.emplace_back(e.source);
    target.emplace_back(e.target);
  }
}

int64_t draw(Rng& rng, int64_t n) { return static_cast<int64_t>(rng.next_u64() % static_cast<uint64_t>(n)); }

// A sentence under construction: source words in order, each with its target word; the target
// side is a list of source positions in target order.
class Builder {
 public:
  explicit Builder(const ToyLanguage& language) : language_(language) {}

  // Appends a source word; returns its position.
  template <size_t N>
  int64_t word(const std::array<Entry, N>& entries, Rng& rng) {
    const Entry& e = entries[static_cast<size_t>(draw(rng, static_cast<int64_t>(N)))];
    pair_.source.push_back(*language_.source.find(e.source));
    target_words_.push_back(*language_.target.find(e.target));
    return static_cast<int64_t>(pair_.source.size()) - 1;
  }

  // Det Adj{0,2} N with distinct adjectives; returns the target order of the phrase: Det N Adj
  // (mirrored).
  std::vector<int64_t> noun_phrase(Rng& rng) {
    const int64_t det = word(kDeterminers, rng);
    std::vector<int64_t> adjectives;
    for (int64_t k = draw(rng, 3); k > 0; --k) {
      adjectives.push_back(word(kAdjectives, rng));
      while (adjectives.size() == 2 &&
             pair_.source[static_cast<size_t>(adjectives[0])] == pair_.source[static_cast<size_t>(adjectives[1])]) {
        redraw_last(kAdjectives, rng);
      }
    }
    const int64_t noun = word(kNouns, rng);
    std::vector<int64_t> order = {det, noun};
    order.insert(order.end(), adjectives.rbegin(), adjectives.rend());
    return order;
  }

  // Replaces the last word appended by another draw from `entries`.
  template <size_t N>
  void redraw_last(const std::array<Entry, N>& entries, Rng& rng) {
    pair_.source.pop_back();
    target_words_.pop_back();
    word(entries, rng);
  }

  SentencePair finish(const std::vector<int64_t>& target_order) {
    for (const int64_t position : target_order) {
      pair_.target.push_back(target_words_[static_cast<size_t>(position)]);
      pair_.alignment.push_back(position);
    }
    return std::move(pair_);
  }

 private:
  const ToyLanguage& language_;
  SentencePair pair_;
  std::vector<int64_t> target_words_;  // by source position
};

SentencePair grammar_sentence(Rng& rng) {
  Builder s(toy_language());
  const std::vector<int64_t> subject = s.noun_phrase(rng);
  const bool transitive = draw(rng, 5) < 3;
  const int64_t verb = transitive ? s.word(kTransitive, rng) : s.word(kIntransitive, rng);
  std::vector<int64_t> object;
  if (transitive) object = s.noun_phrase(rng);
  std::vector<int64_t> phrases;
  for (int64_t k = draw(rng, 3); k > 0; --k) {
    const int64_t preposition = s.word(kPrepositions, rng);
    const std::vector<int64_t> np = s.noun_phrase(rng);
    phrases.insert(phrases.end(), np.begin(), np.end());
    phrases.push_back(preposition);
  }
  std::vector<int64_t> order = subject;
  if (draw(rng, 5) < 2) order.push_back(s.word(kAdverbs, rng));
  order.insert(order.end(), phrases.begin(), phrases.end());
  order.insert(order.end(), object.begin(), object.end());
  order.push_back(verb);
  return s.finish(order);
}

}  // namespace

const ToyLanguage& toy_language() {
  static const ToyLanguage language = [] {
    std::vector<std::string> source, target;
    add_words(kDeterminers, source, target);
    add_words(kNouns, source, target);
    add_words(kAdjectives, source, target);
    add_words(kTransitive, source, target);
    add_words(kIntransitive, source, target);
    add_words(kPrepositions, source, target);
    add_words(kAdverbs, source, target);
    return ToyLanguage{Vocabulary(std::move(source)), Vocabulary(std::move(target))};
  }();
  return language;
}

int64_t toy_word_class(int64_t id) {
  static const std::vector<int64_t> classes = [] {
    std::vector<int64_t> c(static_cast<size_t>(kSpecialTokens), -1);
    const size_t sizes[] = {kDeterminers.size(),  kNouns.size(),
                            kAdjectives.size(),   kTransitive.size() + kIntransitive.size(),
                            kPrepositions.size(), kAdverbs.size()};
    for (size_t k = 0; k < std::size(sizes); ++k) c.insert(c.end(), sizes[k], static_cast<int64_t>(k));
    return c;
  }();
  return id >= 0 && id < static_cast<int64_t>(classes.size()) ? classes[static_cast<size_t>(id)] : -1;
}

SentencePair random_sentence(Rng& rng, int64_t length) {
  if (length < kToyMinLength || length > kToyMaxLength) {
    throw ValueError(fmt::format("length: expected {} to {} words, got {}", kToyMinLength, kToyMaxLength, length));
  }
  // Rejection: the grammar gives every length in range with probability above 1%, so this ends
  // after a few hundred draws at most (the bound only guards against a broken grammar).
  for (int attempt = 0; attempt < 100000; ++attempt) {
    SentencePair pair = grammar_sentence(rng);
    if (static_cast<int64_t>(pair.source.size()) == length) return pair;
  }
  throw ValueError(fmt::format("length: the grammar produced no sentence of {} words", length));
}

TranslationSplits make_translation_splits(uint64_t seed, int64_t train, int64_t validation, int64_t test) {
  for (const auto& [name, count] : {std::pair{"train", train}, {"validation", validation}, {"test", test}}) {
    if (count < 0) throw ValueError(fmt::format("{}: expected a count >= 0, got {}", name, count));
  }
  Rng rng(seed);
  std::set<std::vector<int64_t>> seen;
  const auto fill = [&](std::vector<SentencePair>& split, int64_t count) {
    while (static_cast<int64_t>(split.size()) < count) {
      const int64_t length = kToyMinLength + draw(rng, kToyMaxLength - kToyMinLength + 1);
      SentencePair pair = random_sentence(rng, length);
      if (seen.insert(pair.source).second) split.push_back(std::move(pair));
    }
  };
  TranslationSplits splits;
  fill(splits.test, test);
  fill(splits.validation, validation);
  fill(splits.train, train);
  return splits;
}

}  // namespace qkv::cli
