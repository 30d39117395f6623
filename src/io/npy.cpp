#include "qkv/io/npy.hpp"

#include <fcntl.h>
#include <fmt/format.h>
#include <fmt/ranges.h>
#include <sys/stat.h>
#include <unistd.h>

#include <algorithm>
#include <array>
#include <bit>
#include <cerrno>
#include <cstdint>
#include <cstring>
#include <filesystem>
#include <map>
#include <optional>
#include <random>
#include <span>
#include <stdexcept>
#include <string>
#include <string_view>
#include <system_error>
#include <type_traits>
#include <utility>
#include <variant>
#include <vector>

#include "file_descriptor.hpp"
#include "qkv/core/error.hpp"
#include "qkv/core/memory.hpp"
#include "qkv/io/staged_files.hpp"
#include "zip_archive.hpp"

namespace qkv {
namespace {

using io_detail::Fd;
using io_detail::os_reason;

// Element bytes are copied as they lie in memory, which is the .npy little-endian layout only on a
// little-endian host; a big-endian port would need a byte swap here.
static_assert(std::endian::native == std::endian::little, "qkv's .npy code assumes a little-endian host");

constexpr std::string_view kMagic = "\x93NUMPY";
// Magic, two version bytes, then a 2-byte (version 1.0) or 4-byte (2.0, 3.0) header length.
constexpr size_t kPreambleV1 = kMagic.size() + 2 + 2;
constexpr size_t kPreambleV2 = kMagic.size() + 2 + 4;
// numpy aligns the data to 64 bytes so that it can be memory-mapped for any dtype and SIMD width.
constexpr size_t kAlign = 64;
constexpr char kSupported[] =
    "float32 'f4', float64 'f8', float16 'f2', int32 'i4', int64 'i8', uint16 'u2' (either byte order), bool '|b1', "
    "uint8 '|u1', int8 '|i1'";

[[noreturn]] void fail(const std::filesystem::path& path, std::string_view problem) {
  throw IoError(fmt::format("{}: {}", path.string(), problem));
}

int64_t item_size(DType dtype) {
  switch (dtype) {
    case DType::boolean:
    case DType::uint8:
    case DType::int8:
      return 1;
    case DType::float16:
    case DType::uint16:
      return 2;
    case DType::float32:
    case DType::int32:
      return 4;
    case DType::float64:
    case DType::int64:
      return 8;
  }
  return 0;
}

std::string_view descr_of(DType dtype) {
  switch (dtype) {
    case DType::float32:
      return "<f4";
    case DType::float64:
      return "<f8";
    case DType::boolean:
      return "|b1";
    case DType::int32:
      return "<i4";
    case DType::int64:
      return "<i8";
    case DType::uint8:
      return "|u1";
    case DType::float16:
      return "<f2";
    case DType::uint16:
      return "<u2";
    case DType::int8:
      return "|i1";
  }
  return "";
}

// A descr's element type and whether its bytes are big-endian: '<' little, '>' big, '=' and none
// native (little: see the static_assert above), '|' not applicable (one byte).
struct ElementType {
  DType dtype;
  bool big_endian = false;
};

std::optional<ElementType> dtype_of(std::string_view descr) {
  // numpy writes '|b1' and '|u1'; np.dtype() takes the other spellings of the same one-byte types,
  // which hand-written headers use.
  if (descr == "|b1" || descr == "b1" || descr == "?" || descr == "|?") return ElementType{DType::boolean};
  if (descr == "|u1" || descr == "u1" || descr == "B" || descr == "|B") return ElementType{DType::uint8};
  if (descr == "|i1" || descr == "i1" || descr == "b" || descr == "|b") return ElementType{DType::int8};
  bool big_endian = false;
  if (!descr.empty() && (descr[0] == '<' || descr[0] == '>' || descr[0] == '=')) {
    big_endian = descr[0] == '>';
    descr.remove_prefix(1);
  }
  if (descr == "f4") return ElementType{DType::float32, big_endian};
  if (descr == "f8") return ElementType{DType::float64, big_endian};
  if (descr == "f2") return ElementType{DType::float16, big_endian};
  if (descr == "u2") return ElementType{DType::uint16, big_endian};
  if (descr == "i4") return ElementType{DType::int32, big_endian};
  if (descr == "i8") return ElementType{DType::int64, big_endian};
  return std::nullopt;
}

// "(2, 3)", "(5,)" or "()": the Python repr of a shape tuple.
std::string tuple_str(std::span<const int64_t> dims) {
  return dims.size() == 1 ? fmt::format("({},)", dims[0]) : fmt::format("({})", fmt::join(dims, ", "));
}

// ---- Header parsing -------------------------------------------------------------------------
// The header is the repr of a Python dict; numpy reads it with ast.literal_eval. This parser takes
// the subset that a valid header can hold: string keys, and values that are strings, True/False
// or tuples of integers, with Python's spacing and trailing-comma freedom.

// A list kept as its text: lists appear only in the descr of structured arrays, refused by name.
struct ListText {
  std::string text;
};

using HeaderValue = std::variant<std::string, bool, std::vector<int64_t>, ListText>;

class HeaderParser {
 public:
  explicit HeaderParser(std::string_view text) : text_(text) {}

