#include "cli_io.hpp"

#include <fmt/format.h>
#include <fmt/ranges.h>
#include <sys/ioctl.h>
#include <unistd.h>

#include <algorithm>
#include <array>
#include <cerrno>
#include <charconv>
#include <cmath>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <fstream>
#include <iterator>
#include <limits>
#include <new>
#include <span>
#include <sstream>
#include <stdexcept>
#include <string>
#include <system_error>
#include <type_traits>
#include <utility>
#include <variant>
#include <vector>

#include "qkv/core/error.hpp"
#include "qkv/core/memory.hpp"
#include "qkv/io/npy.hpp"
#include "qkv/io/staged_files.hpp"

namespace qkv::cli {
namespace {

[[noreturn]] void wrong_dtype(const NpyArray& array, std::string_view arg, std::string_view expected) {
  throw ShapeError(fmt::format("{}: expected dtype {}, got {} (shape {})", arg, expected, dtype_name(array.dtype),
                               array.shape_str()));
}

}  // namespace

Shape shape_of(const NpyArray& array, std::string_view arg) {
  if (array.shape.size() > static_cast<size_t>(kMaxRank)) {
    throw ShapeError(fmt::format("{}: expected an array of rank 0 to {}, got shape {} (rank {})", arg, kMaxRank,
                                 array.shape_str(), array.shape.size()));
  }
  return Shape(std::span<const int64_t>(array.shape));
}

NpyArray read_input(const std::filesystem::path& path, std::string_view arg, std::string_view accepted) {
  if (path == "-") {
    throw IoError(
        fmt::format("{}: expected a file path, got - (arrays are read from files, not from standard input; "
                    "write ./- for a file named -)",
                    arg));
  }
  try {
    return read_npy(path);
  } catch (const IoError& e) {
    const std::string_view what = e.what();
    if (what.find("unsupported dtype") != std::string_view::npos) {
      throw IoError(fmt::format("{}: {}; {} takes {}", arg, what, arg, accepted));
    }
    throw IoError(fmt::format("{}: {}", arg, what));
  }
}

Tensor<float> to_float32(NpyArray array, std::string_view arg) {
  const Shape shape = shape_of(array, arg);
  if (array.dtype == DType::float32) return Tensor<float>(shape, std::move(std::get<std::vector<float>>(array.values)));
  if (array.dtype != DType::float64) wrong_dtype(array, arg, kFloatDtypes);

  const auto& source = std::get<std::vector<double>>(array.values);
  std::vector<float> values(source.size());
  constexpr double kFloatMax = std::numeric_limits<float>::max();
  for (size_t i = 0; i < source.size(); ++i) {
    // Outside float32's range the conversion is undefined behaviour, not an infinity.
    if (std::isfinite(source[i]) && std::abs(source[i]) > kFloatMax) {
      throw ValueError(fmt::format("{}: expected float64 values within float32's range (|x| <= {:g}), got {:g} at {}",
                                   arg, kFloatMax, source[i], index_str(shape, static_cast<int64_t>(i))));
    }
    values[i] = static_cast<float>(source[i]);
  }
  return Tensor<float>(shape, std::move(values));
}

Tensor<double> to_float64(NpyArray array, std::string_view arg) {
  const Shape shape = shape_of(array, arg);
  if (array.dtype == DType::float64) {
    return Tensor<double>(shape, std::move(std::get<std::vector<double>>(array.values)));
  }
  if (array.dtype != DType::float32) wrong_dtype(array, arg, kFloatDtypes);
  const auto& source = std::get<std::vector<float>>(array.values);
  return Tensor<double>(shape, std::vector<double>(source.begin(), source.end()));
}

Tensor<uint8_t> to_bool(NpyArray array, std::string_view arg) {
  const Shape shape = shape_of(array, arg);
  if (array.dtype == DType::boolean || array.dtype == DType::uint8) {
    auto& bytes = std::get<std::vector<uint8_t>>(array.values);
    std::ranges::transform(bytes, bytes.begin(), [](uint8_t x) { return static_cast<uint8_t>(x != 0); });
    return Tensor<uint8_t>(shape, std::move(bytes));
  }
  std::vector<uint8_t> values(static_cast<size_t>(array.numel()));
  if (array.dtype == DType::int32) {
    std::ranges::transform(std::get<std::vector<int32_t>>(array.values), values.begin(),
                           [](int32_t x) { return static_cast<uint8_t>(x != 0); });
  } else if (array.dtype == DType::int64) {
    std::ranges::transform(std::get<std::vector<int64_t>>(array.values), values.begin(),
                           [](int64_t x) { return static_cast<uint8_t>(x != 0); });
  } else {
    wrong_dtype(array, arg, "bool, uint8, int32 or int64");
  }
  return Tensor<uint8_t>(shape, std::move(values));
}

Tensor<int64_t> to_int64(NpyArray array, std::string_view arg) {
  const Shape shape = shape_of(array, arg);
  if (array.dtype == DType::int64) {
    return Tensor<int64_t>(shape, std::move(std::get<std::vector<int64_t>>(array.values)));
  }
  if (array.dtype != DType::int32) wrong_dtype(array, arg, "int32 or int64");
  const auto& source = std::get<std::vector<int32_t>>(array.values);
  return Tensor<int64_t>(shape, std::vector<int64_t>(source.begin(), source.end()));
}

Tensor<float> load_float32(const std::filesystem::path& path, std::string_view arg) {
  return to_float32(read_input(path, arg, kFloatDtypes), arg);
}

// ---- Tokens ----------------------------------------------------------------------------------

namespace {

// Whether `text` is well-formed UTF-8: no stray continuation byte, no truncated or overlong
// sequence, no surrogate, nothing beyond U+10FFFF.
bool is_utf8(std::string_view text) {
  size_t i = 0;
  while (i < text.size()) {
    const auto byte = static_cast<unsigned char>(text[i]);
    const size_t length = byte < 0x80           ? 1
                          : (byte >> 5) == 0x6  ? 2
                          : (byte >> 4) == 0xE  ? 3
                          : (byte >> 3) == 0x1E ? 4
                                                : 0;
    if (length == 0 || i + length > text.size()) return false;
    uint32_t code = length == 1 ? byte : byte & (0x7F >> length);
    for (size_t k = 1; k < length; ++k) {
      const auto next = static_cast<unsigned char>(text[i + k]);
      if ((next >> 6) != 0x2) return false;
      code = (code << 6) | (next & 0x3F);
    }
    const uint32_t smallest[] = {0, 0, 0x80, 0x800, 0x10000};
    if (code < smallest[length] || code > 0x10FFFF || (code >= 0xD800 && code <= 0xDFFF)) return false;
    i += length;
  }
  return true;
}

}  // namespace

std::vector<std::string> read_tokens_file(const std::filesystem::path& path, std::string_view arg) {
  std::error_code ec;
  if (std::filesystem::is_directory(path, ec)) {
    throw IoError(fmt::format("{}: {}: is a directory, expected a text file of tokens", arg, path.string()));
  }
  std::ifstream file(path, std::ios::binary);
  if (!file) throw IoError(fmt::format("{}: {}: cannot open it: {}", arg, path.string(), std::strerror(errno)));
  const std::string text((std::istreambuf_iterator<char>(file)), std::istreambuf_iterator<char>());
  if (file.bad()) throw IoError(fmt::format("{}: {}: cannot read it", arg, path.string()));
  std::vector<std::string> tokens;
  size_t start = 0;
  int64_t line = 0;
  while (start < text.size()) {
    ++line;
    size_t end = text.find('\n', start);
    if (end == std::string::npos) end = text.size();
    std::string token = text.substr(start, end - start);
    if (!token.empty() && token.back() == '\r') token.pop_back();
    start = end + 1;
    if (token.find_first_not_of(" \t\v\f\r") == std::string::npos) {
      throw ValueError(fmt::format("{}: {}: line {} is blank, expected one token per line", arg, path.string(), line));
    }
    if (!is_utf8(token)) {
      throw ValueError(fmt::format("{}: {}: line {} is not valid UTF-8", arg, path.string(), line));
    }
    tokens.push_back(std::move(token));
  }
  if (tokens.empty())
    throw ValueError(fmt::format("{}: {}: expected one token per line, got none", arg, path.string()));
  return tokens;
}

// ---- Batches of any rank ---------------------------------------------------------------------

namespace {

int64_t product(std::span<const int64_t> dims) {
  int64_t n = 1;
  for (const int64_t dim : dims) n *= dim;
  return n;
}

std::string dims_str(std::span<const int64_t> dims) { return fmt::format("[{}]", fmt::join(dims, ", ")); }

// The entry of a batch of dims `own` (each 1 or that of `batch`) that entry b of the flattened
// `batch` broadcasts from.
int64_t broadcast_entry(int64_t b, std::span<const int64_t> batch, std::span<const int64_t> own) {
  int64_t entry = 0, stride = 1;
  for (size_t i = batch.size(); i-- > 0;) {
    if (own[i] != 1) entry += (b % batch[i]) * stride;
    b /= batch[i];
    stride *= own[i];
  }
  return entry;
}

// A mask's batch dims, padded on the left with 1s to the batch's rank.
std::vector<int64_t> mask_batch_dims(std::span<const int64_t> mask, size_t batch_rank) {
  std::vector<int64_t> own(batch_rank + 3 - mask.size(), 1);
  own.insert(own.end(), mask.begin(), mask.end() - 3);
  return own;
}

}  // namespace

std::vector<int64_t> Batch::file_shape(const Shape& computed) const {
  std::vector<int64_t> shape(dims);
  for (int i = 1; i < computed.rank(); ++i) shape.push_back(computed[i]);
  return shape;
}

Batch batch_of(const NpyArray& q, std::string_view arg) {
  if (q.shape.size() < 2) {
    throw ShapeError(fmt::format("{}: expected rank 2 or more ([..., Tq, Dk]), got shape {}", arg, q.shape_str()));
  }
  if (q.shape.size() <= static_cast<size_t>(kMaxRank)) return {};
  return {.dims = std::vector<int64_t>(q.shape.begin(), q.shape.end() - 3)};
}

void flatten_batch(NpyArray& array, const Batch& batch, std::string_view arg, std::string_view meaning) {
  if (batch.dims.empty()) return;
  const size_t n = batch.dims.size();
  if (array.shape.size() != n + 3 || !std::equal(batch.dims.begin(), batch.dims.end(), array.shape.begin())) {
    throw ShapeError(fmt::format("{}: expected the batch dims {} of --q, then {}, got shape {}", arg,
                                 dims_str(batch.dims), meaning, array.shape_str()));
  }
  std::vector<int64_t> shape{product(batch.dims)};
  shape.insert(shape.end(), array.shape.end() - 3, array.shape.end());
  array.shape = std::move(shape);
}

BatchedMask flatten_mask_batch(NpyArray& mask, const Batch& batch, std::span<const int64_t> scores) {
  BatchedMask result{.shape = mask.shape};
  const size_t n = batch.dims.size();
  const auto refuse = [&] {
    throw ShapeError(fmt::format("--mask: expected a shape that broadcasts to the scores [..., H, Tq, Tk] = {}, got {}",
                                 dims_str(scores), mask.shape_str()));
  };
  if (mask.shape.size() > n + 3) refuse();
  if (mask.shape.size() <= 3) return result;
  const std::vector<int64_t> own = mask_batch_dims(mask.shape, n);
  for (size_t i = 0; i < n; ++i) {
    if (own[i] != 1 && own[i] != batch.dims[i]) refuse();
  }
  const std::vector<int64_t> rest(mask.shape.end() - 3, mask.shape.end());
  const int64_t inner = product(rest);
  const bool all_one = std::ranges::all_of(own, [](int64_t dim) { return dim == 1; });
  const bool all_full = std::ranges::equal(own, batch.dims);
  std::vector<int64_t> shape{all_one ? 1 : product(batch.dims)};
  shape.insert(shape.end(), rest.begin(), rest.end());
  if (!all_one && !all_full) {
    // Entry b of the flattened batch reads, in each dim the mask broadcasts over, its entry 0.
    result.expanded = true;
    const int64_t count = product(batch.dims);
    check_allocation_fits(static_cast<double>(count) * static_cast<double>(inner) * 8.0,
                          "--mask, expanded to the batch");
    std::visit(
        [&](auto& values) {
          std::remove_reference_t<decltype(values)> full(static_cast<size_t>(count * inner));
          for (int64_t b = 0; b < count; ++b) {
            const int64_t source = broadcast_entry(b, batch.dims, own);
            std::copy_n(values.begin() + source * inner, inner, full.begin() + b * inner);
          }
          values = std::move(full);
        },
        mask.values);
  }
  mask.shape = std::move(shape);
  return result;
}

template <class T>
Tensor<T> sum_expanded_mask_gradient(const Tensor<T>& gradient, const Batch& batch, const BatchedMask& mask) {
  const std::vector<int64_t> own = mask_batch_dims(mask.shape, batch.dims.size());
  const int64_t inner = product(std::span(mask.shape).last(3));
  const int64_t count = product(batch.dims);
  Tensor<T> sum(Shape{product(own), inner});
  T* out = sum.data();
  const T* in = gradient.data();
  // In a fixed order (b ascending), so that the sums are the same on every run.
  for (int64_t b = 0; b < count; ++b) {
    const int64_t target = broadcast_entry(b, batch.dims, own);
    for (int64_t e = 0; e < inner; ++e) out[target * inner + e] += in[b * inner + e];
  }
  return sum;
}

template Tensor<float> sum_expanded_mask_gradient(const Tensor<float>&, const Batch&, const BatchedMask&);
template Tensor<double> sum_expanded_mask_gradient(const Tensor<double>&, const Batch&, const BatchedMask&);

template <class T>
MaskArrays<T> to_mask(NpyArray array, std::string_view arg) {
  MaskArrays<T> mask;
  if (array.dtype == DType::boolean || array.dtype == DType::uint8 || array.dtype == DType::int32 ||
      array.dtype == DType::int64) {
    mask.allowed = to_bool(std::move(array), arg);
  } else if (array.dtype == DType::float32 || array.dtype == DType::float64) {
    mask.bias = to_tensor<T>(std::move(array), arg);
  } else {
    throw ShapeError(fmt::format("{}: expected dtype {}, got {} (shape {})", arg, kMaskDtypes, dtype_name(array.dtype),
                                 array.shape_str()));
  }
  return mask;
}

template MaskArrays<float> to_mask(NpyArray, std::string_view);
template MaskArrays<double> to_mask(NpyArray, std::string_view);

void expect_broadcasts(std::string_view arg, const Shape& shape, const Shape& scores, std::string_view scores_dims) {
  bool broadcasts = shape.rank() <= scores.rank();
  for (int i = 1; i <= shape.rank() && broadcasts; ++i) {
    broadcasts = shape.from_back(i) == 1 || shape.from_back(i) == scores.from_back(i);
  }
  if (!broadcasts) {
    throw ShapeError(fmt::format("{}: expected a shape that broadcasts to the scores {} = {}, got {}", arg, scores_dims,
                                 scores.str(), shape.str()));
  }
}

template <class T>
Tensor<T> read_alibi(const std::string& value, std::string_view arg, int64_t heads) {
  if (value == "auto") {
    const std::vector<double> slopes = alibi_slopes(heads);
    return Tensor<T>(Shape{heads}, std::vector<T>(slopes.begin(), slopes.end()));
  }
  NpyArray array;
  try {
    array = read_input(value, arg, kFloatDtypes);
  } catch (const IoError& e) {
    throw IoError(fmt::format("{} ({} takes auto or a .npy file of one slope per head)", e.what(), arg));
  }
  Tensor<T> slopes = to_tensor<T>(std::move(array), arg);
  if (!(slopes.shape() == Shape{heads})) {
    throw ShapeError(fmt::format("{}: expected shape [{}] ([H]: one slope per head of --q), got {}", arg, heads,
                                 slopes.shape().str()));
  }
  return slopes;
}

template Tensor<float> read_alibi(const std::string&, std::string_view, int64_t);
template Tensor<double> read_alibi(const std::string&, std::string_view, int64_t);

// ---- Outputs --------------------------------------------------------------------------------

template <class T>
Tensor<T> allocate_output(const Shape& shape, std::string_view what) {
  double bytes = sizeof(T);
  for (const int64_t dim : shape.dims()) bytes *= static_cast<double>(dim);
  // The tensor, and the file image that writing builds before it goes to disk.
  check_allocation_fits(2.0 * bytes, fmt::format("{} (a {} array of shape {}, kept and then written)", what,
                                                 sizeof(T) == sizeof(float) ? "float32" : "float64", shape.str()));
  return Tensor<T>(shape);
}

template Tensor<float> allocate_output(const Shape&, std::string_view);
template Tensor<double> allocate_output(const Shape&, std::string_view);

// ---- OutputFiles ----------------------------------------------------------------------------

void OutputFiles::plan(std::string_view arg, const std::filesystem::path& path) {
  namespace fs = std::filesystem;
  if (path.empty()) throw IoError(fmt::format("{}: expected a file path, got an empty string", arg));
  if (path == "-") {
    throw IoError(
        fmt::format("{}: expected a file path, got - (binary arrays and pictures are not written to standard "
                    "output; write ./- for a file named -)",
                    arg));
  }
  const auto refuse = [&](std::string_view why) {
    throw IoError(fmt::format("{}: cannot write {}: {}", arg, path.string(), why));
  };
  std::error_code ec;
  if (!path.has_filename() || fs::is_directory(path, ec)) refuse("it is a directory, expected a file path");
  const fs::path directory = path.has_parent_path() ? path.parent_path() : fs::path(".");
  if (!fs::exists(directory, ec)) refuse(fmt::format("directory {} does not exist", directory.string()));
  if (!fs::is_directory(directory, ec)) refuse(fmt::format("{} is not a directory", directory.string()));
  if (::access(directory.c_str(), W_OK | X_OK) != 0) {
    refuse(fmt::format("directory {} is not writable ({})", directory.string(), std::system_category().message(errno)));
  }
  // weakly_canonical leaves a relative path whose first part does not exist as it is: make it
  // absolute first, so that "o.npy" and "./o.npy" compare equal.
  const auto canonical = [&ec](const fs::path& p) { return fs::weakly_canonical(fs::absolute(p, ec), ec); };
  for (const File& other : files_) {
    if (canonical(other.path) == canonical(path)) {
      refuse(fmt::format("{} writes the same file; each output needs its own path", other.arg));
    }
  }
  files_.push_back({.arg = std::string(arg), .path = path, .contents = {}});
}

bool OutputFiles::planned(std::string_view arg) const {
  return std::ranges::find(files_, arg, &File::arg) != files_.end();
}

void OutputFiles::set(std::string_view arg, Tensor<float> values) {
  const auto file = std::ranges::find(files_, arg, &File::arg);
  if (file != files_.end()) file->contents = std::move(values);
}

void OutputFiles::set(std::string_view arg, Tensor<double> values) {
  const auto file = std::ranges::find(files_, arg, &File::arg);
  if (file != files_.end()) file->contents = std::move(values);
}

void OutputFiles::set(std::string_view arg, std::string bytes) {
  const auto file = std::ranges::find(files_, arg, &File::arg);
  if (file != files_.end()) file->contents = std::move(bytes);
}

void OutputFiles::commit() {
  for (const File& file : files_) {
    if (std::holds_alternative<std::monostate>(file.contents)) {
      throw std::logic_error(fmt::format("output {} was planned but never computed", file.arg));
    }
  }
  StagedFiles staged;
  for (const File& file : files_) {
    try {
      std::string bytes;
      if (const auto* values = std::get_if<Tensor<float>>(&file.contents)) {
        bytes = encode_npy(values->cview());
      } else if (const auto* wide = std::get_if<Tensor<double>>(&file.contents)) {
        bytes = encode_npy(wide->cview());
      } else {
        bytes = std::get<std::string>(file.contents);
      }
      staged.stage(file.path, bytes);
    } catch (const IoError& e) {
      throw IoError(fmt::format("{}: cannot write {}: staging it beside the target failed: {}", file.arg,
                                file.path.string(), e.what()));
    } catch (const std::bad_alloc&) {
      // allocate_output found room for the file's bytes beside the values, but what the run
      // allocated since (a kernel's scratch, threads' stacks) can take it back; nothing is written.
      const auto* values = std::get_if<Tensor<float>>(&file.contents);
      const auto* wide = std::get_if<Tensor<double>>(&file.contents);
      const double image = values ? static_cast<double>(values->numel()) * sizeof(float)
                           : wide ? static_cast<double>(wide->numel()) * sizeof(double)
                                  : static_cast<double>(std::get<std::string>(file.contents).size());
      throw ResourceError(fmt::format("{}: writing {} needs {} for its bytes, but only {} of memory is available",
                                      file.arg, file.path.string(), format_bytes(image),
                                      format_bytes(static_cast<double>(available_memory_bytes()))));
    }
  }
  try {
    staged.commit();
  } catch (const IoError& e) {
    throw IoError(fmt::format("outputs: {}", e.what()));
  }
}

std::optional<std::string> closest_name(std::string_view name, const std::vector<std::string>& candidates) {
  // Levenshtein distance, one row at a time.
  const auto distance = [name](std::string_view other) {
    std::vector<size_t> row(other.size() + 1);
    for (size_t j = 0; j < row.size(); ++j) row[j] = j;
    for (size_t i = 1; i <= name.size(); ++i) {
      size_t diagonal = row[0];
      row[0] = i;
      for (size_t j = 1; j <= other.size(); ++j) {
        const size_t substitute = diagonal + (name[i - 1] == other[j - 1] ? 0 : 1);
        diagonal = row[j];
        row[j] = std::min({substitute, row[j] + 1, row[j - 1] + 1});
      }
    }
    return row.back();
  };
  std::optional<std::string> best;
  size_t best_distance = std::max<size_t>(2, name.size() / 3) + 1;
  for (const std::string& candidate : candidates) {
    const size_t d = distance(candidate);
    if (d < best_distance) {
      best = candidate;
      best_distance = d;
    }
  }
  return best;
}

std::string uint64_error(const std::string& text) {
  uint64_t value = 0;
  const char* end = text.data() + text.size();
  const auto [ptr, ec] = std::from_chars(text.data(), end, value);
  if (ec == std::errc() && ptr == end && !text.empty()) return "";
  return fmt::format("expected an integer from 0 to {}, got {}", std::numeric_limits<uint64_t>::max(), text);
}

AttentionWindow parse_window(std::string_view text, std::string_view arg) {
  const auto integer = [](std::string_view part) -> std::optional<int64_t> {
    int64_t value = 0;
    const char* end = part.data() + part.size();
    const auto [ptr, ec] = std::from_chars(part.data(), end, value);
    if (ec != std::errc() || ptr != end || part.empty()) return std::nullopt;
    return value;
  };
  const size_t comma = text.find(',');
  const std::optional<int64_t> left = comma == std::string_view::npos ? std::nullopt : integer(text.substr(0, comma));
  const std::optional<int64_t> right = comma == std::string_view::npos ? std::nullopt : integer(text.substr(comma + 1));
  if (!left || !right) {
    throw ValueError(
        fmt::format("{}: expected two integers L,R (keys from L before to R after the diagonal, -1 for "
                    "unbounded), got {}",
                    arg, text));
  }
  if (*left < -1 || *right < -1) {
    throw ValueError(fmt::format("{}: expected L and R each -1 (unbounded) or at least 0, got {}", arg, text));
  }
  return {.left = *left, .right = *right};
}

TerminalColor terminal_color(std::string_view when) {
  const bool color = when == "always" || (when == "auto" && terminal_supports_color(stdout));
  if (!color) return TerminalColor::none;
  return terminal_supports_truecolor() ? TerminalColor::truecolor : TerminalColor::palette256;
}

int64_t terminal_width() {
  int64_t columns = 0;
  const char* env = std::getenv("COLUMNS");
  const std::string_view text = env == nullptr ? "" : env;
  const auto [end, error] = std::from_chars(text.data(), text.data() + text.size(), columns);
  if (text.empty() || error != std::errc() || end != text.data() + text.size() || columns <= 0) {
    winsize size{};
    columns = ::isatty(STDOUT_FILENO) == 1 && ::ioctl(STDOUT_FILENO, TIOCGWINSZ, &size) == 0 && size.ws_col > 0
                  ? size.ws_col
                  : 80;
  }
  return std::max(columns, kMinTerminalWidth);
}

// The options that give the library's arguments, by the argument's name in the API.
namespace {

constexpr std::array<std::pair<std::string_view, std::string_view>, 17> kOptionOfArgument{{
    {"q", "--q"},
    {"k", "--k"},
    {"v", "--v"},
    {"mask", "--mask"},
    {"bias", "--mask"},
    {"scale", "--scale"},
    {"window", "--window"},
    {"softcap", "--softcap"},
    {"alibi_slopes", "--alibi"},
    {"sinks", "--sinks"},
    {"cu_seqlens_q", "--cu-seqlens-q"},
    {"cu_seqlens_k", "--cu-seqlens-k"},
    {"dropout", "--dropout"},
    {"dout", "--dout"},
    {"w_q", "--wq"},
    {"w_k", "--wk"},
    {"w", "--ww"},
}};

}  // namespace

std::string with_option_names(std::string_view message) {
  for (const auto& [argument, option] : kOptionOfArgument) {
    const std::string prefix = fmt::format("{}: ", argument);
    if (message.starts_with(prefix)) return fmt::format("{}: {}", option, message.substr(prefix.size()));
  }
  return std::string(message);
}

}  // namespace qkv::cli
