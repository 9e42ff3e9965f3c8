// muonctl's apply-mode commands (DESIGN.md 4b):
//   params init: one rank's initial parameters from a safetensors file laid out exactly as that
//     rank's `step --grads` file (zero_stage 0, world size 1: one tensor per job tensor, full
//     shape; zero_stage 1/2 and explicit layouts: one 1-D tensor `partition`; zero_stage 3: per
//     tensor a 1-D tensor named by it with the rank's padded chunk), each float32 or its tensor's
//     param dtype;
//   export: the master weights as a safetensors model file (every tensor whole, under its name).
#include <cstdio>
#include <map>
#include <optional>
#include <set>
#include <string>
#include <vector>

#include "absl/strings/str_cat.h"
#include "absl/strings/str_join.h"
#include "client/muonctl_util.h"
#include "client/progress_display.h"
#include "common/job_spec_proto.h"
#include "common/layout.h"
#include "common/safetensors.h"
#include "common/status_macros.h"

namespace muond::client {
namespace {

std::string Names(const common::SafetensorsFile& file) {
  std::vector<std::string> names;
  for (const common::TensorInfo& t : file.tensors()) names.push_back("'" + t.name + "'");
  return names.empty() ? "none" : absl::StrJoin(names, ", ");
}

std::string DTypeText(common::DType d) { return std::string(common::DTypeName(d)); }

// The dtypes a file tensor of initial parameters may have: float32 or `param_dtype`.
absl::Status ExpectParamDType(const common::TensorInfo& t, common::DType param_dtype,
                              const std::string& whose) {
  if (t.dtype == common::DType::kFloat32 || t.dtype == param_dtype) return absl::OkStatus();
  return absl::InvalidArgumentError(absl::StrCat("tensor '", t.name, "' is ", DTypeText(t.dtype),
                                                 "; expected float32 or ", whose, " param dtype ",
                                                 DTypeText(param_dtype)));
}

absl::Status ExpectShape(const common::TensorInfo& t, const std::vector<int64_t>& shape,
                         const std::string& why) {
  if (t.shape == shape) return absl::OkStatus();
  return absl::InvalidArgumentError(absl::StrCat("tensor '", t.name, "' has shape [",
                                                 absl::StrJoin(t.shape, ", "), "]; expected [",
                                                 absl::StrJoin(shape, ", "), "] (", why, ")"));
}

// The rank's initial parameters from the file: spans over the file's bytes (or over widened
// copies), float32 or the param dtypes.
struct ParamsUpload {
  std::vector<GradientSpan> spans;
  bool float32 = false;
  uint64_t elements = 0;
  std::map<const common::TensorInfo*, std::vector<float>> widened;
};

// For every job tensor (in job order), the file tensor that holds the rank's part of it; checks
// names, shapes and dtypes as the layout says.
absl::StatusOr<std::vector<const common::TensorInfo*>> SourcesFor(
    const common::JobSpec& spec, int rank, const common::SafetensorsFile& in) {
  const std::vector<common::MatrixSpec>& tensors = spec.matrices;
  if (!spec.explicit_layout.empty() || spec.zero_stage == 1 || spec.zero_stage == 2) {
    const uint64_t n = common::RankBufferElements(spec, rank);
    const common::TensorInfo* t = in.Find("partition");
    if (t == nullptr || in.tensors().size() != 1) {
      return absl::InvalidArgumentError(
          absl::StrCat("a job with ",
                       spec.explicit_layout.empty() ? absl::StrCat("zero_stage ", spec.zero_stage)
                                                    : std::string("an explicit layout"),
                       " takes one 1-D tensor 'partition' with rank ", rank, "'s ", n,
                       " elements; the file holds ", Names(in)));
    }
    RETURN_IF_ERROR(ExpectShape(*t, {static_cast<int64_t>(n)}, "the rank's partition"));
    std::set<common::DType> param_dtypes;
    for (const common::MatrixSpec& ms : tensors) param_dtypes.insert(ms.param_dtype);
    if (param_dtypes.size() > 1 && t->dtype != common::DType::kFloat32) {
      return absl::InvalidArgumentError(
          absl::StrCat("tensor 'partition' is ", DTypeText(t->dtype),
                       "; expected float32 (the job's tensors have different param dtypes)"));
    }
    RETURN_IF_ERROR(ExpectParamDType(*t, tensors[0].param_dtype, "the job's"));
    return std::vector<const common::TensorInfo*>(tensors.size(), t);
  }
  const uint64_t world = static_cast<uint64_t>(spec.world_size);
  std::map<std::string, const common::TensorInfo*> by_name;
  for (const common::TensorInfo& t : in.tensors()) by_name[t.name] = &t;
  std::vector<const common::TensorInfo*> sources;
  for (const common::MatrixSpec& ms : tensors) {
    auto it = by_name.find(ms.name);
    if (it == by_name.end()) {
      return absl::InvalidArgumentError(
          absl::StrCat(spec.zero_stage == 3 ? "the chunk of tensor '" : "tensor '", ms.name,
                       "' is missing (the file holds ", Names(in), ")"));
    }
    if (spec.zero_stage == 3) {
      const uint64_t chunk = (static_cast<uint64_t>(ms.numel()) + world - 1) / world;
      RETURN_IF_ERROR(
          ExpectShape(*it->second, {static_cast<int64_t>(chunk)}, "the rank's padded chunk"));
    } else {
      RETURN_IF_ERROR(ExpectShape(*it->second, ms.shape, "the job's shape"));
    }
    RETURN_IF_ERROR(ExpectParamDType(*it->second, ms.param_dtype, "its"));
    sources.push_back(it->second);
    by_name.erase(it);
  }
  if (!by_name.empty()) {
    return absl::InvalidArgumentError(absl::StrCat("tensor '", by_name.begin()->first,
                                                   "' is not a tensor of job '", spec.job_id, "'"));
  }
  return sources;
}

// The upload of `rank`'s initial parameters from `in`: one wire dtype for all of it, the param
// dtypes when every file tensor is in its own, else float32 (widening a param-dtype tensor is
// exact).
absl::StatusOr<ParamsUpload> ReadParamsUpload(const common::JobSpec& spec, int rank,
                                              const common::SafetensorsFile& in) {
  ASSIGN_OR_RETURN(const std::vector<const common::TensorInfo*> sources,
                   SourcesFor(spec, rank, in));
  ParamsUpload up;
  for (size_t m = 0; m < sources.size(); ++m) {
    up.float32 = up.float32 || sources[m]->dtype != spec.matrices[m].param_dtype;
  }
  // Where a span's elements start in its file tensor: the partition at rank_offset, a stage 3
  // chunk at its start, a whole tensor at the span's offset (0).
  const bool partition =
      !spec.explicit_layout.empty() || spec.zero_stage == 1 || spec.zero_stage == 2;
  for (const common::ShardSpan& s : common::RankSpans(spec, rank)) {
    const common::TensorInfo* t = sources[s.matrix];
    const uint64_t first = partition ? s.rank_offset : spec.zero_stage == 3 ? 0 : s.offset;
    const char* data = in.Data(*t).data();
    size_t esize = common::DTypeSize(t->dtype);
    if (up.float32 && t->dtype != common::DType::kFloat32) {
      auto [it, added] = up.widened.try_emplace(t);
      if (added) {
        it->second.resize(static_cast<size_t>(t->numel()));
        common::ToFloat32(t->dtype, data, it->second.size(), it->second.data());
      }
      data = reinterpret_cast<const char*>(it->second.data());
      esize = sizeof(float);
    }
    up.spans.push_back({s.matrix, s.offset, data + first * esize, s.length});
    up.elements += s.length;
  }
  return up;
}

absl::StatusOr<int> RankFlag(const Args& a) {
  ASSIGN_OR_RETURN(const int64_t rank, IntFlag(a, "rank"));
  if (rank < 0 || rank > INT32_MAX) {
    return absl::InvalidArgumentError(absl::StrCat("--rank ", rank, " is out of range"));
  }
  return static_cast<int>(rank);
}

// The job's spec; FAILED_PRECONDITION naming `command` for an update-mode job and
// INVALID_ARGUMENT for a rank outside its world size.
absl::StatusOr<common::JobSpec> ApplyJobSpec(Client& client, const JobAccess& job, int rank,
                                             const std::string& command) {
  ASSIGN_OR_RETURN(const v1::JobStatus status, client.GetJob(job.job_id, job.token));
  ASSIGN_OR_RETURN(common::JobSpec spec, common::JobSpecFromProto(status.spec()));
  if (spec.mode != common::JobMode::kApply) {
    return absl::FailedPreconditionError(absl::StrCat(
        command, ": job '", job.job_id,
        "' is in mode 'update' (the trainer keeps its weights); this is for mode 'apply' jobs"));
  }
  if (rank >= spec.world_size) {
    return absl::InvalidArgumentError(absl::StrCat("--rank ", rank, " is outside job '", job.job_id,
                                                   "''s world size ", spec.world_size));
  }
  return spec;
}

absl::Status CmdParamsInit(Client& client, const Args& a) {
  for (const char* f : {"job", "rank", "params"}) {
    if (a.flags.count(f) == 0) {
      return absl::InvalidArgumentError(absl::StrCat("params init needs --", f));
    }
  }
  ASSIGN_OR_RETURN(const int rank, RankFlag(a));
  ASSIGN_OR_RETURN(const JobAccess job, JobAndToken(a, "params init"));
  Transport transport = Transport::kAuto;
  if (a.flags.count("transport") != 0) {
    ASSIGN_OR_RETURN(transport, ParseTransport(a.flags.at("transport")));
  }
  const std::string& in_path = a.flags.at("params");
  ASSIGN_OR_RETURN(const common::SafetensorsFile in, common::SafetensorsFile::ReadFile(in_path));
  ASSIGN_OR_RETURN(const common::JobSpec spec, ApplyJobSpec(client, job, rank, "params init"));
  // The file is checked whole before the rank is attached: a refused command leaves the rank's
  // session alone.
  absl::StatusOr<ParamsUpload> up = ReadParamsUpload(spec, rank, in);
  if (!up.ok()) {
    return absl::Status(up.status().code(), absl::StrCat(in_path, ": ", up.status().message()));
  }
  // A muonctl run acts for the rank as a new process: it takes the rank over, detaches when done.
  ASSIGN_OR_RETURN(auto session,
                   client.Attach(job.job_id, rank, job.token, /*takeover=*/true, transport));
  RETURN_IF_ERROR(session->InitParams(up->spans, up->float32));
  const char* via = session->transport() == Transport::kShm ? "shm" : "grpc";
  session.reset();
  ASSIGN_OR_RETURN(const v1::JobStatus status, client.GetJob(job.job_id, job.token));
  const std::string state = status.weights_complete()
                                ? std::string("weights complete")
                                : absl::StrCat("waiting for the weights of rank",
                                               status.ranks_missing_weights_size() > 1 ? "s " : " ",
                                               absl::StrJoin(status.ranks_missing_weights(), ", "));
  std::printf("params init: job %s rank %d (%s): %llu elements (%s) from %s; %s\n",
              job.job_id.c_str(), rank, via, static_cast<unsigned long long>(up->elements),
              up->float32 ? "float32" : "param dtype", in_path.c_str(), state.c_str());
  return absl::OkStatus();
}

}  // namespace

absl::Status CmdParams(Client& client, const Args& a) {
  const std::string sub = a.words.size() > 1 ? a.words[1] : "";
  if (sub != "init") {
    return absl::InvalidArgumentError(
        absl::StrCat("unknown params command '", sub, "' (accepted: init)"));
  }
  return CmdParamsInit(client, a);
}

absl::Status CmdExport(Client& client, const Args& a) {
  ASSIGN_OR_RETURN(const JobAccess job, JobAndToken(a, "export"));
  if (a.flags.count("out") == 0) return absl::InvalidArgumentError("export needs --out");
  common::DType dtype = common::DType::kFloat32;
  if (a.flags.count("dtype") != 0) {
    const absl::StatusOr<common::DType> parsed = common::ParseDType(a.flags.at("dtype"));
    if (!parsed.ok()) {
      return absl::InvalidArgumentError(absl::StrCat("--dtype: ", parsed.status().message()));
    }
    dtype = *parsed;
  }
  const std::string& out = a.flags.at("out");
  ProgressDisplay display(absl::StrCat("export job ", job.job_id), "bytes", stderr,
                          ProgressDisplay::StderrIsTerminal());
  uint64_t done = 0, total = 0;
  ASSIGN_OR_RETURN(const int64_t step, ExportParamsToFile(client, job.job_id, job.token, dtype, out,
                                                          [&](uint64_t d, uint64_t t) {
                                                            done = d;
                                                            total = t;
                                                            display.Update(d, t);
                                                          }));
  if (done > 0) display.Finish(done, total);
  std::printf("exported job %s at step %lld (%s) -> %s\n", job.job_id.c_str(),
              static_cast<long long>(step), DTypeText(dtype).c_str(), out.c_str());
  return absl::OkStatus();
}

}  // namespace muond::client
