#include "common/safetensors.h"

#include <dirent.h>
#include <sys/stat.h>
#include <unistd.h>

#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <string>
#include <vector>

#include "gtest/gtest.h"

namespace muond::common {
namespace {

std::string LengthPrefix(uint64_t n) {
  std::string out(8, '\0');
  for (int i = 0; i < 8; ++i) out[i] = static_cast<char>((n >> (8 * i)) & 0xFF);
  return out;
}

// A file with the given header text followed by data_size zero bytes.
std::string MakeFile(const std::string& header, size_t data_size) {
  return LengthPrefix(header.size()) + header + std::string(data_size, '\0');
}

template <typename T>
std::string_view AsBytes(const std::vector<T>& v) {
  return std::string_view(reinterpret_cast<const char*>(v.data()), v.size() * sizeof(T));
}

// Parses `bytes` and expects INVALID_ARGUMENT with `substring` in the message.
void ExpectInvalid(std::string bytes, const std::string& substring) {
  const auto file = SafetensorsFile::Parse(std::move(bytes));
  ASSERT_FALSE(file.ok()) << "expected an error containing: " << substring;
  EXPECT_EQ(file.status().code(), absl::StatusCode::kInvalidArgument) << file.status();
  EXPECT_NE(file.status().message().find(substring), std::string_view::npos)
      << "message: " << file.status().message() << "\nwanted: " << substring;
}

class TempDir {
 public:
  TempDir() {
    std::string tmpl = ::testing::TempDir() + "safetensors_test_XXXXXX";
    path_ = ::mkdtemp(tmpl.data());
  }
  ~TempDir() {
    if (DIR* d = ::opendir(path_.c_str())) {
      while (dirent* e = ::readdir(d)) {
        if (std::strcmp(e->d_name, ".") && std::strcmp(e->d_name, "..")) {
          ::unlink((path_ + "/" + e->d_name).c_str());
        }
      }
      ::closedir(d);
    }
    ::rmdir(path_.c_str());
  }
  const std::string& path() const { return path_; }
  std::vector<std::string> Entries() const {
    std::vector<std::string> names;
    DIR* d = ::opendir(path_.c_str());
    while (dirent* e = ::readdir(d)) {
      if (std::strcmp(e->d_name, ".") && std::strcmp(e->d_name, "..")) names.push_back(e->d_name);
    }
    ::closedir(d);
    return names;
  }

