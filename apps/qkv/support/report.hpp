#pragma once
// The results of an experiment as files: tables (Markdown for reading, CSV for machines), figures
// (PNG, see plot.hpp) and the settings that produced them, gathered into one results.md.
//
// A Report is built in memory while the experiment runs and written at the end by write(), all or
// nothing (staged_files.hpp): an interrupted or failed run leaves the previous results untouched.

#include <cstdint>
#include <filesystem>
#include <string>
#include <string_view>
#include <variant>
#include <vector>

#include "qkv/viz/plot.hpp"

namespace qkv {

// One cell of a table: text, an integer or a real number (NaN and infinities allowed).
using Cell = std::variant<std::string, int64_t, double>;

struct TableColumn {
  std::string name;
  // How Markdown shows a real number of this column (a fmt format string for one double). CSV always
  // gets the shortest text that reads back as the same double.
  std::string format = "{:.4g}";
};

class Table {
 public:
  explicit Table(std::vector<TableColumn> columns);

  // Throws ValueError when `cells` does not have one cell per column.
  void add_row(std::vector<Cell> cells);

  const std::vector<TableColumn>& columns() const { return columns_; }
  const std::vector<std::vector<Cell>>& rows() const { return rows_; }

  // A GitHub-flavoured Markdown table; text cells have '|' escaped.
  std::string markdown() const;
  // RFC 4180: a header line, then one line per row; fields holding ',', '"' or a line break are quoted.
  std::string csv() const;

 private:
  std::vector<TableColumn> columns_;
  std::vector<std::vector<Cell>> rows_;
};

class Report {
 public:
  // `title` heads results.md.
  explicit Report(std::string title);

  // A line of the settings table at the top of results.md ("| steps | 400 |").
  void add_setting(std::string name, std::string value);
  // A paragraph of Markdown, placed after what was added before it.
  void add_paragraph(std::string markdown);
  // A paragraph that the terminal shows too, among the tables: what a reader must know to read
  // them (e.g. that a --quick run is too short to reach the published numbers).
  void add_note(std::string markdown);
  // A table under a "## caption" heading, also written as `csv_name` (e.g. "results.csv").
  void add_table(std::string caption, Table table, std::string csv_name);
  // Data too long to read as a table (a value per training step): written as `csv_name` only, and
  // named in results.md under `caption`.
  void add_data(std::string caption, Table table, std::string csv_name);
  // A figure under a "## caption" heading, written as `png_name` and shown in results.md.
  void add_figure(std::string caption, Figure figure, std::string png_name);

  // The figure added as `png_name`, or nullptr: what tests check a figure's layout on.
  const Figure* figure(std::string_view png_name) const;

  // The whole of results.md.
  std::string markdown() const;
  // The tables with their captions, as printed on the terminal at the end of a run.
  std::string tables_markdown() const;
  // The names of the files write() produces, results.md last.
  std::vector<std::string> file_names() const;

  // Writes results.md, every table's CSV and every figure's PNG into `directory` (which must exist),
  // all staged first and renamed into place together. Throws IoError naming the file at fault,
  // ValueError for two outputs of one name.
  void write(const std::filesystem::path& directory) const;

 private:
  struct TableBlock {
    std::string caption;
    Table table;
    std::string csv_name;
    bool shown = true;  // in results.md and on the terminal; only as CSV when false
  };
  struct FigureBlock {
    std::string caption;
    Figure figure;
    std::string png_name;
  };
  struct NoteBlock {
    std::string text;
  };
  using Block = std::variant<std::string, TableBlock, FigureBlock, NoteBlock>;

  std::string title_;
  std::vector<std::pair<std::string, std::string>> settings_;
  std::vector<Block> blocks_;
};

}  // namespace qkv
