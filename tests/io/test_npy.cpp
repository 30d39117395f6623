// .npy reading and writing: round trips of every dtype and rank, strided views, files written by
// numpy and files read back by numpy, every refusal with its message, and atomic replacement.

#include "qkv/io/npy.hpp"
#include "qkv/io/staged_files.hpp"

#include <fmt/format.h>
#include <gtest/gtest.h>
#include <sys/resource.h>
#include <sys/stat.h>
#include <unistd.h>

#include <array>
#include <bit>
#include <csignal>
#include <cstdlib>
#include <cstring>
#include <fstream>
#include <initializer_list>
#include <limits>
#include <numeric>
#include <set>
#include <sstream>
#include <string>
#include <string_view>
#include <thread>
#include <vector>

#include "qkv/core/error.hpp"
#include "qkv/core/rng.hpp"
#include "testing.hpp"

namespace qkv {
namespace {

namespace fs = std::filesystem;

constexpr std::string_view kPython = "/usr/bin/python3";

std::string read_bytes(const fs::path& path) {
  std::ifstream in(path, std::ios::binary);
  std::ostringstream out;
  out << in.rdbuf();
  return out.str();
}

void write_bytes(const fs::path& path, std::string_view bytes) {
  std::ofstream out(path, std::ios::binary | std::ios::trunc);
  out.write(bytes.data(), static_cast<std::streamsize>(bytes.size()));
  ASSERT_TRUE(out.good()) << "cannot write fixture " << path;
}

// Raw .npy bytes: the preamble of `major`.0, the dict text as given (so that malformed and
// unusual headers can be written), a newline, then `data`.
std::string npy_bytes(std::string_view dict, std::string_view data, int major = 1, bool newline = true) {
  const std::string header = std::string(dict) + (newline ? "\n" : "");
  std::string bytes("\x93NUMPY", 6);
  bytes.push_back(static_cast<char>(major));
  bytes.push_back('\0');
  const int length_bytes = major == 1 ? 2 : 4;
  for (int i = 0; i < length_bytes; ++i) bytes.push_back(static_cast<char>((header.size() >> (8 * i)) & 0xff));
  return bytes + header + std::string(data);
}

std::string f32_bytes(std::initializer_list<float> values) {
  std::string bytes(values.size() * sizeof(float), '\0');
  std::memcpy(bytes.data(), values.begin(), bytes.size());
  return bytes;
}

// The names of the files in `dir`: a failed or finished atomic write must leave no temporary.
std::set<std::string> listing(const fs::path& dir) {
  std::set<std::string> names;
  for (const auto& entry : fs::directory_iterator(dir)) names.insert(entry.path().filename().string());
  return names;
}

// Passes when `action` throws IoError whose message contains every one of `parts`.
template <class Action>
::testing::AssertionResult throws_io_error(Action action, std::initializer_list<std::string> parts) {
  try {
    action();
  } catch (const IoError& e) {
    const std::string message = e.what();
    for (const std::string& part : parts) {
      if (message.find(part) == std::string::npos) {
        return ::testing::AssertionFailure() << "message \"" << message << "\" lacks \"" << part << "\"";
      }
    }
    return ::testing::AssertionSuccess() << message;
  } catch (const std::exception& e) {
    return ::testing::AssertionFailure() << "threw a non-IoError: " << e.what();
  }
  return ::testing::AssertionFailure() << "did not throw";
}

// Every test gets a fresh directory, removed afterwards.
class Npy : public ::testing::Test {
 protected:
  void SetUp() override {
    std::string name = (fs::temp_directory_path() / "qkv_test_npy_XXXXXX").string();
    ASSERT_NE(::mkdtemp(name.data()), nullptr) << std::strerror(errno);
    dir_ = name;
  }
  void TearDown() override {
    std::error_code ec;
    for (const auto& entry : fs::recursive_directory_iterator(dir_, ec)) {
      fs::permissions(entry.path(), fs::perms::owner_all, fs::perm_options::add, ec);
    }
    fs::remove_all(dir_, ec);
  }

  // Writes raw bytes into the test directory and reads them back as .npy.
  NpyArray read_raw(std::string_view bytes, const std::string& name = "raw.npy") {
    const fs::path path = dir_ / name;
    write_bytes(path, bytes);
    return read_npy(path);
  }
  // Passes when the raw bytes are refused with a message naming the file and containing `parts`.
  ::testing::AssertionResult refused(std::string_view bytes, std::initializer_list<std::string> parts) {
    const fs::path path = dir_ / "refused.npy";
    write_bytes(path, bytes);
    std::vector<std::string> all(parts);
    all.push_back(path.string());
    try {
      read_npy(path);
    } catch (const IoError& e) {
      const std::string message = e.what();
      for (const std::string& part : all) {
        if (message.find(part) == std::string::npos) {
          return ::testing::AssertionFailure() << "message \"" << message << "\" lacks \"" << part << "\"";
        }
      }
      return ::testing::AssertionSuccess();
    }
    return ::testing::AssertionFailure() << "read_npy accepted the file";
  }

