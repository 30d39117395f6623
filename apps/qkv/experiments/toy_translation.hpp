#pragma once
// A synthetic translation task with a known word alignment and real reordering, for `qkv experiment
// alignment`. The source language reads like English; the target language is verb-final, puts
// adjectives after their noun (in mirrored order), turns prepositions into postpositions placed
// after their noun phrase, and moves a sentence adverb from the end to right after the subject:
//
//   source  the big red dog sees a cat near the house today
//   target  le hundo ruga granda hodiau le kasa apude un kato vidas
//
//   S  → NP V_intr PP* [Adv]  |  NP V_tr NP PP* [Adv]      (source; 0 to 2 PPs)
//   NP → Det Adj{0,2} N        PP → Prep NP
//   target: S → NP' [Adv] PP'* [NP'_obj] V,   NP' → Det N Adj (reversed),   PP' → NP' Postp
//
// Every source word has exactly one target word (a fixed lexicon), so the gold alignment is a
// permutation: alignment[i] is the source position of target word i; the two vocabularies are
// parallel, so a target word has the id of its source word. Sentences are 4 to 15 words, their
// lengths drawn uniformly (two adjectives of one noun differ); the splits are generated from one
// seed and hold no sentence twice, the test split first so that it does not depend on the others' sizes.

#include <cstdint>
#include <string_view>
#include <vector>

#include "seq2seq.hpp"

namespace qkv::cli {

struct SentencePair {
  std::vector<int64_t> source;     // source-vocabulary ids
  std::vector<int64_t> target;     // target-vocabulary ids (no <eos>)
  std::vector<int64_t> alignment;  // [target length]: the source position of each target word
};

struct ToyLanguage {
  Vocabulary source;
  Vocabulary target;
};

// The fixed lexicon of both languages.
const ToyLanguage& toy_language();

// The word classes, in the order of toy_word_class's answers.
inline constexpr std::string_view kToyWordClasses[] = {"determiner", "noun",        "adjective",
                                                       "verb",       "preposition", "adverb"};
// The class of a word id, in either language (the lexicons are parallel): an index into
// kToyWordClasses; −1 for the special tokens.
int64_t toy_word_class(int64_t id);

struct TranslationSplits {
  std::vector<SentencePair> train, validation, test;
};

inline constexpr int64_t kToyMinLength = 4;
inline constexpr int64_t kToyMaxLength = 15;

// Deterministic in `seed`: the same seed gives the same sentences in the same order. No source
// sentence occurs twice across the three splits. Throws ValueError for a negative count.
TranslationSplits make_translation_splits(uint64_t seed, int64_t train, int64_t validation, int64_t test);

// One sentence of `length` words (in [kToyMinLength, kToyMaxLength]) drawn from the grammar.
SentencePair random_sentence(Rng& rng, int64_t length);

}  // namespace qkv::cli
