// The model file format (include/qkv/io/model_file.hpp): a round trip keeps every entry and every bit
// of every tensor, float32 or narrow (float16, bfloat16, int8, in version 2 only); the checksum is zlib's CRC-32; every
// way a file can be damaged or foreign is refused with an IoError that names the file and the problem, never a crash or
// a partial model; load_parameters refuses a file that does not hold exactly the model's parameters.

#include "qkv/io/model_file.hpp"

#include <fmt/format.h>
#include <gtest/gtest.h>

#include <cstring>
#include <filesystem>
#include <fstream>
#include <limits>
#include <string>
#include <vector>

#include "qkv/core/error.hpp"
#include "testing.hpp"

namespace qkv {
namespace {

using qkv::testing::random_tensor;
using qkv::testing::throws_naming;

ModelFile sample_model() {
  Rng rng(7);
  ModelFile model;
  model.kind = "toy";
  model.set("hidden", "3");
  model.set("words", "the big dog");
  model.set("empty", "");
  model.tensors.emplace_back("layer.weight", random_tensor<float>(Shape{3, 5}, rng));
  model.tensors.emplace_back("layer.bias", random_tensor<float>(Shape{3}, rng));
  model.tensors.emplace_back("scalar", Tensor<float>(Shape{}, 2.5F));
  model.tensors.emplace_back("odd", random_tensor<float>(Shape{1, 2, 1, 113}, rng));
  return model;
}

// sample_model with a tensor of each narrow type, which makes it a file of format version 2.
ModelFile sample_narrow_model() {
  ModelFile model = sample_model();
  const auto bits = [](std::initializer_list<uint16_t> values) {
    std::vector<uint8_t> bytes(values.size() * 2);
    std::memcpy(bytes.data(), std::data(values), bytes.size());
    return bytes;
  };
  model.narrow_tensors.emplace_back(
      "half",
      NarrowTensor{.type = StorageType::float16, .shape = Shape{2, 2}, .bytes = bits({0x3C00, 0x8001, 0x7BFF, 0})});
  model.narrow_tensors.emplace_back(
      "brain", NarrowTensor{.type = StorageType::bfloat16, .shape = Shape{3}, .bytes = bits({0x3F80, 0xFF7F, 0x0001})});
  model.narrow_tensors.emplace_back(
      "bytes", NarrowTensor{.type = StorageType::int8, .shape = Shape{1, 5}, .bytes = {0x80, 0x7F, 0, 1, 0xFF}});
  return model;
}

// Rewrites the stored checksum so that a deliberately inconsistent payload gets past it and reaches
// the checks behind.
std::string with_valid_checksum(std::string bytes) {
  const size_t body = bytes.size() - 4;
  const uint32_t crc = crc32(std::string_view(bytes).substr(0, body));
  std::memcpy(bytes.data() + body, &crc, 4);
  return bytes;
}

// A file holding `payload` under a correct header and checksum.
std::string file_with_payload(const std::string& payload) {
  std::string bytes(kModelFileMagic);
  const uint32_t version = kModelFileVersion;
  const uint64_t length = payload.size();
  bytes.append(reinterpret_cast<const char*>(&version), 4);
  bytes.append(reinterpret_cast<const char*>(&length), 8);
  bytes += payload;
  bytes.append(4, '\0');
  return with_valid_checksum(bytes);
}

void put_u32(std::string& out, uint32_t v) { out.append(reinterpret_cast<const char*>(&v), 4); }
void put_string(std::string& out, const std::string& s) {
  put_u32(out, static_cast<uint32_t>(s.size()));
  out += s;
}

TEST(ModelFile, Crc32MatchesZlib) {
  EXPECT_EQ(crc32("123456789"), 0xCBF43926U);
  EXPECT_EQ(crc32(""), 0U);
  EXPECT_EQ(crc32("The quick brown fox jumps over the lazy dog"), 0x414FA339U);
}

TEST(ModelFile, RoundTripKeepsEntriesAndEveryBit) {
  const ModelFile model = sample_model();
  const ModelFile back = decode_model_file(encode_model_file(model), "m.qkvm");
  EXPECT_EQ(back.kind, "toy");
  EXPECT_EQ(back.source, "m.qkvm");
  EXPECT_EQ(back.metadata, model.metadata);
  ASSERT_EQ(back.tensors.size(), model.tensors.size());
  for (size_t i = 0; i < model.tensors.size(); ++i) {
    EXPECT_EQ(back.tensors[i].first, model.tensors[i].first);
    EXPECT_EQ(back.tensors[i].second.shape(), model.tensors[i].second.shape());
    EXPECT_EQ(0, std::memcmp(back.tensors[i].second.data(), model.tensors[i].second.data(),
                             static_cast<size_t>(model.tensors[i].second.numel()) * sizeof(float)));
  }
  EXPECT_EQ(back.value("words"), "the big dog");
  EXPECT_EQ(back.int_value("hidden", 1, 10), 3);
  EXPECT_EQ(back.tensor("scalar")[0], 2.5F);
}

// Empty tensors hold no value bytes, so their dims are bounded by nothing the file holds; one last
// in the file sees 0 bytes left. Their zero-byte copies must not pass data() (null) to memcpy.
TEST(ModelFile, EmptyTensorsRoundTripAnywhereInTheFile) {
  Rng rng(3);
  ModelFile model;
  model.kind = "toy";
  model.tensors.emplace_back("first", Tensor<float>(Shape{0}));
  model.tensors.emplace_back("middle", Tensor<float>(Shape{2, 0, 1000000}));
  model.tensors.emplace_back("values", random_tensor<float>(Shape{2, 3}, rng));
  model.tensors.emplace_back("last", Tensor<float>(Shape{0, 3}));
  const ModelFile back = decode_model_file(encode_model_file(model), "e.qkvm");
  ASSERT_EQ(back.tensors.size(), model.tensors.size());
  for (size_t i = 0; i < model.tensors.size(); ++i) {
    EXPECT_EQ(back.tensors[i].first, model.tensors[i].first);
    EXPECT_EQ(back.tensors[i].second.shape(), model.tensors[i].second.shape());
    EXPECT_EQ(back.tensors[i].second.values(), model.tensors[i].second.values());
  }
}

// An empty tensor whose other dims multiply past int64: its strides would overflow, so the file is
// refused rather than decoded to a shape that no Tensor can hold.
TEST(ModelFile, EmptyTensorWithOverflowingDimsIsRefused) {
  std::string payload;
  put_string(payload, "toy");
  put_u32(payload, 0);
  put_u32(payload, 1);
  put_string(payload, "wide");
  payload += '\x01';  // float32
  payload += '\x04';  // rank 4
  for (const uint64_t dim : {uint64_t{0}, uint64_t{2100000}, uint64_t{2100000}, uint64_t{2100000}}) {
    payload.append(reinterpret_cast<const char*>(&dim), 8);
  }
  EXPECT_TRUE(throws_naming<IoError>([&] { decode_model_file(file_with_payload(payload), "w.qkvm"); },
                                     {"w.qkvm", "tensor \"wide\"", "[0, 2100000, 2100000, 2100000]", "64 bits"}));
}

TEST(ModelFile, HeaderLayoutIsAsDocumented) {
  const std::string bytes = encode_model_file(sample_model());
  EXPECT_EQ(bytes.substr(0, 8), "QKVMODEL");
  uint32_t version = 0;
  uint64_t length = 0;
  std::memcpy(&version, bytes.data() + 8, 4);
  std::memcpy(&length, bytes.data() + 12, 8);
  EXPECT_EQ(version, 1U);
  EXPECT_EQ(length + 8 + 4 + 8 + 4, bytes.size());
  uint32_t stored = 0;
  std::memcpy(&stored, bytes.data() + bytes.size() - 4, 4);
  EXPECT_EQ(stored, crc32(std::string_view(bytes).substr(0, bytes.size() - 4)));
}

TEST(ModelFile, WritesAndReadsAFile) {
  const std::filesystem::path path = std::filesystem::temp_directory_path() / "qkv_test_model_file.qkvm";
  write_model_file(path, sample_model());
  const ModelFile back = read_model_file(path);
  EXPECT_EQ(back.source, path.string());
  EXPECT_EQ(back.tensors.size(), 4U);
  std::filesystem::remove(path);
  EXPECT_TRUE(throws_naming<IoError>([&] { read_model_file(path); }, {path.string(), "cannot open"}));
}

TEST(ModelFile, NarrowTensorsRoundTripEveryByteAsVersion2) {
  const ModelFile model = sample_narrow_model();
  const std::string bytes = encode_model_file(model);
  uint32_t version = 0;
  std::memcpy(&version, bytes.data() + 8, 4);
  EXPECT_EQ(version, 2U);
  const ModelFile back = decode_model_file(bytes, "n.qkvm");
  EXPECT_EQ(back.tensors.size(), model.tensors.size());
  ASSERT_EQ(back.narrow_tensors.size(), 3U);
  for (size_t i = 0; i < model.narrow_tensors.size(); ++i) {
    const auto& [name, tensor] = model.narrow_tensors[i];
    SCOPED_TRACE(name);
    ASSERT_NE(back.narrow_tensor(name), nullptr);
    EXPECT_EQ(back.narrow_tensor(name)->type, tensor.type);
    EXPECT_EQ(back.narrow_tensor(name)->shape, tensor.shape);
    EXPECT_EQ(back.narrow_tensor(name)->bytes, tensor.bytes);
  }
  EXPECT_EQ(back.narrow_tensor("layer.weight"), nullptr);
  // Two bytes a float16 value, one an int8 one: the file holds them as they are.
  EXPECT_NE(bytes.find(std::string("\x80\x7F\x00\x01\xFF", 5)), std::string::npos);
}

TEST(ModelFile, NarrowTensorsAreRefusedInVersion1AndWhenTheyLie) {
  std::string bytes = encode_model_file(sample_narrow_model());
  const uint32_t one = 1;
  std::memcpy(bytes.data() + 8, &one, 4);
  EXPECT_TRUE(
      throws_naming<IoError>([&] { decode_model_file(with_valid_checksum(bytes), "old.qkvm"); },
                             {"old.qkvm", "tensor \"half\"", "dtype code 1 (float32) of format version 1", "got 2"}));

  ModelFile wrong_bytes = sample_narrow_model();
  wrong_bytes.narrow_tensors[0].second.bytes.pop_back();
  EXPECT_TRUE(throws_naming<ValueError>([&] { encode_model_file(wrong_bytes); },
                                        {"\"half\"", "expected 8 bytes", "4 float16 values of shape [2, 2]", "got 7"}));
  ModelFile float32 = sample_narrow_model();
  float32.narrow_tensors[2].second.type = StorageType::float32;
  EXPECT_TRUE(throws_naming<ValueError>([&] { encode_model_file(float32); }, {"\"bytes\"", "got float32"}));
  ModelFile shared_name = sample_narrow_model();
  shared_name.narrow_tensors[1].first = "layer.bias";
  EXPECT_TRUE(throws_naming<ValueError>([&] { encode_model_file(shared_name); }, {"\"layer.bias\"", "twice"}));

  for (const auto& [index, bits] : {std::pair{0, uint16_t{0x7C00}}, std::pair{1, uint16_t{0xFFC1}}}) {
    ModelFile non_finite = sample_narrow_model();
    std::memcpy(non_finite.narrow_tensors[static_cast<size_t>(index)].second.bytes.data() + 2, &bits, 2);
    EXPECT_TRUE(throws_naming<ValueError>([&] { encode_model_file(non_finite); }, {"flat index 1", "not finite"}));
  }
  // The same forged past the encoder: the float16 value 1.0 (0x3C00, first in "half") made infinite.
  std::string forged = encode_model_file(sample_narrow_model());
  const size_t at = forged.find(std::string("\x00\x3C\x01\x80", 4));
  ASSERT_NE(at, std::string::npos);
  forged[at + 1] = '\x7C';
  EXPECT_TRUE(
      throws_naming<IoError>([&] { decode_model_file(with_valid_checksum(forged), "inf.qkvm"); },
                             {"inf.qkvm", "tensor \"half\"", "float16 value inf at flat index 0", "not finite"}));
}

TEST(ModelFile, EveryFlippedByteIsRefused) {
  for (const ModelFile& model : {sample_model(), sample_narrow_model()}) {
    const std::string good = encode_model_file(model);
    for (size_t i = 0; i < good.size(); ++i) {
      std::string bad = good;
      bad[i] = static_cast<char>(bad[i] ^ 0x5A);
      // The magic, the version and the length have their own messages; anything else is the checksum's.
      EXPECT_THROW(decode_model_file(bad, "bad.qkvm"), IoError) << "byte " << i;
    }
  }
  const std::string good = encode_model_file(sample_model());
  std::string bad = good;
  bad[good.size() / 2] = static_cast<char>(bad[good.size() / 2] ^ 1);
  EXPECT_TRUE(throws_naming<IoError>([&] { decode_model_file(bad, "bad.qkvm"); },
                                     {"bad.qkvm", "checksum mismatch", "corrupt"}));
}

TEST(ModelFile, EveryTruncationIsRefused) {
  for (const ModelFile& model : {sample_model(), sample_narrow_model()}) {
    const std::string whole = encode_model_file(model);
    for (size_t n = 0; n < whole.size(); ++n) {
      EXPECT_THROW(decode_model_file(std::string_view(whole).substr(0, n), "cut.qkvm"), IoError) << "length " << n;
    }
  }
  const std::string good = encode_model_file(sample_model());
  EXPECT_TRUE(throws_naming<IoError>([&] { decode_model_file(std::string_view(good).substr(0, 40), "cut.qkvm"); },
                                     {"cut.qkvm", "truncated"}));
  EXPECT_TRUE(
      throws_naming<IoError>([&] { decode_model_file(good + "x", "long.qkvm"); }, {"long.qkvm", "trailing bytes"}));
}

TEST(ModelFile, ForeignFilesAndOtherVersionsAreRefused) {
  EXPECT_TRUE(throws_naming<IoError>([] { decode_model_file("\x93NUMPY\x01\x00", "x.npy"); },
                                     {"x.npy", "not a qkv model file"}));
  EXPECT_TRUE(throws_naming<IoError>([] { decode_model_file("", "empty.qkvm"); }, {"empty.qkvm", "not a qkv model"}));
  for (const uint32_t version : {0U, 3U}) {
    std::string other = encode_model_file(sample_model());
    std::memcpy(other.data() + 8, &version, 4);
    EXPECT_TRUE(
        throws_naming<IoError>([&] { decode_model_file(with_valid_checksum(other), "other.qkvm"); },
                               {"other.qkvm", fmt::format("format version {}", version), "reads versions 1 to 2"}));
  }
}

TEST(ModelFile, LyingLengthsInsideAValidChecksumAreRefused) {
  // A tensor whose dims promise far more values than the file holds: refused before allocating.
  std::string payload;
  put_string(payload, "toy");
  put_u32(payload, 0);
  put_u32(payload, 1);
  put_string(payload, "huge");
  payload += '\x01';  // float32
  payload += '\x02';  // rank 2
  const uint64_t dim = uint64_t{1} << 40;
  payload.append(reinterpret_cast<const char*>(&dim), 8);
  payload.append(reinterpret_cast<const char*>(&dim), 8);
  EXPECT_TRUE(throws_naming<IoError>([&] { decode_model_file(file_with_payload(payload), "lie.qkvm"); },
                                     {"lie.qkvm", "tensor \"huge\"", "more values than"}));

  std::string short_string;
  put_u32(short_string, 1000);  // a kind of 1000 bytes, in a payload of 7
  short_string += "abc";
  EXPECT_TRUE(throws_naming<IoError>([&] { decode_model_file(file_with_payload(short_string), "s.qkvm"); },
                                     {"s.qkvm", "truncated payload", "kind"}));

  std::string rank5;
  put_string(rank5, "toy");
  put_u32(rank5, 0);
  put_u32(rank5, 1);
  put_string(rank5, "t");
  rank5 += '\x01';
  rank5 += '\x05';
  EXPECT_TRUE(throws_naming<IoError>([&] { decode_model_file(file_with_payload(rank5), "r.qkvm"); },
                                     {"r.qkvm", "tensor \"t\"", "rank 0 to 4", "got 5"}));

  std::string dtype;
  put_string(dtype, "toy");
  put_u32(dtype, 0);
  put_u32(dtype, 1);
  put_string(dtype, "t");
  dtype += '\x07';
  EXPECT_TRUE(throws_naming<IoError>([&] { decode_model_file(file_with_payload(dtype), "d.qkvm"); },
                                     {"d.qkvm", "dtype", "got 7"}));

  std::string extra;
  put_string(extra, "toy");
  put_u32(extra, 0);
  put_u32(extra, 0);
  extra += "zz";
  EXPECT_TRUE(throws_naming<IoError>([&] { decode_model_file(file_with_payload(extra), "e.qkvm"); },
                                     {"e.qkvm", "2 bytes", "follow the last tensor"}));

  std::string twice;
  put_string(twice, "toy");
  put_u32(twice, 2);
  put_string(twice, "k");
  put_string(twice, "1");
  put_string(twice, "k");
  put_string(twice, "2");
  put_u32(twice, 0);
  EXPECT_TRUE(throws_naming<IoError>([&] { decode_model_file(file_with_payload(twice), "t.qkvm"); },
                                     {"t.qkvm", "entry \"k\"", "twice"}));
}

TEST(ModelFile, NonFiniteValuesAreRefusedBothWays) {
  ModelFile model = sample_model();
  model.tensors[1].second[2] = std::numeric_limits<float>::quiet_NaN();
  EXPECT_TRUE(
      throws_naming<ValueError>([&] { encode_model_file(model); }, {"layer.bias", "flat index 2", "not finite"}));
  // The same file forged past the encoder: the reader refuses it too.
  ModelFile clean = sample_model();
  std::string bytes = encode_model_file(clean);
  const float inf = std::numeric_limits<float>::infinity();
  const std::string needle(reinterpret_cast<const char*>(clean.tensors[2].second.data()), 4);  // "scalar" = 2.5
  const size_t at = bytes.find(needle);
  ASSERT_NE(at, std::string::npos);
  std::memcpy(bytes.data() + at, &inf, 4);
  EXPECT_TRUE(throws_naming<IoError>([&] { decode_model_file(with_valid_checksum(bytes), "inf.qkvm"); },
                                     {"inf.qkvm", "tensor \"scalar\"", "not finite"}));
}

TEST(ModelFile, EncodingRefusesDuplicates) {
  ModelFile model = sample_model();
  model.metadata.emplace_back("hidden", "4");
  EXPECT_TRUE(throws_naming<ValueError>([&] { encode_model_file(model); }, {"entry \"hidden\"", "twice"}));
  model = sample_model();
  model.tensors.emplace_back("scalar", Tensor<float>(Shape{1}));
  EXPECT_TRUE(throws_naming<ValueError>([&] { encode_model_file(model); }, {"tensor \"scalar\"", "twice"}));
}

TEST(ModelFile, LookupsNameTheSourceAndTheKey) {
  ModelFile model = decode_model_file(encode_model_file(sample_model()), "m.qkvm");
  EXPECT_TRUE(throws_naming<IoError>([&] { model.value("missing"); }, {"m.qkvm", "no entry \"missing\""}));
  EXPECT_TRUE(
      throws_naming<IoError>([&] { model.int_value("hidden", 4, 8); }, {"m.qkvm", "\"hidden\"", "4 to 8", "\"3\""}));
  EXPECT_TRUE(throws_naming<IoError>([&] { model.int_value("words", 0, 8); }, {"\"words\"", "the big dog"}));
  EXPECT_TRUE(throws_naming<IoError>([&] { model.tensor("nope"); }, {"m.qkvm", "no tensor \"nope\""}));
  EXPECT_TRUE(
      throws_naming<IoError>([&] { model.check_kind("seq2seq"); }, {"m.qkvm", "expected a seq2seq model", "toy"}));
  model.set("hidden", "5");
  EXPECT_EQ(model.int_value("hidden", 4, 8), 5);
  EXPECT_EQ(model.metadata.size(), 3U);
}

TEST(ModelFile, ParametersRoundTripAndMismatchesAreRefused) {
  Rng rng(3);
  Parameter<double> w(Shape{3, 5}), b(Shape{3});
  rng.fill_normal(w.value.view());
  rng.fill_normal(b.value.view());
  std::vector<ParameterRef<double>> params = {w.ref("layer.weight"), b.ref("layer.bias")};
  ModelFile model;
  model.kind = "toy";
  store_parameters(model, params);
  model = decode_model_file(encode_model_file(model), "p.qkvm");

  Parameter<double> w2(Shape{3, 5}), b2(Shape{3});
  load_parameters(model, std::vector<ParameterRef<double>>{w2.ref("layer.weight"), b2.ref("layer.bias")});
  for (int64_t i = 0; i < w.value.numel(); ++i)
    EXPECT_EQ(w2.value[i], static_cast<double>(static_cast<float>(w.value[i])));

  Parameter<double> wrong(Shape{3, 4});
  EXPECT_TRUE(throws_naming<IoError>(
      [&] {
        load_parameters(model, std::vector<ParameterRef<double>>{wrong.ref("layer.weight"), b2.ref("layer.bias")});
      },
      {"p.qkvm", "tensor \"layer.weight\"", "expected shape [3, 4]", "got [3, 5]"}));
  EXPECT_TRUE(
      throws_naming<IoError>([&] { load_parameters(model, std::vector<ParameterRef<double>>{w2.ref("layer.weight")}); },
                             {"p.qkvm", "tensor \"layer.bias\"", "not a parameter"}));
  Parameter<double> extra(Shape{2});
  EXPECT_TRUE(throws_naming<IoError>(
      [&] {
        load_parameters(model, std::vector<ParameterRef<double>>{w2.ref("layer.weight"), b2.ref("layer.bias"),
                                                                 extra.ref("layer.extra")});
      },
      {"p.qkvm", "no tensor \"layer.extra\""}));
  ModelFile with_narrow = model;
  with_narrow.narrow_tensors.emplace_back(
      "layer.half", NarrowTensor{.type = StorageType::float16, .shape = Shape{1}, .bytes = {0, 0x3C}});
  EXPECT_TRUE(throws_naming<IoError>(
      [&] {
        load_parameters(with_narrow, std::vector<ParameterRef<double>>{w2.ref("layer.weight"), b2.ref("layer.bias")});
      },
      {"p.qkvm", "tensor \"layer.half\" is float16", "parameters of a toy model are float32"}));
  // A refused load leaves the parameters as they were.
  Parameter<double> untouched(Shape{3, 5});
  untouched.value[0] = 42.0;
  EXPECT_THROW(
      load_parameters(model, std::vector<ParameterRef<double>>{untouched.ref("layer.weight"), wrong.ref("layer.bias")}),
      IoError);
  EXPECT_EQ(untouched.value[0], 42.0);
}

}  // namespace
}  // namespace qkv
