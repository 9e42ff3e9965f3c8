// Shared by the job spec tests.
#ifndef MUOND_TESTS_UNIT_COMMON_JOB_SPEC_TEST_UTIL_H_
#define MUOND_TESTS_UNIT_COMMON_JOB_SPEC_TEST_UTIL_H_

#include <string>

#include "common/job_spec.h"
#include "gtest/gtest.h"

namespace muond::common {

// Parses `json` and expects INVALID_ARGUMENT with `substring` in the message.
inline void ExpectInvalid(const std::string& json, const std::string& substring) {
  const auto spec = ParseJobSpecJson(json);
  ASSERT_FALSE(spec.ok()) << "expected an error containing: " << substring;
  EXPECT_EQ(spec.status().code(), absl::StatusCode::kInvalidArgument);
  EXPECT_NE(spec.status().message().find(substring), std::string_view::npos)
      << "message: " << spec.status().message() << "\nwanted: " << substring;
}

}  // namespace muond::common

#endif  // MUOND_TESTS_UNIT_COMMON_JOB_SPEC_TEST_UTIL_H_