  std::map<std::string, HeaderValue> parse_dict() {
    std::map<std::string, HeaderValue> dict;
    skip_space();
    expect('{');
    skip_space();
    while (!consume('}')) {
      std::string key = parse_string();
      skip_space();
      expect(':');
      skip_space();
      HeaderValue value = parse_value();
      if (!dict.emplace(key, std::move(value)).second)
        throw std::invalid_argument(fmt::format("duplicate key '{}'", key));
      skip_space();
      if (!consume(',')) {
        expect('}');
        break;
      }
      skip_space();
    }
    skip_space();
    if (pos_ != text_.size()) throw std::invalid_argument(error_at("unexpected text after the dict"));
    return dict;
  }

 private:
  void skip_space() {
    while (pos_ < text_.size() &&
           (text_[pos_] == ' ' || text_[pos_] == '\t' || text_[pos_] == '\n' || text_[pos_] == '\r'))
      ++pos_;
  }
  bool consume(char c) {
    if (pos_ < text_.size() && text_[pos_] == c) {
      ++pos_;
      return true;
    }
    return false;
  }
  bool consume(std::string_view word) {
    if (text_.substr(pos_, word.size()) != word) return false;
    pos_ += word.size();
    return true;
  }
  void expect(char c) {
    if (!consume(c)) throw std::invalid_argument(error_at(fmt::format("expected '{}'", c)));
  }
  std::string error_at(std::string_view what) const {
    return pos_ < text_.size() ? fmt::format("{} at offset {} ('{}')", what, pos_, text_.substr(pos_, 16))
                               : fmt::format("{} at the end of the header", what);
  }

  // A quoted string without escapes: header keys and dtype descrs never need them.
  std::string parse_string() {
    if (pos_ >= text_.size() || (text_[pos_] != '\'' && text_[pos_] != '"'))
      throw std::invalid_argument(error_at("expected a quoted string"));
    const char quote = text_[pos_++];
    const size_t end = text_.find(quote, pos_);
    if (end == std::string_view::npos) throw std::invalid_argument(error_at("unterminated string"));
    const std::string_view body = text_.substr(pos_, end - pos_);
    if (body.find_first_of("\\\n") != std::string_view::npos)
      throw std::invalid_argument(error_at("unsupported string escape"));
    pos_ = end + 1;
    return std::string(body);
  }

  HeaderValue parse_value() {
    if (pos_ < text_.size() && (text_[pos_] == '\'' || text_[pos_] == '"')) return parse_string();
    if (consume(std::string_view("True"))) return true;
    if (consume(std::string_view("False"))) return false;
    if (consume('(')) return parse_int_tuple();
    if (pos_ < text_.size() && text_[pos_] == '[') return parse_list_text();
    throw std::invalid_argument(error_at("expected a string, True, False, a tuple or a list"));
  }

