// Tests of the text helpers (src/core/text.cpp): display widths of scripts, marks and invalid bytes,
// labels made safe to draw, padding, cutting and wrapping to a width in columns, and token lists split
// on whitespace.

#include <gtest/gtest.h>

#include <sstream>
#include <string>
#include <vector>

#include "qkv/core/text.hpp"

namespace qkv {
namespace {

TEST(DisplayWidth, CountsTerminalColumns) {
  EXPECT_EQ(display_width(""), 0);
  EXPECT_EQ(display_width("book"), 4);
  EXPECT_EQ(display_width("我阅读这本书。"), 14);  // ideographs and the ideographic full stop are wide
  EXPECT_EQ(display_width("한국어"), 6);
  EXPECT_EQ(display_width("カタカナ"), 8);
  EXPECT_EQ(display_width("ｂｏｏｋ"), 8);  // fullwidth forms
  EXPECT_EQ(display_width("\U0001F600"), 2);
  EXPECT_EQ(display_width("\U00020000"), 2);  // CJK extension B, beyond the BMP
  EXPECT_EQ(display_width("e\u0301"), 1);     // a combining accent takes no column
  EXPECT_EQ(display_width("a\u200Bb"), 2);    // zero-width space
  EXPECT_EQ(display_width("ｱ"), 1);           // halfwidth katakana
  EXPECT_EQ(display_width("é→·"), 3);
  EXPECT_EQ(display_width("\xff"), 1);          // invalid byte
  EXPECT_EQ(display_width("\xe4\xb8"), 2);      // truncated sequence: two invalid bytes
  EXPECT_EQ(display_width("\xc0\xaf"), 2);      // overlong '/'
  EXPECT_EQ(display_width("\xed\xa0\x80"), 3);  // a UTF-16 surrogate is not UTF-8
}

TEST(SanitizeLabel, ControlsAndInvalidBytesBecomeVisible) {
  EXPECT_EQ(sanitize_label("a\x1b[31m"), "a?[31m");
  EXPECT_EQ(sanitize_label("b\xff"), "b\uFFFD");
  EXPECT_EQ(sanitize_label("line\nbreak"), "line?break");
  EXPECT_EQ(sanitize_label("我 e\u0301"), "我 e\u0301");
}

TEST(Pad, FillsToAWidthInColumns) {
  EXPECT_EQ(pad_left("书", 4), "  书");
  EXPECT_EQ(pad_right("书", 4), "书  ");
  EXPECT_EQ(pad_left("0.5", 5, "░"), "░░0.5");
  EXPECT_EQ(pad_right("wider", 2), "wider");
  EXPECT_EQ(pad_left("", 0), "");
}

TEST(SplitLabels, WhitespaceSeparatesAnythingElseBelongs) {
  EXPECT_EQ(split_labels("  the student\tis\n"), (std::vector<std::string>{"the", "student", "is"}));
  EXPECT_EQ(split_labels("我 阅读 书。"), (std::vector<std::string>{"我", "阅读", "书。"}));
  EXPECT_TRUE(split_labels("   ").empty());
  EXPECT_EQ(split_labels("a\u3000b").size(), 1U);  // an ideographic space is not ASCII whitespace
}

TEST(TruncateToWidth, CutsBetweenCodePointsAndEndsWithAnEllipsis) {
  EXPECT_EQ(truncate_to_width("student", 7), "student");
  EXPECT_EQ(truncate_to_width("student", 4), "stu…");
  EXPECT_EQ(truncate_to_width("student", 1), "…");
  EXPECT_EQ(truncate_to_width("student", 0), "");
  // A wide character that would overrun is left out whole.
  EXPECT_EQ(truncate_to_width("书书书", 6), "书书书");
  EXPECT_EQ(truncate_to_width("书书书", 5), "书书…");
  EXPECT_EQ(truncate_to_width("书书书", 4), "书…");
  EXPECT_EQ(display_width(truncate_to_width("书书书", 4)), 3);
}

TEST(WrapText, BreaksAtSpacesKeepingEachLinesIndent) {
  EXPECT_EQ(wrap_text("aaa bbb ccc", 7), "aaa bbb\nccc");
  EXPECT_EQ(wrap_text("aaa bbb ccc\n", 7), "aaa bbb\nccc\n");
  EXPECT_EQ(wrap_text("aaa bbb ccc\n", 0), "aaa bbb ccc\n");
  EXPECT_EQ(wrap_text("  aaa bbb ccc\n", 9), "  aaa bbb\n  ccc\n");
  EXPECT_EQ(wrap_text("1. aaa bbb ccc\n", 10, 3), "1. aaa bbb\n   ccc\n");
  EXPECT_EQ(wrap_text("one\n\ntwo\n", 5), "one\n\ntwo\n") << "blank lines stay";
  // Columns, not bytes: four CJK characters are eight columns.
  EXPECT_EQ(wrap_text("书书 书书 书书\n", 5), "书书\n书书\n书书\n");
  // A word wider than the line is cut, so that no line is wider.
  EXPECT_EQ(wrap_text("ab /a/very/long/path\n", 6), "ab\n/a/ver\ny/long\n/path\n");
  for (const int64_t width : {2, 3, 10}) {
    const std::string wrapped = wrap_text("   deep indent and a longwordthatgoeson 书书书\n", width, 4);
    std::istringstream lines(wrapped);
    for (std::string line; std::getline(lines, line);) EXPECT_LE(display_width(line), width) << "'" << line << "'";
  }
}

}  // namespace
}  // namespace qkv