 private:
  std::string path_;
};

class SafetensorsRoundTripTest : public ::testing::Test {
 protected:
  std::vector<float> f32_ = {1.0f, -2.5f, 3.25f, 0.0f, 1e-30f, 7.0f};
  std::vector<uint16_t> bf16_ = {0x3F80, 0xC000, 0x7FC0, 0x0001};
  std::vector<uint16_t> f16_ = {0x3C00, 0x7BFF, 0x8001, 0xFC00};
  // Names deliberately not sorted: the header order is the given order.
  std::vector<TensorRef> Tensors() const {
    return {{"z.weight", DType::kFloat32, {2, 3}, AsBytes(f32_)},
            {"a.bias", DType::kBFloat16, {4}, AsBytes(bf16_)},
            {"m/experts", DType::kFloat16, {2, 2, 1}, AsBytes(f16_)},
            {"empty", DType::kFloat32, {0, 3}, std::string_view()}};
  }
  void CheckParsed(const SafetensorsFile& file) const {
    ASSERT_EQ(file.tensors().size(), 4u);
    EXPECT_EQ(file.tensors()[0].name, "z.weight");
    EXPECT_EQ(file.tensors()[1].name, "a.bias");
    EXPECT_EQ(file.tensors()[2].name, "m/experts");
    EXPECT_EQ(file.tensors()[3].name, "empty");
    const TensorInfo* z = file.Find("z.weight");
    ASSERT_NE(z, nullptr);
    EXPECT_EQ(z->dtype, DType::kFloat32);
    EXPECT_EQ(z->shape, (std::vector<int64_t>{2, 3}));
    EXPECT_EQ(z->numel(), 6);
    EXPECT_EQ(z->data_begin, 0u);
    EXPECT_EQ(z->data_end, 24u);
    EXPECT_EQ(file.Data(*z), AsBytes(f32_));
    const TensorInfo* a = file.Find("a.bias");
    EXPECT_EQ(a->dtype, DType::kBFloat16);
    EXPECT_EQ(a->data_begin, 24u);
    EXPECT_EQ(file.Data(*a), AsBytes(bf16_));
    const TensorInfo* m = file.Find("m/experts");
    EXPECT_EQ(m->dtype, DType::kFloat16);
    EXPECT_EQ(m->shape, (std::vector<int64_t>{2, 2, 1}));
    EXPECT_EQ(file.Data(*m), AsBytes(f16_));
    const TensorInfo* e = file.Find("empty");
    EXPECT_EQ(e->numel(), 0);
    EXPECT_EQ(file.Data(*e).size(), 0u);
    EXPECT_EQ(file.Find("missing"), nullptr);
    EXPECT_EQ(file.metadata(),
              (std::map<std::string, std::string>{{"format", "pt"}, {"step", "7"}}));
  }
};

TEST_F(SafetensorsRoundTripTest, SerializeThenParse) {
  const auto bytes = SerializeSafetensors(Tensors(), {{"format", "pt"}, {"step", "7"}});
  ASSERT_TRUE(bytes.ok()) << bytes.status();
  uint64_t header_len = 0;
  std::memcpy(&header_len, bytes->data(), 8);
  EXPECT_EQ(header_len % 8, 0u);
  EXPECT_EQ(bytes->size(), 8 + header_len + 24 + 8 + 8);
  const std::string header = bytes->substr(8, header_len);
  EXPECT_EQ(header.front(), '{');
  EXPECT_EQ(header.rfind("__metadata__"), header.find("__metadata__"));
  EXPECT_EQ(header.find("\"__metadata__\""), 1u);  // metadata first, like the reference writer
  const auto file = SafetensorsFile::Parse(*bytes);
  ASSERT_TRUE(file.ok()) << file.status();
  CheckParsed(*file);
}

TEST_F(SafetensorsRoundTripTest, WriteThenReadFile) {
  TempDir dir;
  const std::string path = dir.path() + "/ckpt.safetensors";
  ASSERT_TRUE(WriteSafetensorsFile(path, Tensors(), {{"format", "pt"}, {"step", "7"}}).ok());
  EXPECT_EQ(dir.Entries(), std::vector<std::string>{"ckpt.safetensors"});  // no temp file left
  const auto file = SafetensorsFile::ReadFile(path);
  ASSERT_TRUE(file.ok()) << file.status();
  CheckParsed(*file);
  // Overwriting replaces the file atomically.
  ASSERT_TRUE(WriteSafetensorsFile(path, {Tensors()[1]}, {}).ok());
  const auto again = SafetensorsFile::ReadFile(path);
  ASSERT_TRUE(again.ok());
  EXPECT_EQ(again->tensors().size(), 1u);
  EXPECT_TRUE(again->metadata().empty());
}

// The files muonctl writes are never written through a symbolic link: not a link in any
// directory component (refused, naming it), not a link planted at the final name (the name is
// replaced, the link's target untouched), not one planted at the temporary name.
TEST(SafetensorsFileTest, WriteFollowsNoSymbolicLink) {
  TempDir dir;
  const std::string real = dir.path() + "/real";
  const std::string victim = dir.path() + "/victim";
  ASSERT_EQ(::mkdir(real.c_str(), 0755), 0);
  {
    std::FILE* f = std::fopen(victim.c_str(), "w");
    ASSERT_NE(f, nullptr);
    std::fputs("precious", f);
    std::fclose(f);
  }
  ASSERT_EQ(::symlink(real.c_str(), (dir.path() + "/linkdir").c_str()), 0);
  for (const std::string& through :
       {dir.path() + "/linkdir/x.safetensors", dir.path() + "/linkdir/../real/x.safetensors"}) {
    const absl::Status s = WriteSafetensorsFile(through, {});
    EXPECT_EQ(s.code(), absl::StatusCode::kPermissionDenied) << through << ": " << s;
    EXPECT_NE(s.message().find("is a symbolic link"), std::string_view::npos) << s;
  }
  struct stat st {};
  EXPECT_NE(::stat((real + "/x.safetensors").c_str(), &st), 0) << "written through the link";
  // A link at the final name: replaced by the file; its target keeps its bytes.
  const std::string out = real + "/out.safetensors";
  ASSERT_EQ(::symlink(victim.c_str(), out.c_str()), 0);
  ASSERT_TRUE(WriteSafetensorsFile(out, {}).ok());
  ASSERT_EQ(::lstat(out.c_str(), &st), 0);
  EXPECT_TRUE(S_ISREG(st.st_mode)) << "the name is a file now, not the link";
  std::FILE* f = std::fopen(victim.c_str(), "r");
  ASSERT_NE(f, nullptr);
  char buf[16] = {};
  ASSERT_NE(std::fgets(buf, sizeof(buf), f), nullptr);
  std::fclose(f);
  EXPECT_STREQ(buf, "precious");
}

TEST(SafetensorsFileTest, ReadAndWriteErrorsNamePath) {
  const auto missing = SafetensorsFile::ReadFile("/nonexistent/dir/x.safetensors");
  EXPECT_EQ(missing.status().code(), absl::StatusCode::kNotFound);
  EXPECT_NE(missing.status().message().find("open(/nonexistent/dir/x.safetensors)"),
            std::string_view::npos)
      << missing.status();
  const absl::Status write = WriteSafetensorsFile("/nonexistent/dir/x.safetensors", {});
  EXPECT_EQ(write.code(), absl::StatusCode::kNotFound);
  EXPECT_NE(write.message().find("/nonexistent/dir"), std::string_view::npos) << write;
  EXPECT_NE(write.message().find("No such file or directory"), std::string_view::npos);

  TempDir dir;
  const std::string path = dir.path() + "/bad.safetensors";
  ASSERT_TRUE(WriteSafetensorsFile(path, {}).ok());  // a valid, empty file: "{}" padded
  const auto empty = SafetensorsFile::ReadFile(path);
  ASSERT_TRUE(empty.ok()) << empty.status();
  EXPECT_TRUE(empty->tensors().empty());
  FILE* f = std::fopen(path.c_str(), "wb");
  std::fwrite("abc", 1, 3, f);
  std::fclose(f);
  const auto truncated = SafetensorsFile::ReadFile(path);
  EXPECT_EQ(truncated.status().code(), absl::StatusCode::kInvalidArgument);
  EXPECT_NE(truncated.status().message().find(path + ": safetensors: file of 3 bytes"),
            std::string_view::npos)
      << truncated.status();
}

TEST(SafetensorsFileTest, ReadsReferenceFile) {
  const auto file = SafetensorsFile::ReadFile(MUOND_TEST_DATA_DIR "/muon_v1.safetensors");
  ASSERT_TRUE(file.ok()) << file.status();
  EXPECT_EQ(file->tensors().size(), 54u);
  EXPECT_EQ(file->metadata(),
            (std::map<std::string, std::string>{{"format", "muon-reference-v1"}}));
  const TensorInfo* grad = file->Find("wide_std/step0/grad");
  ASSERT_NE(grad, nullptr);
  EXPECT_EQ(grad->dtype, DType::kFloat32);
  EXPECT_EQ(grad->shape, (std::vector<int64_t>{64, 256}));
  EXPECT_EQ(file->Data(*grad).size(), 65536u);
  EXPECT_EQ(file->tensors()[0].name, "wide_std/step0/grad");  // header order, not sorted
}

TEST(SafetensorsParseTest, TooShortOrHeaderBeyondFile) {
  ExpectInvalid("", "file of 0 bytes is shorter than its 8-byte header length");
  ExpectInvalid(std::string(7, '\0'), "file of 7 bytes");
  ExpectInvalid(LengthPrefix(100) + "{}", "header length 100 exceeds the 2 bytes after");
  ExpectInvalid(LengthPrefix(uint64_t{200} << 20) + "{}",
                "header length 209715200 exceeds the limit");
  ExpectInvalid(LengthPrefix(~uint64_t{0}) + "{}", "exceeds the limit");
}

TEST(SafetensorsParseTest, HeaderNotAnObject) {
  ExpectInvalid(MakeFile("{\"a\": ", 0), "safetensors: header is not valid JSON");
  ExpectInvalid(MakeFile("[1, 2]", 0), "safetensors: header is not a JSON object");
  ExpectInvalid(MakeFile("\"x\"", 0), "header is not a JSON object");
}

TEST(SafetensorsParseTest, Metadata) {
  ExpectInvalid(MakeFile(R"({"__metadata__": {"a": "x", "b": 1}})", 0),
                "__metadata__ value of 'b' is not a string");
  ExpectInvalid(MakeFile(R"({"__metadata__": ["a"]})", 0), "__metadata__ is not a JSON object");
  const auto ok = SafetensorsFile::Parse(MakeFile(R"({"__metadata__": {"k": "v"}}    )", 0));
  ASSERT_TRUE(ok.ok()) << ok.status();
  EXPECT_EQ(ok->metadata().at("k"), "v");
}

TEST(SafetensorsParseTest, BadEntries) {
  ExpectInvalid(MakeFile(R"({"w": 3})", 0), "tensor 'w': entry is not a JSON object");
  ExpectInvalid(MakeFile(R"({"w": {"dtype": "I64", "shape": [1], "data_offsets": [0, 8]}})", 8),
                "tensor 'w': unsupported safetensors dtype 'I64'");
  ExpectInvalid(MakeFile(R"({"w": {"shape": [1], "data_offsets": [0, 4]}})", 4),
                "tensor 'w': 'dtype' is missing");
  ExpectInvalid(MakeFile(R"({"w": {"dtype": "F32", "data_offsets": [0, 4]}})", 4),
                "tensor 'w': 'shape' is missing");
  ExpectInvalid(MakeFile(R"({"w": {"dtype": "F32", "shape": [1]}})", 4),
                "tensor 'w': 'data_offsets' must be [begin, end]");
  ExpectInvalid(MakeFile(R"({"w": {"dtype": "F32", "shape": [1], "data_offsets": [0]}})", 4),
                "tensor 'w': 'data_offsets' must be");
  ExpectInvalid(MakeFile(R"({"w": {"dtype": "F32", "shape": [1], "data_offsets": [-4, 0]}})", 4),
                "tensor 'w': 'data_offsets' must be");
  ExpectInvalid(
      MakeFile(R"({"w": {"dtype": "F32", "shape": [1], "data_offsets": [0, 4], "x": 1}})", 4),
      "tensor 'w': unknown field 'x'");
  ExpectInvalid(MakeFile(R"({"": {"dtype": "F32", "shape": [1], "data_offsets": [0, 4]}})", 4),
                "a tensor has an empty name");
}

TEST(SafetensorsParseTest, BadShapes) {
  ExpectInvalid(MakeFile(R"({"w": {"dtype": "F32", "shape": [2, -2], "data_offsets": [0, 0]}})", 0),
                "tensor 'w': shape [2, -2] has a negative dimension");
  ExpectInvalid(MakeFile(R"({"w": {"dtype": "F32", "shape": [2.5], "data_offsets": [0, 0]}})", 0),
                "tensor 'w': shape [2.5] is not a list of integers");
  ExpectInvalid(MakeFile(R"({"w": {"dtype": "F32", "shape": "2", "data_offsets": [0, 0]}})", 0),
                "tensor 'w': 'shape' is missing or not an array");
  ExpectInvalid(MakeFile(R"({"w": {"dtype": "F32", "shape": [4294967296, 4294967296],
                                   "data_offsets": [0, 0]}})",
                         0),
                "tensor 'w': shape [4294967296, 4294967296] overflows the element count");
  ExpectInvalid(MakeFile(R"({"w": {"dtype": "F32", "shape": [4611686018427387904],
                                   "data_offsets": [0, 0]}})",
                         0),
                "overflows the byte size");
  ExpectInvalid(MakeFile(R"({"w": {"dtype": "F32", "shape": [18446744073709551615],
                                   "data_offsets": [0, 0]}})",
                         0),
                "tensor 'w': shape dimension 18446744073709551615 overflows");
}

