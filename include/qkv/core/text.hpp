#pragma once
// UTF-8 text as a terminal or a picture shows it: the columns it takes, labels made safe to draw,
// padding, cutting and wrapping to a width in columns, and token lists split on ASCII whitespace.

#include <cstdint>
#include <string>
#include <string_view>
#include <vector>

namespace qkv {

// Terminal columns taken by UTF-8 text: 2 for East Asian Wide and Fullwidth characters (CJK, Hangul,
// kana, fullwidth forms, most emoji), 0 for combining marks, zero-width characters and controls, 1
// otherwise. An invalid byte counts 1 (terminals show it as one replacement character).
int64_t display_width(std::string_view utf8);

// The label as a grid or an image shows it: controls (an ESC would start an escape sequence, a
// newline would break a row) become '?', bytes that are not well-formed UTF-8 U+FFFD.
std::string sanitize_label(std::string_view label);

// `text` after (pad_left) or before (pad_right) as many copies of `fill`, one column wide, as it takes
// to fill `width` display columns; `text` alone when it is that wide already.
std::string pad_left(std::string_view text, int64_t width, std::string_view fill = " ");
std::string pad_right(std::string_view text, int64_t width, std::string_view fill = " ");

// `text` when it takes at most `width` columns; else its longest prefix (cut between code points)
// that fits `width` − 1 columns, followed by "…". Empty for a width below 1.
std::string truncate_to_width(std::string_view text, int64_t width);

// Each line of `text` broken at spaces into lines of at most `width` columns; a line's leading
// spaces (its indent) and `hanging` more start each of its continuation lines. A word wider than its
// line is cut between code points, so that no line is wider than `width` (indents are cut to leave
// two columns, room for a wide character). Lines end in '\n' as in `text`; width 0 leaves `text` as it is.
std::string wrap_text(std::string_view text, int64_t width, int64_t hanging = 0);

// "the student  is" → {"the", "student", "is"}: labels separated by ASCII whitespace; anything
// else (CJK text included) belongs to a label.
std::vector<std::string> split_labels(std::string_view text);

}  // namespace qkv
