// Fuzz target: a safetensors file (common/safetensors.cc) as init_from, a checkpoint payload or
// a reference file gives it. Properties: a refusal is INVALID_ARGUMENT with a message; an accepted
// file's tensors each lie inside the data, are found by name, and hold exactly numel x dtype size
// bytes; written back out, the same tensors and metadata parse again with the same bytes.
#include "common/safetensors.h"

#include <cstdint>
#include <string>
#include <vector>

#include "common/dtype.h"
#include "tests/fuzz/fuzz_check.h"

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  using muond::common::SafetensorsFile;
  auto file = SafetensorsFile::Parse(std::string(reinterpret_cast<const char*>(data), size));
  if (!file.ok()) {
    FUZZ_CHECK(file.status().code() == absl::StatusCode::kInvalidArgument &&
                   !file.status().message().empty(),
               file.status().ToString());
    return 0;
  }
  std::vector<muond::common::TensorRef> refs;
  for (const auto& t : file->tensors()) {
    FUZZ_CHECK(file->Find(t.name) == &t, "Find(" + t.name + ") is another tensor");
    FUZZ_CHECK(t.numel() >= 0, t.name);
    const std::string_view bytes = file->Data(t);
    FUZZ_CHECK(bytes.size() == static_cast<uint64_t>(t.numel()) * muond::common::DTypeSize(t.dtype),
               "tensor " + t.name + " holds " + std::to_string(bytes.size()) + " bytes");
    FUZZ_CHECK(t.data_begin <= t.data_end, "tensor " + t.name + " ends before it begins");
    refs.push_back({t.name, t.dtype, t.shape, bytes});
  }
  auto written = muond::common::SerializeSafetensors(refs, file->metadata());
  FUZZ_CHECK(written.ok(), "an accepted file does not write back: " + written.status().ToString());
  auto again = SafetensorsFile::Parse(*written);
  FUZZ_CHECK(again.ok(), "written back, refused: " + again.status().ToString());
  FUZZ_CHECK(again->tensors().size() == refs.size() && again->metadata() == file->metadata(),
             "written back, different tensors or metadata");
  for (size_t i = 0; i < refs.size(); ++i) {
    const auto& t = again->tensors()[i];
    FUZZ_CHECK(t.name == refs[i].name && t.dtype == refs[i].dtype && t.shape == refs[i].shape &&
                   again->Data(t) == refs[i].data,
               "written back, tensor " + refs[i].name + " differs");
  }
  return 0;
}
