#include "support/report.hpp"

#include <fmt/format.h>

#include <algorithm>
#include <cmath>
#include <iterator>
#include <set>
#include <utility>

#include "qkv/core/error.hpp"
#include "qkv/core/text.hpp"
#include "qkv/io/staged_files.hpp"

namespace qkv {
namespace {

std::string markdown_cell(const Cell& cell, const TableColumn& column) {
  if (const auto* text = std::get_if<std::string>(&cell)) {
    std::string escaped;
    for (const char c : *text) {
      if (c == '|') escaped += '\\';
      escaped += c == '\n' ? ' ' : c;
    }
    return escaped;
  }
  if (const auto* integer = std::get_if<int64_t>(&cell)) return fmt::format("{}", *integer);
  return fmt::format(fmt::runtime(column.format), std::get<double>(cell));
}

std::string csv_field(const Cell& cell) {
  if (const auto* integer = std::get_if<int64_t>(&cell)) return fmt::format("{}", *integer);
  if (const auto* real = std::get_if<double>(&cell)) return fmt::format("{}", *real);
  const std::string& text = std::get<std::string>(cell);
  if (text.find_first_of(",\"\r\n") == std::string::npos) return text;
  std::string quoted = "\"";
  for (const char c : text) {
    if (c == '"') quoted += '"';
    quoted += c;
  }
  return quoted + "\"";
}

// Markdown rows as lines, columns padded to a common width so that the table reads in a terminal too.
// Numbers are right-aligned.
std::string markdown_rows(const std::vector<std::string>& header, const std::vector<std::vector<std::string>>& rows,
                          const std::vector<bool>& numeric) {
  std::vector<int64_t> widths(header.size(), 3);
  for (size_t c = 0; c < header.size(); ++c) widths[c] = std::max(widths[c], display_width(header[c]));
  for (const auto& row : rows) {
    for (size_t c = 0; c < row.size(); ++c) widths[c] = std::max(widths[c], display_width(row[c]));
  }
  std::string out;
  const auto line = [&](const std::vector<std::string>& cells) {
    out += '|';
    for (size_t c = 0; c < cells.size(); ++c)
      fmt::format_to(std::back_inserter(out), " {} |",
                     numeric[c] ? pad_left(cells[c], widths[c]) : pad_right(cells[c], widths[c]));
    out += '\n';
  };
  line(header);
  out += '|';
  for (size_t c = 0; c < header.size(); ++c) {
    const std::string dashes(static_cast<size_t>(numeric[c] ? widths[c] - 1 : widths[c]), '-');
    fmt::format_to(std::back_inserter(out), " {}{} |", dashes, numeric[c] ? ":" : "");
  }
  out += '\n';
  for (const auto& row : rows) line(row);
  return out;
}

}  // namespace

Table::Table(std::vector<TableColumn> columns) : columns_(std::move(columns)) {
  if (columns_.empty()) throw ValueError("columns: expected at least one column, got none");
  for (const TableColumn& column : columns_) {
    try {
      (void)fmt::format(fmt::runtime(column.format), 1.0);
    } catch (const fmt::format_error& e) {
      throw ValueError(fmt::format("column \"{}\": format \"{}\" does not format a double: {}", column.name,
                                   column.format, e.what()));
    }
  }
}

void Table::add_row(std::vector<Cell> cells) {
  if (cells.size() != columns_.size()) {
    throw ValueError(fmt::format("row: expected {} cells (one per column), got {}", columns_.size(), cells.size()));
  }
  rows_.push_back(std::move(cells));
}

std::string Table::markdown() const {
  std::vector<std::string> header;
  std::vector<bool> numeric;
  for (size_t c = 0; c < columns_.size(); ++c) {
    header.push_back(markdown_cell(Cell{columns_[c].name}, columns_[c]));
    // A column is right-aligned when every cell in it is a number.
    numeric.push_back(!rows_.empty() && std::all_of(rows_.begin(), rows_.end(), [&](const std::vector<Cell>& row) {
      return !std::holds_alternative<std::string>(row[c]);
    }));
  }
  std::vector<std::vector<std::string>> rows;
  for (const auto& row : rows_) {
    std::vector<std::string> cells;
    for (size_t c = 0; c < row.size(); ++c) cells.push_back(markdown_cell(row[c], columns_[c]));
    rows.push_back(std::move(cells));
  }
  return markdown_rows(header, rows, numeric);
}

std::string Table::csv() const {
  const auto line = [](const std::vector<Cell>& cells) {
    std::string text;
    for (size_t c = 0; c < cells.size(); ++c) {
      if (c > 0) text += ',';
      text += csv_field(cells[c]);
    }
    return text + "\n";
  };
  std::vector<Cell> header;
  for (const TableColumn& column : columns_) header.emplace_back(column.name);
  std::string out = line(header);
  for (const auto& row : rows_) out += line(row);
  return out;
}

Report::Report(std::string title) : title_(std::move(title)) {}

void Report::add_setting(std::string name, std::string value) {
  settings_.emplace_back(std::move(name), std::move(value));
}

void Report::add_paragraph(std::string markdown) { blocks_.emplace_back(std::move(markdown)); }

void Report::add_note(std::string markdown) { blocks_.emplace_back(NoteBlock{std::move(markdown)}); }

void Report::add_table(std::string caption, Table table, std::string csv_name) {
  blocks_.emplace_back(TableBlock{std::move(caption), std::move(table), std::move(csv_name)});
}

void Report::add_data(std::string caption, Table table, std::string csv_name) {
  blocks_.emplace_back(TableBlock{std::move(caption), std::move(table), std::move(csv_name), false});
}

void Report::add_figure(std::string caption, Figure figure, std::string png_name) {
  blocks_.emplace_back(FigureBlock{std::move(caption), std::move(figure), std::move(png_name)});
}

const Figure* Report::figure(std::string_view png_name) const {
  for (const Block& block : blocks_) {
    if (const auto* figure = std::get_if<FigureBlock>(&block); figure != nullptr && figure->png_name == png_name) {
      return &figure->figure;
    }
  }
  return nullptr;
}

std::string Report::markdown() const {
  std::string out = fmt::format("# {}\n\n", title_);
  if (!settings_.empty()) {
    std::vector<std::vector<std::string>> rows;
    for (const auto& [name, value] : settings_) rows.push_back({name, value});
    out += "## Settings\n\n" + markdown_rows({"setting", "value"}, rows, {false, false}) + "\n";
  }
  for (const Block& block : blocks_) {
    if (const auto* text = std::get_if<std::string>(&block)) {
      out += *text + "\n\n";
    } else if (const auto* note = std::get_if<NoteBlock>(&block)) {
      out += note->text + "\n\n";
    } else if (const auto* table = std::get_if<TableBlock>(&block)) {
      if (table->shown) {
        out += fmt::format("## {}\n\n{}\n(CSV: `{}`)\n\n", table->caption, table->table.markdown(), table->csv_name);
      } else {
        out += fmt::format("{}: `{}` ({} rows).\n\n", table->caption, table->csv_name, table->table.rows().size());
      }
    } else {
      const auto& figure = std::get<FigureBlock>(block);
      out += fmt::format("## {}\n\n![{}]({})\n\n", figure.caption, figure.caption, figure.png_name);
    }
  }
  return out;
}

std::string Report::tables_markdown() const {
  std::string out;
  for (const Block& block : blocks_) {
    const auto* table = std::get_if<TableBlock>(&block);
    if (table != nullptr && table->shown) out += fmt::format("{}\n\n{}\n", table->caption, table->table.markdown());
    if (const auto* note = std::get_if<NoteBlock>(&block)) out += note->text + "\n\n";
  }
  return out;
}

std::vector<std::string> Report::file_names() const {
  std::vector<std::string> names;
  for (const Block& block : blocks_) {
    if (const auto* table = std::get_if<TableBlock>(&block)) names.push_back(table->csv_name);
    if (const auto* figure = std::get_if<FigureBlock>(&block)) names.push_back(figure->png_name);
  }
  names.emplace_back("results.md");
  return names;
}

void Report::write(const std::filesystem::path& directory) const {
  const std::vector<std::string> names = file_names();
  std::set<std::string> seen;
  for (const std::string& name : names) {
    if (!seen.insert(name).second) throw ValueError(fmt::format("report: two outputs named \"{}\"", name));
  }
  StagedFiles files;
  for (const Block& block : blocks_) {
    if (const auto* table = std::get_if<TableBlock>(&block))
      files.stage(directory / table->csv_name, table->table.csv());
    if (const auto* figure = std::get_if<FigureBlock>(&block)) {
      files.stage(directory / figure->png_name, render_png(figure->figure));
    }
  }
  files.stage(directory / "results.md", markdown());
  files.commit();
}

}  // namespace qkv
