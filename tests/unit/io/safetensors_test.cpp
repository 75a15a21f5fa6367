// safetensors reader and writer: round trips of every dtype, layout, metadata, and one test per kind of hostile
// file (bytes written by hand) that must be rejected with a DataError naming the file and the problem.
#include <ATen/ATen.h>
#include <gtest/gtest.h>

#include <cstring>
#include <filesystem>
#include <initializer_list>
#include <random>

#include "support/temp_dir.h"
#include "trainer/errors.h"
#include "trainer/safetensors.h"

namespace trainer {
namespace {

using test::TempDir;

// A tensor of `dtype` whose bytes are random (every bit pattern is a valid value of the float and int types;
// bool must be 0 or 1), so a round trip that mixes up bytes, order or dtype cannot pass by accident.
at::Tensor random_tensor(at::ScalarType dtype, at::IntArrayRef shape, std::uint32_t seed) {
  at::Tensor t = at::empty(shape, at::TensorOptions().dtype(dtype));
  std::mt19937 rng(seed);
  auto* bytes = static_cast<unsigned char*>(t.data_ptr());
  const auto n = static_cast<std::size_t>(t.numel()) * t.element_size();
  for (std::size_t i = 0; i < n; ++i) bytes[i] = static_cast<unsigned char>(dtype == at::kBool ? rng() % 2 : rng());
  return t;
}

bool same_bytes(const at::Tensor& a, const at::Tensor& b) {
  if (a.scalar_type() != b.scalar_type() || a.sizes() != b.sizes()) return false;
  if (a.numel() == 0) return true;  // empty tensors may have no data pointer at all
  const auto ca = a.contiguous(), cb = b.contiguous();
  return std::memcmp(ca.const_data_ptr(), cb.const_data_ptr(), ca.numel() * ca.element_size()) == 0;
}

TEST(Safetensors, RoundTripsEveryDtype) {
  TempDir dir;
  NamedTensors tensors;
  std::uint32_t seed = 1;
  for (const auto& [name, dtype] : safetensors_dtypes())
    tensors.emplace_back("t." + name, random_tensor(dtype, {2, 3, 5}, seed++));
  const auto path = dir.file("all.safetensors");
  write_safetensors(path, tensors);

  const auto file = SafetensorsFile::open(path);
  ASSERT_EQ(file.tensors().size(), tensors.size());
  for (const auto& [name, tensor] : tensors) {
    const TensorInfo* info = file.find(name);
    ASSERT_NE(info, nullptr) << name;
    EXPECT_EQ(info->dtype, tensor.scalar_type()) << name;
    EXPECT_EQ(info->shape, (std::vector<int64_t>{2, 3, 5})) << name;
    EXPECT_TRUE(same_bytes(file.load(name), tensor)) << name;
    EXPECT_TRUE(same_bytes(file.view(name), tensor)) << name;
  }
  EXPECT_EQ(file.find("nope"), nullptr);
  EXPECT_THROW(file.load("nope"), DataError);
}

TEST(Safetensors, RoundTripsEmptyAndScalarTensors) {
  TempDir dir;
  const NamedTensors tensors = {{"scalar", at::tensor(3.5f).reshape({})},
                                {"empty", at::empty({0, 4}, at::kBFloat16)},
                                {"empty_last", at::empty({3, 0}, at::kLong)},
                                {"after", at::arange(4, at::kInt)}};
  const auto path = dir.file("edge.safetensors");
  write_safetensors(path, tensors);
  const auto file = SafetensorsFile::open(path);
  EXPECT_EQ(file.find("scalar")->shape, std::vector<int64_t>{});
  EXPECT_EQ(file.find("scalar")->nbytes(), 4u);
  EXPECT_EQ(file.find("empty")->nbytes(), 0u);
  for (const auto& [name, tensor] : tensors) {
    EXPECT_TRUE(same_bytes(file.load(name), tensor)) << name;
    EXPECT_TRUE(same_bytes(file.view(name), tensor)) << name;
  }
  EXPECT_EQ(file.load("scalar").item<float>(), 3.5f);
}

TEST(Safetensors, PadsHeaderTo8AndAlignsEveryTensor) {
  TempDir dir;
  // Odd sizes in an order that would misalign the wider types if written as given.
  const NamedTensors tensors = {{"a", random_tensor(at::kByte, {3}, 1)},
                                {"b", random_tensor(at::kBFloat16, {3}, 2)},
                                {"c", random_tensor(at::kFloat, {1}, 3)},
                                {"d", random_tensor(at::kDouble, {2}, 4)}};
  const auto path = dir.file("layout.safetensors");
  write_safetensors(path, tensors);
  const std::string bytes = test::read_file(path);
  std::uint64_t header_size = 0;
  std::memcpy(&header_size, bytes.data(), 8);
  EXPECT_EQ(header_size % 8, 0u);
  const std::string header = bytes.substr(8, header_size);
  EXPECT_EQ(header.front(), '{');
  EXPECT_EQ(header.find_last_not_of(' '), header.find_last_of('}')) << "padding is spaces after the JSON";
  EXPECT_EQ(bytes.size(), 8 + header_size + 3 + 6 + 4 + 16) << "no holes, no trailing bytes";

  const auto file = SafetensorsFile::open(path);
  std::uint64_t expected_begin = 0;
  for (const auto& info : file.tensors()) {  // file order: d (8-byte), c, b, a
    EXPECT_EQ(info.begin, expected_begin) << info.name;
    EXPECT_EQ(info.begin % c10::elementSize(info.dtype), 0u) << info.name;
    expected_begin = info.end;
  }
  EXPECT_EQ(file.tensors().front().name, "d");
  EXPECT_EQ(file.tensors().back().name, "a");
}

TEST(Safetensors, WritesMetadataWithFormatPt) {
  TempDir dir;
  const auto path = dir.file("meta.safetensors");
  write_safetensors(path, {{"x", at::ones({2})}}, {{"step", "17"}, {"note", "ünïcode"}});
  const auto file = SafetensorsFile::open(path);
  const std::map<std::string, std::string> expected = {{"format", "pt"}, {"step", "17"}, {"note", "ünïcode"}};
  EXPECT_EQ(file.metadata(), expected);
}

TEST(Safetensors, ConvertsDtypeWhileLoading) {
  TempDir dir;
  const auto path = dir.file("convert.safetensors");
  const at::Tensor f32 = at::randn({4, 8});
  const at::Tensor bf16 = at::randn({3}).to(at::kBFloat16);
  write_safetensors(path, {{"f32", f32}, {"bf16", bf16}});
  const auto file = SafetensorsFile::open(path);
  EXPECT_TRUE(same_bytes(file.load("f32", at::kBFloat16), f32.to(at::kBFloat16)));
  EXPECT_TRUE(same_bytes(file.load("bf16", at::kFloat), bf16.to(at::kFloat)));
  EXPECT_TRUE(same_bytes(file.load("f32", at::kFloat), f32)) << "released pages are read again from the file";
}

TEST(Safetensors, ViewKeepsTheMappingAlive) {
  TempDir dir;
  const auto path = dir.file("view.safetensors");
  const at::Tensor x = at::arange(1000, at::kFloat);
  write_safetensors(path, {{"x", x}});
  at::Tensor view;
  {
    const auto file = SafetensorsFile::open(path);
    view = file.view("x");
    file.load("x");  // releases the pages under the view: it must still read the right values
  }
  EXPECT_TRUE(at::equal(view, x));
}

TEST(Safetensors, ReadsUnalignedDataFromOtherWriters) {
  TempDir dir;
  const auto path = dir.file("unaligned.safetensors");
  const float value = 1.25f;
  std::string data(1, '\x07');
  data.append(reinterpret_cast<const char*>(&value), 4);
  test::write_file(path, test::safetensors_bytes(
                             R"({"u":{"dtype":"U8","shape":[1],"data_offsets":[0,1]},)"
                             R"("f":{"dtype":"F32","shape":[],"data_offsets":[1,5]}})",
                             data));
  const auto file = SafetensorsFile::open(path);
  EXPECT_EQ(file.view("f").item<float>(), 1.25f);
  EXPECT_EQ(file.load("f").item<float>(), 1.25f);
  EXPECT_EQ(file.load("f", at::kDouble).item<double>(), 1.25);
  EXPECT_EQ(file.load("u").item<uint8_t>(), 7);
}

TEST(Safetensors, WriteRejectsDuplicateNamesAndKeepsTheOldFile) {
  TempDir dir;
  const auto path = dir.file("keep.safetensors");
  write_safetensors(path, {{"old", at::ones({1})}});
  try {
    write_safetensors(path, {{"w", at::ones({1})}, {"w", at::zeros({1})}});
    FAIL() << "duplicate names were accepted";
  } catch (const DataError& e) {
    EXPECT_NE(std::string(e.what()).find(path), std::string::npos) << e.what();
    EXPECT_NE(std::string(e.what()).find("\"w\" is given twice"), std::string::npos) << e.what();
  }
  EXPECT_THROW(write_safetensors(path, {{"c", at::ones({1}, at::kComplexDouble)}}), DataError);
  EXPECT_NE(SafetensorsFile::open(path).find("old"), nullptr);
  EXPECT_FALSE(std::filesystem::exists(path + ".tmp"));
}

TEST(Safetensors, WritesNonContiguousTensorsInCOrder) {
  TempDir dir;
  const auto path = dir.file("strided.safetensors");
  const at::Tensor t = at::arange(12, at::kFloat).reshape({3, 4}).t();  // a transposed view
  write_safetensors(path, {{"t", t}, {"slice", at::arange(10, at::kLong).slice(0, 2, 8, 2)}});
  const auto file = SafetensorsFile::open(path);
  EXPECT_TRUE(at::equal(file.load("t"), t));
  EXPECT_TRUE(at::equal(file.load("slice"), at::tensor({2, 4, 6}, at::kLong)));
}

// ---- hostile files ---------------------------------------------------------------------------------------------

// Writes `bytes` to a file and expects open() to throw a DataError whose message names the file and contains
// every one of `needles`.
void expect_rejected(const std::string& bytes, std::initializer_list<std::string> needles) {
  TempDir dir;
  const auto path = dir.file("hostile.safetensors");
  test::write_file(path, bytes);
  try {
    SafetensorsFile::open(path);
    FAIL() << "accepted a bad file";
  } catch (const DataError& e) {
    const std::string message = e.what();
    EXPECT_NE(message.find(path), std::string::npos) << "names the file: " << message;
    for (const auto& needle : needles) EXPECT_NE(message.find(needle), std::string::npos) << message;
    EXPECT_FALSE(e.hint().empty());
  }
}

void expect_rejected_header(const std::string& header, std::size_t data_bytes,
                            std::initializer_list<std::string> needles) {
  expect_rejected(test::safetensors_bytes(header, std::string(data_bytes, '\0')), needles);
}

TEST(SafetensorsHostile, FileShorterThanTheHeaderLength) {
  expect_rejected("abc", {"3 bytes", "shorter than the 8-byte header length"});
  expect_rejected("", {"0 bytes"});
}

TEST(SafetensorsHostile, HeaderLengthPastTheEnd) {
  std::string bytes = test::safetensors_bytes("{}", "");
  bytes[0] = 100;
  expect_rejected(bytes, {"header length 100 runs past the end of the file (10 bytes)"});
}

TEST(SafetensorsHostile, HeaderLengthAbsurd) {
  std::string bytes = test::safetensors_bytes("{}", "");
  bytes[7] = '\x7f';
  expect_rejected(bytes, {"absurdly large"});
}

TEST(SafetensorsHostile, InvalidJson) { expect_rejected_header(R"({"a": {"dtype": )", 0, {"not valid JSON"}); }

TEST(SafetensorsHostile, HeaderNotAnObject) { expect_rejected_header("[1, 2]", 0, {"not a JSON object"}); }

TEST(SafetensorsHostile, DuplicateTensorName) {
  expect_rejected_header(R"({"a":{"dtype":"U8","shape":[1],"data_offsets":[0,1]},)"
                         R"("a":{"dtype":"U8","shape":[1],"data_offsets":[1,2]}})",
                         2, {"names \"a\" twice"});
}

TEST(SafetensorsHostile, NestedTooDeeply) {
  expect_rejected_header(R"({"a":{"dtype":"U8","shape":[[[1]]],"data_offsets":[0,1]}})", 1, {"nested deeper"});
}

TEST(SafetensorsHostile, EntryMissingAField) {
  expect_rejected_header(R"({"w":{"dtype":"F32","shape":[1]}})", 4, {"tensor \"w\"", "no \"data_offsets\""});
  expect_rejected_header(R"({"w":{"shape":[1],"data_offsets":[0,4]}})", 4, {"tensor \"w\"", "no \"dtype\""});
  expect_rejected_header(R"({"w":[1,2]})", 4, {"tensor \"w\"", "not an object"});
}

TEST(SafetensorsHostile, EntryFieldsOfTheWrongType) {
  expect_rejected_header(R"({"w":{"dtype":4,"shape":[1],"data_offsets":[0,4]}})", 4,
                         {"tensor \"w\"", "\"dtype\" is not a string"});
  expect_rejected_header(R"({"w":{"dtype":"F32","shape":"1","data_offsets":[0,4]}})", 4,
                         {"tensor \"w\"", "\"shape\" is not an array"});
  expect_rejected_header(R"({"w":{"dtype":"F32","shape":[1],"data_offsets":[0]}})", 4,
                         {"tensor \"w\"", "is not [begin, end]"});
  expect_rejected_header(R"({"w":{"dtype":"F32","shape":[1],"data_offsets":[0,"4"]}})", 4,
                         {"tensor \"w\"", "is not [begin, end]"});
}

TEST(SafetensorsHostile, UnknownDtype) {
  expect_rejected_header(R"({"w":{"dtype":"F4","shape":[2],"data_offsets":[0,1]}})", 1,
                         {"tensor \"w\"", "unknown dtype \"F4\"", "BF16"});
}

TEST(SafetensorsHostile, NegativeOrFractionalDimension) {
  expect_rejected_header(R"({"w":{"dtype":"U8","shape":[-1],"data_offsets":[0,0]}})", 0,
                         {"tensor \"w\"", "not a non-negative integer"});
  expect_rejected_header(R"({"w":{"dtype":"U8","shape":[1.5],"data_offsets":[0,1]}})", 1,
                         {"tensor \"w\"", "not a non-negative integer"});
  expect_rejected_header(R"({"w":{"dtype":"U8","shape":[18446744073709551615],"data_offsets":[0,1]}})", 1,
                         {"tensor \"w\"", "not a non-negative integer"});
}

TEST(SafetensorsHostile, OffsetsPastTheEnd) {
  expect_rejected_header(R"({"w":{"dtype":"F32","shape":[2],"data_offsets":[4,12]}})", 8,
                         {"tensor \"w\"", "run past the end of the data (8 bytes after the header)"});
}

TEST(SafetensorsHostile, BeginAfterEnd) {
  expect_rejected_header(R"({"w":{"dtype":"U8","shape":[0],"data_offsets":[4,2]}})", 8,
                         {"tensor \"w\"", "begin after they end"});
}

TEST(SafetensorsHostile, OverlappingRanges) {
  expect_rejected_header(R"({"a":{"dtype":"F32","shape":[2],"data_offsets":[0,8]},)"
                         R"("b":{"dtype":"F32","shape":[2],"data_offsets":[4,12]}})",
                         12, {"\"a\"", "\"b\"", "overlap"});
}

TEST(SafetensorsHostile, SizeNotNumelTimesElementSize) {
  expect_rejected_header(R"({"w":{"dtype":"F32","shape":[2,3],"data_offsets":[0,12]}})", 24,
                         {"tensor \"w\"", "shape [2, 3] of F32 needs 6 x 4 bytes but data_offsets [0,12] hold 12"});
  // numel x element size overflows 64 bits: must not wrap around to a small size that happens to match
  expect_rejected_header(
      R"({"w":{"dtype":"F32","shape":[4294967296,4294967296,4],"data_offsets":[0,0]}})", 0,
      {"tensor \"w\"", "more than 2^64"});
  expect_rejected_header(R"({"w":{"dtype":"F64","shape":[2305843009213693952],"data_offsets":[0,0]}})", 0,
                         {"tensor \"w\""});
}

TEST(SafetensorsHostile, MetadataValueNotAString) {
  expect_rejected_header(R"({"__metadata__":{"format":"pt","step":5}})", 0, {"metadata \"step\" is 5, not a string"});
  expect_rejected_header(R"({"__metadata__":[1]})", 0, {"\"__metadata__\" is not an object"});
}

TEST(SafetensorsHostile, MissingFileAndDirectory) {
  TempDir dir;
  EXPECT_THROW(SafetensorsFile::open(dir.file("absent.safetensors")), DataError);
  EXPECT_THROW(SafetensorsFile::open(dir.path().string()), DataError);
}

}  // namespace
}  // namespace trainer
