// Conversions between common::JobSpec and the API's muond.v1.JobSpec message.
#ifndef MUOND_COMMON_JOB_SPEC_PROTO_H_
#define MUOND_COMMON_JOB_SPEC_PROTO_H_

#include "absl/status/statusor.h"
#include "common/job_spec.h"
#include "muond/v1/muond.pb.h"

namespace muond::common {

// Fills defaults for unset fields and runs ValidateJobSpec; INVALID_ARGUMENT on unknown enum values.
absl::StatusOr<JobSpec> JobSpecFromProto(const v1::JobSpec& proto);
v1::JobSpec JobSpecToProto(const JobSpec& spec);

v1::DType DTypeToProto(DType dtype);
absl::StatusOr<DType> DTypeFromProto(v1::DType dtype);

}  // namespace muond::common

#endif  // MUOND_COMMON_JOB_SPEC_PROTO_H_
