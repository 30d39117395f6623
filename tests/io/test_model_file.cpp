// The model file format (include/qkv/io/model_file.hpp): a round trip keeps every entry and every bit
// of every tensor; the checksum is zlib's CRC-32; every way a file can be damaged or foreign is
// refused with an IoError that names the file and the problem, never a crash or a partial model;
// load_parameters refuses a file that does not hold exactly the model's parameters.

#include "qkv/io/model_file.hpp"

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

TEST(ModelFile, EveryFlippedByteIsRefused) {
  const std::string good = encode_model_file(sample_model());
  for (size_t i = 0; i < good.size(); ++i) {
    std::string bad = good;
    bad[i] = static_cast<char>(bad[i] ^ 0x5A);
    // The magic, the version and the length have their own messages; anything else is the checksum's.
    EXPECT_THROW(decode_model_file(bad, "bad.qkvm"), IoError) << "byte " << i;
  }
  std::string bad = good;
  bad[good.size() / 2] = static_cast<char>(bad[good.size() / 2] ^ 1);
  EXPECT_TRUE(throws_naming<IoError>([&] { decode_model_file(bad, "bad.qkvm"); },
                                     {"bad.qkvm", "checksum mismatch", "corrupt"}));
}

TEST(ModelFile, EveryTruncationIsRefused) {
  const std::string good = encode_model_file(sample_model());
  for (size_t n = 0; n < good.size(); ++n) {
    EXPECT_THROW(decode_model_file(std::string_view(good).substr(0, n), "cut.qkvm"), IoError) << "length " << n;
  }
  EXPECT_TRUE(throws_naming<IoError>([&] { decode_model_file(std::string_view(good).substr(0, 40), "cut.qkvm"); },
                                     {"cut.qkvm", "truncated"}));
  EXPECT_TRUE(
      throws_naming<IoError>([&] { decode_model_file(good + "x", "long.qkvm"); }, {"long.qkvm", "trailing bytes"}));
}

TEST(ModelFile, ForeignFilesAndOtherVersionsAreRefused) {
  EXPECT_TRUE(throws_naming<IoError>([] { decode_model_file("\x93NUMPY\x01\x00", "x.npy"); },
                                     {"x.npy", "not a qkv model file"}));
  EXPECT_TRUE(throws_naming<IoError>([] { decode_model_file("", "empty.qkvm"); }, {"empty.qkvm", "not a qkv model"}));
  std::string future = encode_model_file(sample_model());
  const uint32_t version = 2;
  std::memcpy(future.data() + 8, &version, 4);
  EXPECT_TRUE(throws_naming<IoError>([&] { decode_model_file(with_valid_checksum(future), "new.qkvm"); },
                                     {"new.qkvm", "format version 2", "reads version 1"}));
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
