// The float64 reference trajectories of tests/data/muon_v1.{json,safetensors} and helpers to build
// jobs and tensors from them and to compare updates with them.
//
// A case (muon_v1.json "cases") is one matrix with its Muon config; tensors are named
// '<case>/step<t>/{grad,update,momentum}' (fp32), t = 0, 1, 2, momentum starting at zero.
// Loaded once; the accessors are thread-safe after the first call.
#ifndef MUOND_TESTS_INTEGRATION_REFERENCE_DATA_H_
#define MUOND_TESTS_INTEGRATION_REFERENCE_DATA_H_

#include <cstdint>
#include <string>
#include <vector>

#include "client/client.h"
#include "common/job_spec.h"
#include "gtest/gtest.h"

namespace muond::integration {

struct ReferenceCase {
  std::string name;
  int64_t rows = 0;
  int64_t cols = 0;
  int64_t num_heads = 1;
  int steps = 0;
  common::MuonConfig muon;
};

// The case named `name` (aborts the test binary when the data files are unusable or it is absent).
const ReferenceCase& Case(const std::string& name);

// The fp32 values of '<case>/step<step>/<kind>' (kind: grad, update, momentum).
std::vector<float> RefTensor(const std::string& case_name, int step, const std::string& kind);

// A matrix spec of the case's shape and heads, named `matrix_name`, with gradient dtype `dtype`.
common::MatrixSpec CaseMatrix(const std::string& case_name, const std::string& matrix_name,
                              common::DType dtype = common::DType::kFloat32);

// A world-size-1, zero-stage-0 job with the Muon config of `config_case` and `matrices`.
common::JobSpec WholeMatrixJob(const std::string& job_id, const std::string& config_case,
                               std::vector<common::MatrixSpec> matrices);

// A named tensor holding `values` converted to `dtype` (round to nearest even).
client::NamedTensor MakeTensor(const std::string& name, const std::vector<int64_t>& shape,
                               const std::vector<float>& values,
                               common::DType dtype = common::DType::kFloat32);
// The reference gradient of a case and step as a tensor named `name`.
client::NamedTensor RefGrad(const std::string& case_name, int step, const std::string& name,
                            common::DType dtype = common::DType::kFloat32);
// The values of a tensor (any dtype) widened to fp32.
std::vector<float> ToFloats(common::DType dtype, const std::string& bytes);
inline std::vector<float> ToFloats(const client::NamedTensor& t) {
  return ToFloats(t.dtype, t.data);
}

// ||got - want||_F / ||want||_F in float64 (infinity when the sizes differ).
double RelFrobeniusError(const std::vector<float>& got, const std::vector<float>& want);

// Success when `got` matches the reference update of `case_name` step `step` (times `sign`) to a
// relative Frobenius error below `tolerance`.
::testing::AssertionResult MatchesReferenceUpdate(const std::vector<float>& got,
                                                  const std::string& case_name, int step,
                                                  double tolerance, float sign = 1.0f);

}  // namespace muond::integration

#endif  // MUOND_TESTS_INTEGRATION_REFERENCE_DATA_H_