TEST(SafetensorsParseTest, BadOffsets) {
  ExpectInvalid(
      MakeFile(R"({"w1": {"dtype": "F32", "shape": [2, 2], "data_offsets": [0, 12]}})", 16),
      "safetensors: tensor 'w1': data_offsets [0, 12] hold 12 bytes but F32 [2, 2] needs 16");
  ExpectInvalid(MakeFile(R"({"w": {"dtype": "BF16", "shape": [4], "data_offsets": [0, 16]}})", 16),
                "data_offsets [0, 16] hold 16 bytes but BF16 [4] needs 8");
  ExpectInvalid(MakeFile(R"({"w": {"dtype": "F32", "shape": [4], "data_offsets": [0, 16]}})", 8),
                "tensor 'w': data_offsets [0, 16] lie outside the data section of 8 bytes");
  ExpectInvalid(MakeFile(R"({"w": {"dtype": "F32", "shape": [0], "data_offsets": [8, 4]}})", 8),
                "tensor 'w': data_offsets [8, 4] are reversed");
  ExpectInvalid(MakeFile(R"({"w": {"dtype": "F32", "shape": [1],
                                   "data_offsets": [18446744073709551612, 18446744073709551615]}})",
                         8),
                "lie outside the data section");
}

TEST(SafetensorsParseTest, OverlapAndDuplicates) {
  ExpectInvalid(MakeFile(R"({"a": {"dtype": "F32", "shape": [4], "data_offsets": [8, 24]},
                             "b": {"dtype": "F32", "shape": [4], "data_offsets": [0, 16]}})",
                         24),
                "safetensors: tensors 'b' [0, 16] and 'a' [8, 24] overlap");
  ExpectInvalid(MakeFile(R"({"a": {"dtype": "F32", "shape": [1], "data_offsets": [0, 4]},
                             "a": {"dtype": "F32", "shape": [1], "data_offsets": [4, 8]}})",
                         8),
                "safetensors: tensor 'a' appears more than once in the header");
  // Adjacent ranges, a gap, and an empty tensor inside another's range are all fine.
  const auto ok = SafetensorsFile::Parse(
      MakeFile(R"({"a": {"dtype": "F32", "shape": [1], "data_offsets": [0, 4]},
                   "b": {"dtype": "F32", "shape": [1], "data_offsets": [4, 8]},
                   "c": {"dtype": "F32", "shape": [1], "data_offsets": [12, 16]},
                   "d": {"dtype": "F32", "shape": [0], "data_offsets": [2, 2]}})",
               16));
  ASSERT_TRUE(ok.ok()) << ok.status();
  EXPECT_EQ(ok->tensors().size(), 4u);
}