  ListText parse_list_text() {
    const size_t start = pos_;
    int depth = 0;
    do {
      if (pos_ >= text_.size()) throw std::invalid_argument(error_at("unterminated list"));
      const char c = text_[pos_];
      if (c == '\'' || c == '"') {
        parse_string();
        continue;
      }
      depth += c == '[' ? 1 : c == ']' ? -1 : 0;
      ++pos_;
    } while (depth > 0);
    return {std::string(text_.substr(start, pos_ - start))};
  }

  // "(4, 5)", "(4,)" or "()"; "(4)" is the integer 4 in Python, not a tuple.
  std::vector<int64_t> parse_int_tuple() {
    std::vector<int64_t> dims;
    bool comma = false;
    skip_space();
    while (!consume(')')) {
      dims.push_back(parse_int());
      skip_space();
      comma = consume(',');
      skip_space();
      if (!comma) {
        expect(')');
        break;
      }
    }
    if (dims.size() == 1 && !comma)
      throw std::invalid_argument(error_at("expected a tuple, got a parenthesised integer"));
    return dims;
  }

  int64_t parse_int() {
    const bool negative = consume('-');
    const size_t start = pos_;
    uint64_t magnitude = 0;
    bool too_large = false;
    while (pos_ < text_.size() && text_[pos_] >= '0' && text_[pos_] <= '9') {
      const auto digit = static_cast<uint64_t>(text_[pos_++] - '0');
      too_large = too_large || magnitude > (static_cast<uint64_t>(INT64_MAX) - digit) / 10;
      if (!too_large) magnitude = magnitude * 10 + digit;
    }
    if (pos_ == start) throw std::invalid_argument(error_at("expected an integer"));
    if (too_large)
      throw std::invalid_argument(
          fmt::format("shape dimension {} does not fit in 64 bits", text_.substr(start, pos_ - start)));
    return negative ? -static_cast<int64_t>(magnitude) : static_cast<int64_t>(magnitude);
  }

