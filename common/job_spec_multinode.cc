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

absl::Status ParseTensorRowsField(const Json& tensor, const std::string& path, MatrixSpec* spec) {
  const auto it = tensor.find("rows");
  if (it == tensor.end()) return absl::OkStatus();
  const std::string where = path + ".rows";
  if (!it->is_object()) return FieldError(where, "expected an object {\"offset\": n, \"of\": n}");
  RETURN_IF_ERROR(CheckKnownFields(*it, where + ".", {"offset", "of"}));
  for (const char* key : {"offset", "of"}) {
    if (it->find(key) == it->end()) return FieldError(absl::StrCat(where, ".", key), "missing");
  }
  RETURN_IF_ERROR(ReadInt64(*it, "offset", where + ".offset", &spec->row_offset));
  RETURN_IF_ERROR(ReadInt64(*it, "of", where + ".of", &spec->full_rows));
  if (spec->full_rows < 1) {
    return FieldError(where + ".of", absl::StrCat(spec->full_rows, " is not >= 1"));
  }
  return absl::OkStatus();
}

void WriteTensorRowsField(const MatrixSpec& m, Json* tensor) {
  if (m.full_rows <= 0) return;
  (*tensor)["rows"] = {{"offset", m.row_offset}, {"of", m.full_rows}};
}

}  // namespace json_fields

namespace {

// A tensor's rows of a split tensor (MatrixSpec::full_rows).
absl::Status ValidateRows(const JobSpec& spec, const MatrixSpec& t) {
  const std::string where = absl::StrCat("tensor '", t.name, "': rows");
  if (spec.multinode.nodes <= 0 || spec.mode != JobMode::kApply ||
      t.optimizer != Optimizer::kAdamW) {
    return absl::InvalidArgumentError(absl::StrCat(
        where, ": only an AdamW tensor of an apply-mode multi-node job may hold rows of a tensor "
        "split across nodes"));
  }
  if (t.shape.empty()) {
    return absl::InvalidArgumentError(absl::StrCat(where, ": a 0-d tensor has no rows to split"));
  }
  if (t.full_rows < 1 || t.row_offset < 0 || t.row_offset > t.full_rows - t.shape[0]) {
    return absl::InvalidArgumentError(absl::StrCat(
        where, ": rows [", t.row_offset, ", ", t.row_offset, " + ", t.shape[0], ") are not within "
        "the tensor's ", t.full_rows, " rows"));
  }
  const int64_t row = t.numel() / t.shape[0];  // ValidateMatrix bounded numel
  if (t.full_rows > kMaxMatrixElements / row) {
    return absl::InvalidArgumentError(absl::StrCat(where, ": the whole tensor (", t.full_rows,
                                                   " rows of ", row, " elements) has more than ",
                                                   kMaxMatrixElements, " elements"));
  }
  return absl::OkStatus();
}

}  // namespace

absl::Status ValidateMultiNode(const JobSpec& spec) {
  for (const MatrixSpec& t : spec.matrices) {
    if (t.full_rows != 0 || t.row_offset != 0) RETURN_IF_ERROR(ValidateRows(spec, t));
  }
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
