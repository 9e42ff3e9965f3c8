// The "multinode" block of job.json (DESIGN.md 4c): which node's part of which global job a job
// is. Its presence makes the job's steps two-phase (server/jobs/job_prepare.cc).
#include "absl/strings/str_cat.h"
#include "common/job_spec.h"
#include "common/job_spec_json.h"
#include "common/status_macros.h"

namespace muond::common {

namespace json_fields {

absl::Status ParseMultiNodeField(const Json& root, JobSpec* spec) {
  const auto it = root.find("multinode");
  if (it == root.end()) return absl::OkStatus();
  if (!it->is_object()) return FieldError("multinode", "expected an object");
  RETURN_IF_ERROR(CheckKnownFields(*it, "multinode.", {"global_job_id", "node", "nodes"}));
  for (const char* key : {"global_job_id", "node", "nodes"}) {
    if (it->find(key) == it->end()) return FieldError(absl::StrCat("multinode.", key), "missing");
  }
  MultiNode& m = spec->multinode;
  RETURN_IF_ERROR(ReadString(*it, "global_job_id", "multinode.global_job_id", &m.global_job_id));
  RETURN_IF_ERROR(ReadInt(*it, "node", "multinode.node", &m.node));
  RETURN_IF_ERROR(ReadInt(*it, "nodes", "multinode.nodes", &m.nodes));
  if (m.nodes < 1) return FieldError("multinode.nodes", absl::StrCat(m.nodes, " is not >= 1"));
  return absl::OkStatus();
}

void WriteMultiNodeField(const JobSpec& spec, Json* root) {
  if (spec.multinode.nodes <= 0) return;
  (*root)["multinode"] = {{"global_job_id", spec.multinode.global_job_id},
                          {"node", spec.multinode.node},
                          {"nodes", spec.multinode.nodes}};
}

}  // namespace json_fields

absl::Status ValidateMultiNode(const JobSpec& spec) {
  const MultiNode& m = spec.multinode;
  if (m.nodes == 0 && m.node == 0 && m.global_job_id.empty()) return absl::OkStatus();
  if (m.nodes < 1 || m.nodes > kMaxNodes) {
    return absl::InvalidArgumentError(
        absl::StrCat("multinode.nodes ", m.nodes, " is outside 1..", kMaxNodes));
  }
  if (m.node < 0 || m.node >= m.nodes) {
    return absl::InvalidArgumentError(absl::StrCat("multinode.node ", m.node, " is outside 0..",
                                                   m.nodes - 1, " (nodes ", m.nodes, ")"));
  }
  return ValidateJobId(m.global_job_id, "multinode.global_job_id");
}

}  // namespace muond::common
