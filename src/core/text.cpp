#include "qkv/core/text.hpp"

#include <algorithm>
#include <array>
#include <iterator>
#include <utility>

namespace qkv {
namespace {

constexpr char32_t kInvalid = 0xFFFFFFFF;

// The code point starting at text[pos] and its length in bytes; kInvalid (length 1) for a byte that
// does not start a well-formed sequence (stray continuation, overlong form, surrogate, > U+10FFFF).
std::pair<char32_t, size_t> decode_utf8(std::string_view text, size_t pos) {
  const auto byte = [&](size_t i) { return static_cast<unsigned char>(text[i]); };
  const unsigned char lead = byte(pos);
  if (lead < 0x80) return {lead, 1};
  size_t length = 0;
  char32_t cp = 0;
  char32_t min = 0;
  if ((lead & 0xE0) == 0xC0) {
    length = 2, cp = lead & 0x1F, min = 0x80;
  } else if ((lead & 0xF0) == 0xE0) {
    length = 3, cp = lead & 0x0F, min = 0x800;
  } else if ((lead & 0xF8) == 0xF0) {
    length = 4, cp = lead & 0x07, min = 0x10000;
  } else {
    return {kInvalid, 1};
  }
  if (pos + length > text.size()) return {kInvalid, 1};
  for (size_t i = 1; i < length; ++i) {
    if ((byte(pos + i) & 0xC0) != 0x80) return {kInvalid, 1};
    cp = (cp << 6) | (byte(pos + i) & 0x3F);
  }
  if (cp < min || cp > 0x10FFFF || (cp >= 0xD800 && cp <= 0xDFFF)) return {kInvalid, 1};
  return {cp, length};
}

struct Range {
  char32_t first, last;
};

// East Asian Width W and F (Unicode UAX #11), merged into blocks: the few unassigned or ambiguous
// code points a block spans count wide too, which is how most terminals draw them.
constexpr std::array kWide = {
    Range{0x1100, 0x115F},   Range{0x231A, 0x231B},   Range{0x2329, 0x232A},   Range{0x23E9, 0x23EC},
    Range{0x23F0, 0x23F0},   Range{0x23F3, 0x23F3},   Range{0x25FD, 0x25FE},   Range{0x2614, 0x2615},
    Range{0x2648, 0x2653},   Range{0x267F, 0x267F},   Range{0x2693, 0x2693},   Range{0x26A1, 0x26A1},
    Range{0x26AA, 0x26AB},   Range{0x26BD, 0x26BE},   Range{0x26C4, 0x26C5},   Range{0x26CE, 0x26CE},
    Range{0x26D4, 0x26D4},   Range{0x26EA, 0x26EA},   Range{0x26F2, 0x26F3},   Range{0x26F5, 0x26F5},
    Range{0x26FA, 0x26FA},   Range{0x26FD, 0x26FD},   Range{0x2705, 0x2705},   Range{0x270A, 0x270B},
    Range{0x2728, 0x2728},   Range{0x274C, 0x274C},   Range{0x274E, 0x274E},   Range{0x2753, 0x2755},
    Range{0x2757, 0x2757},   Range{0x2795, 0x2797},   Range{0x27B0, 0x27B0},   Range{0x27BF, 0x27BF},
    Range{0x2B1B, 0x2B1C},   Range{0x2B50, 0x2B50},   Range{0x2B55, 0x2B55},   Range{0x2E80, 0x303E},
    Range{0x3041, 0x33FF},   Range{0x3400, 0x4DBF},   Range{0x4E00, 0x9FFF},   Range{0xA000, 0xA4CF},
    Range{0xA960, 0xA97F},   Range{0xAC00, 0xD7A3},   Range{0xF900, 0xFAFF},   Range{0xFE10, 0xFE19},
    Range{0xFE30, 0xFE6F},   Range{0xFF00, 0xFF60},   Range{0xFFE0, 0xFFE6},   Range{0x16FE0, 0x16FE4},
    Range{0x17000, 0x18CFF}, Range{0x1B000, 0x1B2FF}, Range{0x1F004, 0x1F004}, Range{0x1F0CF, 0x1F0CF},
    Range{0x1F18E, 0x1F18E}, Range{0x1F191, 0x1F19A}, Range{0x1F200, 0x1F265}, Range{0x1F300, 0x1F320},
    Range{0x1F32D, 0x1F335}, Range{0x1F337, 0x1F37C}, Range{0x1F37E, 0x1F393}, Range{0x1F3A0, 0x1F3CA},
    Range{0x1F3CF, 0x1F3D3}, Range{0x1F3E0, 0x1F3F0}, Range{0x1F3F4, 0x1F3F4}, Range{0x1F3F8, 0x1F43E},
    Range{0x1F440, 0x1F440}, Range{0x1F442, 0x1F4FC}, Range{0x1F4FF, 0x1F53D}, Range{0x1F54B, 0x1F54E},
    Range{0x1F550, 0x1F567}, Range{0x1F57A, 0x1F57A}, Range{0x1F595, 0x1F596}, Range{0x1F5A4, 0x1F5A4},
    Range{0x1F5FB, 0x1F64F}, Range{0x1F680, 0x1F6C5}, Range{0x1F6CC, 0x1F6CC}, Range{0x1F6D0, 0x1F6D2},
    Range{0x1F6D5, 0x1F6D7}, Range{0x1F6DC, 0x1F6DF}, Range{0x1F6EB, 0x1F6EC}, Range{0x1F6F4, 0x1F6FC},
    Range{0x1F7E0, 0x1F7EB}, Range{0x1F7F0, 0x1F7F0}, Range{0x1F90C, 0x1F93A}, Range{0x1F93C, 0x1F945},
    Range{0x1F947, 0x1F9FF}, Range{0x1FA70, 0x1FAFF}, Range{0x20000, 0x2FFFD}, Range{0x30000, 0x3FFFD},
};

// Combining marks and zero-width characters: drawn on top of (or between) their neighbours.
constexpr std::array kZeroWidth = {
    Range{0x0300, 0x036F}, Range{0x0483, 0x0489}, Range{0x0591, 0x05BD}, Range{0x0610, 0x061A}, Range{0x064B, 0x065F},
    Range{0x1AB0, 0x1AFF}, Range{0x1DC0, 0x1DFF}, Range{0x200B, 0x200F}, Range{0x2028, 0x202E}, Range{0x2060, 0x2064},
    Range{0x20D0, 0x20FF}, Range{0xFE00, 0xFE0F}, Range{0xFE20, 0xFE2F}, Range{0xFEFF, 0xFEFF}, Range{0xE0100, 0xE01EF},
};

template <size_t N>
bool in_ranges(const std::array<Range, N>& ranges, char32_t cp) {
  const auto it =
      std::upper_bound(ranges.begin(), ranges.end(), cp, [](char32_t c, const Range& r) { return c < r.first; });
  return it != ranges.begin() && cp <= std::prev(it)->last;
}

bool is_control(char32_t cp) { return cp < 0x20 || (cp >= 0x7F && cp < 0xA0); }

int codepoint_width(char32_t cp) {
  if (cp == kInvalid) return 1;
  if (is_control(cp) || in_ranges(kZeroWidth, cp)) return 0;
  return in_ranges(kWide, cp) ? 2 : 1;
}

}  // namespace

int64_t display_width(std::string_view utf8) {
  int64_t width = 0;
  for (size_t pos = 0; pos < utf8.size();) {
    const auto [cp, length] = decode_utf8(utf8, pos);
    width += codepoint_width(cp);
    pos += length;
  }
  return width;
}

std::string sanitize_label(std::string_view label) {
  std::string out;
  for (size_t pos = 0; pos < label.size();) {
    const auto [cp, length] = decode_utf8(label, pos);
    if (cp == kInvalid) {
      out += "\uFFFD";
    } else if (is_control(cp)) {
      out += '?';
    } else {
      out.append(label.substr(pos, length));
    }
    pos += length;
  }
  return out;
}

std::string pad_left(std::string_view text, int64_t width, std::string_view fill) {
  std::string out;
  for (int64_t i = display_width(text); i < width; ++i) out.append(fill);
  return out.append(text);
}

std::string pad_right(std::string_view text, int64_t width, std::string_view fill) {
  std::string out(text);
  for (int64_t i = display_width(text); i < width; ++i) out.append(fill);
  return out;
}

std::string truncate_to_width(std::string_view text, int64_t width) {
  if (display_width(text) <= width) return std::string(text);
  if (width < 1) return {};
  size_t cut = 0;
  for (int64_t used = 0; cut < text.size();) {
    const auto [cp, length] = decode_utf8(text, cut);
    if (used + codepoint_width(cp) > width - 1) break;
    used += codepoint_width(cp);
    cut += length;
  }
  return std::string(text.substr(0, cut)) + "…";
}

namespace {

// One line of wrap_text, without its '\n'.
void wrap_line(std::string& out, std::string_view line, int64_t width, int64_t hanging) {
  const size_t body = std::min(line.find_first_not_of(' '), line.size());
  // However deep the indent, a line keeps two columns for text: room for a wide character.
  const int64_t deepest = std::max<int64_t>(width - 2, 0);
  const std::string indent(static_cast<size_t>(std::min<int64_t>(static_cast<int64_t>(body), deepest)), ' ');
  const std::string continuation(
      static_cast<size_t>(std::clamp<int64_t>(static_cast<int64_t>(body) + hanging, 0, deepest)), ' ');
  std::string current = indent;
  int64_t used = display_width(indent);
  bool has_word = false;
  const auto flush = [&] {
    out += current;
    out += '\n';
    current = continuation;
    used = display_width(continuation);
    has_word = false;
  };
  for (size_t pos = body; pos < line.size();) {
    const size_t end = std::min(line.find(' ', pos), line.size());
    std::string_view word = line.substr(pos, end - pos);
    pos = std::min(line.find_first_not_of(' ', end), line.size());
    if (word.empty()) continue;
    int64_t word_width = display_width(word);
    if (has_word && used + 1 + word_width > width) flush();
    if (has_word) {
      current += ' ';
      ++used;
    }
    // A word wider than a whole line goes out in pieces of what is left of each line.
    while (used + word_width > width) {
      size_t cut = 0;
      for (int64_t taken = used; cut < word.size();) {
        const auto [cp, length] = decode_utf8(word, cut);
        if (taken + codepoint_width(cp) > width) break;
        taken += codepoint_width(cp);
        cut += length;
      }
      if (cut == 0) break;
      current += word.substr(0, cut);
      word.remove_prefix(cut);
      word_width = display_width(word);
      flush();
    }
    current += word;
    used += word_width;
    has_word = has_word || !word.empty();
  }
  if (has_word || current == indent) flush();
}

}  // namespace

std::string wrap_text(std::string_view text, int64_t width, int64_t hanging) {
  if (width <= 0) return std::string(text);
  std::string out;
  for (size_t start = 0; start < text.size();) {
    const size_t newline = text.find('\n', start);
    const size_t end = newline == std::string_view::npos ? text.size() : newline;
    wrap_line(out, text.substr(start, end - start), width, hanging);
    start = end + 1;
  }
  // The last line had no '\n' of its own.
  if (!text.empty() && text.back() != '\n') out.pop_back();
  return out;
}

std::vector<std::string> split_labels(std::string_view text) {
  std::vector<std::string> labels;
  constexpr std::string_view kSpace = " \t\n\r\f\v";
  for (size_t pos = text.find_first_not_of(kSpace); pos != std::string_view::npos;) {
    const size_t end = text.find_first_of(kSpace, pos);
    labels.emplace_back(text.substr(pos, end - pos));
    pos = end == std::string_view::npos ? end : text.find_first_not_of(kSpace, end);
  }
  return labels;
}

}  // namespace qkv
