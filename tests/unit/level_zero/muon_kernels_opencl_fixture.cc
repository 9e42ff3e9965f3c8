#include "tests/unit/level_zero/muon_kernels_opencl_fixture.h"

#include <cstdint>
#include <cstdio>
#include <fstream>
#include <sstream>

#include "absl/strings/str_cat.h"
#include "server/device/level_zero/muon_kernels.h"
#include "server/optim/muon_math.h"
#include "tests/unit/level_zero/muon_kernels_test_util.h"

namespace muond::server::device::level_zero {

using common::DType;

#ifdef MUOND_HAVE_OPENCL
OpenClKernelQueue* MuonKernelsOpenClTest::queue_ = nullptr;
#endif
std::string MuonKernelsOpenClTest::skip_reason_;
std::string MuonKernelsOpenClTest::setup_error_;

void MuonKernelsOpenClTest::SetUpTestSuite() {
  SetMathThreads(2);
#ifdef MUOND_HAVE_OPENCL
  std::ifstream in(MUOND_MUON_KERNELS_CL);
  std::stringstream source;
  source << in.rdbuf();
  if (!in || source.str().empty()) {
    setup_error_ = absl::StrCat("cannot read ", MUOND_MUON_KERNELS_CL);
    return;
  }
  auto q = OpenClKernelQueue::Create(source.str());
  if (q.ok()) {
    queue_ = q->release();
    std::printf("OpenCL: %s\n", queue_->description().c_str());
  } else if (q.status().code() == absl::StatusCode::kUnavailable) {
    skip_reason_ = std::string(q.status().message());
  } else {
    setup_error_ = std::string(q.status().message());
  }
#else
  skip_reason_ = "built without the OpenCL headers and library (ocl-icd-opencl-dev)";
#endif
}

void MuonKernelsOpenClTest::TearDownTestSuite() {
#ifdef MUOND_HAVE_OPENCL
  delete queue_;
  queue_ = nullptr;
#endif
}

void MuonKernelsOpenClTest::SetUp() {
  ASSERT_TRUE(setup_error_.empty()) << setup_error_;
  // ctest reports the suite skipped by this message (tests/unit/level_zero/CMakeLists.txt).
  if (!skip_reason_.empty()) GTEST_SKIP() << "no OpenCL device: " << skip_reason_;
}

#ifdef MUOND_HAVE_OPENCL
std::unique_ptr<QueueBuffer> MuonKernelsOpenClTest::Upload(const std::vector<float>& values,
                                                           DType dtype) {
  const std::vector<uint8_t> bytes = testutil::Encode(values, dtype);
  auto b = queue_->Allocate(bytes.size());
  EXPECT_TRUE(b.ok()) << b.status();
  EXPECT_TRUE(queue_->Write((*b)->ref(), 0, bytes.data(), bytes.size()).ok());
  return *std::move(b);
}

std::vector<float> MuonKernelsOpenClTest::Download(const QueueBuffer& b, size_t n, DType dtype) {
  std::vector<uint8_t> bytes(n * static_cast<size_t>(DTypeBytes(dtype)));
  EXPECT_TRUE(queue_->Read(b.ref(), 0, bytes.data(), bytes.size()).ok());
  return testutil::Decode(bytes, dtype);
}
#endif  // MUOND_HAVE_OPENCL

}  // namespace muond::server::device::level_zero