  std::string_view text_;
  size_t pos_ = 0;
};

struct Header {
  DType dtype = DType::float32;
  bool big_endian = false;
  bool fortran_order = false;
  std::vector<int64_t> shape;
  int64_t numel = 1;
  int64_t data_bytes = 0;
};

template <class V>
const V& header_entry(const std::map<std::string, HeaderValue>& dict, const std::string& key, std::string_view kind) {
  const auto it = dict.find(key);
  if (it == dict.end()) throw std::invalid_argument(fmt::format("no '{}' key", key));
  const V* value = std::get_if<V>(&it->second);
  if (value == nullptr) throw std::invalid_argument(fmt::format("'{}' must be {}", key, kind));
  return *value;
}

Header parse_header(const std::filesystem::path& path, std::string_view text) {
  std::map<std::string, HeaderValue> dict;
  std::string descr;
  std::optional<std::string> structured;
  bool fortran_order = false;
  Header header;
  try {
    dict = HeaderParser(text).parse_dict();
    for (const auto& entry : dict) {
      if (entry.first != "descr" && entry.first != "fortran_order" && entry.first != "shape") {
        throw std::invalid_argument(fmt::format("unexpected key '{}'", entry.first));
      }
    }
    const auto descr_entry = dict.find("descr");
    if (descr_entry != dict.end() && std::holds_alternative<ListText>(descr_entry->second)) {
      structured = std::get<ListText>(descr_entry->second).text;
    } else {
      descr = header_entry<std::string>(dict, "descr", "a string");
    }
    fortran_order = header_entry<bool>(dict, "fortran_order", "True or False");
    header.shape = header_entry<std::vector<int64_t>>(dict, "shape", "a tuple of integers");
  } catch (const std::invalid_argument& e) {
    const std::string_view shown = text.substr(0, std::min<size_t>(text.find_last_not_of(" \n") + 1, 200));
    fail(path, fmt::format("malformed header: {} (header: {})", e.what(), shown));
  }

  if (structured) {
    fail(path, fmt::format("unsupported dtype {} (structured arrays are not supported; supported: {})", *structured,
                           kSupported));
  }
  const std::optional<ElementType> element = dtype_of(descr);
  if (!element) fail(path, fmt::format("unsupported dtype '{}' (supported: {})", descr, kSupported));
  header.dtype = element->dtype;
  header.big_endian = element->big_endian;
  header.fortran_order = fortran_order;

  for (const int64_t dim : header.shape) {
    if (dim < 0)
      fail(path, fmt::format("malformed header: shape {} has a negative dimension", tuple_str(header.shape)));
  }
  // numpy refuses a shape whose non-zero dims multiply past int64 even when a zero dim makes it
  // empty, and so does qkv: the strides of such a shape overflow.
  for (const int64_t dim : header.shape) {
    if (dim != 0 && __builtin_mul_overflow(header.numel, dim, &header.numel)) {
      fail(path,
           fmt::format("shape {}: the product of its non-zero dims does not fit in 64 bits", tuple_str(header.shape)));
    }
  }
  if (std::ranges::find(header.shape, 0) != header.shape.end()) header.numel = 0;
  if (__builtin_mul_overflow(header.numel, item_size(header.dtype), &header.data_bytes)) {
    fail(path, fmt::format("shape {} of {} needs more bytes than fit in 64 bits", tuple_str(header.shape),
                           dtype_name(header.dtype)));
  }
  return header;
}

// ---- Files ----------------------------------------------------------------------------------

std::string read_whole_file(const std::filesystem::path& path) {
  Fd fd(::open(path.c_str(), O_RDONLY | O_CLOEXEC));
  if (fd.get() < 0) fail(path, fmt::format("cannot open for reading: {}", os_reason(errno)));
  struct stat info {};
  if (::fstat(fd.get(), &info) != 0) fail(path, fmt::format("cannot read: {}", os_reason(errno)));
  if (S_ISDIR(info.st_mode)) fail(path, fmt::format("cannot read: {}", os_reason(EISDIR)));
  std::string bytes;
  // A regular file's size is known; a pipe grows the buffer as it goes.
  if (S_ISREG(info.st_mode)) {
    check_allocation_fits(static_cast<double>(info.st_size),
                          fmt::format("reading {} ({} bytes)", path.string(), info.st_size));
    bytes.reserve(static_cast<size_t>(info.st_size));
  }
  std::array<char, 1 << 16> chunk{};
  for (;;) {
    const ssize_t got = ::read(fd.get(), chunk.data(), chunk.size());
    if (got < 0 && errno == EINTR) continue;
    if (got < 0) fail(path, fmt::format("cannot read: {}", os_reason(errno)));
    if (got == 0) break;
    bytes.append(chunk.data(), static_cast<size_t>(got));
  }
  return bytes;
}

// On huge pages where large, as Tensor's own storage: decode streams K and V read from files.
template <class T>
std::vector<T> copy_values(std::string_view data, int64_t numel) {
  std::vector<T> values;
  assign_on_huge_pages(values, static_cast<size_t>(numel), T{});
  if (numel > 0) std::memcpy(values.data(), data.data(), data.size());
  return values;
}

// The whole header: preamble, dict and padding, of the version that can hold it.
std::string make_header(DType dtype, std::span<const int64_t> dims) {
  std::string dict =
      fmt::format("{{'descr': '{}', 'fortran_order': False, 'shape': {}, }}", descr_of(dtype), tuple_str(dims));
  const auto padded_length = [&](size_t preamble) {
    return (preamble + dict.size() + 1 + kAlign - 1) / kAlign * kAlign - preamble;
  };
  // Version 2.0 only for a header past 64 KiB, which shapes of rank <= 4 never reach; numpy does the same.
  const bool v1 = padded_length(kPreambleV1) <= 0xffff;
  const size_t preamble = v1 ? kPreambleV1 : kPreambleV2;
  const size_t length = padded_length(preamble);
  dict.resize(length - 1, ' ');
  dict.push_back('\n');
  std::string header(kMagic);
  header.push_back(static_cast<char>(v1 ? 1 : 2));
  header.push_back('\0');
  for (size_t byte = 0; byte < preamble - kMagic.size() - 2; ++byte)
    header.push_back(static_cast<char>((length >> (8 * byte)) & 0xff));
  return header + dict;
}

template <class T>
DType dtype_for() {
  if constexpr (std::is_same_v<T, float>) {
    return DType::float32;
  } else if constexpr (std::is_same_v<T, double>) {
    return DType::float64;
  } else if constexpr (std::is_same_v<T, uint8_t>) {
    return DType::boolean;
  } else if constexpr (std::is_same_v<T, int8_t>) {
    return DType::int8;
  } else {
    static_assert(std::is_same_v<T, int64_t>, "write_npy takes float, double, uint8_t, int8_t or int64_t");
    return DType::int64;
  }
}

}  // namespace

std::string dtype_name(DType dtype) {
  switch (dtype) {
    case DType::float32:
      return "float32";
    case DType::float64:
      return "float64";
    case DType::boolean:
      return "bool";
    case DType::int32:
      return "int32";
    case DType::int64:
      return "int64";
    case DType::uint8:
      return "uint8";
    case DType::float16:
      return "float16";
    case DType::uint16:
      return "uint16";
    case DType::int8:
      return "int8";
  }
  return fmt::format("DType({})", static_cast<int>(dtype));
}

int64_t NpyArray::numel() const {
  int64_t n = 1;
  for (const int64_t dim : shape) n *= dim;
  return n;
}

std::string NpyArray::shape_str() const { return fmt::format("[{}]", fmt::join(shape, ", ")); }

namespace {

// numpy writes big-endian arrays only when asked ('>f4'); their elements are reversed in place.
template <class T>
void swap_bytes(std::vector<T>& values) {
  if constexpr (sizeof(T) > 1) {
    for (T& value : values) {
      auto bytes = std::bit_cast<std::array<unsigned char, sizeof(T)>>(value);
      std::reverse(bytes.begin(), bytes.end());
      value = std::bit_cast<T>(bytes);
    }
  }
}

// The elements of a Fortran-order array (the first index fastest, as np.save writes a transposed
// view) in C order, the last index fastest.
template <class T>
std::vector<T> to_c_order(const std::vector<T>& fortran, const std::vector<int64_t>& shape) {
  if (shape.size() < 2 || fortran.empty()) return fortran;
  std::vector<T> c_order(fortran.size());
  std::vector<int64_t> index(shape.size(), 0);
  for (size_t flat = 0; flat < c_order.size(); ++flat) {
    int64_t offset = 0;
    for (size_t axis = shape.size(); axis-- > 0;) offset = offset * shape[axis] + index[axis];
    c_order[flat] = fortran[static_cast<size_t>(offset)];
    for (size_t axis = shape.size(); axis-- > 0;) {
      if (++index[axis] < shape[axis]) break;
      index[axis] = 0;
    }
  }
  return c_order;
}

NpyArray parse_npy(const std::filesystem::path& path, std::string_view file) {
  if (!file.starts_with(kMagic)) fail(path, "not a .npy file (bad magic: it does not start with \\x93NUMPY)");
  if (file.size() < kMagic.size() + 2) fail(path, fmt::format("truncated header: file has only {} bytes", file.size()));
  const auto major = static_cast<unsigned char>(file[kMagic.size()]);
  const auto minor = static_cast<unsigned char>(file[kMagic.size() + 1]);
  if (major < 1 || major > 3 || minor != 0) {
    fail(path, fmt::format("unsupported .npy format version {}.{} (supported: 1.0, 2.0, 3.0)", major, minor));
  }
  const size_t preamble = major == 1 ? kPreambleV1 : kPreambleV2;
  if (file.size() < preamble) {
    fail(path, fmt::format("truncated header: expected at least {} bytes, file has {}", preamble, file.size()));
  }
  uint64_t header_length = 0;
  for (size_t byte = preamble - kMagic.size() - 2; byte-- > 0;) {
    header_length = (header_length << 8) | static_cast<unsigned char>(file[kMagic.size() + 2 + byte]);
  }
  if (file.size() - preamble < header_length) {
    fail(path, fmt::format("truncated header: expected {} bytes, file has {}", preamble + header_length, file.size()));
  }
  const Header header = parse_header(path, file.substr(preamble, header_length));

  const std::string_view data = file.substr(preamble + header_length);
  const auto expected = static_cast<uint64_t>(header.data_bytes);
  if (data.size() < expected) {
    fail(path, fmt::format("truncated data: expected {} bytes of data for shape {} of {}, file has {}", expected,
                           tuple_str(header.shape), dtype_name(header.dtype), data.size()));
  }
  if (data.size() > expected) {
    fail(path, fmt::format("{} trailing bytes after the {} bytes of data for shape {} of {}", data.size() - expected,
                           expected, tuple_str(header.shape), dtype_name(header.dtype)));
  }

  check_allocation_fits(static_cast<double>(expected), fmt::format("{}: its values ({} of shape {})", path.string(),
                                                                   dtype_name(header.dtype), tuple_str(header.shape)));
  NpyArray array{.dtype = header.dtype, .shape = header.shape, .values = {}};
  switch (header.dtype) {
    case DType::float32:
      array.values = copy_values<float>(data, header.numel);
      break;
    case DType::float64:
      array.values = copy_values<double>(data, header.numel);
      break;
    case DType::int32:
      array.values = copy_values<int32_t>(data, header.numel);
      break;
    case DType::int64:
      array.values = copy_values<int64_t>(data, header.numel);
      break;
    case DType::boolean: {
      const size_t bad = data.find_first_not_of(std::string_view("\0\1", 2));
      if (bad != std::string_view::npos) {
        fail(path, fmt::format("bool element {} is {}, expected 0 or 1", bad, static_cast<unsigned char>(data[bad])));
      }
      array.values = copy_values<uint8_t>(data, header.numel);
      break;
    }
    case DType::uint8:
      array.values = copy_values<uint8_t>(data, header.numel);
      break;
    case DType::float16:
    case DType::uint16:
      array.values = copy_values<uint16_t>(data, header.numel);
      break;
    case DType::int8:
      array.values = copy_values<int8_t>(data, header.numel);
      break;
  }
  std::visit(
      [&](auto& values) {
        if (header.big_endian) swap_bytes(values);
        if (header.fortran_order) values = to_c_order(values, header.shape);
      },
      array.values);
  return array;
}

}  // namespace

NpyArray decode_npy(std::string_view bytes, const std::filesystem::path& name) { return parse_npy(name, bytes); }

NpyArray decode_npz(std::string_view archive, const std::filesystem::path& archive_path, const std::string& name) {
  std::vector<io_detail::ZipMember> members;
  try {
    members = io_detail::zip_members(archive);
  } catch (const std::invalid_argument& e) {
    fail(archive_path, fmt::format("not a readable .npz archive: {}", e.what()));
  }
  std::vector<std::string> names;
  for (const io_detail::ZipMember& m : members) {
    names.push_back(m.name.ends_with(".npy") ? m.name.substr(0, m.name.size() - 4) : m.name);
  }
  const auto listed = [&] { return names.empty() ? std::string("none") : fmt::format("{}", fmt::join(names, ", ")); };
  size_t chosen = 0;
  if (name.empty()) {
    if (members.size() != 1) {
      fail(archive_path,
           fmt::format("holds {} arrays ({}): name one as {}:NAME", members.size(), listed(), archive_path.string()));
    }
  } else {
    chosen = static_cast<size_t>(std::ranges::find(names, name) - names.begin());
    if (chosen == names.size()) fail(archive_path, fmt::format("has no array '{}' (it holds {})", name, listed()));
  }
  const std::filesystem::path shown = archive_path.string() + ":" + names[chosen];
  std::string_view bytes;
  try {
    bytes = io_detail::zip_member_bytes(archive, members[chosen]);
  } catch (const std::invalid_argument& e) {
    fail(shown, e.what());
  }
  return parse_npy(shown, bytes);
}

std::vector<std::pair<std::string, NpyArray>> read_npz_arrays(const std::filesystem::path& path) {
  const std::string archive = read_whole_file(path);
  std::vector<io_detail::ZipMember> members;
  try {
    members = io_detail::zip_members(archive);
  } catch (const std::invalid_argument& e) {
    fail(path, fmt::format("not a readable .npz archive: {}", e.what()));
  }
  if (members.empty()) fail(path, "holds no arrays");
  std::vector<std::pair<std::string, NpyArray>> arrays;
  for (const io_detail::ZipMember& m : members) {
    const std::string name = m.name.ends_with(".npy") ? m.name.substr(0, m.name.size() - 4) : m.name;
    arrays.emplace_back(name, decode_npz(archive, path, name));
  }
  return arrays;
}

NpyArray read_npy(const std::filesystem::path& path) {
  // "arrays.npz:q" is member q.npy of arrays.npz, unless a file of that very name exists.
  const std::string spec = path.string();
  const size_t colon = spec.rfind(':');
  std::error_code ignored;
  if (colon != std::string::npos && std::string_view(spec).substr(0, colon).ends_with(".npz") &&
      !std::filesystem::exists(path, ignored)) {
    const std::filesystem::path archive = spec.substr(0, colon);
    return decode_npz(read_whole_file(archive), archive, spec.substr(colon + 1));
  }
  if (spec.ends_with(".npz")) return decode_npz(read_whole_file(path), path, "");
  const std::string bytes = read_whole_file(path);
  return parse_npy(path, bytes);
}

template <class T>
std::string encode_npy(TensorView<const T> view) {
  return encode_npy(view, view.shape.dims());
}

namespace {

template <class T>
std::string encode_npy_as(TensorView<const T> view, std::span<const int64_t> file_shape, DType dtype) {
  int64_t file_numel = 1;
  for (const int64_t dim : file_shape) file_numel *= dim;
  if (file_numel != view.numel()) {
    throw ShapeError(fmt::format("file_shape: expected {} elements (those of the view, shape {}), got shape [{}]",
                                 view.numel(), view.shape.str(), fmt::join(file_shape, ", ")));
  }
  std::string bytes = make_header(dtype, file_shape);
  const size_t data_start = bytes.size();
  bytes.resize(data_start + static_cast<size_t>(view.numel() * item_size(dtype)));
  char* out = bytes.data() + data_start;
  const TensorView<const T> v4 = as_rank4(view);
  for (int64_t a = 0; a < v4.shape[0]; ++a)
    for (int64_t b = 0; b < v4.shape[1]; ++b)
      for (int64_t c = 0; c < v4.shape[2]; ++c)
        for (int64_t d = 0; d < v4.shape[3]; ++d) {
          T value = v4(a, b, c, d);
          if constexpr (std::is_same_v<T, uint8_t>) value = value != 0 ? 1 : 0;
          std::memcpy(out, &value, sizeof(T));
          out += sizeof(T);
        }
  return bytes;
}

}  // namespace

template <class T>
std::string encode_npy(TensorView<const T> view, std::span<const int64_t> file_shape) {
  return encode_npy_as(view, file_shape, dtype_for<T>());
}

template <class T>
void write_npy(const std::filesystem::path& path, TensorView<const T> view) {
  write_file_atomically(path, encode_npy(view));
}

std::string encode_npy_bits(TensorView<const uint16_t> bits, DType dtype) {
  if (dtype != DType::float16 && dtype != DType::uint16) {
    throw ValueError(
        fmt::format("dtype: expected float16 or uint16 (the two 2-byte dtypes), got {}", dtype_name(dtype)));
  }
  return encode_npy_as(bits, bits.shape.dims(), dtype);
}

void write_npy_bits(const std::filesystem::path& path, TensorView<const uint16_t> bits, DType dtype) {
  write_file_atomically(path, encode_npy_bits(bits, dtype));
}

#define QKV_INSTANTIATE_NPY(T)                                                       \
  template std::string encode_npy<T>(TensorView<const T>);                           \
  template std::string encode_npy<T>(TensorView<const T>, std::span<const int64_t>); \
  template void write_npy<T>(const std::filesystem::path&, TensorView<const T>);
QKV_INSTANTIATE_NPY(float)
QKV_INSTANTIATE_NPY(double)
QKV_INSTANTIATE_NPY(uint8_t)
QKV_INSTANTIATE_NPY(int8_t)
QKV_INSTANTIATE_NPY(int64_t)
#undef QKV_INSTANTIATE_NPY

}  // namespace qkv
