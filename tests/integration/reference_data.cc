#include "tests/integration/reference_data.h"

#include <cmath>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <fstream>
#include <limits>
#include <map>
#include <sstream>

#include "common/dtype.h"
#include "common/safetensors.h"
#include "nlohmann/json.hpp"

namespace muond::integration {
namespace {

[[noreturn]] void Die(const std::string& why) {
  std::fprintf(stderr, "integration_tests: reference data: %s\n", why.c_str());
  std::abort();
}

struct ReferenceData {
  common::SafetensorsFile file;
  std::map<std::string, ReferenceCase> cases;
};

const ReferenceData& Data() {
  static const ReferenceData* data = [] {
    const std::string dir = MUOND_TEST_DATA_DIR;
    auto file = common::SafetensorsFile::ReadFile(dir + "/muon_v1.safetensors");
    if (!file.ok()) Die(std::string(file.status().message()));
    std::ifstream in(dir + "/muon_v1.json");
    std::stringstream text;
    text << in.rdbuf();
    const nlohmann::json json = nlohmann::json::parse(text.str(), nullptr, false);
    if (json.is_discarded() || !json.contains("cases")) Die("muon_v1.json is not usable");
    auto* d = new ReferenceData{*std::move(file), {}};
    for (const nlohmann::json& c : json["cases"]) {
      ReferenceCase rc;
      rc.name = c.at("name").get<std::string>();
      rc.rows = c.at("rows").get<int64_t>();
      rc.cols = c.at("cols").get<int64_t>();
      rc.num_heads = c.at("num_heads").get<int64_t>();
      rc.steps = c.at("steps").get<int>();
      rc.muon.momentum = c.at("momentum").get<double>();
      rc.muon.nesterov = c.at("nesterov").get<bool>();
      rc.muon.ns_steps = c.at("ns_steps").get<int>();
      auto method = common::ParseNsMethod(c.at("ns_method").get<std::string>());
      auto scale = common::ParseScaleMode(c.at("scale_mode").get<std::string>());
      if (!method.ok() || !scale.ok()) Die("bad ns_method or scale_mode in case " + rc.name);
      rc.muon.ns_method = *method;
      rc.muon.scale_mode = *scale;
      d->cases[rc.name] = rc;
    }
    return d;
  }();
  return *data;
}

}  // namespace

const ReferenceCase& Case(const std::string& name) {
  auto it = Data().cases.find(name);
  if (it == Data().cases.end()) Die("no case " + name);
  return it->second;
}

std::vector<float> RefTensor(const std::string& case_name, int step, const std::string& kind) {
  const std::string name = case_name + "/step" + std::to_string(step) + "/" + kind;
  const common::SafetensorsFile& f = Data().file;
  const common::TensorInfo* info = f.Find(name);
  if (info == nullptr || info->dtype != common::DType::kFloat32) Die("no fp32 tensor " + name);
  std::string_view bytes = f.Data(*info);
  std::vector<float> out(bytes.size() / sizeof(float));
  std::memcpy(out.data(), bytes.data(), out.size() * sizeof(float));
  return out;
}

common::MatrixSpec CaseMatrix(const std::string& case_name, const std::string& matrix_name,
                              common::DType dtype) {
  const ReferenceCase& c = Case(case_name);
  common::MatrixSpec m;
  m.name = matrix_name;
  m.shape = {c.rows, c.cols};
  m.num_heads = c.num_heads;
  m.dtype = dtype;
  return m;
}

common::JobSpec WholeMatrixJob(const std::string& job_id, const std::string& config_case,
                               std::vector<common::MatrixSpec> matrices) {
  common::JobSpec spec;
  spec.job_id = job_id;
  spec.world_size = 1;
  spec.zero_stage = 0;
  spec.muon = Case(config_case).muon;
  spec.matrices = std::move(matrices);
  return spec;
}

client::NamedTensor MakeTensor(const std::string& name, const std::vector<int64_t>& shape,
                               const std::vector<float>& values, common::DType dtype) {
  client::NamedTensor t;
  t.name = name;
  t.dtype = dtype;
  t.shape = shape;
  t.data.resize(values.size() * common::DTypeSize(dtype));
  common::FromFloat32(values.data(), values.size(), dtype, t.data.data());
  return t;
}

client::NamedTensor RefGrad(const std::string& case_name, int step, const std::string& name,
                            common::DType dtype) {
  const ReferenceCase& c = Case(case_name);
  return MakeTensor(name, {c.rows, c.cols}, RefTensor(case_name, step, "grad"), dtype);
}

std::vector<float> ToFloats(common::DType dtype, const std::string& bytes) {
  std::vector<float> out(bytes.size() / common::DTypeSize(dtype));
  common::ToFloat32(dtype, bytes.data(), out.size(), out.data());
  return out;
}

double RelFrobeniusError(const std::vector<float>& got, const std::vector<float>& want) {
  if (got.size() != want.size()) return std::numeric_limits<double>::infinity();
  double diff = 0, norm = 0;
  for (size_t i = 0; i < got.size(); ++i) {
    const double d = static_cast<double>(got[i]) - static_cast<double>(want[i]);
    diff += d * d;
    norm += static_cast<double>(want[i]) * static_cast<double>(want[i]);
  }
  return std::sqrt(diff) / std::sqrt(norm);
}

::testing::AssertionResult MatchesReferenceUpdate(const std::vector<float>& got,
                                                  const std::string& case_name, int step,
                                                  double tolerance, float sign) {
  std::vector<float> want = RefTensor(case_name, step, "update");
  for (float& v : want) v *= sign;
  const double err = RelFrobeniusError(got, want);
  if (err < tolerance) return ::testing::AssertionSuccess();
  return ::testing::AssertionFailure()
         << case_name << " step " << step << ": rel. Frobenius error " << err << " >= " << tolerance
         << " (" << got.size() << " vs " << want.size() << " elements)";
}

}  // namespace muond::integration