  fs::path dir_;
};

// ---- Round trips ----------------------------------------------------------------------------

const std::vector<Shape> kShapes = {Shape{},    Shape{5}, Shape{3, 4}, Shape{2, 3, 4}, Shape{2, 1, 3, 2},
                                    Shape{113}, Shape{0}, Shape{3, 0}, Shape{2, 0, 4}, Shape{1, 2, 0, 3}};

// Values that exercise every bit pattern class of the type: specials first, then random ones.
template <class T>
Tensor<T> awkward_tensor(const Shape& shape, Rng& rng) {
  Tensor<T> t(shape);
  std::vector<T> specials;
  if constexpr (std::is_floating_point_v<T>) {
    using limits = std::numeric_limits<T>;
    specials = {limits::quiet_NaN(),  limits::infinity(), -limits::infinity(), T(-0.0),
                limits::denorm_min(), limits::max(),      limits::lowest(),    T(1) / T(3)};
  } else if constexpr (std::is_same_v<T, int64_t>) {
    specials = {std::numeric_limits<int64_t>::min(), std::numeric_limits<int64_t>::max(), -1, 0, 1};
  } else {
    specials = {0, 1, 0, 1, 1};
  }
  for (int64_t i = 0; i < t.numel(); ++i) {
    const auto k = static_cast<size_t>(i);
    if (k < specials.size()) {
      t[i] = specials[k];
    } else if constexpr (std::is_floating_point_v<T>) {
      t[i] = static_cast<T>(rng.normal());
    } else {
      // Bool bytes are 0 or 1; int64 takes all 64 random bits.
      t[i] = static_cast<T>(std::is_same_v<T, uint8_t> ? rng.next_u64() & 1 : rng.next_u64());
    }
  }
  return t;
}

// Bit-exact comparison (NaN payloads and -0 included) of what was read with what was written.
template <class T>
::testing::AssertionResult same_array(const NpyArray& array, DType dtype, const Tensor<T>& expected) {
  if (array.dtype != dtype) return ::testing::AssertionFailure() << "dtype " << dtype_name(array.dtype);
  if (array.shape_str() != expected.shape().str()) {
    return ::testing::AssertionFailure() << "shape " << array.shape_str() << ", expected " << expected.shape().str();
  }
  const auto* values = std::get_if<std::vector<T>>(&array.values);
  if (values == nullptr) return ::testing::AssertionFailure() << "values hold the wrong alternative";
  if (static_cast<int64_t>(values->size()) != expected.numel() || array.numel() != expected.numel()) {
    return ::testing::AssertionFailure() << values->size() << " values, expected " << expected.numel();
  }
  for (int64_t i = 0; i < expected.numel(); ++i) {
    const T got = (*values)[static_cast<size_t>(i)];
    using Bits = std::array<unsigned char, sizeof(T)>;
    if (std::bit_cast<Bits>(got) != std::bit_cast<Bits>(expected[i])) {
      return ::testing::AssertionFailure()
             << "element " << index_str(expected.shape(), i) << ": got " << +got << ", expected " << +expected[i];
    }
  }
  return ::testing::AssertionSuccess();
}

template <class T>
void check_round_trips(const fs::path& dir, DType dtype) {
  Rng rng(17);
  for (const Shape& shape : kShapes) {
    SCOPED_TRACE(fmt::format("{} {}", dtype_name(dtype), shape.str()));
    const Tensor<T> t = awkward_tensor<T>(shape, rng);
    const fs::path path = dir / "round_trip.npy";
    write_npy(path, t.cview());
    EXPECT_TRUE(same_array(read_npy(path), dtype, t));
  }
}

TEST_F(Npy, RoundTripFloat32) { check_round_trips<float>(dir_, DType::float32); }
TEST_F(Npy, RoundTripFloat64) { check_round_trips<double>(dir_, DType::float64); }
TEST_F(Npy, RoundTripBool) { check_round_trips<uint8_t>(dir_, DType::boolean); }
TEST_F(Npy, RoundTripInt64) { check_round_trips<int64_t>(dir_, DType::int64); }

TEST_F(Npy, RoundTripInt8) {
  const Tensor<int8_t> t(Shape{2, 3}, std::vector<int8_t>{-128, -1, 0, 1, 127, 5});
  write_npy(dir_ / "i8.npy", t.cview());
  EXPECT_TRUE(same_array(read_npy(dir_ / "i8.npy"), DType::int8, t));
}

// float16 and bfloat16 bits travel as uint16_t; every pattern, NaNs included, comes back unchanged.
TEST_F(Npy, RoundTripSixteenBitPatterns) {
  Tensor<uint16_t> t(Shape{4, 16384});
  for (int64_t i = 0; i < t.numel(); ++i) t[i] = static_cast<uint16_t>(i);
  for (const DType dtype : {DType::float16, DType::uint16}) {
    SCOPED_TRACE(dtype_name(dtype));
    write_npy_bits(dir_ / "bits.npy", t.cview(), dtype);
    EXPECT_TRUE(same_array(read_npy(dir_ / "bits.npy"), dtype, t));
  }
  EXPECT_THROW(encode_npy_bits(t.cview(), DType::float32), ValueError);
}

TEST_F(Npy, NonzeroBytesAreWrittenAsTrue) {
  const Tensor<uint8_t> t(Shape{5}, std::vector<uint8_t>{0, 1, 2, 128, 255});
  write_npy(dir_ / "b.npy", t.cview());
  EXPECT_TRUE(same_array(read_npy(dir_ / "b.npy"), DType::boolean, Tensor<uint8_t>(Shape{5}, {0, 1, 1, 1, 1})));
}

TEST_F(Npy, WritesAlignedVersion1Header) {
  const Tensor<float> t(Shape{2, 3}, 1.5f);
  write_npy(dir_ / "h.npy", t.cview());
  const std::string bytes = read_bytes(dir_ / "h.npy");
  ASSERT_GE(bytes.size(), 10u);
  EXPECT_EQ(bytes.substr(0, 8), std::string("\x93NUMPY\x01\x00", 8));
  const size_t header_length =
      static_cast<unsigned char>(bytes[8]) | (static_cast<size_t>(static_cast<unsigned char>(bytes[9])) << 8);
  const size_t data_start = 10 + header_length;
  EXPECT_EQ(data_start % 64, 0u) << "data must start on a 64-byte boundary";
  EXPECT_EQ(bytes.size(), data_start + 6 * sizeof(float));
  const std::string header = bytes.substr(10, header_length);
  EXPECT_TRUE(header.starts_with("{'descr': '<f4', 'fortran_order': False, 'shape': (2, 3), }")) << header;
  EXPECT_EQ(header.back(), '\n');
  EXPECT_EQ(header.find_first_not_of(' ', header.find('}') + 1), header.size() - 1) << "padding must be spaces";
}

TEST_F(Npy, ShapeTupleSpelling) {
  // Python needs the comma in a one-tuple, "(5,)": "(5)" would be the integer 5.
  for (const auto& [shape, tuple] : std::vector<std::pair<Shape, std::string>>{
           {Shape{}, "'shape': (), "}, {Shape{5}, "'shape': (5,), "}, {Shape{2, 0, 4}, "'shape': (2, 0, 4), "}}) {
    const Tensor<int64_t> t(shape);
    write_npy(dir_ / "s.npy", t.cview());
    EXPECT_NE(read_bytes(dir_ / "s.npy").find(tuple), std::string::npos) << shape.str();
  }
}

// ---- Strided and broadcast views ------------------------------------------------------------

TEST_F(Npy, WritesStridedViewsInRowMajorOrder) {
  Rng rng(3);
  Tensor<double> x = testing::random_tensor<double>(Shape{4, 6, 5}, rng);
  const double* base = x.data();
  const std::vector<std::pair<std::string, TensorView<const double>>> views = {
      {"transposed [5, 6] of row 1", {base + 30, Shape{5, 6}, {1, 5, 0, 0}}},
      {"every second column", {base, Shape{4, 6, 3}, {30, 5, 2, 0}}},
      {"reversed rows", {base + 25, Shape{6, 5}, {-5, 1, 0, 0}}},
      {"broadcast row",
       broadcast_to(TensorView<const double>{base, Shape{1, 5}, {5, 1, 0, 0}}, Shape{2, 3, 4, 5}, "row")},
      {"scalar", {base + 7, Shape{}, {}}},
  };
  for (const auto& [name, view] : views) {
    SCOPED_TRACE(name);
    write_npy(dir_ / "v.npy", view);
    EXPECT_TRUE(same_array(read_npy(dir_ / "v.npy"), DType::float64, to_tensor<double, double>(view)));
  }
}

TEST_F(Npy, WritesStridedBoolView) {
  Tensor<uint8_t> mask(Shape{2, 3, 4, 5});
  for (int64_t i = 0; i < mask.numel(); ++i) mask[i] = static_cast<uint8_t>(i % 7);
  const TensorView<const uint8_t> view{mask.data() + 1, Shape{2, 3, 2, 4}, {60, 20, 10, 1}};
  write_npy(dir_ / "m.npy", view);
  Tensor<uint8_t> expected = to_tensor<uint8_t, uint8_t>(view);
  for (uint8_t& v : expected.values()) v = v != 0;
  EXPECT_TRUE(same_array(read_npy(dir_ / "m.npy"), DType::boolean, expected));
}

// ---- Headers that are unusual but valid ------------------------------------------------------

TEST_F(Npy, AcceptsAnyValidHeaderSpelling) {
  const std::string data = f32_bytes({1, 2, 3, 4, 5, 6});
  const Tensor<float> expected(Shape{2, 3}, {1, 2, 3, 4, 5, 6});
  const std::vector<std::string> dicts = {
      "{'shape': (2, 3), 'fortran_order': False, 'descr': '<f4'}",
      "{ 'descr' : '<f4' ,\t'fortran_order':False,'shape':( 2 ,3 , ) , }   ",
      R"({"descr": "<f4", "fortran_order": False, "shape": (2, 3)})",
  };
  for (const std::string& dict : dicts) {
    SCOPED_TRACE(dict);
    EXPECT_TRUE(same_array(read_raw(npy_bytes(dict, data)), DType::float32, expected));
    EXPECT_TRUE(same_array(read_raw(npy_bytes(dict, data, 1, false)), DType::float32, expected)) << "no newline";
    EXPECT_TRUE(same_array(read_raw(npy_bytes(dict, data, 2)), DType::float32, expected)) << "version 2.0";
    EXPECT_TRUE(same_array(read_raw(npy_bytes(dict, data, 3)), DType::float32, expected)) << "version 3.0";
  }
}

TEST_F(Npy, AcceptsScalarsBoolSpellingsAndHighRank) {
  EXPECT_TRUE(
      same_array(read_raw(npy_bytes("{'descr': '<f4', 'fortran_order': False, 'shape': ()}", f32_bytes({2.5f}))),
                 DType::float32, Tensor<float>(Shape{}, std::vector<float>{2.5f})));
  for (const std::string descr : {"|b1", "b1", "?", "|?"}) {
    SCOPED_TRACE(descr);
    const std::string dict = fmt::format("{{'descr': '{}', 'fortran_order': False, 'shape': (3,)}}", descr);
    EXPECT_TRUE(same_array(read_raw(npy_bytes(dict, std::string("\1\0\1", 3))), DType::boolean,
                           Tensor<uint8_t>(Shape{3}, {1, 0, 1})));
  }
  const NpyArray rank6 = read_raw(
      npy_bytes("{'descr': '<i8', 'fortran_order': False, 'shape': (1, 2, 1, 1, 1, 1)}", std::string(16, '\0')));
  EXPECT_EQ(rank6.shape_str(), "[1, 2, 1, 1, 1, 1]");
  EXPECT_EQ(rank6.numel(), 2);
  // A zero dim makes the array empty whatever the other dims are, as in numpy.
  const NpyArray empty =
      read_raw(npy_bytes("{'descr': '<f8', 'fortran_order': False, 'shape': (0, 9223372036854775807)}", ""));
  EXPECT_EQ(empty.numel(), 0);
  EXPECT_TRUE(std::get<std::vector<double>>(empty.values).empty());
}

TEST(NpyNames, DTypeNamesAndShapeStrings) {
  EXPECT_EQ(dtype_name(DType::float32), "float32");
  EXPECT_EQ(dtype_name(DType::float64), "float64");
  EXPECT_EQ(dtype_name(DType::boolean), "bool");
  EXPECT_EQ(dtype_name(DType::int64), "int64");
  EXPECT_EQ(dtype_name(DType::int32), "int32");
  EXPECT_EQ(dtype_name(DType::uint8), "uint8");
  EXPECT_EQ(dtype_name(DType::float16), "float16");
  EXPECT_EQ(dtype_name(DType::uint16), "uint16");
  EXPECT_EQ(dtype_name(DType::int8), "int8");
  NpyArray array;
  EXPECT_EQ(array.shape_str(), "[]");
  EXPECT_EQ(array.numel(), 1);
  array.shape = {2, 3, 4};
  EXPECT_EQ(array.shape_str(), Shape({2, 3, 4}).str());
  EXPECT_EQ(array.numel(), 24);
}

// ---- Refusals -------------------------------------------------------------------------------

const std::string kGoodDict = "{'descr': '<f4', 'fortran_order': False, 'shape': (3,), }";

TEST_F(Npy, RefusesFilesThatAreNotNpy) {
  EXPECT_TRUE(refused("", {"not a .npy file"}));
  EXPECT_TRUE(refused("hello, world, this is text", {"not a .npy file", "bad magic"}));
  EXPECT_TRUE(refused(std::string("\x93NUM", 4), {"not a .npy file"}));
  EXPECT_TRUE(refused(std::string("\x93NUMPY", 6), {"truncated header"}));
  EXPECT_TRUE(
      refused(std::string("\x93NUMPY\x02\x00\x10", 9), {"truncated header", "expected at least 12 bytes, file has 9"}));
}

TEST_F(Npy, RefusesUnsupportedVersions) {
  const std::string good = npy_bytes(kGoodDict, f32_bytes({1, 2, 3}));
  for (const auto& [major, minor] : std::vector<std::pair<int, int>>{{0, 0}, {4, 0}, {1, 1}, {2, 5}}) {
    std::string bytes = good;
    bytes[6] = static_cast<char>(major);
    bytes[7] = static_cast<char>(minor);
    EXPECT_TRUE(refused(bytes, {fmt::format("unsupported .npy format version {}.{}", major, minor), "1.0, 2.0, 3.0"}));
  }
}

TEST_F(Npy, RefusesTruncatedHeader) {
  const std::string bytes = npy_bytes(kGoodDict, "");
  EXPECT_TRUE(
      refused(bytes.substr(0, 40), {"truncated header", fmt::format("expected {} bytes, file has 40", bytes.size())}));
}

TEST_F(Npy, RefusesMalformedHeaders) {
  const std::string data = f32_bytes({1, 2, 3});
  const std::vector<std::pair<std::string, std::string>> cases = {
      {"", "expected '{'"},
      {"'descr': '<f4'", "expected '{'"},
      {"{'descr': '<f4', 'fortran_order': False, 'shape': (3,)", "expected '}'"},
      {"{'descr': '<f4' 'fortran_order': False, 'shape': (3,)}", "expected '}'"},
      {"{'descr': '<f4', 'fortran_order': False}", "no 'shape' key"},
      {"{'fortran_order': False, 'shape': (3,)}", "no 'descr' key"},
      {"{'descr': '<f4', 'shape': (3,)}", "no 'fortran_order' key"},
      {"{'descr': '<f4', 'fortran_order': False, 'shape': (3,), 'extra': True}", "unexpected key 'extra'"},
      {"{'descr': '<f4', 'descr': '<f4', 'fortran_order': False, 'shape': (3,)}", "duplicate key 'descr'"},
      {"{'descr': '<f4', 'fortran_order': False, 'shape': [3]}", "'shape' must be a tuple of integers"},
      {"{'descr': [('a', '<f4'), 'fortran_order': False, 'shape': (3,)}", "unterminated list"},
      {"{'descr': '<f4', 'fortran_order': False, 'shape': (3)}", "expected a tuple, got a parenthesised integer"},
      {"{'descr': '<f4', 'fortran_order': False, 'shape': (3, 'a')}", "expected an integer"},
      {"{'descr': '<f4', 'fortran_order': False, 'shape': ('3',)}", "expected an integer"},
      {"{'descr': '<f4', 'fortran_order': 'no', 'shape': (3,)}", "'fortran_order' must be True or False"},
      {"{'descr': True, 'fortran_order': False, 'shape': (3,)}", "'descr' must be a string"},
      {"{'descr': '<f4', 'fortran_order': False, 'shape': True}", "'shape' must be a tuple of integers"},
      {"{'descr': '<f4, 'fortran_order': False, 'shape': (3,)}", "expected '}' at offset 17"},
      {"{'descr': '<f4', 'fortran_order': False, 'shape': (3,)} x", "unexpected text after the dict"},
      {"{'descr': '<f4', 'fortran_order': False, 'shape': (3,)}}", "unexpected text after the dict"},
      {"{'descr': '<f4', 'fortran_order': False, 'shape': (3,), 'x", "unterminated string"},
      {"{descr: '<f4', 'fortran_order': False, 'shape': (3,)}", "expected a quoted string"},
      {"{'descr': '<f4', 'fortran_order': false, 'shape': (3,)}", "expected a string, True, False, a tuple or a list"},
      {"{'descr': '<f4', 'fortran_order': False, 'shape': (99999999999999999999,)}", "does not fit in 64 bits"},
  };
  for (const auto& [dict, problem] : cases) {
    SCOPED_TRACE(dict);
    EXPECT_TRUE(refused(npy_bytes(dict, data), {"malformed header", problem}));
  }
}

TEST_F(Npy, ReadsBigEndianAndFortranOrderAsLittleEndianCOrder) {
  std::string big;
  for (const float x : {1.0f, 2.0f, 3.0f}) {
    auto bytes = std::bit_cast<std::array<char, 4>>(x);
    big.append(bytes.rbegin(), bytes.rend());
  }
  EXPECT_TRUE(same_array(read_raw(npy_bytes("{'descr': '>f4', 'fortran_order': False, 'shape': (3,)}", big)),
                         DType::float32, Tensor<float>(Shape{3}, {1, 2, 3})));
  std::string big_int(8, '\0');
  big_int[7] = 5;
  EXPECT_TRUE(same_array(read_raw(npy_bytes("{'descr': '>i8', 'fortran_order': False, 'shape': ()}", big_int)),
                         DType::int64, Tensor<int64_t>(Shape{}, {5})));
  // int32 has no Tensor of its own: the values are compared as they were read.
  const auto int32_values = [](const NpyArray& array) {
    EXPECT_EQ(array.dtype, DType::int32);
    const auto* values = std::get_if<std::vector<int32_t>>(&array.values);
    return values != nullptr ? *values : std::vector<int32_t>{};
  };
  const std::string big_int32("\x00\x00\x00\x07\xff\xff\xff\xfe\x80\x00\x00\x00", 12);
  const NpyArray big32 = read_raw(npy_bytes("{'descr': '>i4', 'fortran_order': False, 'shape': (3,)}", big_int32));
  EXPECT_EQ(big32.shape_str(), "[3]");
  EXPECT_EQ(int32_values(big32), (std::vector<int32_t>{7, -2, std::numeric_limits<int32_t>::min()}));
  std::string fortran_int32(6 * sizeof(int32_t), '\0');
  const std::array<int32_t, 6> columns{1, 4, 2, 5, 3, 6};
  std::memcpy(fortran_int32.data(), columns.data(), fortran_int32.size());
  const NpyArray c_order =
      read_raw(npy_bytes("{'descr': '<i4', 'fortran_order': True, 'shape': (2, 3)}", fortran_int32));
  EXPECT_EQ(c_order.shape_str(), "[2, 3]");
  EXPECT_EQ(int32_values(c_order), (std::vector<int32_t>{1, 2, 3, 4, 5, 6}));
  EXPECT_EQ(int32_values(read_raw(npy_bytes("{'descr': 'i4', 'fortran_order': False, 'shape': (0,)}", ""))),
            std::vector<int32_t>{});
  // [[1, 2, 3], [4, 5, 6]] in Fortran order is its columns one after the other.
  EXPECT_TRUE(same_array(
      read_raw(npy_bytes("{'descr': '<f4', 'fortran_order': True, 'shape': (2, 3)}", f32_bytes({1, 4, 2, 5, 3, 6}))),
      DType::float32, Tensor<float>(Shape{2, 3}, {1, 2, 3, 4, 5, 6})));
  EXPECT_TRUE(same_array(
      read_raw(npy_bytes("{'descr': '|u1', 'fortran_order': False, 'shape': (3,)}", std::string("\x00\x07\xff", 3))),
      DType::uint8, Tensor<uint8_t>(Shape{3}, {0, 7, 255})));
  EXPECT_TRUE(same_array(
      read_raw(npy_bytes("{'descr': '|i1', 'fortran_order': False, 'shape': (3,)}", std::string("\x00\x07\xff", 3))),
      DType::int8, Tensor<int8_t>(Shape{3}, std::vector<int8_t>{0, 7, -1})));
  // 1.0 in half precision is 0x3c00; '>f2' stores it high byte first.
  EXPECT_TRUE(same_array(read_raw(npy_bytes("{'descr': '>f2', 'fortran_order': False, 'shape': (2,)}",
                                            std::string("\x3c\x00\xc0\x00", 4))),
                         DType::float16, Tensor<uint16_t>(Shape{2}, std::vector<uint16_t>{0x3c00, 0xc000})));
  EXPECT_TRUE(same_array(read_raw(npy_bytes("{'descr': '<u2', 'fortran_order': False, 'shape': (2,)}",
                                            std::string("\x80\x3f\x00\xc0", 4))),
                         DType::uint16, Tensor<uint16_t>(Shape{2}, std::vector<uint16_t>{0x3f80, 0xc000})));
}

TEST_F(Npy, RefusesOtherDtypes) {
  EXPECT_TRUE(
      refused(npy_bytes("{'descr': [('x', '<f4'), ('y', [('z', '|b1')])], 'fortran_order': False, 'shape': (1,)}",
                        std::string(5, '\0')),
              {"unsupported dtype [('x', '<f4'), ('y', [('z', '|b1')])]", "structured arrays are not supported",
               "float32 'f4'"}));
  for (const std::string descr : {"<i2", "<u4", "<f16", "<c8", "|S3", "<U2", "O", "", "|V2", "<f1"}) {
    SCOPED_TRACE(descr);
    EXPECT_TRUE(refused(
        npy_bytes(fmt::format("{{'descr': '{}', 'fortran_order': False, 'shape': (3,)}}", descr), f32_bytes({1, 2, 3})),
        {fmt::format("unsupported dtype '{}'", descr), "float32 'f4'", "float64 'f8'", "bool '|b1'", "int32 'i4'",
         "int64 'i8'", "uint8 '|u1'", "float16 'f2'", "uint16 'u2'", "int8 '|i1'"}));
  }
}

TEST_F(Npy, RefusesShapesThatCannotBeAllocated) {
  EXPECT_TRUE(refused(npy_bytes("{'descr': '<f4', 'fortran_order': False, 'shape': (2, -3)}", ""),
                      {"malformed header", "shape (2, -3) has a negative dimension"}));
  EXPECT_TRUE(refused(npy_bytes("{'descr': '<f4', 'fortran_order': False, 'shape': (4294967296, 4294967296)}", ""),
                      {"shape (4294967296, 4294967296): the product of its non-zero dims does not fit in 64 bits"}));
  // numpy refuses this shape too: empty, but its strides overflow, and so would any product of its dims.
  const std::string empty_but_huge =
      npy_bytes("{'descr': '<f4', 'fortran_order': False, 'shape': (4294967296, 4294967296, 0), }", "");
  EXPECT_TRUE(refused(empty_but_huge,
                      {"shape (4294967296, 4294967296, 0): the product of its non-zero dims does not fit in 64 bits"}));
  EXPECT_TRUE(refused(npy_bytes("{'descr': '<f4', 'fortran_order': False, 'shape': (0, 4294967296, 4294967296)}", ""),
                      {"shape (0, 4294967296, 4294967296)", "does not fit in 64 bits"}));
  EXPECT_TRUE(refused(npy_bytes("{'descr': '<f8', 'fortran_order': False, 'shape': (4611686018427387904,)}", ""),
                      {"shape (4611686018427387904,) of float64 needs more bytes than fit in 64 bits"}));
  // Fits in 64 bits but not in the file: refused from the sizes, before any allocation.
  EXPECT_TRUE(refused(npy_bytes("{'descr': '<f4', 'fortran_order': False, 'shape': (1000000000000,)}", f32_bytes({1})),
                      {"expected 4000000000000 bytes of data", "file has 4"}));
}

TEST_F(Npy, RefusesTruncatedAndTrailingData) {
  EXPECT_TRUE(
      refused(npy_bytes(kGoodDict, f32_bytes({1, 2})), {"truncated data", "expected 12 bytes of data", "file has 8"}));
  EXPECT_TRUE(refused(npy_bytes(kGoodDict, ""), {"expected 12 bytes of data", "file has 0"}));
  EXPECT_TRUE(refused(npy_bytes(kGoodDict, f32_bytes({1, 2, 3, 4})), {"4 trailing bytes after the 12 bytes of data"}));
  EXPECT_TRUE(
      refused(npy_bytes("{'descr': '<f4', 'fortran_order': False, 'shape': ()}", ""), {"expected 4 bytes of data"}));
  EXPECT_TRUE(refused(npy_bytes("{'descr': '<f4', 'fortran_order': False, 'shape': (0,)}", "x"), {"1 trailing bytes"}));
}

TEST_F(Npy, RefusesBoolBytesOtherThanZeroOrOne) {
  EXPECT_TRUE(refused(npy_bytes("{'descr': '|b1', 'fortran_order': False, 'shape': (4,)}", std::string("\1\0\2\1", 4)),
                      {"bool element 2 is 2, expected 0 or 1"}));
  EXPECT_TRUE(refused(npy_bytes("{'descr': '|b1', 'fortran_order': False, 'shape': ()}", "\xff"),
                      {"bool element 0 is 255, expected 0 or 1"}));
}

TEST_F(Npy, RefusesMissingAndUnreadableFiles) {
  EXPECT_TRUE(throws_io_error([&] { read_npy(dir_ / "absent.npy"); },
                              {(dir_ / "absent.npy").string(), "No such file or directory"}));
  EXPECT_TRUE(throws_io_error([&] { read_npy(dir_); }, {dir_.string(), "Is a directory"}));
  if (::geteuid() != 0) {
    write_bytes(dir_ / "locked.npy", npy_bytes(kGoodDict, f32_bytes({1, 2, 3})));
    fs::permissions(dir_ / "locked.npy", fs::perms::none);
    EXPECT_TRUE(throws_io_error([&] { read_npy(dir_ / "locked.npy"); }, {"locked.npy", "Permission denied"}));
  }
}

// ---- Interoperability with numpy -----------------------------------------------------------

// The value at flat index i of the arrays that the numpy scripts below make, for each dtype.
double expected_float(int64_t i) { return static_cast<double>(i) * 0.25 - 3.0; }
int64_t expected_int(int64_t i) { return (i - 7) * 1000000000000 + i; }
int32_t expected_int32(int64_t i) { return static_cast<int32_t>((i - 7) * 100000 + i); }
uint8_t expected_bool(int64_t i) { return i % 3 == 0 ? 1 : 0; }

constexpr std::string_view kNumpyArrays = R"(
import sys
import numpy as np

SHAPES = {"r0": (), "r1": (5,), "r2": (3, 4), "r3": (2, 3, 4), "r4": (2, 1, 3, 2), "r5": (1, 2, 1, 2, 3),
          "empty": (2, 0, 3)}

def arrays(shape):
    i = np.arange(int(np.prod(shape)), dtype=np.int64).reshape(shape)
    return {"f4": (i * 0.25 - 3).astype("<f4"), "f8": (i * 0.25 - 3).astype("<f8"),
            "i8": (i - 7) * 10**12 + i, "i4": ((i - 7) * 10**5 + i).astype("<i4"), "b1": i % 3 == 0}
)";

bool has_numpy() { return std::system(fmt::format("{} -c 'import numpy' >/dev/null 2>&1", kPython).c_str()) == 0; }

// Runs a Python script (kNumpyArrays followed by `body`) with the test directory as argv[1].
int run_python(const fs::path& dir, std::string_view body) {
  const fs::path script = dir / "script.py";
  write_bytes(script, std::string(kNumpyArrays) + std::string(body));
  return std::system(fmt::format("{} '{}' '{}'", kPython, script.string(), dir.string()).c_str());
}

template <class T>
Tensor<T> numpy_expected(const Shape& shape, T (*value)(int64_t)) {
  Tensor<T> t(shape);
  for (int64_t i = 0; i < t.numel(); ++i) t[i] = value(i);
  return t;
}

TEST_F(Npy, ReadsFilesWrittenByNumpy) {
  if (!has_numpy()) GTEST_SKIP() << kPython << " has no numpy";
  ASSERT_EQ(run_python(dir_, R"(
d = sys.argv[1]
for name, shape in SHAPES.items():
    for dt, a in arrays(shape).items():
        np.save(f"{d}/{name}_{dt}_save.npy", a)
        for v in (1, 2, 3):
            with open(f"{d}/{name}_{dt}_v{v}.npy", "wb") as f:
                np.lib.format.write_array(f, a, version=(v, 0))
)"),
            0);
  const std::vector<std::pair<std::string, std::vector<int64_t>>> shapes = {
      {"r0", {}}, {"r1", {5}}, {"r2", {3, 4}}, {"r3", {2, 3, 4}}, {"r4", {2, 1, 3, 2}}, {"empty", {2, 0, 3}}};
  for (const auto& entry : shapes) {
    const std::string& name = entry.first;
    const Shape shape{std::span<const int64_t>(entry.second)};
    for (const std::string version : {"save", "v1", "v2", "v3"}) {
      SCOPED_TRACE(fmt::format("{} {}", name, version));
      const auto path = [&](std::string_view dt) { return dir_ / fmt::format("{}_{}_{}.npy", name, dt, version); };
      EXPECT_TRUE(same_array(read_npy(path("f4")), DType::float32,
                             to_tensor<float, double>(numpy_expected(shape, expected_float).cview())));
      EXPECT_TRUE(same_array(read_npy(path("f8")), DType::float64, numpy_expected(shape, expected_float)));
      EXPECT_TRUE(same_array(read_npy(path("i8")), DType::int64, numpy_expected(shape, expected_int)));
      EXPECT_TRUE(same_array(read_npy(path("i4")), DType::int32, numpy_expected(shape, expected_int32)));
      EXPECT_TRUE(same_array(read_npy(path("b1")), DType::boolean, numpy_expected(shape, expected_bool)));
    }
  }
  const NpyArray rank5 = read_npy(dir_ / "r5_i8_v1.npy");
  EXPECT_EQ(rank5.shape_str(), "[1, 2, 1, 2, 3]");
  const auto& values = std::get<std::vector<int64_t>>(rank5.values);
  for (int64_t i = 0; i < rank5.numel(); ++i) EXPECT_EQ(values[static_cast<size_t>(i)], expected_int(i));
}

TEST_F(Npy, ReadsWhatNumpySavesInAnyOrderByteOrderAndArchive) {
  if (!has_numpy()) GTEST_SKIP() << kPython << " has no numpy";
  ASSERT_EQ(run_python(dir_, R"(
d = sys.argv[1]
a = np.arange(24, dtype="<f8").reshape(2, 3, 4)
np.save(f"{d}/big.npy", a.astype(">f4"))
np.save(f"{d}/fortran.npy", np.asfortranarray(a))
np.save(f"{d}/transposed.npy", a.T)
np.save(f"{d}/mask.npy", (a > 5).astype(np.uint8) * 3)
np.savez(f"{d}/arrays.npz", q=a, k=a.astype(">f4"))
np.savez(f"{d}/one.npz", a)
np.savez_compressed(f"{d}/compressed.npz", q=a)
np.save(f"{d}/int32.npy", np.array([0, -5, 2**31 - 1], dtype="<i4"))
np.save(f"{d}/int32_big_fortran.npy", np.asfortranarray(np.arange(6, dtype=">i4").reshape(2, 3)))
np.save(f"{d}/int16.npy", np.arange(3, dtype="<i2"))
)"),
            0);
  std::vector<double> values(24);
  std::iota(values.begin(), values.end(), 0.0);
  const Tensor<double> expected(Shape{2, 3, 4}, values);
  const Tensor<float> expected_f32(Shape{2, 3, 4}, std::vector<float>(values.begin(), values.end()));
  EXPECT_TRUE(same_array(read_npy(dir_ / "big.npy"), DType::float32, expected_f32));
  EXPECT_TRUE(same_array(read_npy(dir_ / "fortran.npy"), DType::float64, expected));
  std::vector<double> transposed(24);
  for (int i = 0; i < 2; ++i)
    for (int j = 0; j < 3; ++j)
      for (int k = 0; k < 4; ++k)
        transposed[static_cast<size_t>((k * 3 + j) * 2 + i)] = values[static_cast<size_t>((i * 3 + j) * 4 + k)];
  EXPECT_TRUE(
      same_array(read_npy(dir_ / "transposed.npy"), DType::float64, Tensor<double>(Shape{4, 3, 2}, transposed)));
  const NpyArray mask = read_npy(dir_ / "mask.npy");
  EXPECT_EQ(mask.dtype, DType::uint8);
  EXPECT_EQ(std::get<std::vector<uint8_t>>(mask.values)[6], 3);
  EXPECT_TRUE(same_array(read_npy(dir_.string() + "/arrays.npz:q"), DType::float64, expected));
  EXPECT_TRUE(same_array(read_npy(dir_.string() + "/arrays.npz:k"), DType::float32, expected_f32));
  EXPECT_TRUE(same_array(read_npy(dir_ / "one.npz"), DType::float64, expected));
  EXPECT_TRUE(
      throws_io_error([&] { read_npy(dir_ / "arrays.npz"); }, {"arrays.npz", "holds 2 arrays (q, k)", ":NAME"}));
  EXPECT_TRUE(throws_io_error([&] { read_npy(dir_.string() + "/arrays.npz:v"); }, {"has no array 'v'", "q, k"}));
  EXPECT_TRUE(throws_io_error([&] { read_npy(dir_.string() + "/compressed.npz:q"); },
                              {"compressed.npz:q", "compressed", "np.savez"}));
  const NpyArray int32 = read_npy(dir_ / "int32.npy");
  EXPECT_EQ(int32.dtype, DType::int32);
  EXPECT_EQ(std::get<std::vector<int32_t>>(int32.values), (std::vector<int32_t>{0, -5, 2147483647}));
  const NpyArray int32_c = read_npy(dir_ / "int32_big_fortran.npy");
  EXPECT_EQ(int32_c.shape_str(), "[2, 3]");
  EXPECT_EQ(std::get<std::vector<int32_t>>(int32_c.values), (std::vector<int32_t>{0, 1, 2, 3, 4, 5}));
  EXPECT_TRUE(throws_io_error([&] { read_npy(dir_ / "int16.npy"); }, {"int16.npy", "unsupported dtype '<i2'"}));
}

TEST_F(Npy, RefusesWhatIsNotAnArchive) {
  write_bytes(dir_ / "not.npz", "PK this is not a zip archive at all, just text");
  EXPECT_TRUE(throws_io_error([&] { read_npy(dir_ / "not.npz"); }, {"not.npz", "not a readable .npz archive"}));
  write_bytes(dir_ / "short.npz", "PK");
  EXPECT_TRUE(throws_io_error([&] { read_npy(dir_ / "short.npz"); }, {"short.npz", "too short"}));
}

TEST_F(Npy, NumpyReadsFilesWrittenByQkv) {
  if (!has_numpy()) GTEST_SKIP() << kPython << " has no numpy";
  const std::vector<std::pair<std::string, Shape>> shapes = {{"r0", Shape{}},           {"r1", Shape{5}},
                                                             {"r2", Shape{3, 4}},       {"r3", Shape{2, 3, 4}},
                                                             {"r4", Shape{2, 1, 3, 2}}, {"empty", Shape{2, 0, 3}}};
  for (const auto& [name, shape] : shapes) {
    write_npy(dir_ / (name + "_f4.npy"),
              to_tensor<float, double>(numpy_expected(shape, expected_float).cview()).cview());
    write_npy(dir_ / (name + "_f8.npy"), numpy_expected(shape, expected_float).cview());
    write_npy(dir_ / (name + "_i8.npy"), numpy_expected(shape, expected_int).cview());
    write_npy(dir_ / (name + "_b1.npy"), numpy_expected(shape, expected_bool).cview());
  }
  EXPECT_EQ(run_python(dir_, R"(
d = sys.argv[1]
bad = 0
for name, shape in SHAPES.items():
    if name == "r5":
        continue
    for dt, want in arrays(shape).items():
        if dt == "i4":  # read, never written: qkv's outputs are float, bool or int64
            continue
        path = f"{d}/{name}_{dt}.npy"
        with open(path, "rb") as f:
            version = np.lib.format.read_magic(f)
            np.lib.format.read_array_header_1_0(f)
            aligned = f.tell() % 64 == 0
        got = np.load(path)
        same = got.dtype == want.dtype and got.shape == want.shape and np.array_equal(got, want)
        if version != (1, 0) or not aligned or not same:
            print(f"{path}: version {version}, aligned {aligned}, got {got.dtype}{got.shape} {got!r}", file=sys.stderr)
            bad += 1
sys.exit(1 if bad else 0)
)"),
            0);
}

// ---- Atomic writes --------------------------------------------------------------------------

TEST_F(Npy, AtomicWriteReplacesTheWholeFile) {
  write_bytes(dir_ / "f", std::string(1000, 'a'));
  write_file_atomically(dir_ / "f", "short");
  EXPECT_EQ(read_bytes(dir_ / "f"), "short");
  write_file_atomically(dir_ / "g", "");
  EXPECT_EQ(read_bytes(dir_ / "g"), "");
  EXPECT_EQ(listing(dir_), (std::set<std::string>{"f", "g"})) << "a temporary file was left behind";
}

TEST_F(Npy, AtomicWriteTakesNamesUpToNameMax) {
  const std::string name(255, 'n');
  write_file_atomically(dir_ / name, "long");
  EXPECT_EQ(read_bytes(dir_ / name), "long");
  EXPECT_EQ(listing(dir_), std::set<std::string>{name});
}

TEST_F(Npy, AtomicWriteToMissingDirectoryCreatesNothing) {
  const fs::path path = dir_ / "no" / "such" / "x.npy";
  EXPECT_TRUE(
      throws_io_error([&] { write_file_atomically(path, "data"); }, {path.string(), "No such file or directory"}));
  EXPECT_TRUE(throws_io_error([&] { write_npy(path, Tensor<float>(Shape{2}).cview()); },
                              {path.string(), "No such file or directory"}));
  EXPECT_TRUE(listing(dir_).empty());
}

TEST_F(Npy, AtomicWriteUnderARegularFileFails) {
  write_bytes(dir_ / "plain", "old");
  const fs::path path = dir_ / "plain" / "x.npy";
  EXPECT_TRUE(throws_io_error([&] { write_file_atomically(path, "data"); }, {path.string(), "Not a directory"}));
  EXPECT_EQ(read_bytes(dir_ / "plain"), "old");
  EXPECT_EQ(listing(dir_), std::set<std::string>{"plain"});
}

TEST_F(Npy, FailedRenameRemovesTheTemporary) {
  fs::create_directory(dir_ / "target");
  write_bytes(dir_ / "target" / "inside", "kept");
  EXPECT_TRUE(throws_io_error([&] { write_file_atomically(dir_ / "target", "data"); }, {"target", "rename failed"}));
  EXPECT_EQ(read_bytes(dir_ / "target" / "inside"), "kept");
  EXPECT_EQ(listing(dir_), std::set<std::string>{"target"});
}

// A write that fails halfway (here: past the file size limit, which binds root too) must leave
// the old file as it was and no temporary behind.
TEST_F(Npy, FailedWriteKeepsTheOldFile) {
  const std::string old(100, 'o');
  write_bytes(dir_ / "f", old);
  rlimit saved{};
  ASSERT_EQ(::getrlimit(RLIMIT_FSIZE, &saved), 0);
  rlimit small = saved;
  small.rlim_cur = 64;
  // Past the limit a write raises SIGXFSZ, which would kill the test; ignored, write fails with EFBIG.
  const auto previous_handler = std::signal(SIGXFSZ, SIG_IGN);
  ASSERT_EQ(::setrlimit(RLIMIT_FSIZE, &small), 0);
  const ::testing::AssertionResult refused_write = throws_io_error(
      [&] { write_file_atomically(dir_ / "f", std::string(4096, 'n')); }, {"f", "write failed", "File too large"});
  ::setrlimit(RLIMIT_FSIZE, &saved);
  std::signal(SIGXFSZ, previous_handler);
  EXPECT_TRUE(refused_write);
  EXPECT_EQ(read_bytes(dir_ / "f"), old);
  EXPECT_EQ(listing(dir_), std::set<std::string>{"f"});
}

TEST_F(Npy, AtomicWriteIntoReadOnlyDirectoryKeepsTheOldFile) {
  if (::geteuid() == 0)
    GTEST_SKIP() << "root ignores directory permissions (FailedWriteKeepsTheOldFile covers the failure)";
  fs::create_directory(dir_ / "ro");
  write_bytes(dir_ / "ro" / "f.npy", "old");
  fs::permissions(dir_ / "ro", fs::perms::owner_read | fs::perms::owner_exec);
  EXPECT_TRUE(throws_io_error([&] { write_npy(dir_ / "ro" / "f.npy", Tensor<float>(Shape{2}).cview()); },
                              {"f.npy", "Permission denied"}));
  EXPECT_EQ(read_bytes(dir_ / "ro" / "f.npy"), "old");
  EXPECT_EQ(listing(dir_ / "ro"), std::set<std::string>{"f.npy"});
}

// Writers racing on one path each leave a complete file: the result is one of theirs, whole.
TEST_F(Npy, ConcurrentWritersNeverMixTheirBytes) {
  constexpr int kWriters = 4;
  constexpr int kWrites = 10;
  std::vector<std::thread> writers;
  writers.reserve(kWriters);
  for (int w = 0; w < kWriters; ++w) {
    writers.emplace_back([&, w] {
      for (int i = 0; i < kWrites; ++i)
        write_file_atomically(dir_ / "shared",
                              std::string(static_cast<size_t>(1000 * (w + 1)), static_cast<char>('a' + w)));
    });
  }
  for (std::thread& writer : writers) writer.join();
  const std::string result = read_bytes(dir_ / "shared");
  ASSERT_FALSE(result.empty());
  EXPECT_EQ(result, std::string(static_cast<size_t>(1000 * (result[0] - 'a' + 1)), result[0]));
  EXPECT_EQ(listing(dir_), std::set<std::string>{"shared"});
}

}  // namespace
}  // namespace qkv
