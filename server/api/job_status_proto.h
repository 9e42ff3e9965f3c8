// The API's view of a job: server/jobs' JobReport as the generated JobStatus message.
#ifndef MUOND_SERVER_API_JOB_STATUS_PROTO_H_
#define MUOND_SERVER_API_JOB_STATUS_PROTO_H_

#include "muond/v1/muond.pb.h"
#include "server/jobs/job_report.h"

namespace muond::server {

v1::JobStatus JobStatusToProto(const JobReport& report);
// What a caller that neither owns the job nor holds its token sees (JobStatus.details_withheld):
// the id, mode, world size and ZeRO stage of the spec, sizes and state; no tensors, paths, owner,
// fence reason or session ids.
v1::JobStatus WithheldJobStatus(const JobReport& report);

}  // namespace muond::server

#endif  // MUOND_SERVER_API_JOB_STATUS_PROTO_H_