TEST(SafetensorsSerializeTest, Errors) {
  const std::vector<float> four(4, 1.0f);
  const auto expect = [](absl::StatusOr<std::string> got, const std::string& substring) {
    ASSERT_FALSE(got.ok()) << substring;
    EXPECT_EQ(got.status().code(), absl::StatusCode::kInvalidArgument);
    EXPECT_NE(got.status().message().find(substring), std::string_view::npos) << got.status();
  };
  expect(SerializeSafetensors({{"w", DType::kFloat32, {4}, AsBytes(four)},
                               {"w", DType::kFloat32, {4}, AsBytes(four)}}),
         "tensor 'w': the name appears more than once");
  expect(SerializeSafetensors({{"", DType::kFloat32, {4}, AsBytes(four)}}),
         "a tensor has an empty name");
  expect(SerializeSafetensors({{"__metadata__", DType::kFloat32, {4}, AsBytes(four)}}),
         "the name is reserved");
  expect(SerializeSafetensors({{"w", DType::kFloat32, {2, 3}, AsBytes(four)}}),
         "tensor 'w': data holds 16 bytes but F32 [2, 3] needs 24");
  expect(SerializeSafetensors({{"w", DType::kFloat32, {-4}, AsBytes(four)}}),
         "tensor 'w': shape [-4] has a negative dimension");
  expect(SerializeSafetensors({{"w\xFF", DType::kFloat32, {4}, AsBytes(four)}}),
         "the name is not valid UTF-8");
  expect(SerializeSafetensors({}, {{"k", "\xC0\x80"}}),
         "__metadata__ entry 'k' is not valid UTF-8");
}

}  // namespace
}  // namespace muond::common
